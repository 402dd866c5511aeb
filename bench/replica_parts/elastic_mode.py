"""Elastic mode's run: three torchrun nodes on spottrain's Redis rendezvous
(:class:`LocalElasticJob`, as ``bench/rendezvous.py`` runs them) of
``examples/elastic_train.py`` at the same step pace, and the same three events done to a
node that does not hold rank 0: a notice (the agent's leave, ``leave_node``), SIGKILL and
SIGSTOP. The survivors' pause is the time from their last step before the event to their
first after the re-form; a new node joins after the first two events, as in replica mode."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from replica_parts.figures import pause_through, step_time
from spottrain.agent.rendezvous.membership import leave_node
from spottrain.agent.testing.local_launcher import LocalElasticJob, Record
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "examples" / "elastic_train.py")


@dataclass
class ElasticRun:
    step_s: float | None = None
    stalls: dict[str, float | None] = field(default_factory=dict)
    join_s: list[float] = field(default_factory=list)


def _rank0(recs: list[Record], world: int | None = None) -> list[float]:
    return [r.t for r in recs if r.rank == 0 and (world is None or r.world == world)]


def run(workdir: Path, server: RedisServer, step_time_s: float, cap: float) -> ElasticRun:
    run_id = f"bench-el-{uuid.uuid4().hex[:8]}"
    job = LocalElasticJob(workdir, server.endpoint, run_id, script=SCRIPT, step_time=step_time_s)
    out = ElasticRun()
    names = iter("defgh")
    try:
        for n in ("a", "b", "c"):
            job.start_node(n)
        job.wait_for_world(3, cap * 2, steps=10)
        out.step_s = step_time(_rank0(job.records(), 3)[-10:])
        for event in ("notice", "kill", "freeze"):
            victim = next(
                n for n, node in job.nodes.items() if node.alive() and n != job.rank0_node()
            )
            t0 = time.time()
            if event == "notice":
                leave_node(server.client(), RunKeys(run_id), victim)
            elif event == "kill":
                job.nodes[victim].kill()
            else:
                job.nodes[victim].freeze()
            try:
                job.wait_for_world(2, cap, since=t0)
            except AssertionError:
                out.stalls[event] = None  # never re-formed within the cap
                break
            out.stalls[event] = pause_through(_rank0(job.records()), t0, time.time())
            if event == "freeze":
                break
            if event == "notice":
                job.nodes[victim].wait(timeout=60)
            t_join = time.time()
            job.start_node(next(names))
            first3 = job.wait_for_world(3, cap, since=t_join)
            out.join_s.append(first3 - t_join)
        return out
    finally:
        job.close(server.client())

"""The local elastic demo: a real job on torchrun's `redis` rendezvous, with a fleet's faults.

It starts an embedded Redis server (persistence on), then three torchrun "nodes" (each its own
process group, one worker each) training examples/elastic_train.py on the CPU, and does to
them what a spot fleet does:

1. a node is lost without notice (SIGKILL of its whole process group): the survivors go on at
   world size 2;
2. a replacement node starts (a backfill): the job returns to world size 3;
3. a node is preempted with notice and leaves explicitly: the others re-form at once;
4. training runs to the last step, and a summary says what each fault cost.

    scripts/demo              # or: .venv/bin/python examples/elastic_demo.py [--steps N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from demo_progress import Progress, say

from spottrain.agent.rendezvous.membership import leave_node
from spottrain.agent.testing.local_launcher import LocalElasticJob
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys, make_run_id

HERE = Path(__file__).resolve().parent


class Demo(Progress):
    def __init__(self, job: LocalElasticJob) -> None:
        super().__init__(job, every=2.0)
        self.costs: list[tuple[str, float]] = []

    def recover(self, label: str, world: int, since: float) -> None:
        self.run_until(
            lambda: any(
                r.world == world and r.t >= since and r.rank == 0 for r in self.job.records()
            ),
            300,
            f"training at world size {world}",
        )
        first = min(
            r.t for r in self.job.records() if r.world == world and r.t >= since and r.rank == 0
        )
        self.costs.append((label, first - since))
        say(f"  -> training again at world size {world} after {first - since:.1f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--step-time", type=float, default=0.1)
    args = ap.parse_args()
    started = time.monotonic()
    with RedisServer() as redis_server, tempfile.TemporaryDirectory() as tmp:
        run_id = make_run_id("elastic-demo")
        say(f"embedded Redis on {redis_server.endpoint}; run id {run_id}")
        job = LocalElasticJob(
            Path(tmp),
            redis_server.endpoint,
            run_id,
            script=str(HERE / "elastic_train.py"),
            steps=args.steps,
            step_time=args.step_time,
        )
        demo = Demo(job)
        try:
            for n in ("node-a", "node-b", "node-c"):
                job.start_node(n)
            say("started 3 torchrun nodes (--nnodes=1:3 --rdzv-backend=redis)")
            demo.run_until(lambda: demo.status()[1] == 3, 300, "world size 3")

            demo.at_step(args.steps // 4)
            victim = next(n for n in ("node-b", "node-c") if n != job.rank0_node())
            say(f"FAULT: {victim} lost without notice (SIGKILL to its process group)")
            t = time.time()
            job.nodes[victim].kill()
            demo.recover("node lost without notice", 2, t)

            demo.at_step(args.steps * 2 // 4)
            say("BACKFILL: node-d starts and joins")
            t = time.time()
            job.start_node("node-d")
            demo.recover("backfilled node joins", 3, t)

            demo.at_step(args.steps * 3 // 4)
            leaver = next(n for n in ("node-c", "node-b") if job.nodes[n].alive())
            say(f"NOTICE: {leaver} is preempted and leaves the rendezvous explicitly")
            t = time.time()
            leave_node(redis_server.client(), RunKeys(run_id), leaver)
            demo.recover("node leaves after a notice", 2, t)

            demo.run_until(
                lambda: all(not node.alive() for node in job.nodes.values()),
                600,
                "the job to finish",
            )
            final_step = demo.status()[0]
            losses = [r.step for r in job.records() if r.rank == 0]
            repeated = len(losses) - len(set(losses))
            say("summary")
            print(f"  steps trained        {final_step} of {args.steps}")
            print(f"  membership changes   {len(demo.costs)}")
            for label, secs in demo.costs:
                print(f"    {label:28s} {secs:5.1f} s to train again")
            print(f"  steps repeated       {repeated} (work redone after a loss)")
            print(f"  wall time            {time.monotonic() - started:.0f} s")
            return 0 if final_step == args.steps else 1
        finally:
            job.close(redis_server.client())


if __name__ == "__main__":
    sys.exit(main())

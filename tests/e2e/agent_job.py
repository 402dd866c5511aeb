"""Helpers for the end-to-end tests of agent-run nodes (examples/gpt_train.py under
`spottrain-agent run`)."""

from __future__ import annotations

import uuid
from pathlib import Path

import redis

from spottrain.agent.testing.local_launcher import LocalAgentJob, Record
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys

REPO = Path(__file__).resolve().parents[2]
GPT = str(REPO / "examples" / "gpt_train.py")
START_TIMEOUT = 120
RECOVER_TIMEOUT = 90


def make_job(
    redis_server: RedisServer, workdir: Path, nnodes: str = "1:2", **kwargs: object
) -> LocalAgentJob:
    args = ["--every-steps", "1000", *kwargs.pop("script_args", [])]  # type: ignore[misc]
    return LocalAgentJob(
        workdir,
        redis_server.endpoint,
        f"agent-{uuid.uuid4().hex[:8]}",
        script=GPT,
        nnodes=nnodes,
        steps=int(kwargs.pop("steps", 100_000)),  # type: ignore[call-overload]
        step_time=float(kwargs.pop("step_time", 0.05)),  # type: ignore[arg-type]
        script_args=args,
        **kwargs,  # type: ignore[arg-type]
    )


def events(client: redis.Redis, run_id: str, node: str | None = None) -> list[dict[str, str]]:
    out = []
    for _, fields in client.xrange(RunKeys(run_id).events):
        e = {k.decode(): v.decode() for k, v in fields.items()}
        if node is None or e.get("node") == node:
            out.append(e)
    return out


def states(client: redis.Redis, run_id: str, node: str) -> list[str]:
    return [e["state"] for e in events(client, run_id, node) if e["type"] == "state"]


def assert_no_progress_lost(job: LocalAgentJob, since: float, ckpt_step: int) -> None:
    """Nothing trained at the old world size after the emergency checkpoint, and the new
    world starts at exactly the step after it."""
    recs: list[Record] = job.records()
    before = [r for r in recs if r.world == 2]
    after = [r for r in recs if r.t >= since and r.world == 1]
    assert max(r.step for r in before) == ckpt_step, "steps were trained after the checkpoint"
    assert min(r.step for r in after) == ckpt_step + 1, "the new world did not resume there"


def wait_drained(job: LocalAgentJob, node: str, timeout: float = 60) -> int | None:
    code = job.nodes[node].wait(timeout)
    assert code == 0, f"agent {node} exited {code}\n{job.diagnose()}"
    return code


def emergency_commit(client: redis.Redis, run_id: str) -> dict[str, str]:
    raw = client.hgetall(RunKeys(run_id).ckpt_last)
    return {k.decode(): v.decode() for k, v in raw.items()}

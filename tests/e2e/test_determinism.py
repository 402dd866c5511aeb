"""Determinism: a run interrupted by preemptions ends with parameters bitwise equal to a run
without preemptions that has the same world size at every step.

The reference is `simulate` in examples/gpt_train.py: one process, no checkpoint and no
restart, computing each simulated rank's gradients with the script's own code and summing
them as the gloo all-reduce does (exact for two ranks: float addition commutes). Anything a
checkpoint fails to carry across a preemption (optimizer moments, the LR schedule, the data
position) makes the parameters differ.
"""

from __future__ import annotations

import importlib.util
import time
import uuid
from pathlib import Path

import pytest
import torch

from spottrain.agent.testing.local_launcher import LocalAgentJob
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys
from spottrain.protocol.notices import inject_notice

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
GPT = str(REPO / "examples" / "gpt_train.py")
STEPS = 60


def reference(segments: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    """The uninterrupted run: one process trains at world size w up to step s for each (w, s),
    summing the ranks' gradients as the all-reduce does; no checkpoint, no restart."""
    spec = importlib.util.spec_from_file_location("gpt_train", GPT)
    assert spec is not None and spec.loader is not None
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    params: dict[str, torch.Tensor] = gpt.simulate(gpt.parse_args([]), segments)
    return params


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"parameters differ: {different}"


def preempted_run(
    redis_server: RedisServer, tmp: Path, nnodes: str, backfill: bool
) -> tuple[dict[str, torch.Tensor], int]:
    out = tmp / "run.pt"
    job = LocalAgentJob(
        tmp / "job",
        redis_server.endpoint,
        f"det-{uuid.uuid4().hex[:8]}",
        script=GPT,
        nnodes=nnodes,
        steps=STEPS,
        step_time=0.05,
        script_args=["--every-steps", "1000", "--dump-params", str(out)],
    )
    client = redis_server.client()
    try:
        job.start_node("a")
        job.start_node("b")
        job.wait_for_world(2, 120, steps=5)
        noticed = time.time()
        inject_notice(client, RunKeys(job.run_id), "b", "terminate", 60)
        if backfill:
            job.wait_for(lambda recs: not job.nodes["b"].alive(), 60, "node b to drain and exit")
            job.start_node("c")
        for node in job.nodes.values():
            assert node.wait(300) == 0, job.diagnose()
        raw = client.hget(RunKeys(job.run_id).ckpt_last, "step")
        assert raw is not None
        emergency = max(
            int(e[1][b"step"])
            for e in client.xrange(RunKeys(job.run_id).events)
            if e[1][b"type"] == b"checkpoint-committed" and e[1][b"kind"] == b"emergency"
        )
        recs = job.records()
        assert max(r.step for r in recs if r.t < noticed) <= emergency
        return torch.load(out), emergency
    finally:
        job.close(client)


def test_a_preempted_run_equals_a_run_that_shrinks_at_the_same_step(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    params, step = preempted_run(redis_server, tmp_path, "1:2", backfill=False)
    assert 0 < step < STEPS
    assert_bitwise_equal(params, reference([(2, step), (1, STEPS)]))


def test_a_preempted_and_backfilled_run_equals_an_uninterrupted_run(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    params, step = preempted_run(redis_server, tmp_path, "2:2", backfill=True)
    assert 0 < step < STEPS
    assert_bitwise_equal(params, reference([(2, STEPS)]))


def test_a_node_lost_without_notice_resumes_from_the_last_periodic_checkpoint_exactly(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """A VM gone without a word: the survivor restores the newest (asynchronously written)
    periodic checkpoint and redoes the steps after it at its new world size."""
    out = tmp_path / "run.pt"
    job = LocalAgentJob(
        tmp_path / "job",
        redis_server.endpoint,
        f"det-{uuid.uuid4().hex[:8]}",
        script=GPT,
        nnodes="1:2",
        steps=STEPS,
        step_time=0.05,
        script_args=["--every-steps", "5", "--dump-params", str(out)],
    )
    client = redis_server.client()
    try:
        job.start_node("a")
        job.start_node("b")
        job.wait_for_world(2, 120, steps=12)
        killed = time.time()
        job.nodes["b"].kill()
        assert job.nodes["a"].wait(300) == 0, job.diagnose()
        resumed = min(r.step for r in job.records() if r.t >= killed and r.world == 1) - 1
        assert resumed % 5 == 0 and resumed > 0
        params = torch.load(out)
    finally:
        job.close(client)
    assert_bitwise_equal(params, reference([(2, resumed), (1, STEPS)]))

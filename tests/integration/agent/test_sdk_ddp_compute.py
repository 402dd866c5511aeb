"""``session.time_ddp``: a compute span around a DDP model's forward and backward leaves out
the wait on the gradient all-reduce, which DDP runs inside the backward."""

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from spottrain.agent.sdk import TrainSession

WAIT_S = 0.5  # the all-reduce's wait for a slower peer, as the hook below makes it


def slow_allreduce(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:  # type: ignore[name-defined]
    """A world of one has no peer to wait for: this hook's all-reduce completes ``WAIT_S``
    after the bucket is ready, as a slower peer would make it. (This module's annotations
    are objects, not strings: DDP checks that ``bucket``'s is the GradBucket class.)"""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def complete() -> None:
        time.sleep(WAIT_S)
        fut.set_result(bucket.buffer())

    threading.Thread(target=complete, daemon=True).start()
    return fut


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path / "store"), 1)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def one_step(session: TrainSession, model: torch.nn.Module) -> float:
    """One timed forward and backward; returns its whole span in seconds."""
    t0 = time.monotonic()
    with session.compute():
        model(torch.randn(8, 16)).sum().backward()
    span = time.monotonic() - t0
    session.step(1, {})
    return span


def test_a_ddp_backward_is_timed_without_its_all_reduce_wait(
    tmp_path: Path, world_of_one: None
) -> None:
    session = TrainSession(tmp_path, redis_url="", install_signal_handlers=False)
    try:
        timed = DistributedDataParallel(torch.nn.Linear(16, 4))
        session.time_ddp(timed, slow_allreduce)
        span = one_step(session, timed)
        compute = session.compute_time
        assert compute is not None and span >= WAIT_S  # the backward waited for the reduce
        assert compute <= span - WAIT_S  # the compute figure did not
        # Without it the span holds the wait: every rank's figure is the slowest's.
        plain = DistributedDataParallel(torch.nn.Linear(16, 4))
        plain.register_comm_hook(None, slow_allreduce)
        again = TrainSession(tmp_path, redis_url="", install_signal_handlers=False)
        try:
            one_step(again, plain)
            assert (again.compute_time or 0.0) >= WAIT_S
        finally:
            again.close()
    finally:
        session.close()

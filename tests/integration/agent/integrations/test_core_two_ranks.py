"""The integrations' core on two ranks (gloo, spawned processes) against a real Redis: an
early checkpoint request is saved once, at one step on both ranks, and never again."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import redis
import torch.distributed as dist
import torch.multiprocessing as mp

from spottrain.agent.sdk.integrations.core import FrameworkSession
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.ports import free_port
from spottrain.protocol.keys import RunKeys

AFTER = 20


def _rank(rank: int, port: int, root: str, url: str, run_id: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    fs = FrameworkSession(
        "plain",
        root,
        redis_url=url,
        run_id=run_id,
        install_signal_handlers=False,
        agree_interval=0.0,
        poll_interval=0.02,
    )
    client = redis.Redis.from_url(url)
    orders = []
    step, first = 0, None
    # Every rank gets the same orders, so every rank stops at the same step: 20 past the
    # first save (the request is read by a thread of rank 0's, so it takes steps to arrive).
    while first is None or step < first + AFTER:
        step += 1
        assert step < 1_000_000, "the request never reached the agreement"
        if step == 3 and rank == 0:
            body = {"id": 7, "drain": False, "deadline": None, "at": 1.0, "source": "test"}
            client.hset(RunKeys(run_id).ckpt_requests, "n1:early", json.dumps(body))
        order = fs.step(step, loss=1.0)
        if order is not None:
            orders.append([order.step, order.kind, order.request_id])
            (fs.staging_path(order) / f"rank{rank}.bin").write_bytes(b"x" * 100)
            fs.after_commit(fs.commit_staged(order))
            first = step if first is None else first
    fs.finish(step)
    Path(out, f"rank{rank}.json").write_text(json.dumps(orders))
    dist.destroy_process_group()


def test_an_early_request_is_saved_once_on_every_rank(
    tmp_path: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    run_id = f"core2-{uuid.uuid4().hex[:8]}"
    root = tmp_path / "ckpt"
    root.mkdir()
    env = {k: os.environ.pop(k) for k in ("SPOTTRAIN_ROUND",) if k in os.environ}
    try:
        mp.spawn(
            _rank,
            args=(free_port(), str(root), redis_server.url, run_id, str(tmp_path)),
            nprocs=2,
        )
    finally:
        os.environ.update(env)
        keys = list(redis_client.scan_iter(match=RunKeys(run_id).pattern))
        if keys:
            redis_client.delete(*keys)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert seen[0] == seen[1], seen
    [(step, kind, request_id)] = seen[0]  # one save: the request served, not saved again
    assert (kind, request_id) == ("requested", 7) and step >= 3

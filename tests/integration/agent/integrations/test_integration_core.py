"""The integrations' shared core in one process (no torch.distributed) against a real Redis:
what it answers per step, what it commits and how, what it refuses, what it tells Redis."""

from __future__ import annotations

import json
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from spottrain.agent.checkpoint.directory import CheckpointDir
from spottrain.agent.checkpoint.manifest import MANIFEST_NAME, Manifest
from spottrain.agent.sdk.integrations.core import (
    CheckpointPathError,
    FrameworkSession,
    SaveOrder,
    find_complete,
)
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys


@pytest.fixture
def run_id(redis_client: redis.Redis) -> Iterator[str]:
    rid = f"core-{uuid.uuid4().hex[:8]}"
    yield rid
    keys = list(redis_client.scan_iter(match=RunKeys(rid).pattern))
    if keys:
        redis_client.delete(*keys)


def session(root: Path, redis_server: RedisServer | None = None, **kw: object) -> FrameworkSession:
    kw.setdefault("install_signal_handlers", False)
    kw.setdefault("agree_interval", 0.0)  # every step agrees
    kw.setdefault("poll_interval", 0.02)
    url = redis_server.url if redis_server is not None else ""
    return FrameworkSession("plain", root, redis_url=url, **kw)


def write_framework_files(directory: Path, tag: str) -> None:
    (directory / "weights").mkdir(exist_ok=True)
    (directory / "weights" / "model.bin").write_bytes(tag.encode() * 1000)
    (directory / "state.json").write_text(json.dumps({"tag": tag}))


def wait_for_order(fs: FrameworkSession, first: int) -> SaveOrder:
    """Step on until the session orders a save (a request is read by a thread of rank 0's)."""
    step = first
    while True:
        order = fs.step(step, loss=1.0)
        if order is not None:
            return order
        step += 1
        assert step < first + 100_000, "the request never reached the agreement"


def test_a_staged_save_is_committed_as_step_n_with_every_file_in_its_manifest(
    tmp_path: Path, redis_server: RedisServer, redis_client: redis.Redis, run_id: str
) -> None:
    fs = session(tmp_path, redis_server, run_id=run_id)
    order = SaveOrder(7, "periodic")
    tmp = fs.staging_path(order)
    assert tmp.parent == tmp_path and tmp.name.startswith(".tmp-step-000000007")
    write_framework_files(tmp, "a")
    result = fs.commit_staged(order, extra={"seen": 3})
    assert result.committed and result.path == tmp_path / "step-000000007"
    assert not tmp.exists()
    manifest = Manifest.read(tmp_path / "step-000000007")
    assert set(manifest.files) == {"weights/model.bin", "state.json"}
    assert manifest.extra["seen"] == 3 and manifest.extra["framework"] == "plain"
    assert manifest.epoch == fs.epoch >= 0
    found = fs.newest_staged()
    assert found is not None and found.step == 7 and found.path == result.path
    fs.close()
    last = redis_client.hgetall(RunKeys(run_id).ckpt_last)
    assert last[b"step"] == b"7" and last[b"kind"] == b"periodic"


def test_a_changed_file_makes_a_staged_checkpoint_skipped_on_resume(tmp_path: Path) -> None:
    fs = session(tmp_path)
    for step, tag in ((1, "a"), (2, "b")):
        order = SaveOrder(step, "periodic")
        write_framework_files(fs.staging_path(order), tag)
        assert fs.commit_staged(order).committed
    (tmp_path / "step-000000002" / "weights" / "model.bin").write_bytes(b"c" * 1000)
    found = fs.newest_staged()
    assert found is not None and found.step == 1
    assert [name for name, _ in found.skipped] == ["step-000000002"]
    assert "weights/model.bin fails its CRC32" in found.skipped[0][1]
    fs.close()


def test_an_in_place_commit_makes_the_manifest_the_commit_point(tmp_path: Path) -> None:
    fs = session(tmp_path)
    out = tmp_path / "out"
    for step in (3, 6):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        write_framework_files(out / f"checkpoint-{step}", str(step))
    result = fs.commit_in_place(out / "checkpoint-3", SaveOrder(3, "requested", False, 5))
    assert result.committed and result.path == out / "checkpoint-3"
    manifest = Manifest.read(out / "checkpoint-3")
    assert (manifest.kind, manifest.request_id) == ("requested", 5)
    # checkpoint-6 was written but never committed (no manifest): resume takes 3, and 6 is
    # set aside under a name no framework's "newest checkpoint" matches.
    found = find_complete(out)
    assert found is not None and found.path == out / "checkpoint-3"
    assert found.skipped == [("checkpoint-6", f"no {MANIFEST_NAME}")]
    names = sorted(p.name for p in out.iterdir())
    assert names[0].startswith(".torn-checkpoint-6-") and names[1:] == ["checkpoint-3"]
    fs.close()


def test_a_commit_from_a_stale_generation_is_refused_and_reported(
    tmp_path: Path, redis_server: RedisServer, redis_client: redis.Redis, run_id: str
) -> None:
    fs = session(tmp_path, redis_server, run_id=run_id)
    CheckpointDir(tmp_path).claim_epoch("a newer generation")
    order = SaveOrder(4, "emergency", True, 2)
    tmp = fs.staging_path(order)
    write_framework_files(tmp, "x")
    result = fs.commit_staged(order)
    assert not result.committed and result.refused is not None
    assert "a newer generation holds fencing epoch" in result.refused
    assert not tmp.exists() and CheckpointDir(tmp_path).committed() == []
    out = tmp_path / "out" / "checkpoint-4"
    out.mkdir(parents=True)
    write_framework_files(out, "y")
    in_place = fs.commit_in_place(out, order)
    assert not in_place.committed and not (out / MANIFEST_NAME).exists()
    fs.close()
    refused = redis_client.hgetall(RunKeys(run_id).ckpt_refused)
    assert refused[b"count"] == b"2" and refused[b"step"] == b"4"


def test_a_request_in_redis_orders_one_save_which_serves_it(
    tmp_path: Path, redis_server: RedisServer, redis_client: redis.Redis, run_id: str
) -> None:
    fs = session(tmp_path, redis_server, run_id=run_id)
    keys = RunKeys(run_id)
    assert fs.step(1) is None
    body = {"id": 3, "drain": False, "deadline": None, "at": 1.0, "source": "test"}
    redis_client.hset(keys.ckpt_requests, "n1:early", json.dumps(body))
    order = wait_for_order(fs, 2)
    assert (order.kind, order.drain, order.request_id) == ("requested", False, 3)
    write_framework_files(fs.staging_path(order), "r")
    result = fs.commit_staged(order)
    fs.after_commit(result)  # not a drain: returns at once
    # Served: the next steps order nothing more, though the request is still in Redis.
    assert [fs.step(order.step + i) for i in range(1, 20)] == [None] * 19
    fs.close()
    assert int(redis_client.hget(keys.ckpt_last, "request_id") or 0) == 3
    assert int(float(redis_client.hget(keys.progress, "step") or 0)) >= order.step


def test_sigterm_orders_an_emergency_drain_save(tmp_path: Path) -> None:
    fs = session(tmp_path, install_signal_handlers=True)
    try:
        assert fs.step(1) is None
        os.kill(os.getpid(), signal.SIGTERM)
        order = wait_for_order(fs, 2)
        assert (order.kind, order.drain) == ("emergency", True)
    finally:
        fs.close()


def test_the_restore_reported_is_the_step_the_framework_gives(
    tmp_path: Path, redis_server: RedisServer, redis_client: redis.Redis, run_id: str
) -> None:
    keys = RunKeys(run_id)
    redis_client.hset(keys.progress, mapping={"step": "12"})
    fs = session(tmp_path, redis_server, run_id=run_id)
    fs.report_restore(9)
    fs.close()
    assert [json.loads(r) for r in redis_client.lrange(keys.restores, 0, -1)] == [
        {"step": 9, "reached": 12}
    ]


def test_a_path_outside_the_checkpoint_volume_is_refused_naming_the_setting(
    tmp_path: Path,
) -> None:
    (tmp_path / "vol").mkdir()
    fs = session(tmp_path / "vol")
    try:
        assert fs.check_inside(tmp_path / "vol" / "a" / "b", "dirpath") == tmp_path / "vol/a/b"
        (tmp_path / "vol" / "link").symlink_to(tmp_path)
        for outside in (tmp_path / "elsewhere", tmp_path / "vol" / "link" / "x", tmp_path / "vo"):
            with pytest.raises(CheckpointPathError, match=r"set dirpath to a directory under"):
                fs.check_inside(outside, "dirpath")
    finally:
        fs.close()

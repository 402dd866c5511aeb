"""Golden fixtures: what today's code wrote (a run's Redis keys, its event stream, an SDK
checkpoint directory) must stay readable, and read the same, by the code of every release.

The fixtures were captured once by ``capture.py`` (see README.md); these tests only read them.
A failure here means a format changed: running fleets and old checkpoints would break.
"""

from __future__ import annotations

import base64
import json
import pickle
import random
import shutil
import sys
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
import torch.distributed as dist
from golden_state import make_state

from spottrain.agent.checkpoint.directory import CheckpointDir
from spottrain.agent.checkpoint.manifest import Manifest, verify_files
from spottrain.agent.rendezvous.backend import RedisRendezvousBackend
from spottrain.agent.sdk import GlobalBatch, TrainSession
from spottrain.controller.reconcile.state import RunState
from spottrain.controller.reconcile.summary import summarize
from spottrain.controller.report import build_report, read_archive_inputs, read_redis_inputs
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.ports import free_port
from spottrain.protocol.keys import RunKeys
from spottrain.redis_conn import RedisSettings

HERE = Path(__file__).resolve().parent
DUMP = json.loads((HERE / "redis_dump.json").read_text())
EVENTS: list[dict[str, str]] = json.loads((HERE / "events.json").read_text())
EXPECTED_CKPT = json.loads((HERE / "checkpoint_expected.json").read_text())
READERS = DUMP["readers"]
KEYS = RunKeys(DUMP["run_id"])


def dec(v: dict[str, str]) -> bytes:
    return base64.b64decode(v["b64"]) if "b64" in v else v["s"].encode()


def load_dump(client: redis.Redis, keys: dict[str, Any]) -> None:
    """Write every dumped key into ``client`` as it was (without its TTL, so nothing lapses
    while a test reads)."""
    for name, entry in keys.items():
        kind, value = entry["type"], entry["value"]
        if kind == "string":
            client.set(name, dec(value))
        elif kind == "hash":
            client.hset(name, mapping={dec(k): dec(v) for k, v in value})
        elif kind == "list":
            client.rpush(name, *[dec(v) for v in value])
        elif kind == "set":
            client.sadd(name, *[dec(v) for v in value])
        elif kind == "zset":
            client.zadd(name, {dec(m): s for m, s in value})
        elif kind == "stream":
            for entry_id, fields in value:
                client.xadd(name, {dec(k): dec(v) for k, v in fields}, id=entry_id)
        else:
            raise AssertionError(f"{name}: unknown type {kind}")


def plain(obj: Any) -> Any:
    """What JSON makes of ``obj`` (tuples become lists), as the captured readers were kept."""
    return json.loads(json.dumps(obj))


@pytest.fixture
def loaded(redis_client: redis.Redis) -> Iterator[redis.Redis]:
    stale = list(redis_client.scan_iter(match=KEYS.pattern, count=1000))
    if stale:
        redis_client.delete(*stale)
    load_dump(redis_client, DUMP["keys"])
    yield redis_client
    stale = list(redis_client.scan_iter(match=KEYS.pattern, count=1000))
    if stale:
        redis_client.delete(*stale)


# -- the Redis dump -------------------------------------------------------------------------------
def test_every_dumped_key_is_a_key_of_the_schema() -> None:
    for name in DUMP["keys"]:
        assert name.startswith(KEYS.base + ":"), name
    names = set(DUMP["keys"])
    for key in (KEYS.ctl, KEYS.ctl_launches, KEYS.events, KEYS.progress, KEYS.ckpt_last):
        assert key in names
    for key in (KEYS.rdzv_state, KEYS.rdzv_view, KEYS.rdzv_presence, KEYS.rdzv_members):
        assert key in names
    for node in ("n0", "n1"):
        assert KEYS.node(node) in names and KEYS.heartbeat(node) in names
    assert KEYS.nodes in names and KEYS.restores in names


def test_status_json_reads_the_dump_as_it_did(loaded: redis.Redis) -> None:
    state = RunState(loaded, KEYS)
    status = {
        "run_id": KEYS.run_id,
        **asdict(summarize(state, READERS["now"])),
        "ckpt_refused": state.ckpt_refused(),
    }
    assert plain(status) == READERS["status_json"]


def test_the_report_reads_the_dump_as_it_did(loaded: redis.Redis) -> None:
    now = READERS["now"]
    inputs = read_redis_inputs(loaded, KEYS, now)
    report = build_report(KEYS.run_id, inputs, start=READERS["created_at"], now=now, source="redis")
    assert plain(asdict(report)) == READERS["report"]


def test_the_rendezvous_state_and_view_read_as_they_did(
    loaded: redis.Redis, redis_server: RedisServer
) -> None:
    settings = RedisSettings(host=redis_server.host, port=redis_server.port)
    backend = RedisRendezvousBackend(loaded, settings, KEYS, ttl_s=60)
    got = backend.get_state()
    assert got is not None
    raw, token = got
    assert isinstance(token, int)
    state = pickle.loads(raw)
    assert {
        "round": state.round,
        "complete": state.complete,
        "closed": state.closed,
        "participants": sorted(str(n) for n in state.participants),
    } == READERS["rdzv_state"]
    view = {k.decode(): v.decode() for k, v in loaded.hgetall(KEYS.rdzv_view).items()}
    assert view == READERS["rdzv_view"]


# -- the event stream ---------------------------------------------------------------------------
def test_the_event_stream_reads_back_as_written(loaded: redis.Redis) -> None:
    assert RunState(loaded, KEYS).events() == EVENTS
    for row in EVENTS:
        assert {"type", "node", "id"} <= set(row), row


def test_the_archived_event_log_reads_back_as_written(tmp_path: Path) -> None:
    shutil.copy(HERE / "events.jsonl", tmp_path / "events.jsonl")
    inputs = read_archive_inputs(tmp_path)
    assert inputs.events == EVENTS


# -- the checkpoint directory ---------------------------------------------------------------------
@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(HERE / "checkpoint", target, symlinks=True)
    return target


def test_the_manifest_reads_and_the_files_verify(ckpt: Path) -> None:
    assert [step for step, _ in CheckpointDir(ckpt).committed()] == [EXPECTED_CKPT["step"]]
    found = CheckpointDir(ckpt).find_restorable()
    assert found is not None and found.manifest.step == EXPECTED_CKPT["step"]
    manifest = Manifest.read(found.path)
    want = EXPECTED_CKPT["manifest"]
    got = {
        "step": manifest.step,
        "world_size": manifest.world_size,
        "round": manifest.round,
        "kind": manifest.kind,
        "request_id": manifest.request_id,
        "epoch": manifest.epoch,
        "extra": manifest.extra,
        "files": sorted(manifest.files),
    }
    assert got == want
    assert manifest == Manifest.from_bytes((found.path / "MANIFEST.json").read_bytes())
    assert verify_files(found.path, manifest) == []


def test_the_sdk_restores_the_checkpoint_bitwise(ckpt: Path) -> None:
    if "numpy_rand" in EXPECTED_CKPT:
        import numpy  # noqa: F401  (the RNG state holds NumPy's generator: restore it too)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        state, model, opt, sched = make_state(
            99, lr=0.5, step_size=3, gamma=0.9, batch=GlobalBatch(4, 1, 1, 0), note="fresh"
        )
        session = TrainSession(ckpt, redis_url="", install_signal_handlers=False, tracking=False)
        assert session.restore(state) == EXPECTED_CKPT["step"]
        session.close()
        for name, value in model.state_dict().items():
            want = torch.tensor(EXPECTED_CKPT["model"][name], dtype=value.dtype)
            assert torch.equal(value, want), name
        optim = opt.state_dict()["state"]
        for idx, fields in EXPECTED_CKPT["optim"].items():
            for field, want in fields.items():
                got = optim[int(idx)][field]
                got = got.tolist() if torch.is_tensor(got) else got
                assert got == want, (idx, field)
        assert plain(sched.state_dict()) == EXPECTED_CKPT["sched"]
        batch = state["extra"]["batch"]
        assert isinstance(batch, GlobalBatch) and asdict(batch) == EXPECTED_CKPT["batch"]
        assert state["extra"]["note"] == "golden"
        assert torch.rand(4).tolist() == EXPECTED_CKPT["torch_rand"]
        assert random.random() == EXPECTED_CKPT["python_random"]
        if "numpy_rand" in EXPECTED_CKPT:
            assert sys.modules["numpy"].random.rand(2).tolist() == EXPECTED_CKPT["numpy_rand"]
    finally:
        dist.destroy_process_group()

"""The trainer SDK in one process (no torch.distributed): when it saves, what it restores,
what it tells Redis, and what it refuses. Multi-rank behaviour is in tests/e2e."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from spottrain.agent import sdk
from spottrain.agent.checkpoint.dcp_io import CheckpointLoadError
from spottrain.agent.checkpoint.directory import CheckpointDir
from spottrain.agent.checkpoint.files import CheckpointDirError
from spottrain.agent.sdk import GlobalBatch, ModelState, RngState, TrainSession, channel
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys


def make_state(seed: int = 0) -> tuple[dict[str, object], torch.nn.Module]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return {"model": ModelState(model, opt), "rng": RngState()}, model


def train(
    session: TrainSession, state: dict[str, object], model: torch.nn.Module, steps: range
) -> None:
    opt = state["model"].optimizer  # type: ignore[attr-defined]
    for step in steps:
        loss = model(torch.ones(2, 8)).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        session.step(step + 1, state, loss=loss.item())


@pytest.fixture
def run_id(redis_client: redis.Redis) -> Iterator[str]:
    rid = f"sdk-{uuid.uuid4().hex[:8]}"
    yield rid
    keys = list(redis_client.scan_iter(match=RunKeys(rid).pattern))
    if keys:
        redis_client.delete(*keys)


def session(tmp_path: Path, **kwargs: object) -> TrainSession:
    kwargs.setdefault("install_signal_handlers", False)
    kwargs.setdefault("redis_url", "")
    return TrainSession(tmp_path, **kwargs)  # type: ignore[arg-type]


# -- the global batch ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("global_size", "micro", "world"),
    [(32, 4, 1), (32, 4, 2), (32, 4, 4), (32, 4, 3), (30, 4, 5), (768, 8, 40), (768, 8, 56)],
)
def test_every_sample_of_a_step_is_used_once_whatever_the_world_size(
    global_size: int, micro: int, world: int
) -> None:
    for step in (0, 7):
        seen = []
        counts = []
        for rank in range(world):
            ranges = GlobalBatch(global_size, micro, world, rank).micro_ranges(step)
            counts.append(len(ranges))
            for r in ranges:
                assert 0 < len(r) <= micro
                seen.extend(r)
        assert sorted(seen) == list(range(step * global_size, (step + 1) * global_size))
        assert max(counts) - min(counts) <= 1  # as even as the micro-batches allow


def test_gradient_accumulation_follows_the_world_size() -> None:
    assert [GlobalBatch(32, 4, w, 0).accum_steps for w in (1, 2, 4, 8)] == [8, 4, 2, 1]
    # 768 in micro batches of 8 is 96 micro-batches: 5 nodes of 8 GPUs run 3 or 2 each.
    counts = [GlobalBatch(768, 8, 40, r).accum_steps for r in range(40)]
    assert counts.count(3) == 16 and counts.count(2) == 24


@pytest.mark.parametrize("world", [1, 2, 3, 5, 7])
def test_uneven_splits_average_to_the_global_batch_gradient(world: int) -> None:
    """Ranks' gradients of ``loss * weight``, averaged as an all-reduce does, are the
    gradient of the mean loss over the whole global batch, at any world size."""
    torch.manual_seed(0)
    global_size, micro = 30, 4  # 8 micro-batches, the last of 2 samples
    xs, ys = torch.randn(global_size, 6), torch.randn(global_size, 1)
    model = torch.nn.Linear(6, 1)

    def grad_of(loss: torch.Tensor) -> torch.Tensor:
        model.zero_grad()
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    want = grad_of(torch.nn.functional.mse_loss(model(xs), ys))
    summed = torch.zeros_like(want)
    for rank in range(world):
        batch = GlobalBatch(global_size, micro, world, rank)
        model.zero_grad()
        for r in batch.micro_ranges(0):
            idx = torch.tensor(list(r))
            loss = torch.nn.functional.mse_loss(model(xs[idx]), ys[idx])
            (loss * batch.weight(r)).backward()
        summed += torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    torch.testing.assert_close(summed / world, want, rtol=1e-5, atol=1e-6)


def test_a_world_with_more_ranks_than_micro_batches_names_the_largest_usable_one() -> None:
    with pytest.raises(ValueError, match=r"fewer than world size 9.*largest usable world size"):
        GlobalBatch(32, 4, 9, 0)
    GlobalBatch(32, 4, 8, 7)
    with pytest.raises(ValueError, match="positive"):
        GlobalBatch(0, 4, 1, 0)


# -- configuration ------------------------------------------------------------------------------
def test_no_checkpoint_directory_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPOTTRAIN_CKPT_DIR", raising=False)
    with pytest.raises(ValueError, match="SPOTTRAIN_CKPT_DIR"):
        TrainSession(install_signal_handlers=False)


def test_a_missing_checkpoint_directory_is_an_error_not_a_new_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointDirError, match="does not exist"):
        session(tmp_path / "nope")
    assert not (tmp_path / "nope").exists()


# -- saving and restoring -----------------------------------------------------------------------
@pytest.mark.parametrize("async_periodic", [True, False])
def test_saves_every_n_steps_and_restores_the_newest(tmp_path: Path, async_periodic: bool) -> None:
    state, model = make_state()
    s = session(tmp_path, every_steps=4, keep=2, async_periodic=async_periodic)
    assert s.restore(state) == 0
    train(s, state, model, range(10))
    s.finish(10, state)
    assert [r.step for r in s.saves] == [4, 8, 10]
    assert [step for step, _ in CheckpointDir(tmp_path).committed()] == [8, 10]
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    state2, model2 = make_state(seed=1)
    s2 = session(tmp_path)
    assert s2.restore(state2) == 10
    for k, v in model2.state_dict().items():
        assert torch.equal(v, expected[k])
    s2.close()


def test_saves_every_t_seconds(tmp_path: Path) -> None:
    state, model = make_state()
    s = session(tmp_path, every_seconds=0.3)
    s.restore(state)
    t0 = time.monotonic()
    for step in range(12):
        train(s, state, model, range(step, step + 1))
        time.sleep(0.1)
    elapsed = time.monotonic() - t0
    s.close()
    # About one save per 0.3 s of training, however slow this machine is right now.
    assert 2 <= len(s.saves) <= elapsed / 0.3 + 1
    assert all(r.manifest is not None and r.manifest.kind == "periodic" for r in s.saves)


def test_restore_skips_a_corrupt_newest_checkpoint_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state, model = make_state()
    s = session(tmp_path, every_steps=3, async_periodic=False)
    s.restore(state)
    train(s, state, model, range(6))
    s.close()
    shard = next((tmp_path / "step-000000006").glob("*.distcp"))
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    caplog.set_level(logging.WARNING)
    state2, _ = make_state()
    assert session(tmp_path).restore(state2) == 3
    assert "step-000000006" in caplog.text and "CRC32" in caplog.text


# -- Redis: requests, progress, fencing ---------------------------------------------------------
def test_a_request_in_redis_makes_rank_zero_save_once(
    tmp_path: Path, redis_server: RedisServer, redis_client: redis.Redis, run_id: str
) -> None:
    keys = RunKeys(run_id)
    state, model = make_state()
    s = session(tmp_path, redis_url=redis_server.endpoint, run_id=run_id, poll_interval=0.05)
    s.restore(state)
    train(s, state, model, range(3))
    body = {"id": 7, "drain": False, "deadline": None, "at": time.time(), "source": "test"}
    redis_client.hset(keys.ckpt_requests, "n1", json.dumps(body))
    time.sleep(0.3)
    train(s, state, model, range(3, 8))
    s.close()
    requested = [r for r in s.saves if r.manifest and r.manifest.kind == "requested"]
    assert len(requested) == 1, s.saves
    assert requested[0].manifest is not None and requested[0].manifest.request_id == 7
    last = redis_client.hgetall(keys.ckpt_last)
    assert last[b"kind"] == b"requested" and last[b"request_id"] == b"7"
    progress = redis_client.hgetall(keys.progress)
    assert int(progress[b"step"]) >= 3 and b"loss" in progress


@pytest.mark.parametrize(("every_s", "expect_many"), [(3600.0, False), (0.0, True)])
def test_rank_zero_keeps_a_thinned_progress_history_in_the_event_stream(
    tmp_path: Path,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    run_id: str,
    monkeypatch: pytest.MonkeyPatch,
    every_s: float,
    expect_many: bool,
) -> None:
    monkeypatch.setattr(channel, "PROGRESS_EVENT_S", every_s)
    keys = RunKeys(run_id)
    state, model = make_state()
    s = session(tmp_path, redis_url=redis_server.endpoint, run_id=run_id, poll_interval=0.02)
    s.restore(state)
    for step in range(6):
        train(s, state, model, range(step, step + 1))
        time.sleep(0.06)
    s.close()
    rows = [
        {k.decode(): v.decode() for k, v in f.items()} for _, f in redis_client.xrange(keys.events)
    ]
    progress = [r for r in rows if r["type"] == "progress"]
    assert progress and all(r["world_size"] == "1" and "loss" in r for r in progress)
    steps = [int(r["step"]) for r in progress]
    assert steps == sorted(steps)
    # At most one a minute (and one per world size): a single one here, unless the interval
    # is zero, when each poll that found new progress adds one.
    assert (len(progress) > 2) if expect_many else (len(progress) == 1)


def test_a_drain_request_holds_the_worker_then_training_goes_on(
    tmp_path: Path, redis_server: RedisServer, redis_client: redis.Redis, run_id: str
) -> None:
    keys = RunKeys(run_id)
    state, model = make_state()
    s = session(
        tmp_path,
        redis_url=redis_server.endpoint,
        run_id=run_id,
        poll_interval=0.05,
        hold_timeout=0.5,
    )
    s.restore(state)
    body = {"id": 1, "drain": True, "deadline": time.time() + 60, "at": time.time()}
    redis_client.hset(keys.ckpt_requests, "n1", json.dumps(body))
    time.sleep(0.3)
    t0 = time.monotonic()
    train(s, state, model, range(4))
    s.close()
    assert time.monotonic() - t0 >= 0.5, "the worker did not hold after the drain save"
    kinds = [r.manifest.kind for r in s.saves if r.manifest]
    assert kinds == ["emergency"]
    assert redis_client.hget(keys.ckpt_last, "drain") == b"1"


def test_a_commit_from_a_stale_round_is_refused(
    tmp_path: Path,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    run_id: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node frozen mid-save and woken after its peers formed round 5 must not commit."""
    monkeypatch.setenv("SPOTTRAIN_RDZV_ROUND", "3")
    state, model = make_state()
    s = session(
        tmp_path,
        redis_url=redis_server.endpoint,
        run_id=run_id,
        every_steps=2,
        async_periodic=False,
    )
    s.restore(state)
    train(s, state, model, range(2))
    assert s.saves[-1].committed
    redis_client.hset(RunKeys(run_id).rdzv_view, mapping={"round": 5, "world_size": 2})
    train(s, state, model, range(2, 4))
    s.close()
    assert not s.saves[-1].committed
    assert "round 5" in (s.saves[-1].refused or "")
    assert [step for step, _ in CheckpointDir(tmp_path).committed()] == [2]
    assert not list(tmp_path.glob(".tmp-*"))


def test_rounds_starting_again_at_zero_still_commit(
    tmp_path: Path,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    run_id: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Round 7 commits; then the rendezvous state is new (Redis lost its data, its keys
    expired, or a relaunch under a new --rdzv-id over the same directory): round 1 commits."""
    monkeypatch.setenv("SPOTTRAIN_RDZV_ROUND", "7")
    redis_client.hset(RunKeys(run_id).rdzv_view, mapping={"round": 7, "world_size": 1})
    state, model = make_state()
    kw = {"redis_url": redis_server.endpoint, "every_steps": 2, "async_periodic": False}
    s = session(tmp_path, run_id=run_id, keep=10, **kw)
    s.restore(state)
    train(s, state, model, range(4))
    s.close()
    assert [r.committed for r in s.saves] == [True, True]

    redis_client.delete(*redis_client.scan_iter(match=RunKeys(run_id).pattern))  # data lost
    monkeypatch.setenv("SPOTTRAIN_RDZV_ROUND", "1")
    redis_client.hset(RunKeys(run_id).rdzv_view, mapping={"round": 1, "world_size": 1})
    state2, model2 = make_state()
    s2 = session(tmp_path, run_id=run_id, keep=10, **kw)
    assert s2.restore(state2) == 4
    train(s2, state2, model2, range(4, 8))
    s2.finish(9, state2)
    assert [(r.step, r.refused) for r in s2.saves] == [(6, None), (8, None), (9, None)]
    assert [step for step, _ in CheckpointDir(tmp_path).committed()] == [2, 4, 6, 8, 9]
    assert not redis_client.exists(RunKeys(run_id).ckpt_refused)
    assert session(tmp_path).restore(make_state()[0]) == 9


def test_a_frozen_older_session_is_refused_and_status_says_so(
    tmp_path: Path,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    run_id: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A session frozen while a newer generation started (its round even lower, as after
    Redis lost its data) cannot commit, and the refusal is an event and a count in Redis
    that `spottrain status` shows."""
    keys = RunKeys(run_id)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    monkeypatch.setenv("SPOTTRAIN_RDZV_ROUND", "3")
    monkeypatch.setenv(sdk.ENV_NODE, "n-frozen")
    kw = {"redis_url": redis_server.endpoint, "run_id": run_id, "async_periodic": False}
    state, model = make_state()
    frozen = session(ckpt, every_steps=2, **kw)
    frozen.restore(state)
    monkeypatch.setenv("SPOTTRAIN_RDZV_ROUND", "0")
    newer = session(ckpt, **kw)
    assert newer.epoch > frozen.epoch
    train(frozen, state, model, range(4))
    frozen.close()
    newer.close()
    assert [(r.step, r.committed) for r in frozen.saves] == [(2, False), (4, False)]
    assert CheckpointDir(ckpt).committed() == []
    assert not list(ckpt.glob(".tmp-*"))

    events = [
        {k.decode(): v.decode() for k, v in f.items()} for _, f in redis_client.xrange(keys.events)
    ]
    refused = [e for e in events if e["type"] == "checkpoint-refused"]
    assert [(e["step"], e["node"], e["round"]) for e in refused] == [
        ("2", "n-frozen", "3"),
        ("4", "n-frozen", "3"),
    ]
    assert f"newer generation holds fencing epoch {newer.epoch}" in refused[0]["reason"]
    last = redis_client.hgetall(keys.ckpt_refused)
    assert last[b"count"] == b"2" and last[b"step"] == b"4"

    import yaml
    from spec_samples import LOCAL

    from spottrain.controller.cli import main as cli
    from spottrain.controller.run.records import RunInfo

    monkeypatch.setenv("SPOTTRAIN_HOME", str(tmp_path / "home"))
    RunInfo(
        run_id=run_id,
        spec_text=yaml.safe_dump(LOCAL),
        spec_source="job.yaml",
        base_dir=str(tmp_path),
        redis_url=redis_server.endpoint,
        embedded_redis=False,
        created_at=time.time(),
    ).save()
    assert cli.main(["status", run_id]) == 0
    out = capsys.readouterr().out
    assert "2 checkpoint commits refused (newest: step 4 by n-frozen: refused to commit" in out
    assert cli.main(["status", run_id, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ckpt_refused"]["count"] == "2"


def test_training_goes_on_when_redis_is_unreachable(tmp_path: Path) -> None:
    state, model = make_state()
    s = session(tmp_path, redis_url="127.0.0.1:1", run_id="x-1", every_steps=2, poll_interval=0.05)
    s.restore(state)
    train(s, state, model, range(4))
    s.close()
    assert [r.step for r in s.saves if r.committed] == [2, 4]


def test_a_checkpoint_that_does_not_fit_the_model_stops_with_a_clear_error(tmp_path: Path) -> None:
    state, model = make_state()
    s = session(tmp_path, every_steps=2, async_periodic=False)
    s.restore(state)
    train(s, state, model, range(2))
    s.close()
    bigger = torch.nn.Linear(8, 6)  # the model changed shape since the checkpoint
    other = {"model": ModelState(bigger, torch.optim.Adam(bigger.parameters())), "rng": RngState()}
    with pytest.raises(CheckpointLoadError, match="new one"):
        session(tmp_path).restore(other)
    assert [step for step, _ in CheckpointDir(tmp_path).committed()] == [2], "nothing deleted"


def test_staging_copies_tensors_and_keeps_container_types() -> None:
    from collections import namedtuple

    from spottrain.agent.sdk.state import stage

    Pair = namedtuple("Pair", "a b")
    t = torch.ones(3)
    staged = stage({"p": Pair(t, [t, (t, 1)]), "n": 5})
    assert isinstance(staged["p"], Pair) and staged["n"] == 5
    t.add_(1)
    assert torch.equal(staged["p"].a, torch.ones(3)), "the staged copy followed the original"
    assert isinstance(staged["p"].b[1], tuple)


def test_each_rank_reports_its_own_compute_time_not_the_wall_step(
    tmp_path: Path,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    run_id: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SPOTTRAIN_NODE_ID", "n5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    s = session(tmp_path, redis_url=redis_server.endpoint, run_id=run_id, report_interval=0.05)
    s.restore({})
    for step in range(1, 4):
        for _micro in range(2):
            with s.compute():  # forward and backward of one micro-batch
                time.sleep(0.05)
        time.sleep(0.4)  # the all-reduce's wait for a slower peer: not compute
        s.step(step, {})
    key = RunKeys(run_id).node("n5")
    deadline = time.monotonic() + 30
    while redis_client.hget(key, "compute:1") is None:
        assert time.monotonic() < deadline, "no compute time reported"
        time.sleep(0.02)
    s.close()
    secs, at = (float(x) for x in redis_client.hget(key, "compute:1").split())  # type: ignore[union-attr]
    assert 0.1 <= secs < 0.4
    assert abs(at - time.time()) < 60
    # Only local rank 0 speaks for the node's wall step time.
    assert redis_client.hget(key, "step_time") is None


def test_a_script_can_give_its_compute_time_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    s = session(tmp_path)
    s.restore({})
    for step in range(1, 4):
        s.step(step, {}, compute_s=1.5)
    assert s.compute_time == 1.5
    with pytest.raises(ValueError, match=r"compute_s=-1\.0: give this step's compute seconds"):
        s.step(4, {}, compute_s=-1.0)
    s.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_compute_is_timed_with_cuda_events_without_waiting(tmp_path: Path) -> None:
    s = session(tmp_path)
    s.restore({})
    a = torch.randn(2048, 2048, device="cuda")
    for step in range(1, 4):
        with s.compute():
            for _ in range(20):
                a = (a @ a).tanh()
        s.step(step, {})
    # Steps are filed once their events completed: after a synchronisation, the next step
    # files every earlier one.
    torch.cuda.synchronize()
    s.step(4, {})
    assert len(s._timer.compute_times) == 3 and not s._timer.gpu_pending
    assert s.compute_time is not None and s.compute_time > 0
    s.close()

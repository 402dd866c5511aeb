"""The agent's dead man's switch, one look at a time, against a real Redis and a real
progress file: it fires only when Redis answers without a controller heartbeat AND the node's
own workers have not stepped, each for the orphan timeout; a Redis outage never counts.

The clock is passed to each look, so no test waits on wall-clock time."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from spottrain.agent.local_progress import ProgressFile, read_step
from spottrain.agent.orphan import OrphanView, OrphanWatch, end_this_vm, orphaned
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys

TIMEOUT = 10.0


def _watch(client: redis.Redis, keys: RunKeys, progress: Path) -> OrphanWatch:
    fired: list[str] = []
    return OrphanWatch(client, keys, str(progress), TIMEOUT, fired.append, clock=lambda: 0.0)


def _step(progress: Path, step: int) -> None:
    ProgressFile(str(progress), every_s=0).report(step)


def test_no_controller_and_no_step_for_the_timeout_ends_the_vm(
    redis_client: redis.Redis, run_keys: RunKeys, tmp_path: Path
) -> None:
    progress = tmp_path / "step"
    _step(progress, 5)
    watch = _watch(redis_client, run_keys, progress)
    assert watch.look(0.0) is None
    assert watch.look(6.0) is None
    reason = watch.look(10.5)
    assert reason is not None
    assert "no controller heartbeat for 10 s and no training step on this node for 10 s" in reason
    assert "step 5" in reason


def test_training_that_steps_keeps_its_vm_until_it_stops_stepping(
    redis_client: redis.Redis, run_keys: RunKeys, tmp_path: Path
) -> None:
    progress = tmp_path / "step"
    watch = _watch(redis_client, run_keys, progress)
    for t in range(0, 100, 2):
        _step(progress, t)
        assert watch.look(float(t)) is None, t
    assert watch.view.controller_absent_s >= TIMEOUT  # the controller is long gone
    assert watch.look(105.0) is None
    assert watch.look(108.5) is not None  # no step since t=98


def test_a_controller_heartbeat_resets_the_count(
    redis_client: redis.Redis, run_keys: RunKeys, tmp_path: Path
) -> None:
    watch = _watch(redis_client, run_keys, tmp_path / "step")
    watch.look(0.0)
    watch.look(9.0)
    redis_client.set(run_keys.ctl_alive, "ctl-x", px=60_000)
    assert watch.look(9.5) is None and watch.view.controller_absent_s == 0
    redis_client.delete(run_keys.ctl_alive)
    assert watch.look(15.0) is None
    assert watch.look(25.6) is not None


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as server:
        yield server


def test_a_redis_outage_never_counts_as_a_missing_controller(
    own_redis: RedisServer, tmp_path: Path
) -> None:
    client = own_redis.client(socket_timeout=2)
    keys = RunKeys("orphan-outage")
    # Even with no step at all on this node: Redis is away, so nothing is known of the
    # controller and the VM stays.
    watch = _watch(client, keys, tmp_path / "step")
    own_redis.stop()
    for t in range(0, 1000, 50):
        assert watch.look(float(t)) is None
    assert watch.view.controller_absent_s == 0
    own_redis.start()
    # Back: the absence counts from the first answer on, not from before the outage.
    assert watch.look(1000.0) is None
    assert watch.look(1009.0) is None
    assert watch.look(1010.5) is not None


def test_an_outage_in_the_middle_of_an_absence_adds_nothing(
    own_redis: RedisServer, tmp_path: Path
) -> None:
    client = own_redis.client(socket_timeout=2)
    watch = _watch(client, RunKeys("orphan-gap"), tmp_path / "step")
    watch.look(0.0)
    watch.look(6.0)
    own_redis.stop()
    assert watch.look(500.0) is None
    own_redis.start()
    assert watch.look(501.0) is None and watch.view.controller_absent_s == 6.0
    assert watch.look(505.5) is not None


def test_the_switch_is_off_at_zero() -> None:
    view = OrphanView(started_at=0.0, controller_absent_s=1e9)
    assert orphaned(view, 1e9, 0.0) is None
    assert orphaned(view, 1e9, 60.0) is not None
    with pytest.raises(ValueError, match="0 turns it off"):
        OrphanWatch(None, RunKeys("x"), "", 0.0, print)  # type: ignore[arg-type]


def test_the_progress_file_is_written_at_most_once_a_second(tmp_path: Path) -> None:
    now = [0.0]
    path = tmp_path / "step"
    pf = ProgressFile(str(path), every_s=1.0, clock=lambda: now[0])
    assert read_step(str(path)) is None
    pf.report(1)
    assert read_step(str(path)) == 1
    now[0] = 0.5
    pf.report(2)
    assert read_step(str(path)) == 1
    now[0] = 1.2
    pf.report(3)
    assert read_step(str(path)) == 3
    assert [p.name for p in tmp_path.iterdir()] == ["step"]  # no temporary file left
    ProgressFile(None).report(9)  # no file named: nothing written, nothing raised


def test_ending_the_vm_runs_the_configured_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SPOTTRAIN_LOCAL_VM_PID", raising=False)
    marker = tmp_path / "ended"
    assert end_this_vm("aws", f"touch {marker}") is None
    assert marker.exists()
    problem = end_this_vm("gcp", "false")
    assert problem is not None and "false exited 1" in problem
    assert "SPOTTRAIN_LOCAL_VM_PID is not set" in (end_this_vm("local") or "")


def test_the_agent_refuses_a_negative_orphan_timeout(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    from spottrain.agent import cli as agent_cli

    argv = ["run", "--redis", redis_server.url, "--run-id", "r-1", "--orphan-timeout", "-1"]
    assert agent_cli.main([*argv, "--", "train.py"]) == 2
    assert "orphan timeout -1 s must be >= 0 (0 turns it off)" in capsys.readouterr().err

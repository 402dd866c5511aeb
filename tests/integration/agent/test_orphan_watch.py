"""The agent's dead man's switch, one look at a time, against a real Redis and a real
progress file: it fires only when Redis answers without a controller heartbeat AND the node's
own workers have not stepped, each for the orphan timeout; a Redis outage never counts.

The clock is passed to each look, so no test waits on wall-clock time."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from fakes.metadata_server import MetadataServer

from spottrain.agent.local_progress import ProgressFile, read_step, tree_cpu_s
from spottrain.agent.orphan import OrphanView, OrphanWatch, VmEnding, end_this_vm, orphaned
from spottrain.cloud.this_vm.gcp import GcpThisVm
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


def test_a_vm_its_cloud_does_not_end_is_powered_off_by_the_configured_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SPOTTRAIN_LOCAL_VM_PID", raising=False)
    marker = tmp_path / "ended"
    with MetadataServer() as md:  # a metadata server that knows nothing of this VM
        vm = GcpThisVm(metadata_host=md.host)
        ending = end_this_vm("gcp", f"touch {marker}", vm=vm)
        assert marker.exists()
        assert ending.how == f"power-off: touch {marker}"
        assert ending.problems == (
            "the metadata server answered HTTP 404 for instance/zone: not a Compute Engine VM?",
        )
        failed = end_this_vm("gcp", "false", vm=vm)
    assert failed.how == "" and "false exited 1" in failed.problems[-1]
    local = end_this_vm("local")
    assert local.how == "" and "$SPOTTRAIN_LOCAL_VM_PID is not set" in local.problems[0]
    marker.unlink()
    # On the local cloud the command replaces the signal to the VM process.
    assert end_this_vm("local", f"touch {marker}") == VmEnding(f"power-off: touch {marker}")
    assert marker.exists()


BUSY = "import sys, time\nwhile time.process_time() < 0.3:\n    pass\n"
# A process whose first busy child ended (reaped: its time is in ours) and whose second is
# alive once it made the file named in argv[1].
TREE = f"""
import subprocess, sys, time
busy = {BUSY!r}
subprocess.run([sys.executable, "-c", busy], check=True)
made = "open(sys.argv[1], 'w').close()\\ntime.sleep(600)"
subprocess.Popen([sys.executable, "-c", busy + made, sys.argv[1]])
time.sleep(600)
"""


def test_the_workers_cpu_counts_every_process_of_the_tree_alive_or_reaped(
    tmp_path: Path,
) -> None:
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", TREE, str(ready)], start_new_session=True)
    try:
        wait_for(ready.exists, "the second busy child")
        seconds = tree_cpu_s(proc.pid)
        assert seconds is not None and seconds >= 0.6  # 0.3 s reaped + 0.3 s alive
        os.killpg(proc.pid, signal.SIGKILL)
        # Dead but not yet reaped: torchrun gone, its workers with it.
        wait_for(lambda: tree_cpu_s(proc.pid) is None, "the root to die")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert tree_cpu_s(proc.pid) is None


def wait_for(cond: Callable[[], bool], what: str, limit_s: float = 120.0) -> None:
    """Poll ``cond`` until it holds; fail naming ``what`` after ``limit_s`` (a deadlock guard,
    not a pace: every wait here ends on a condition)."""
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, f"waited {limit_s:g} s for {what}"
        time.sleep(0.05)


def test_the_agent_refuses_a_negative_orphan_timeout(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    from spottrain.agent import cli as agent_cli

    argv = ["run", "--redis", redis_server.url, "--run-id", "r-1", "--orphan-timeout", "-1"]
    assert agent_cli.main([*argv, "--", "train.py"]) == 2
    assert "orphan timeout -1 s must be >= 0 (0 turns it off)" in capsys.readouterr().err

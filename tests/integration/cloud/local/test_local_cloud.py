"""The local cloud's own behaviour: VMs are real process trees that outlive their launcher,
boot after a latency, get the notice window on a preemption or die at once without one, and
take their whole process tree with them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from spottrain.agent.processes import running
from spottrain.cloud.base import (
    AuthError,
    CapacityError,
    InstanceState,
    LaunchRequest,
    Market,
    OfferQuery,
    QuotaError,
    TransientError,
)
from spottrain.cloud.local.compute import (
    LocalProvider,
    PreemptionInjector,
)
from spottrain.cloud.local.settings import LocalSettings
from spottrain.trace import TracedPreemption, load_trace

# A boot command that records its pid and its SIGTERM, starts a grandchild in a session of
# its own (as torchrun does with its workers), and leaves 0.5 s after a SIGTERM.
BOOT = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    out = sys.argv[1]
    child = subprocess.Popen(["sleep", "600"], start_new_session=True)
    open(out + ".pids", "w").write(f"{os.getpid()} {child.pid}")
    def term(*_):
        open(out + ".term", "w").write(str(time.time()))
        if len(sys.argv) > 2:  # a boot command that ignores the notice
            return
        time.sleep(0.5)
        sys.exit(0)
    signal.signal(signal.SIGTERM, term)
    print("booted", flush=True)
    while True:
        time.sleep(0.1)
    """
)


@pytest.fixture
def cloud(tmp_path: Path) -> Iterator[LocalProvider]:
    p = LocalProvider(
        LocalSettings(tmp_path / "cloud", zones={"local-a": 2, "local-b": 1}, notice_s=3.0)
    )
    yield p
    for rec in p.store.all():
        if rec["state"] != "terminated":
            p.preempt(rec["id"], notice=False)


def _boot(tmp_path: Path, name: str, *extra: str) -> str:
    script = tmp_path / "boot.py"
    script.write_text(BOOT)
    return json.dumps({"argv": [sys.executable, str(script), str(tmp_path / name), *extra]})


def _launch(cloud: LocalProvider, user_data: str, rid: str, zone: str = "local-a") -> str:
    offer = next(o for o in cloud.offers(OfferQuery(zones=(zone,))) if o.market is Market.SPOT)
    return cloud.launch(LaunchRequest(rid, "job-1", f"n-{rid}", offer, user_data)).id


def _wait(fn: Callable[[], Any], what: str, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := fn()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return value


def _state(cloud: LocalProvider, vm: str) -> InstanceState:
    return next(i.state for i in cloud.list("job-1") if i.id == vm)


def _pids(tmp_path: Path, name: str) -> list[int]:
    path = tmp_path / f"{name}.pids"
    _wait(path.exists, "the boot command to start")
    return [int(p) for p in path.read_text().split()]


def test_vm_is_pending_for_the_launch_latency_then_runs(tmp_path: Path) -> None:
    cloud = LocalProvider(LocalSettings(tmp_path / "c", launch_latency_s=1.5, notice_s=2))
    offer = cloud.offers(OfferQuery(markets=(Market.SPOT,)))[0]
    started = time.monotonic()
    vm = cloud.launch(LaunchRequest("r1", "job-1", "n0", offer, _boot(tmp_path, "a"))).id
    assert _state(cloud, vm) is InstanceState.PENDING
    _wait(lambda: _state(cloud, vm) is InstanceState.RUNNING, "the VM to run")
    assert time.monotonic() - started >= 1.4
    cloud.preempt(vm, notice=False)


def test_preemption_with_notice_sigterms_the_boot_command_and_ends_the_vm(
    cloud: LocalProvider, tmp_path: Path
) -> None:
    vm = _launch(cloud, _boot(tmp_path, "a"), "r1")
    pids = _pids(tmp_path, "a")
    assert cloud.preempt(vm, notice=True)
    _wait(lambda: _state(cloud, vm) is InstanceState.TERMINATED, "the VM to end", timeout=10)
    assert (tmp_path / "a.term").exists(), "the boot command got its SIGTERM"
    inst = next(i for i in cloud.list("job-1") if i.id == vm)
    assert inst.interrupted and inst.state_reason == "preempted"
    assert running(pids) == [], "the grandchild in its own session died with the VM"
    assert "booted" in cloud.log_path(vm).read_text(), "the console log outlives the VM"


def test_notice_window_is_enforced_on_a_boot_command_that_ignores_it(
    cloud: LocalProvider, tmp_path: Path
) -> None:
    vm = _launch(cloud, _boot(tmp_path, "a", "ignore-term"), "r1")
    pids = _pids(tmp_path, "a")
    t0 = time.monotonic()
    cloud.preempt(vm, notice=True)
    _wait(lambda: _state(cloud, vm) is InstanceState.TERMINATED, "the VM to end", timeout=15)
    elapsed = time.monotonic() - t0
    assert elapsed >= 2.5, f"the VM died {elapsed:.1f} s into a 3 s notice window"
    assert running(pids) == []


def test_preemption_without_notice_kills_the_whole_tree_at_once(
    cloud: LocalProvider, tmp_path: Path
) -> None:
    vm = _launch(cloud, _boot(tmp_path, "a"), "r1")
    pids = _pids(tmp_path, "a")
    cloud.preempt(vm, notice=False)
    assert _state(cloud, vm) is InstanceState.TERMINATED
    assert not (tmp_path / "a.term").exists(), "no notice means no SIGTERM"
    _wait(lambda: running(pids) == [], "every process of the VM to die", timeout=5)
    assert cloud.preempt(vm, notice=False) is False


def test_vm_outlives_the_process_that_launched_it(tmp_path: Path) -> None:
    script = tmp_path / "launcher.py"
    script.write_text(
        textwrap.dedent(
            f"""
            from pathlib import Path
            from spottrain.cloud.base import LaunchRequest, OfferQuery
            from spottrain.cloud.local.compute import LocalProvider
            from spottrain.cloud.local.settings import LocalSettings
            cloud = LocalProvider(LocalSettings(Path({str(tmp_path / "c")!r})))
            offer = cloud.offers(OfferQuery())[0]
            boot = {_boot(tmp_path, "a")!r}
            print(cloud.launch(LaunchRequest("r1", "job-1", "n0", offer, boot)).id)
            """
        )
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True)
    vm = out.stdout.strip()
    # A new provider object (a restarted controller) finds the VM by its job tag alone.
    cloud = LocalProvider.open(tmp_path / "c")
    _wait(lambda: _state(cloud, vm) is InstanceState.RUNNING, "the VM to run")
    inst = next(i for i in cloud.list("job-1") if i.id == vm)
    assert (inst.node, inst.request_id) == ("n0", "r1")
    cloud.preempt(vm, notice=False)


def test_a_vm_whose_process_vanished_is_reported_terminated(
    cloud: LocalProvider, tmp_path: Path
) -> None:
    vm = _launch(cloud, _boot(tmp_path, "a"), "r1")
    _pids(tmp_path, "a")
    rec = cloud.record(vm)
    os.kill(int(rec["pid"]), 9)  # the VM process dies (its boot command is orphaned)
    _wait(lambda: _state(cloud, vm) is InstanceState.TERMINATED, "the VM to be seen gone")
    inst = next(i for i in cloud.list("job-1") if i.id == vm)
    assert inst.state_reason == "the VM process is gone" and not inst.interrupted
    for pid in _pids(tmp_path, "a"):
        with __import__("contextlib").suppress(ProcessLookupError):
            os.kill(pid, 9)


def test_capacity_counts_live_vms_and_can_be_changed_from_another_process(
    cloud: LocalProvider, tmp_path: Path
) -> None:
    _launch(cloud, _boot(tmp_path, "a"), "r1", "local-b")
    with pytest.raises(CapacityError, match="holds 1 VMs and has 1"):
        _launch(cloud, _boot(tmp_path, "b"), "r2", "local-b")
    # The CLI, in another process, raises the zone's capacity.
    cli = [
        sys.executable,
        "-m",
        "spottrain.controller.cli",
        "local",
        "--state-dir",
        str(cloud.store.root),
    ]
    subprocess.run(
        [*cli, "capacity", "local-b", "2"],
        check=True,
        capture_output=True,
    )
    assert cloud.capacity()["local-b"] == 2
    _launch(cloud, _boot(tmp_path, "b"), "r2", "local-b")


def test_a_preempted_vm_frees_its_capacity(cloud: LocalProvider, tmp_path: Path) -> None:
    vm = _launch(cloud, _boot(tmp_path, "a"), "r1", "local-b")
    cloud.preempt(vm, notice=False)
    _launch(cloud, _boot(tmp_path, "b"), "r2", "local-b")


@pytest.mark.parametrize(("kind", "error"), [("auth", AuthError), ("transient", TransientError)])
def test_refusals_are_typed_errors(cloud: LocalProvider, kind: str, error: type) -> None:
    cloud.set_refusal(kind)
    with pytest.raises(error):
        cloud.offers(OfferQuery())
    with pytest.raises(error):
        cloud.list("job-1")
    cloud.set_refusal(None)
    assert cloud.offers(OfferQuery())


def test_a_used_up_quota_refuses_launches_only(cloud: LocalProvider, tmp_path: Path) -> None:
    cloud.set_refusal("quota")
    assert cloud.offers(OfferQuery()) and cloud.list("job-1") == []
    with pytest.raises(QuotaError):
        _launch(cloud, _boot(tmp_path, "a"), "r1")


def test_injector_follows_a_trace(cloud: LocalProvider, tmp_path: Path) -> None:
    a = _launch(cloud, _boot(tmp_path, "a"), "r1")
    b = _launch(cloud, _boot(tmp_path, "b"), "r2")
    _pids(tmp_path, "a")
    _pids(tmp_path, "b")
    node_b = next(i.node for i in cloud.list("job-1") if i.id == b)
    trace = [TracedPreemption(10, node_b, notice=False), TracedPreemption(20, None, True)]
    inj = PreemptionInjector(cloud, "job-1", started_at=1000.0, trace=trace)
    assert inj.tick(1005.0) == []
    assert inj.tick(1010.0) == [(b, False)]
    assert _state(cloud, b) is InstanceState.TERMINATED
    assert inj.tick(1020.5) == [(a, True)]
    assert inj.tick(1100.0) == []


def test_injector_rate_is_seeded_and_honours_the_notice_fraction(
    cloud: LocalProvider, tmp_path: Path
) -> None:
    for rid, name in (("r1", "a"), ("r2", "b")):
        _launch(cloud, _boot(tmp_path, name), rid)
        _pids(tmp_path, name)
    # 3600 preemptions per node-hour over 1 s: each node is preempted on the first tick.
    inj = PreemptionInjector(
        cloud, "job-1", started_at=0.0, rate_per_hour=3600 * 10, notice_fraction=0.0, seed=7
    )
    hits = inj.tick(1.0)
    assert len(hits) == 2 and all(notice is False for _, notice in hits)
    assert inj.tick(2.0) == []


def test_trace_file_errors_name_the_row(tmp_path: Path) -> None:
    good = tmp_path / "t.yaml"
    good.write_text("- {at_s: 5, notice: false}\n- {at_s: 1}\n")
    assert [p.at_s for p in load_trace(good)] == [1.0, 5.0]
    bad = tmp_path / "bad.yaml"
    bad.write_text("- {at_s: -1}\n")
    with pytest.raises(ValueError, match="row 0: at_s must be seconds >= 0"):
        load_trace(bad)
    bad.write_text("- {when: 3}\n")
    with pytest.raises(ValueError, match="row 0 must be a mapping with at_s"):
        load_trace(bad)
    with pytest.raises(ValueError, match="cannot read it"):
        load_trace(tmp_path / "missing.yaml")


def test_cli_lists_and_preempts_vms(cloud: LocalProvider, tmp_path: Path) -> None:
    vm = _launch(cloud, _boot(tmp_path, "a"), "r1")
    _pids(tmp_path, "a")
    base = [
        sys.executable,
        "-m",
        "spottrain.controller.cli",
        "local",
        "--state-dir",
        str(cloud.store.root),
    ]
    out = subprocess.run([*base, "vms"], capture_output=True, text=True, check=True).stdout
    assert vm in out and "job=job-1" in out
    out = subprocess.run(
        [*base, "preempt", vm, "--no-notice"], capture_output=True, text=True, check=True
    ).stdout
    assert "preempted without notice" in out
    bad = subprocess.run([*base, "preempt", vm], capture_output=True, text=True)
    assert bad.returncode == 2 and "is not a running VM" in bad.stderr


def test_cli_without_a_local_cloud_says_how_to_start_one(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "spottrain.controller.cli",
            "local",
            "--state-dir",
            str(tmp_path),
            "vms",
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "no local cloud in" in out.stderr

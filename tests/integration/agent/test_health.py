"""The boot health check (spottrain.agent.health) with real worker processes: a gloo
all-reduce on this machine, GPU counts from torch and from nvidia-smi (a stand-in script on
PATH where the machine has none), a worker that fails and one that hangs, and no process
left behind either way."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from spottrain.agent.health import HealthReport, check_health, count_gpus, run_collective_check
from spottrain.process_group import descendants

# Generous: two interpreters importing torch on a loaded 2-core machine take a while. The
# bound under test is the one in the hang test.
PASS_TIMEOUT = 120
HANG_TIMEOUT = 4
# Killing and reaping the workers after the deadline.
KILL_MARGIN = 5

needs_no_gpu = pytest.mark.skipif(count_gpus() > 0, reason="needs a machine without GPUs")
needs_cpu_torch = pytest.mark.skipif(
    torch.cuda.is_available(), reason="needs torch without CUDA (nvidia-smi stand-in)"
)


@pytest.fixture
def no_leftovers() -> Iterator[None]:
    """Fails the test if it leaves a child process (zombies included) behind."""
    before = set(descendants(os.getpid()))
    yield
    left = set(descendants(os.getpid())) - before
    assert not left, f"processes left behind: {sorted(left)}"


def fake_nvidia_smi(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, output: str, code: int = 0
) -> None:
    """Put an ``nvidia-smi`` on PATH that prints ``output`` and exits with ``code``."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "nvidia-smi"
    script.write_text(f"#!/bin/sh\ncat <<'EOF'\n{output}EOF\nexit {code}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")


def gpu_lines(n: int) -> str:
    return "".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:08d})\n" for i in range(n))


@pytest.mark.usefixtures("no_leftovers")
def test_two_process_all_reduce_passes_on_this_machine() -> None:
    ok, message = run_collective_check(2, timeout=PASS_TIMEOUT)
    assert ok, message
    assert "returned the expected sum" in message
    if count_gpus() < 2:
        assert message.startswith("gloo all_reduce over 2 processes on 127.0.0.1:")


@needs_no_gpu
@pytest.mark.usefixtures("no_leftovers")
def test_cpu_job_on_a_machine_without_gpus_is_healthy() -> None:
    report = check_health(0, timeout=PASS_TIMEOUT)
    assert report.ok, report.summary()
    assert (report.gpus_expected, report.gpus_found, report.collective_ok) == (0, 0, True)
    assert report.problems == []
    assert report.summary().startswith("healthy after ")
    assert "gloo all_reduce over 2 processes" in report.summary()


@needs_no_gpu
def test_expecting_8_gpus_where_there_are_none_fails_naming_both_counts() -> None:
    report = check_health(8, collective=False)
    assert not report.ok
    assert (report.gpus_expected, report.gpus_found) == (8, 0)
    [problem] = report.problems
    assert problem.startswith("expected 8 GPUs, found 0 (")
    assert "nvidia-smi not found" in problem
    assert problem.endswith("the VM is unhealthy; it will not join, replace it")
    assert report.collective_ok and report.collective_detail == "skipped"
    assert report.summary() == f"unhealthy after {report.seconds:.1f} s: {problem}"


@pytest.mark.usefixtures("no_leftovers")
def test_a_hung_worker_is_reported_within_the_timeout_and_killed() -> None:
    start = time.monotonic()
    ok, message = run_collective_check(2, timeout=HANG_TIMEOUT, hang_rank=1)
    elapsed = time.monotonic() - start
    assert not ok
    assert f"did not finish in {HANG_TIMEOUT} s" in message
    assert "ranks still running: " in message
    assert "replace the VM" in message
    assert HANG_TIMEOUT <= elapsed < HANG_TIMEOUT + KILL_MARGIN


@needs_cpu_torch
def test_gpus_from_nvidia_smi_when_torch_sees_none(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake_nvidia_smi(monkeypatch, tmp_path, gpu_lines(7))
    assert count_gpus() == 7
    report = check_health(8, collective=False)
    assert report.gpus_found == 7
    [problem] = report.problems
    assert problem.startswith("expected 8 GPUs, found 7 (")
    assert "nvidia-smi lists 7" in problem
    assert problem.endswith("replace it")


@needs_cpu_torch
def test_mig_devices_are_not_counted_as_gpus(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    mig = "  MIG 3g.40gb     Device  0: (UUID: MIG-0)\n  MIG 3g.40gb     Device  1: (UUID: MIG-1)\n"
    fake_nvidia_smi(monkeypatch, tmp_path, gpu_lines(1) + mig)
    assert count_gpus() == 1


@needs_cpu_torch
def test_a_failing_nvidia_smi_counts_as_no_gpu_and_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    driver_down = (
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
        "Make sure that the latest NVIDIA driver is installed and running.\n"
    )
    fake_nvidia_smi(monkeypatch, tmp_path, driver_down, code=9)
    assert count_gpus() == 0
    report = check_health(1, collective=False)
    [problem] = report.problems
    assert "expected 1 GPUs, found 0" in problem
    assert "nvidia-smi -L failed (NVIDIA-SMI has failed because" in problem


@needs_cpu_torch
@pytest.mark.usefixtures("no_leftovers")
def test_gpus_torch_cannot_use_fail_the_check_fast(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A CPU build of torch on a 2-GPU VM: the count looks right, the workers cannot train.
    fake_nvidia_smi(monkeypatch, tmp_path, gpu_lines(2))
    start = time.monotonic()
    report = check_health(2, timeout=PASS_TIMEOUT)
    elapsed = time.monotonic() - start
    assert not report.ok and not report.collective_ok
    torch_problem, collective_problem = report.problems
    assert torch_problem.startswith("torch sees 0 of the 2 GPUs nvidia-smi lists")
    assert collective_problem.startswith("collective check failed: nccl all_reduce over 2")
    assert "exited with code 1" in collective_problem
    # The first worker to fail ends the check; it does not wait for the timeout.
    assert elapsed < PASS_TIMEOUT / 2
    assert "\n" not in report.summary()


def test_collective_check_refuses_fewer_than_two_processes() -> None:
    with pytest.raises(ValueError, match="at least 2 processes, got nprocs=1"):
        run_collective_check(1)


def test_collective_check_refuses_a_hang_rank_out_of_range() -> None:
    with pytest.raises(ValueError, match="hang_rank=2 is not a rank of 2 processes"):
        run_collective_check(2, hang_rank=2)


def test_check_health_refuses_a_negative_gpu_count() -> None:
    with pytest.raises(ValueError, match="expected_gpus must be >= 0, got -1"):
        check_health(-1)


def test_a_report_is_ok_exactly_when_it_has_no_problems() -> None:
    with pytest.raises(ValueError, match="ok exactly when it lists no problems"):
        HealthReport(True, 8, 7, True, 0.1, ["expected 8 GPUs, found 7"])
    with pytest.raises(ValueError, match="ok exactly when it lists no problems"):
        HealthReport(False, 8, 8, True, 0.1, [])

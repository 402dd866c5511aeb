"""The boot health check: does this VM have the GPUs it should, and can they all-reduce?

A VM that boots with a GPU missing, a driver that does not load, or an NCCL that hangs would
join the job and stall every peer at its first collective. The agent runs this check before
it starts torchrun and, when it fails, stays out of the job so the controller replaces the VM.

The collective runs in fresh interpreters started with ``subprocess`` (``python -m
spottrain.agent.health --worker ...``), not ``torch.multiprocessing``: the agent has threads
by the time it checks (notice watchers), and forking a threaded process, or the "spawn" start
method re-importing the agent's ``__main__``, are both ways to hang or run the agent twice.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import IO

from spottrain.ports import free_port

_WORKER_MODULE = "spottrain.agent.health"
# More than one element so that a reduce that only half-worked shows; small enough that the
# check measures the GPUs and the library, not bandwidth.
_TENSOR_LEN = 1024
# nvidia-smi itself hangs on some broken GPUs; no answer in half a minute is an answer.
_NVIDIA_SMI_TIMEOUT = 30.0
# A worker that ignores SIGKILL is stuck in the kernel (the GPU driver); waiting longer for
# it would only make the check unbounded.
_REAP_TIMEOUT = 10.0
_UNHEALTHY = "the VM is unhealthy; it will not join, replace it"


@dataclass(frozen=True)
class HealthReport:
    """What the boot health check found.

    Attributes:
        ok: Whether the VM may join (no problems).
        gpus_expected: How many GPUs the VM must have.
        gpus_found: How many are visible (see :func:`count_gpus`).
        collective_ok: Whether the all-reduce check passed (True when it was not run).
        seconds: How long the whole check took.
        problems: One line per problem, each saying what is wrong and what to do.
        collective_detail: What the all-reduce check said, or that it was skipped.

    Raises:
        ValueError: ``ok`` disagrees with ``problems``.
    """

    ok: bool
    gpus_expected: int
    gpus_found: int
    collective_ok: bool
    seconds: float
    problems: list[str] = field(default_factory=list)
    collective_detail: str = ""

    def __post_init__(self) -> None:
        if self.ok == bool(self.problems):
            raise ValueError(
                f"HealthReport(ok={self.ok}) with {len(self.problems)} problem(s): a report is "
                "ok exactly when it lists no problems"
            )

    def summary(self) -> str:
        """The report as one plain line, for the log and the event stream."""
        if self.ok:
            line = (
                f"healthy after {self.seconds:.1f} s: {self.gpus_found} GPUs found "
                f"({self.gpus_expected} expected); collective: {self.collective_detail}"
            )
        else:
            line = f"unhealthy after {self.seconds:.1f} s: " + " | ".join(self.problems)
        return " ".join(line.split())  # one line, whatever a worker's error looked like


@dataclass(frozen=True)
class _GpuProbe:
    """What each source says about the GPUs; None where the source is not there."""

    torch_count: int | None  # None: torch not importable; 0: no CUDA
    smi_count: int | None  # None: nvidia-smi missing or failed
    smi_error: str = ""

    @property
    def found(self) -> int:
        if self.torch_count:
            return self.torch_count
        return self.smi_count or 0

    def describe(self) -> str:
        if self.torch_count is None:
            torch_says = "torch not importable"
        elif self.torch_count == 0:
            torch_says = "torch sees no CUDA device"
        else:
            torch_says = f"torch sees {self.torch_count}"
        if self.smi_count is not None:
            smi_says = f"nvidia-smi lists {self.smi_count}"
        else:
            smi_says = self.smi_error or "nvidia-smi not found"
        if self.torch_count is None and self.smi_count is not None:
            return smi_says  # the one source there is
        return f"{torch_says}, {smi_says}"


def _torch_gpu_count() -> int | None:
    try:
        import torch

        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:
        # A torch whose CUDA libraries do not load raises here rather than on import; to the
        # check that is the same as no usable GPU, and nvidia-smi gets its say.
        return None


def _nvidia_smi_count() -> tuple[int | None, str]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, "nvidia-smi not found"
    try:
        out = subprocess.run(
            [exe, "-L"],
            capture_output=True,
            text=True,
            timeout=_NVIDIA_SMI_TIMEOUT,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return None, f"nvidia-smi -L did not answer in {_NVIDIA_SMI_TIMEOUT:g} s"
    except OSError as e:
        return None, f"nvidia-smi -L could not run: {e}"
    if out.returncode != 0:
        first = (out.stdout + out.stderr).strip().splitlines()
        return None, f"nvidia-smi -L failed ({first[0] if first else f'exit {out.returncode}'})"
    # MIG devices are listed indented under their GPU; count the GPUs only.
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines()), ""


def _probe_gpus() -> _GpuProbe:
    torch_count = _torch_gpu_count()
    smi_count, smi_error = (None, "") if torch_count else _nvidia_smi_count()
    return _GpuProbe(torch_count=torch_count, smi_count=smi_count, smi_error=smi_error)


def count_gpus() -> int:
    """How many GPUs this VM shows: torch's CUDA device count, else ``nvidia-smi -L``, else 0.

    Honours ``CUDA_VISIBLE_DEVICES`` where torch answers. Never raises.
    """
    try:
        return _probe_gpus().found
    except Exception:
        return 0


def run_collective_check(
    nprocs: int, timeout: float = 60, *, hang_rank: int | None = None
) -> tuple[bool, str]:
    """All-reduce a small tensor across ``nprocs`` fresh processes on this machine.

    The processes form a process group over 127.0.0.1 on a free port: with NCCL, one GPU
    each, when the VM has at least 2 GPUs and ``nprocs`` equals their number; with gloo on
    the CPU otherwise. Each adds ``rank + 1``; the check passes when every element of every
    rank's result is ``nprocs * (nprocs + 1) / 2``. The first worker to fail ends the check.
    Every worker is killed and reaped before this returns, whatever happened.

    Args:
        nprocs: How many processes (at least 2).
        timeout: Seconds for the whole check, interpreter start-up included.
        hang_rank: Test hook: this rank sleeps instead of joining the all-reduce, so the
            timeout path can be exercised. Never set outside tests.

    Returns:
        ``(ok, message)``: whether it passed, and one line saying what happened (on failure,
        which rank failed how, and what to do).

    Raises:
        ValueError: ``nprocs`` < 2, ``timeout`` <= 0, or ``hang_rank`` not a rank.
    """
    if nprocs < 2:
        raise ValueError(
            f"run_collective_check needs at least 2 processes, got nprocs={nprocs}: a "
            "one-process all-reduce checks nothing; use 2 (on the CPU) for a VM with 0 or 1 GPU"
        )
    if timeout <= 0:
        raise ValueError(f"run_collective_check timeout must be > 0 seconds, got {timeout}")
    if hang_rank is not None and not 0 <= hang_rank < nprocs:
        raise ValueError(f"hang_rank={hang_rank} is not a rank of {nprocs} processes")
    gpus = count_gpus()
    backend = "nccl" if gpus >= 2 and nprocs == gpus else "gloo"
    return _run_workers(nprocs, timeout, backend, hang_rank)


def _tail(log: IO[bytes]) -> str:
    log.seek(0)
    lines = [ln.strip() for ln in log.read().decode(errors="replace").splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _run_workers(
    nprocs: int, timeout: float, backend: str, hang_rank: int | None
) -> tuple[bool, str]:
    if importlib.util.find_spec("torch") is None:
        return False, (
            f"torch is not importable by {sys.executable}: install spottrain[agent] in the "
            "agent's environment"
        )
    # Bound and released: rank 0's store binds it again a moment later. Another process
    # taking it in between fails the check with "address already in use", which a retry of
    # the agent's start fixes; a tighter handshake is not worth it for a boot check.
    port = free_port()
    what = f"{backend} all_reduce over {nprocs} processes on 127.0.0.1:{port}"
    env = {
        **os.environ,
        # Each worker adds a few numbers: one thread each keeps the check from competing with
        # itself (and with anything else) for the cores.
        "OMP_NUM_THREADS": "1",
        # The check is about the GPUs and the collective library, not the VM's network: keep
        # gloo and NCCL's bootstrap on loopback whatever the training environment sets.
        "GLOO_SOCKET_IFNAME": "lo",
        "NCCL_SOCKET_IFNAME": "lo",
    }
    start = time.monotonic()
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[IO[bytes]] = []
    with contextlib.ExitStack() as files:
        try:
            try:
                for rank in range(nprocs):
                    logs.append(files.enter_context(tempfile.TemporaryFile()))
                    procs.append(
                        _start_worker(
                            rank, nprocs, port, backend, timeout, hang_rank, env, logs[-1]
                        )
                    )
            except OSError as e:
                ok, message = (
                    False,
                    f"{what}: could not start rank {len(procs)} ({e}): "
                    f"check that {sys.executable} runs",
                )
            else:
                ok, message = _wait_workers(procs, logs, start, timeout, what)
        finally:
            # Whatever happened (an interrupt included), nothing of the check outlives it.
            stuck = _kill_all(procs)
    if stuck:
        ok = False
        message += (
            f"; worker pid(s) {', '.join(map(str, stuck))} did not die after SIGKILL (stuck in "
            "the kernel, likely the GPU driver): replace the VM"
        )
    return ok, message


def _start_worker(
    rank: int,
    nprocs: int,
    port: int,
    backend: str,
    timeout: float,
    hang_rank: int | None,
    env: dict[str, str],
    log: IO[bytes],
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        _WORKER_MODULE,
        "--worker",
        f"--rank={rank}",
        f"--world-size={nprocs}",
        f"--port={port}",
        f"--backend={backend}",
        # The workers give up a little after the parent would, so they go away on their own
        # if the parent dies, without racing the parent's clearer timeout message.
        f"--timeout={timeout + 5:g}",
    ]
    if rank == hang_rank:
        cmd.append("--hang")
    return subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        # Files, not pipes: nobody reads while waiting, and a chatty NCCL would fill a pipe
        # and block the worker.
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        # Its own process group, so a kill reaches anything the worker started.
        start_new_session=True,
    )


def _wait_workers(
    procs: Sequence[subprocess.Popen[bytes]],
    logs: Sequence[IO[bytes]],
    start: float,
    timeout: float,
    what: str,
) -> tuple[bool, str]:
    """Poll until every worker succeeded, one failed, or ``timeout`` from ``start`` passed."""
    while True:
        codes = [p.poll() for p in procs]
        for rank, code in enumerate(codes):
            if code is not None and code != 0:
                return False, (
                    f"{what}: rank {rank} {_exit_text(code)}: {_tail(logs[rank])}; if it names "
                    "a GPU, driver or NCCL fault, replace the VM"
                )
        if all(code == 0 for code in codes):
            return True, f"{what} returned the expected sum in {time.monotonic() - start:.1f} s"
        if time.monotonic() >= start + timeout:
            running = ", ".join(str(r) for r, c in enumerate(codes) if c is None)
            return False, (
                f"{what} did not finish in {timeout:g} s (ranks still running: {running}): a "
                "hung GPU, collective library or loopback network; replace the VM"
            )
        time.sleep(0.05)


def _kill_all(procs: Sequence[subprocess.Popen[bytes]]) -> list[int]:
    """SIGKILL and reap every worker still running; the pids that would not die."""
    for p in procs:
        # poll() before killpg: a worker that exited but is not yet reaped keeps its pid, so
        # the group id cannot have been reused by an unrelated process.
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
    stuck = []
    for p in procs:
        try:
            p.wait(timeout=_REAP_TIMEOUT)
        except subprocess.TimeoutExpired:
            stuck.append(p.pid)
    return stuck


def check_health(expected_gpus: int, collective: bool = True, timeout: float = 60) -> HealthReport:
    """The boot health check: GPU count, then an all-reduce across them.

    The all-reduce runs on all the GPUs found (NCCL) when there are at least 2, otherwise on
    2 CPU processes (gloo), which still shows that torch and the process group work. More
    GPUs than expected is not a problem: the job uses the ones it asks for.

    Args:
        expected_gpus: How many GPUs the VM must have (0 for a CPU job).
        collective: Whether to run the all-reduce check.
        timeout: Seconds for the all-reduce check.

    Returns:
        The report; ``report.ok`` says whether the VM may join.

    Raises:
        ValueError: ``expected_gpus`` < 0 or ``timeout`` <= 0.
    """
    if expected_gpus < 0:
        raise ValueError(f"expected_gpus must be >= 0, got {expected_gpus}")
    if timeout <= 0:
        raise ValueError(f"check_health timeout must be > 0 seconds, got {timeout}")
    start = time.monotonic()
    probe = _probe_gpus()
    found = probe.found
    problems = []
    if found < expected_gpus:
        problems.append(
            f"expected {expected_gpus} GPUs, found {found} ({probe.describe()}): {_UNHEALTHY}"
        )
    elif expected_gpus and probe.torch_count is not None and probe.torch_count < expected_gpus:
        # nvidia-smi sees them and torch does not: the job's workers would find no GPU.
        problems.append(
            f"torch sees {probe.torch_count} of the {found} GPUs nvidia-smi lists (a CPU build "
            "of torch, or a driver older than torch's CUDA): the VM will not join; fix torch or "
            "the driver in the image"
        )
    collective_ok, detail = True, "skipped"
    if collective:
        nprocs = found if found >= 2 else 2
        backend = "nccl" if found >= 2 else "gloo"
        collective_ok, detail = _run_workers(nprocs, timeout, backend, hang_rank=None)
        if not collective_ok:
            problems.append(f"collective check failed: {detail}")
    return HealthReport(
        ok=not problems,
        gpus_expected=expected_gpus,
        gpus_found=found,
        collective_ok=collective_ok,
        seconds=time.monotonic() - start,
        problems=problems,
        collective_detail=detail,
    )


def _worker(argv: Sequence[str]) -> int:
    """One rank of the collective check (run by :func:`run_collective_check`, not by hand)."""
    parser = argparse.ArgumentParser(prog=f"python -m {_WORKER_MODULE}")
    parser.add_argument("--worker", action="store_true", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", choices=["gloo", "nccl"], required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--hang", action="store_true")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", args.rank)
        torch.cuda.set_device(device)
    dist.init_process_group(
        args.backend,
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=args.world_size,
        timeout=timedelta(seconds=args.timeout),
    )
    try:
        if args.hang:
            time.sleep(2 * args.timeout)  # bounded, so even a lost parent's worker goes away
            return 4
        t = torch.full((_TENSOR_LEN,), float(args.rank + 1), device=device)
        dist.all_reduce(t)
        want = args.world_size * (args.world_size + 1) / 2
        if not bool(torch.all(t == want)):
            got = sorted({float(x) for x in t.cpu().tolist()})
            print(f"rank {args.rank}: all_reduce returned {got[:5]}, expected {want}")
            return 3
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))

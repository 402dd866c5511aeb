"""Run a torchrun "node" as its own process group on this machine, the way a VM would.

The demo, the benchmarks and the end-to-end tests use it to start nodes of a job on one
machine and to do to them what a spot fleet does: kill a node outright (SIGKILL to every
process), freeze it (SIGSTOP, as a hung VM or a partition looks to its peers), thaw it, or
shut it down (SIGTERM, as systemd does).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType


def torchrun_command(
    *,
    script: str,
    script_args: Sequence[str],
    rdzv_endpoint: str,
    run_id: str,
    nnodes: str,
    backend: str = "redis",
    nproc_per_node: int = 1,
    max_restarts: int = 100,
    rdzv_conf: Mapping[str, object] | None = None,
    local_addr: str = "127.0.0.1",
    monitor_interval: float = 0.1,
) -> list[str]:
    """The torchrun command line of one node (using this interpreter's torchrun)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        f"--rdzv-backend={backend}",
        f"--rdzv-endpoint={rdzv_endpoint}",
        f"--rdzv-id={run_id}",
        f"--max-restarts={max_restarts}",
        f"--monitor-interval={monitor_interval}",
        f"--local-addr={local_addr}",
    ]
    if rdzv_conf:
        cmd.append("--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in rdzv_conf.items()))
    return [*cmd, script, *script_args]


class LocalNode:
    """One node: a torchrun process and its workers, in a process group of their own.

    Args:
        node_id: The node's name (exported as ``SPOTTRAIN_NODE_ID``).
        command: The command to run (see :func:`torchrun_command`).
        log_path: Where its stdout and stderr go.
        env: Extra environment variables.
        cwd: Working directory.
    """

    def __init__(
        self,
        node_id: str,
        command: Sequence[str],
        log_path: str | Path,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
    ) -> None:
        self.node_id = node_id
        self.command = list(command)
        self.log_path = Path(log_path)
        self.env = {**os.environ, **(env or {}), "SPOTTRAIN_NODE_ID": node_id}
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None

    def start(self) -> LocalNode:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,  # its own process group, like a VM of its own
            )
        self.started_at = time.monotonic()
        return self

    @property
    def pgid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"node {self.node_id} was never started")
        return self.proc.pid  # session leader: pgid == pid

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, sig)

    def kill(self) -> None:
        """Every process of the node dies at once, as when a VM is taken without notice."""
        self.signal_group(signal.SIGKILL)
        self.wait(timeout=30)

    def freeze(self) -> None:
        """Stop every process of the node (a hung or partitioned VM, to its peers)."""
        self.signal_group(signal.SIGSTOP)

    def thaw(self) -> None:
        self.signal_group(signal.SIGCONT)

    def terminate(self, timeout: float = 60) -> int | None:
        """SIGTERM to the whole group, as systemd does at shutdown; SIGKILL after timeout."""
        self.signal_group(signal.SIGTERM)
        code = self.wait(timeout)
        if code is None:
            self.kill()
        return code

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait(self, timeout: float | None = None) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        """Make sure nothing of the node is left running (workers included)."""
        if self.proc is None:
            return
        self.signal_group(signal.SIGCONT)
        self.signal_group(signal.SIGKILL)
        self.wait(timeout=30)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> LocalNode:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

"""The stock torchft lighthouse (``torchft_lighthouse``, installed beside the interpreter),
run as the controller runs it, with every fake replica a ``LighthouseClient`` of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

# torchft logs a line per client and per request at INFO through Rust's ``log`` crate, which
# reads RUST_LOG when the extension loads: set it before the first torchft import.
os.environ.setdefault("RUST_LOG", "warn")

from torchft._torchft import LighthouseClient

from spottrain.ports import free_port

from .rounds import QuorumCall

QUORUM_TIMEOUT = timedelta(seconds=600)
CONNECT_TIMEOUT = timedelta(seconds=60)
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def binary() -> Path:
    return Path(sys.executable).parent / "torchft_lighthouse"


class StockLighthouse:
    """``torchft_lighthouse --min_replicas N`` on a free port; its own log level
    (``log_level``: RUST_LOG of the server) is ``warn`` unless asked."""

    name = "torchft lighthouse 0.2.0"

    def __init__(self, min_replicas: int, log_level: str = "warn") -> None:
        self.min_replicas = min_replicas
        self.log_level = log_level
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> StockLighthouse:
        self.proc = subprocess.Popen(
            [
                str(binary()),
                "--min_replicas",
                str(self.min_replicas),
                "--bind",
                f"127.0.0.1:{self.port}",
                "--quorum_tick_ms",
                "10",
                "--join_timeout_ms",
                "60000",
                "--heartbeat_timeout_ms",
                "60000",
            ],
            env={**os.environ, "RUST_LOG": self.log_level},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._wait_listening()
        return self

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{binary()} exited {self.proc.returncode} at start")
            try:
                LighthouseClient(self.address, timedelta(seconds=1))
                return
            except Exception:
                time.sleep(0.05)
        raise RuntimeError(f"{binary()} did not listen on {self.address} within 30 s")

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()

    def client(self, i: int) -> QuorumCall:
        c = LighthouseClient(self.address, CONNECT_TIMEOUT)
        rid = f"replica-{i}"

        def call(step: int) -> int:
            q = c.quorum(
                replica_id=rid,
                timeout=QUORUM_TIMEOUT,
                address=f"127.0.0.1:{20000 + i}",
                store_address=f"127.0.0.1:{40000 + i}",
                step=step,
                world_size=1,
                shrink_only=False,
            )
            return len(q.participants)

        return call

    def cpu_s(self) -> float:
        assert self.proc is not None
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S

"""Real replicas for the replica-mode tests: a torchft lighthouse subprocess and replicas of
``examples/replica_train.py`` as plain subprocesses (each a one-process group with its own
store port), each in a process group of its own that is killed afterwards, even on failure."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spottrain.ports import free_port
from spottrain.protocol.env import (
    ENV_LIGHTHOUSE,
    ENV_MANAGER_PORT,
    ENV_MIN_REPLICAS,
    ENV_NODE,
    ENV_REDIS,
    ENV_REPLICA_ID,
    ENV_RUN_ID,
)

ROOT = Path(__file__).resolve().parents[4]
TRAIN = ROOT / "examples" / "replica_train.py"
LIGHTHOUSE_BIN = Path(sys.executable).parent / "torchft_lighthouse"
HEARTBEAT_MS = 1000


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGCONT)  # a stopped process dies only once continued
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


@dataclass
class Lighthouse:
    port: int
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [
            str(LIGHTHOUSE_BIN),
            "--min_replicas",
            "1",
            "--bind",
            self.addr,
            "--heartbeat_timeout_ms",
            str(HEARTBEAT_MS),
            "--join_timeout_ms",
            "200",
        ]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=out, start_new_session=True)
        wait_for(self._up, 20, "the lighthouse to listen")

    def _up(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.addr}/", timeout=1):
                return True
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc is not None:
            _kill_group(self.proc)
            self.proc = None


@dataclass
class Replica:
    name: str
    proc: subprocess.Popen[bytes]
    progress: Path
    log: Path
    started_at: float = field(default_factory=time.time)  # wall time of the launch

    def rows(self) -> list[dict[str, Any]]:
        if not self.progress.exists():
            return []
        out = []
        for line in self.progress.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def steps(self) -> list[dict[str, Any]]:
        return [r for r in self.rows() if "event" not in r]

    def committed(self) -> list[dict[str, Any]]:
        return [r for r in self.steps() if r["committed"]]

    def events(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.rows() if r.get("event") == name]

    def reached(self) -> int:
        """Committed steps so far."""
        done = self.committed()
        return done[-1]["step"] + 1 if done else 0

    def tail(self) -> str:
        return self.log.read_text()[-3000:] if self.log.exists() else ""


def wait_for(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@dataclass
class Cluster:
    tmp: Path
    lighthouse: Lighthouse
    redis_url: str | None = None
    run_id: str | None = None
    replicas: list[Replica] = field(default_factory=list)

    def start(self, name: str, *args: str, ckpt: Path | None = None) -> Replica:
        progress = self.tmp / f"{name}-{len(self.replicas)}.jsonl"
        log = self.tmp / f"{name}-{len(self.replicas)}.log"
        env = dict(os.environ)
        env.update(
            {
                ENV_REPLICA_ID: name,
                ENV_LIGHTHOUSE: self.lighthouse.addr,
                ENV_MIN_REPLICAS: "1",
                ENV_MANAGER_PORT: str(free_port()),
                ENV_NODE: f"node-{name}",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port()),
                "RANK": "0",
                "WORLD_SIZE": "1",
                "LOCAL_RANK": "0",
                "RUST_LOG": "warn",
            }
        )
        if self.redis_url and self.run_id:
            env[ENV_REDIS] = self.redis_url
            env[ENV_RUN_ID] = self.run_id
        cmd = [sys.executable, str(TRAIN), "--progress", str(progress), *args]
        if ckpt is not None:
            cmd += ["--ckpt-dir", str(ckpt)]
        with log.open("wb") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        replica = Replica(name, proc, progress, log)
        self.replicas.append(replica)
        return replica

    def stop_all(self) -> None:
        for r in self.replicas:
            _kill_group(r.proc)
        self.lighthouse.kill()


def max_gap(rows: list[dict[str, Any]], after_t: float) -> float:
    """The longest time between two consecutive committed steps, from ``after_t`` on."""
    times = [r["t"] for r in rows if r["committed"] and r["t"] >= after_t]
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def figure(name: str, value: float) -> None:
    """A measured figure, printed for the report (``pytest -s ... | grep FIGURE``)."""
    print(f"FIGURE {name}={value:.3f}")

"""The bench's own ``redis-server`` for the Redis quorum, and what it reports about itself:
CPU seconds (``INFO cpu``), bytes in and out (``INFO stats``), per-command timings
(``INFO commandstats``) and latency events (``LATENCY LATEST`` / ``HISTORY``).

It runs with ``maxclients`` raised to what the file-descriptor limit allows (every simulated
replica holds a connection blocked in BLPOP), AOF on with ``appendfsync everysec`` (what a
run's Redis uses; a BGREWRITEAOF forks it) and ``latency-monitor-threshold`` set so the
fork and slow commands show up in ``LATENCY``."""

from __future__ import annotations

import resource
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from spottrain.ports import free_port

LATENCY_THRESHOLD_MS = 5


def raise_fd_limit() -> int:
    """The soft RLIMIT_NOFILE raised to the hard one (inherited by the processes started
    after it); returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class BenchRedis:
    """``redis-server`` on a free port in a temporary directory, removed at exit."""

    def __init__(self, maxclients: int) -> None:
        self.fd_limit = raise_fd_limit()
        # Redis keeps 32 descriptors for itself and refuses a maxclients above what is left.
        self.maxclients = min(maxclients, self.fd_limit - 32)
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="qscale-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.client: redis.Redis | None = None

    def __enter__(self) -> BenchRedis:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not on PATH: install Redis 7 to run this bench")
        self.proc = subprocess.Popen(
            [
                exe,
                *("--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir)),
                *("--save", "", "--appendonly", "yes", "--appendfsync", "everysec"),
                *("--maxclients", str(self.maxclients), "--tcp-backlog", "4096"),
                *("--latency-monitor-threshold", str(LATENCY_THRESHOLD_MS)),
                *("--auto-aof-rewrite-percentage", "0", "--loglevel", "warning"),
                *("--enable-debug-command", "local"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.client = redis.Redis(port=self.port, socket_timeout=60)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    @property
    def r(self) -> redis.Redis:
        assert self.client is not None
        return self.client

    def snapshot(self) -> dict[str, Any]:
        """CPU seconds, bytes in/out and per-command totals, to subtract from a later one."""
        cpu = self.r.info("cpu")
        stats = self.r.info("stats")
        cmds = self.r.info("commandstats")
        return {
            "cpu_s": float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
            "in": int(stats["total_net_input_bytes"]),
            "out": int(stats["total_net_output_bytes"]),
            "cmds": {
                k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
                for k, v in cmds.items()
            },
        }

    def reset_latency(self) -> None:
        self.r.execute_command("LATENCY", "RESET")

    def latency(self) -> dict[str, Any]:
        """``LATENCY LATEST`` as {event: {"latest_ms", "max_ms"}} and each event's history
        length and worst spike."""
        out: dict[str, Any] = {}
        for row in self.r.execute_command("LATENCY", "LATEST") or []:
            event = row[0].decode() if isinstance(row[0], bytes) else str(row[0])
            history = self.r.execute_command("LATENCY", "HISTORY", event) or []
            out[event] = {
                "latest_ms": int(row[2]),
                "max_ms": int(row[3]),
                "history_samples": len(history),
            }
        return out

    def populate(self, mib: int) -> None:
        """About ``mib`` MiB of unrelated keys, so a fork copies a real page table."""
        if mib > 0:
            self.r.execute_command("DEBUG", "POPULATE", mib * 1024, "qscale-filler", 1024)

    def rewrite_aof(self, timeout_s: float = 300) -> float:
        """BGREWRITEAOF, waiting for it to finish; returns its wall seconds."""
        t0 = time.monotonic()
        self.r.bgrewriteaof()
        deadline = t0 + timeout_s
        while time.monotonic() < deadline:
            info = self.r.info("persistence")
            if not info["aof_rewrite_in_progress"] and not info["aof_rewrite_scheduled"]:
                return time.monotonic() - t0
            time.sleep(0.05)
        raise RuntimeError(f"BGREWRITEAOF did not finish within {timeout_s:.0f} s")


def diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What happened between two snapshots: CPU s, bytes in/out, and per command its calls
    and usec (commands with no call in between left out)."""
    cmds = {}
    for name, (calls, usec) in after["cmds"].items():
        c0, u0 = before["cmds"].get(name, (0, 0))
        if calls > c0:
            cmds[name] = (calls - c0, usec - u0)
    return {
        "cpu_s": after["cpu_s"] - before["cpu_s"],
        "in": after["in"] - before["in"],
        "out": after["out"] - before["out"],
        "cmds": cmds,
    }

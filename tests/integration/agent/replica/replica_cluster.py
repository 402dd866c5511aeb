"""Real replicas for the replica-mode tests: replicas of ``examples/replica_train.py`` as
plain subprocesses (each a one-process group with its own store port), each in a process
group of its own that is killed afterwards, even on failure, and their quorum:

- the Redis quorum (the default): a redis-server of the test's own (or the test's
  ``redis_url``) and one lighthouse shim per replica, as each VM's agent runs one, in this
  process; the workers' managers call their shim;
- torchft's lighthouse (:meth:`Cluster.with_lighthouse`, kept for comparison): a subprocess.
"""

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

from spottrain.agent.quorum_shim.local import RelayPlan, start_local_shim
from spottrain.agent.quorum_shim.relay import relay_group
from spottrain.agent.quorum_shim.server import LighthouseShim
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.ports import free_port
from spottrain.protocol.env import (
    ENV_LIGHTHOUSE,
    ENV_MANAGER_PORT,
    ENV_MIN_REPLICAS,
    ENV_NODE,
    ENV_QUORUM,
    ENV_REDIS,
    ENV_REPLICA_ID,
    ENV_RUN_ID,
)
from spottrain.protocol.keys import RunKeys
from spottrain.quorum.model import QuorumConfig
from spottrain.redis_conn import settings_from_url

ROOT = Path(__file__).resolve().parents[4]
TRAIN = ROOT / "examples" / "replica_train.py"
LIGHTHOUSE_BIN = Path(sys.executable).parent / "torchft_lighthouse"
HEARTBEAT_MS = 1000
JOIN_MS = 250  # the product default (QuorumConfig), as the lighthouse the controller runs


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
            str(JOIN_MS),
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
    shim: LighthouseShim | None = None  # its "VM"'s shim, with the Redis quorum

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
    """The replicas of one test and their quorum. With the Redis quorum (``lighthouse``
    None) the Redis is ``redis_url``/``run_id`` when the test sets them, else the cluster's
    own :attr:`redis` (started at the first replica)."""

    tmp: Path
    lighthouse: Lighthouse | None = None
    redis_url: str | None = None
    run_id: str | None = None
    replicas: list[Replica] = field(default_factory=list)
    min_replicas: int = 1
    redis: RedisServer | None = None
    shims: dict[str, LighthouseShim] = field(default_factory=dict)  # per launch (a "VM")
    last_shim: LighthouseShim | None = None
    relay_group: int = 0  # replicas per quorum relay (0: none); a replica's group: its index

    @classmethod
    def with_lighthouse(cls, tmp: Path, lighthouse: Lighthouse) -> Cluster:
        return cls(tmp, lighthouse)

    def quorum_env(self, name: str, shim: LighthouseShim | None = None) -> dict[str, str]:
        """The quorum variables of one replica's workers; with the Redis quorum, a new shim
        (each launch is a new "VM" with its own agent) unless ``shim`` is given (the same
        VM's workers restarted by its torchrun)."""
        if self.lighthouse is not None:
            env = {ENV_LIGHTHOUSE: self.lighthouse.addr}
            if self.redis_url and self.run_id:
                env.update({ENV_REDIS: self.redis_url, ENV_RUN_ID: self.run_id})
            return env
        if not (self.redis_url and self.run_id):
            if self.redis is None:
                self.redis = RedisServer(self.tmp / "redis").start()
            self.redis_url, self.run_id = self.redis.endpoint, f"t-{os.getpid()}-{id(self)}"
        if shim is not None:
            self.last_shim = shim
            return {
                ENV_LIGHTHOUSE: shim.address,
                ENV_QUORUM: "redis",
                ENV_REDIS: self.redis_url,
                ENV_RUN_ID: self.run_id,
            }
        config = QuorumConfig(
            heartbeat_timeout_ms=HEARTBEAT_MS,
            join_timeout_ms=JOIN_MS,
            min_replicas=self.min_replicas,
        )
        self.last_shim = None
        relay = None
        if self.relay_group:
            port = free_port()
            group = relay_group(name, self.relay_group)
            relay = RelayPlan(group, f"127.0.0.1:{port}", f"127.0.0.1:{port}")
        shim = start_local_shim(
            settings_from_url(self.redis_url), RunKeys(self.run_id), config, relay=relay
        )
        self.shims[f"{name}-{len(self.shims)}"] = self.last_shim = shim
        return {
            ENV_LIGHTHOUSE: shim.address,
            ENV_QUORUM: "redis",
            ENV_REDIS: self.redis_url,
            ENV_RUN_ID: self.run_id,
        }

    def start(
        self,
        name: str,
        *args: str,
        ckpt: Path | None = None,
        shim: LighthouseShim | None = None,
    ) -> Replica:
        progress = self.tmp / f"{name}-{len(self.replicas)}.jsonl"
        log = self.tmp / f"{name}-{len(self.replicas)}.log"
        env = dict(os.environ)
        env.update(
            {
                ENV_REPLICA_ID: name,
                **self.quorum_env(name, shim),
                ENV_MIN_REPLICAS: str(self.min_replicas),
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
        cmd = [sys.executable, str(TRAIN), "--progress", str(progress), *args]
        if ckpt is not None:
            cmd += ["--ckpt-dir", str(ckpt)]
        with log.open("wb") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        replica = Replica(name, proc, progress, log, shim=self.last_shim)
        self.replicas.append(replica)
        return replica

    def notice(self, replica: Replica) -> None:
        """What the agent does on a notice: its shim is told the replica leaves (it leaves
        the Redis quorum once its manager stops), then the workers get SIGTERM (they leave
        at the next step boundary)."""
        if replica.shim is not None:
            replica.shim.leave()
        os.killpg(replica.proc.pid, signal.SIGTERM)

    def stop_all(self) -> None:
        for r in self.replicas:
            _kill_group(r.proc)
        for shim in self.shims.values():
            shim.stop(0)
        if self.lighthouse is not None:
            self.lighthouse.kill()
        if self.redis is not None:
            self.redis.close()


def max_gap(rows: list[dict[str, Any]], after_t: float) -> float:
    """The longest time between two consecutive committed steps, from ``after_t`` on."""
    times = [r["t"] for r in rows if r["committed"] and r["t"] >= after_t]
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def figure(name: str, value: float) -> None:
    """A measured figure, printed for the report (``pytest -s ... | grep FIGURE``)."""
    print(f"FIGURE {name}={value:.3f}")

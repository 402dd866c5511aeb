"""Run a torchrun "node" as its own process group on this machine, the way a VM would.

The demo, the benchmarks and the end-to-end tests use it to start nodes of a job on one
machine and to do to them what a spot fleet does: kill a node outright (SIGKILL to every
process), freeze it (SIGSTOP, as a hung VM or a partition looks to its peers), thaw it, or
shut it down (SIGTERM, as systemd does).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import redis

from spottrain.process_group import descendants
from spottrain.protocol.env import ENV_NODE
from spottrain.protocol.keys import RunKeys

from ..processes import running, torchrun_command

__all__ = [
    "LocalAgentJob",
    "LocalElasticJob",
    "LocalNode",
    "Record",
    "agent_command",
    "descendants",
    "torchrun_command",
]


class LocalNode:
    """One node: a torchrun process and its workers, the way a VM holds them.

    torchrun starts each worker in a session of its own, so signalling torchrun's process
    group alone would leave the workers running: every signal here goes to torchrun's group
    and to each of its descendants, as a VM's death would.

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
        self.env = {**os.environ, **(env or {}), ENV_NODE: node_id}
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None
        self._seen: set[int] = set()

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

    def pids(self) -> list[int]:
        """torchrun's pid and those of all its descendants (workers included)."""
        if self.proc is None:
            return []
        return [self.proc.pid, *descendants(self.proc.pid)]

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to every process of the node."""
        targets = self.pids()
        self._seen.update(targets)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, sig)
        for pid in targets:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def leftover_pids(self) -> list[int]:
        """Processes this node ever had that are still running (zombies excluded)."""
        return running(self._seen | set(self.pids()))

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
        """SIGTERM to every process, as systemd does at shutdown; SIGKILL after timeout."""
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


@dataclass(frozen=True)
class Record:
    t: float
    node: str
    rank: int
    world: int
    round: int
    step: int
    loss: float = float("nan")


class LocalElasticJob:
    """Nodes of one elastic run on this machine, their progress, and their cleanup.

    The training script must accept ``--steps --step-time --ckpt-dir --progress`` and append
    one JSON line per step and worker to the progress file, as ``examples/elastic_train.py``
    does.
    """

    def __init__(
        self,
        workdir: Path,
        endpoint: str,
        run_id: str,
        *,
        script: str,
        nnodes: str = "1:3",
        backend: str = "redis",
        rdzv_conf: Mapping[str, object] | None = None,
        steps: int = 100_000,
        step_time: float = 0.1,
    ) -> None:
        self.workdir = workdir
        self.script = script
        self.endpoint = endpoint
        self.run_id = run_id
        self.nnodes = nnodes
        self.backend = backend
        self.rdzv_conf = dict(rdzv_conf or {})
        self.steps = steps
        self.step_time = step_time
        self.progress = workdir / "progress.jsonl"
        self.ckpt = workdir / "ckpt"
        self.ckpt.mkdir(parents=True, exist_ok=True)
        self.nodes: dict[str, LocalNode] = {}
        self.extra_env: dict[str, str] = {}

    def start_node(self, node_id: str) -> LocalNode:
        cmd = torchrun_command(
            script=self.script,
            script_args=[
                "--steps",
                str(self.steps),
                "--step-time",
                str(self.step_time),
                "--ckpt-dir",
                str(self.ckpt),
                "--progress",
                str(self.progress),
            ],
            rdzv_endpoint=self.endpoint,
            run_id=self.run_id,
            nnodes=self.nnodes,
            backend=self.backend,
            rdzv_conf=self.rdzv_conf,
        )
        return self._start(node_id, cmd)

    def _start(self, node_id: str, cmd: list[str]) -> LocalNode:
        env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **self.extra_env}
        node = LocalNode(node_id, cmd, self.workdir / f"{node_id}.log", env=env, cwd=self.workdir)
        self.nodes[node_id] = node.start()
        return node

    def records(self) -> list[Record]:
        if not self.progress.exists():
            return []
        out = []
        for line in self.progress.read_text().splitlines():
            try:
                d: dict[str, Any] = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written right now
            out.append(
                Record(
                    d["t"],
                    d["node"],
                    d["rank"],
                    d["world"],
                    d["round"],
                    d["step"],
                    float(d.get("loss", "nan")),
                )
            )
        return out

    def wait_for(
        self, pred: Callable[[list[Record]], bool], timeout: float, what: str
    ) -> list[Record]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            recs = self.records()
            if pred(recs):
                return recs
            if self.nodes and all(not node.alive() for node in self.nodes.values()):
                break
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{self.diagnose()}")

    def wait_for_world(
        self, world: int, timeout: float, since: float = 0.0, steps: int = 3
    ) -> float:
        """Wait until `steps` steps ran at world size `world` after time `since`; return the
        time of the first of them."""

        def ok(recs: list[Record]) -> bool:
            hits = {r.step for r in recs if r.t >= since and r.world == world and r.rank == 0}
            return len(hits) >= steps

        recs = self.wait_for(ok, timeout, f"{steps} steps at world size {world}")
        return min(r.t for r in recs if r.t >= since and r.world == world)

    def rank0_node(self) -> str:
        recs = [r for r in self.records() if r.rank == 0]
        return recs[-1].node

    def diagnose(self) -> str:
        tail = self.records()[-6:]
        logs = "\n".join(
            f"--- {n} (alive={node.alive()}) ---\n{node.log_text()[-2500:]}"
            for n, node in self.nodes.items()
        )
        return f"last records: {tail}\n{logs}"

    def close(self, client: redis.Redis | None = None) -> None:
        for node in self.nodes.values():
            node.close()
        for node in self.nodes.values():
            # A SIGKILLed process takes a moment to die: look again before calling it left.
            deadline = time.monotonic() + 10
            while (left := node.leftover_pids()) and time.monotonic() < deadline:
                time.sleep(0.1)
            if left:
                raise AssertionError(f"node {node.node_id} left processes behind: {left}")
        if client is not None:
            keys = list(client.scan_iter(match=RunKeys(self.run_id).pattern, count=1000))
            if keys:
                client.delete(*keys)


def agent_command(
    *,
    redis_url: str,
    run_id: str,
    node_id: str,
    train_cmd: Sequence[str],
    nnodes: str,
    ckpt_dir: str | Path = "",
    nproc_per_node: int = 1,
    rdzv_conf: Mapping[str, object] | None = None,
    health_check: bool = False,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The ``spottrain-agent run`` command line of one local node."""
    cmd = [
        sys.executable,
        "-m",
        "spottrain.agent.cli",
        "run",
        f"--redis={redis_url}",
        f"--run-id={run_id}",
        f"--node-id={node_id}",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--cloud=local",
    ]
    if ckpt_dir:
        cmd.append(f"--ckpt-dir={ckpt_dir}")
    if rdzv_conf:
        cmd.append("--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in rdzv_conf.items()))
    if not health_check:
        cmd.append("--no-health-check")
    return [*cmd, *extra_args, "--", *train_cmd]


class LocalAgentJob(LocalElasticJob):
    """Nodes that each run ``spottrain-agent run`` as their own process group, the way a VM
    runs the agent under systemd; the agent launches torchrun and the training script.

    The script must accept ``--steps --ckpt-dir --progress`` plus ``script_args`` (as
    ``examples/gpt_train.py`` does).
    """

    def __init__(
        self,
        workdir: Path,
        endpoint: str,
        run_id: str,
        *,
        script: str,
        script_args: Sequence[str] = (),
        agent_args: Sequence[str] = (),
        health_check: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(workdir, endpoint, run_id, script=script, **kwargs)
        self.script_args = list(script_args)
        self.agent_args = list(agent_args)
        self.health_check = health_check

    def start_node(self, node_id: str) -> LocalNode:
        train = [
            self.script,
            "--steps",
            str(self.steps),
            "--ckpt-dir",
            str(self.ckpt),
            "--progress",
            str(self.progress),
            *self.script_args,
        ]
        cmd = agent_command(
            redis_url=self.endpoint,
            run_id=self.run_id,
            node_id=node_id,
            train_cmd=train,
            nnodes=self.nnodes,
            ckpt_dir=self.ckpt,
            rdzv_conf=self.rdzv_conf,
            health_check=self.health_check,
            extra_args=self.agent_args,
        )
        return self._start(node_id, cmd)

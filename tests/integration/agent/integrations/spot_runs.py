"""Runs of a staged-layout integration's worker (Accelerate, plain script) for the tests
beside it: real torchrun with two workers on the CPU, a real Redis, and the agent's own
notice handler writing the drain request. One uninterrupted run, one a drain stops, and
one that resumes the drained run's checkpoint (with a torn newer one planted beside it).
Every wait ends on a condition; the time limits only guard against a deadlock."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import redis
import torch

from spottrain.agent.checkpoint.directory import CheckpointDir
from spottrain.agent.checkpoint.manifest import MANIFEST_NAME, Manifest
from spottrain.agent.lifecycle import Lifecycle
from spottrain.agent.node_record import NodeInfo, NodeRecord
from spottrain.agent.notices.handler import NoticeHandler
from spottrain.agent.notices.notice import Notice, NoticeKind
from spottrain.ports import free_port
from spottrain.protocol.keys import RunKeys
from spottrain.protocol.states import NodeState

RUN_TIMEOUT = 180.0


@dataclass
class Run:
    """One torchrun of a worker: where it checkpoints (for the Trainer, its output_dir),
    where its ranks report (``rank<R>.jsonl``, ``final.pt``), its run id, and its output."""

    ckpt: Path
    report: Path
    run_id: str
    proc: subprocess.Popen[str] | None = None
    log: str = ""

    def rows(self, rank: int) -> list[dict[str, Any]]:
        path = self.report / f"rank{rank}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def ids(self, rank: int) -> list[int]:
        """The sample ids this rank consumed in the optimizer steps it completed."""
        return [i for r in self.rows(rank) if "ids" in r for i in r["ids"]]

    def steps(self, rank: int) -> list[int]:
        return [r["step"] for r in self.rows(rank) if "ids" in r]

    def saves(self, rank: int) -> list[int]:
        """The steps this rank saved at."""
        return [r["save"] for r in self.rows(rank) if "save" in r]

    def final(self) -> dict[str, torch.Tensor]:
        return torch.load(self.report / "final.pt", weights_only=True)  # type: ignore[no-any-return]


class Process(Protocol):
    """A run of the tests: its torchrun, and its output once it ended."""

    proc: subprocess.Popen[str] | None
    log: str


def torchrun(
    worker: Path,
    argv: Sequence[str],
    *,
    ckpt: Path,
    redis_url: str,
    node: str,
    run_id: str,
    workers: int = 2,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[str]:
    """torchrun of ``worker ARGV`` with ``workers`` workers on this machine, checkpoints in
    ``ckpt``, progress to ``redis_url`` as node ``node``; ``env`` adds to the environment
    (the caller's own SPOTTRAIN_ settings never leak in)."""
    full = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SPOTTRAIN_")},
        "SPOTTRAIN_CKPT_DIR": str(ckpt),
        "SPOTTRAIN_REDIS": redis_url,
        "SPOTTRAIN_NODE": node,
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={workers}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        f"--rdzv-id={run_id}",
        "--max-restarts=0",
        str(worker),
        *argv,
    ]
    return subprocess.Popen(
        cmd, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def start(
    worker: Path, root: Path, name: str, redis_url: str, *args: str, ckpt: Path | None = None
) -> Run:
    """torchrun of ``worker REPORT_DIR *args`` with two workers; checkpoints in ``ckpt``
    (default ``root/ckpt-<name>``)."""
    run = Run(
        ckpt or root / f"ckpt-{name}", root / f"report-{name}", f"{name}-{uuid.uuid4().hex[:8]}"
    )
    run.ckpt.mkdir(exist_ok=True)
    run.report.mkdir()
    run.proc = torchrun(
        worker,
        [str(run.report), *args],
        ckpt=run.ckpt,
        redis_url=redis_url,
        node=f"node-{name}",
        run_id=run.run_id,
    )
    return run


def finish(run: Process, timeout: float = RUN_TIMEOUT) -> int:
    """Wait for the run's end and keep its output.

    Raises:
        AssertionError: it did not end within ``timeout`` (it is killed).
    """
    assert run.proc is not None
    try:
        run.log = run.proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        run.proc.kill()
        run.log = run.proc.communicate()[0]
        raise AssertionError(f"the run did not end:\n{run.log[-6000:]}") from None
    return run.proc.returncode


def wait_for(pred: Callable[[], bool], run: Process, what: str) -> None:
    """Poll ``pred`` until it holds; fail at once, with the output, if the run ends first."""
    assert run.proc is not None
    deadline = time.monotonic() + RUN_TIMEOUT
    while not pred():
        if run.proc.poll() is not None:
            raise AssertionError(
                f"the run ended before {what}:\n{run.proc.communicate()[0][-6000:]}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {RUN_TIMEOUT:.0f} s")
        time.sleep(0.05)


def notice_handler(
    client: redis.Redis,
    run: Process,
    run_id: str,
    node: str,
    stopped: list[float] | None = None,
) -> NoticeHandler:
    """The agent's notice handler of node ``node``; its drain ends by stopping torchrun,
    which passes the SIGTERM on to its workers (each stop's timeout goes to ``stopped``)."""
    lifecycle = Lifecycle()
    for state in (NodeState.HEALTHY, NodeState.JOINED):
        lifecycle.advance(state)

    def stop_workers(timeout: float) -> None:
        if stopped is not None:
            stopped.append(timeout)
        assert run.proc is not None
        if run.proc.poll() is None:
            run.proc.send_signal(signal.SIGTERM)

    record = NodeRecord(client, RunKeys(run_id), NodeInfo(node, "local"))
    return NoticeHandler(client, RunKeys(run_id), node, lifecycle, record, stop_workers)


def agent_for(client: redis.Redis, run: Run) -> NoticeHandler:
    """The agent's notice handler of the run's node, stopping torchrun after its drain."""
    node = f"node-{run.report.name.removeprefix('report-')}"
    return notice_handler(client, run, run.run_id, node)


def plant_torn(ckpt: Path, source: str, step: int) -> str:
    """A copy of committed checkpoint ``source`` as ``step-<step>`` with one byte of its
    largest file flipped after its commit: newer, and torn."""
    target = CheckpointDir(ckpt).step_path(step)
    shutil.copytree(ckpt / source, target)
    manifest = Manifest.read(target)
    (target / MANIFEST_NAME).write_bytes(Manifest(**{**manifest.__dict__, "step": step}).to_bytes())
    files = [p for p in target.rglob("*") if p.is_file() and p.name != MANIFEST_NAME]
    victim = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    return str(target.name)


@dataclass
class Runs:
    plain: Run
    drained: Run
    resumed: Run
    handler: NoticeHandler
    progress: dict[str, str]
    ckpt_last: dict[str, str]
    restores: list[dict[str, int]]
    drained_listing: list[str]
    torn: str


def run_three(
    worker: Path, root: Path, redis_url: str, client: redis.Redis, gate: int, *extra: str
) -> Runs:
    """The uninterrupted, drained and resumed runs of ``worker``."""
    plain = start(worker, root, "plain", redis_url, *extra)
    assert finish(plain) == 0, plain.log[-6000:]

    drained = start(worker, root, "drained", redis_url, "--gate-step", str(gate), *extra)
    keys = RunKeys(drained.run_id)
    wait_for(lambda: int(client.hget(keys.progress, "step") or 0) >= gate, drained, f"step {gate}")
    handler = agent_for(client, drained)
    now = time.time()
    handler.submit(Notice("test", NoticeKind.TERMINATE, now + 120, now))
    assert handler.done.wait(RUN_TIMEOUT), "the agent's drain did not end"
    finish(drained)
    progress = {k.decode(): v.decode() for k, v in client.hgetall(keys.progress).items()}
    ckpt_last = {k.decode(): v.decode() for k, v in client.hgetall(keys.ckpt_last).items()}
    listing = sorted(p.name for p in drained.ckpt.iterdir() if p.name.startswith("step-"))
    torn = plant_torn(drained.ckpt, listing[-1], gate + 50)

    resumed = start(worker, root, "resumed", redis_url, *extra, ckpt=drained.ckpt)
    assert finish(resumed) == 0, resumed.log[-6000:]
    restores = [json.loads(r) for r in client.lrange(RunKeys(resumed.run_id).restores, 0, -1)]
    return Runs(plain, drained, resumed, handler, progress, ckpt_last, restores, listing, torn)

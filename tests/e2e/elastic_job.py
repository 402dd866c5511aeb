"""A local elastic job for the end-to-end tests: torchrun nodes (each its own process group)
on the redis rendezvous, training examples/elastic_train.py, observed through the progress
lines its workers write."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from spottrain.agent.local_torchrun import LocalNode, torchrun_command
from spottrain.keys import RunKeys

REPO = Path(__file__).resolve().parents[2]
TRAIN_SCRIPT = str(REPO / "examples" / "elastic_train.py")


@dataclass(frozen=True)
class Record:
    t: float
    node: str
    rank: int
    world: int
    round: int
    step: int


class ElasticJob:
    """Nodes of one run, their progress, and their cleanup."""

    def __init__(
        self,
        workdir: Path,
        endpoint: str,
        run_id: str,
        *,
        nnodes: str = "1:3",
        backend: str = "redis",
        rdzv_conf: Mapping[str, object] | None = None,
        steps: int = 100_000,
        step_time: float = 0.1,
    ) -> None:
        self.workdir = workdir
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

    def start_node(self, node_id: str) -> LocalNode:
        cmd = torchrun_command(
            script=TRAIN_SCRIPT,
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
        env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
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
            out.append(Record(d["t"], d["node"], d["rank"], d["world"], d["round"], d["step"]))
        return out

    def wait_for(
        self, pred: Callable[[list[Record]], bool], timeout: float, what: str
    ) -> list[Record]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            recs = self.records()
            if pred(recs):
                return recs
            dead = [n for n, node in self.nodes.items() if node.proc and node.proc.poll() == 1]
            if dead and all(not node.alive() for node in self.nodes.values()):
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
            if node.proc is not None:
                try:
                    os.killpg(node.pgid, 0)
                except ProcessLookupError:
                    continue
                raise AssertionError(f"node {node.node_id} left processes behind")
        if client is not None:
            keys = list(client.scan_iter(match=RunKeys(self.run_id).pattern, count=1000))
            if keys:
                client.delete(*keys)

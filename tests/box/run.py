"""A run of ``spottrain`` in the box: the real CLI, started in the box's switch namespace (the
operator's workstation, which reaches Redis and the clouds' APIs at the addresses the VMs
use), and what a test reads of it (its output, Redis, the hypervisor's VMs)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from spottrain.controller.reconcile.state import RunState
from spottrain.protocol.keys import RunKeys

from .kits import Kit

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "gpt_train.py"
# What a run's waits may take together, however each is bounded (a loaded machine slows every
# phase): a test's timeout is this, plus its down and its fixtures, so its own waits never
# add up past it.
RUN_BUDGET_S = 1200.0


def job_spec(kit: Kit, name: str, code: dict[str, Any], **over: Any) -> dict[str, Any]:
    """A small CPU job on the kit's cloud: two one-worker nodes (one at least), checkpoints
    on the box's shared volume every 10 steps, copies and logs in the kit's store."""
    spec: dict[str, Any] = {
        "name": name,
        "code": code,
        "train": {"command": "gpt_train.py --steps 120 --every-steps 10 --step-time 0.2"},
        "nodes": {"min": 1, "max": 2, "gpus": 0, "workers": 1},
        "resources": {
            "clouds": [kit.cloud],
            "regions": ["us-east-1" if kit.cloud == "aws" else "us-central1"],
            "instance_types": ["p4d.24xlarge" if kit.cloud == "aws" else "a2-highgpu-8g"],
        },
        "budget": {"max_usd": 1000},
        "checkpoint": {
            "volume": {"path": "/mnt/spottrain/ckpt", "write_gbps": 1},
            "every_steps": 10,
            "size_gb": 0.001,
            "copy_to": kit.store(name),
        },
        "redis": {"url": kit.redis_url, "password_secret": "box-redis-password"},
        kit.cloud: kit.section(),
        "packages": {"index_url": kit.index_url},
    }
    for key, value in over.items():
        spec[key] = value
    return spec


class BoxRun:
    """``spottrain`` commands against one kit, with a home of the test's own."""

    def __init__(self, kit: Kit, folder: Path) -> None:
        self.kit, self.folder = kit, folder
        self.home = folder / "home"
        self.up_proc: subprocess.Popen[bytes] | None = None
        self.run_id = ""
        self.deadline = time.monotonic() + RUN_BUDGET_S

    def within_budget(self, timeout: float) -> float:
        """``timeout``, cut to what is left of the run's budget."""
        return max(0.0, min(timeout, self.deadline - time.monotonic()))

    def write_job(self, spec: dict[str, Any], files: dict[str, str] | None = None) -> Path:
        job = self.folder / "job"
        (job / "code").mkdir(parents=True, exist_ok=True)
        shutil.copy(TRAIN, job / "code" / TRAIN.name)
        for name, text in (files or {}).items():
            (job / "code" / name).write_text(text)
        path = job / "job.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        return path

    def cli(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        env = self.kit.controller_env(self.home)
        return subprocess.run(
            ["ip", "netns", "exec", self.kit.box.network.switch, sys.executable, "-m",
             "spottrain.controller.cli", *args],
            capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout,
        )  # fmt: skip

    def up(self, job: Path, *flags: str) -> None:
        """``spottrain up JOB FLAGS`` in the background; its output in ``up.log``."""
        log = (self.folder / "up.log").open("wb")
        env = self.kit.controller_env(self.home)
        argv = [sys.executable, "-m", "spottrain.controller.cli", "up", str(job), *flags]
        self.up_proc = self.kit.box.network.run_in_switch(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO
        )
        log.close()
        self.run_id = wait(self._run_id, "up to name its run", 300, self)

    def _run_id(self) -> str:
        for line in self.output().splitlines():
            if line.startswith("run ") and ":" in line:
                return line.split()[1].rstrip(":")
        if self.up_proc is not None and self.up_proc.poll() is not None:
            raise AssertionError(f"up exited {self.up_proc.returncode}:\n{self.output()}")
        return ""

    def output(self) -> str:
        path = self.folder / "up.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_up(self, timeout: float) -> int:
        assert self.up_proc is not None
        timeout = self.within_budget(timeout)
        try:
            return self.up_proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"up still runs after {timeout:.0f} s:\n{self.report()}") from None

    # --- what a test reads --------------------------------------------------------------

    @property
    def keys(self) -> RunKeys:
        return RunKeys(self.run_id)

    def state(self) -> RunState:
        assert self.kit.redis is not None
        return RunState(self.kit.redis.client(), self.keys)

    def step(self) -> int:
        return int(self.kit.client().hget(self.keys.progress, "step") or -1)

    def vm_of(self, node: str) -> str:
        rec = self.state().ledger().records.get(node)
        return rec.instance_id if rec is not None and rec.status == "launched" else ""

    def node(self, node: str) -> dict[str, str]:
        return dict(self.kit.client().hgetall(self.keys.node(node)))

    def events(self, kind: str | None = None) -> list[dict[str, str]]:
        rows = [
            {k: v for k, v in fields.items()}
            for _, fields in self.kit.client().xrange(self.keys.events)
        ]
        return [r for r in rows if kind is None or r.get("type") == kind]

    def status(self) -> dict[str, Any]:
        out = self.cli("status", self.run_id, "--json")
        assert out.returncode == 0, out.stderr
        return dict(json.loads(out.stdout))

    def report(self) -> str:
        """What went on, for a failed assertion: up's output, the VMs' consoles and the
        agents' own logs."""
        parts = [f"--- up ({self.run_id}):\n{self.output()[-4000:]}"]
        for vm_id, vm in self.kit.box.vms.items():
            parts.append(f"--- console {vm_id} (alive {vm.alive()}):\n{vm.console()[-1500:]}")
            log = vm.folder / "var" / "log" / "spottrain-agent.log"
            if log.exists():
                parts.append(f"--- agent log {vm_id}:\n{log.read_text(errors='replace')[-2500:]}")
        parts.append(f"--- box errors: {self.kit.box.errors}")
        return "\n".join(parts)


def wait(fn: Callable[[], Any], what: str, timeout: float, run: BoxRun | None = None) -> Any:
    """Poll ``fn`` until it returns something true (every 0.5 s), and return it; at most
    ``timeout`` seconds, and at most what is left of ``run``'s budget."""
    if run is not None:
        timeout = run.within_budget(timeout)
    end = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > end:
            more = f"\n{run.report()}" if run is not None else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{more}")
        time.sleep(0.5)

"""A run on this workstation: its record and how commands find it.

``$SPOTTRAIN_HOME/runs/<run id>/`` holds ``run.json`` (the spec, where Redis is, where the
code archive went), the embedded Redis's data (append-only file) and its password
(``redis/password``, mode 0600), a replica run's lighthouse (``lighthouse/``: its pidfile and
log), the controller's log, and,
after the run, ``summary.json`` and ``events.jsonl`` so ``status`` and ``logs`` still answer
once its Redis is gone. ``$SPOTTRAIN_HOME/jobs/<name>`` names the newest run of a job.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from spottrain.fileio import atomic_write
from spottrain.protocol.env import ENV_HOME
from spottrain.protocol.keys import validate_run_id
from spottrain.spec import JobSpec, LoadedSpec, parse_spec


class RunError(Exception):
    """A run cannot be started, found or reached; the message says why and what to do."""


def home_dir() -> Path:
    return Path(os.environ.get(ENV_HOME) or Path.home() / ".spottrain")


@dataclass
class RunInfo:
    """``run.json``: what every command needs to find a run's parts."""

    run_id: str
    spec_text: str
    spec_source: str
    base_dir: str
    redis_url: str
    embedded_redis: bool
    created_at: float
    local_state_dir: str = ""
    code_url: str = ""
    code_sha256: str = ""
    controller_pid: int = 0
    # Who drives the run: its controller's process mark (controller/run/processes.py) and
    # lease owner, written by that controller itself once it holds the run's lease (never
    # before: a refused controller writes nothing). `down` signals only that very process.
    controller: dict[str, Any] = field(default_factory=dict)
    # The hashed lock of the agent's environment per cloud (controller/run/env_lock.py):
    # {cloud: {"file": "env-aws.lock", "sha256": ..., "packages": n}}, files in the run dir.
    env_locks: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Replica mode: where the run's torchft lighthouse is dialled ("host:port") and what it
    # binds (controller/run/lighthouse.py); "" for an elastic run.
    lighthouse: str = ""
    lighthouse_bind: str = ""
    # The spottrain wheel this run ships to its VMs ({"sha256", "filename", "version",
    # "origin"}) and, per AWS/GCP cloud, the files each VM fetches at boot from the run's
    # store, pinned by sha256 (controller/run/boot_files.py: BootFiles.as_dict()).
    wheel: dict[str, str] = field(default_factory=dict)
    boot_files: dict[str, dict[str, dict[str, str]]] = field(default_factory=dict)

    @property
    def dir(self) -> Path:
        return home_dir() / "runs" / self.run_id

    def save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.dir / "run.json", json.dumps(asdict(self), indent=1), durable=False)

    def __post_init__(self) -> None:
        # The parsed spec: given by `from_loaded` (what `up` validated), else parsed from
        # ``spec_text`` on the first `spec()` (a run loaded from run.json). Not a field: it
        # is never written to run.json.
        self._spec: JobSpec | None = None

    @classmethod
    def from_loaded(cls, loaded: LoadedSpec, run_id: str, **fields: Any) -> RunInfo:
        """A new run's record of a spec parsed once: it keeps the parsed model (a JobSpec is
        frozen) and the exact text it was parsed from."""
        info = cls(
            run_id=run_id,
            spec_text=loaded.text,
            spec_source=loaded.source,
            base_dir=str(loaded.base_dir),
            **fields,
        )
        info._spec = loaded.spec
        return info

    def spec(self) -> JobSpec:
        if self._spec is None:
            self._spec = parse_spec(self.spec_text, self.spec_source, Path(self.base_dir)).spec
        return self._spec

    @classmethod
    def load(cls, run_id: str) -> RunInfo:
        path = home_dir() / "runs" / run_id / "run.json"
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            raise RunError(f"no run {run_id!r} on this machine (see `spottrain status`)") from None


def find_run(name_or_id: str | None) -> RunInfo:
    """A run by run id, by job name (its newest run), or the newest run of all (``None``:
    no name given).

    Raises:
        RunError: nothing matches, or the name is empty or not a run id or job name (an
            unset shell variable must never pick the newest run).
    """
    runs = home_dir() / "runs"
    if name_or_id is not None:
        _check_run_name(name_or_id)
        if (runs / name_or_id / "run.json").exists():
            return RunInfo.load(name_or_id)
        latest = home_dir() / "jobs" / name_or_id
        if latest.exists():
            return RunInfo.load(latest.read_text().strip())
        raise RunError(f"no run or job named {name_or_id!r} on this machine")
    candidates = sorted(runs.glob("*/run.json"), key=lambda p: p.stat().st_mtime)
    if not candidates:
        raise RunError("no runs on this machine yet: start one with `spottrain up JOB.yaml`")
    return RunInfo.load(candidates[-1].parent.name)


def _check_run_name(name: str) -> None:
    if not name.strip():
        raise RunError(
            "the run name is empty (an unset variable?): give a run id or job name, or leave "
            "it out to mean the newest run"
        )
    try:
        validate_run_id(name)
    except ValueError:
        raise RunError(
            f"{name!r} is not a run id or job name: use letters, digits, '.', '_' or '-'"
        ) from None
    if name in (".", ".."):
        raise RunError(f"{name!r} is not a run id or job name")

"""The local cloud's own state: one JSON record per VM in a directory, like a cloud's
database of instances.

Every process that touches it (controllers, the CLI, each VM) takes one file lock around a
read-modify-write, and every write is a rename of a complete file, so a process killed at any
point leaves every record whole.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from spottrain.fileio import atomic_write


class RecordStore:
    """The records under ``root``: ``instances/<id>.json``, ``logs/<id>.log``, ``lock``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.instances = self.root / "instances"
        self.logs = self.root / "logs"
        self.instances.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the store's lock (one writer at a time, across processes)."""
        with open(self.root / "lock", "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def path(self, vm_id: str) -> Path:
        return self.instances / f"{vm_id}.json"

    def log_path(self, vm_id: str) -> Path:
        return self.logs / f"{vm_id}.log"

    def read(self, vm_id: str) -> dict[str, Any]:
        """The record of ``vm_id``.

        Raises:
            KeyError: no such VM.
        """
        try:
            data: dict[str, Any] = json.loads(self.path(vm_id).read_text())
        except FileNotFoundError:
            raise KeyError(vm_id) from None
        return data

    def all(self) -> list[dict[str, Any]]:
        """Every record, oldest launch first."""
        out = []
        for p in self.instances.glob("*.json"):
            if p.name.startswith("."):
                continue  # a write in progress (pathlib's glob matches dot files)
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                out.append(json.loads(p.read_text()))
        return sorted(out, key=lambda r: (r.get("launched_at", 0), r["id"]))

    def write(self, record: dict[str, Any]) -> None:
        """Write a whole record atomically (call with the lock held)."""
        # The temporary file's name starts with a dot: records() skips it.
        atomic_write(self.path(record["id"]), json.dumps(record, indent=1, sort_keys=True))

    def update(self, vm_id: str, **fields: Any) -> dict[str, Any]:
        """Change some fields of a record under the lock; returns the new record.

        A VM that is already terminated stays terminated: a late write from a VM process that
        lost a race with a hard kill must not bring it back.
        """
        with self.locked():
            rec = self.read(vm_id)
            if rec.get("state") == "terminated" and fields.get("state") != "terminated":
                fields = {k: v for k, v in fields.items() if k not in ("state",)}
            rec.update(fields)
            self.write(rec)
            return rec

    def remove(self, vm_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(vm_id).unlink()

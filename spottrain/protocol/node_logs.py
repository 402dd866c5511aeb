"""Where a node's shipped output lives in the run's object store, and how a chunk is named.

The agent on every VM ships its node's output (the agent's own lines, torchrun's and the
workers') in gzip chunks; ``spottrain logs --node N`` reads them back, for live and gone VMs
alike. Both sides build and parse names here, so the layout is written down once:

    <logs store>/<run id>/<node>/<vm>/<seq:08d>-<started ms>.gz

- ``seq`` counts a VM's chunks from 0 with no gaps: a missing number is a chunk that was lost.
- ``started ms`` is when the VM's agent started shipping (unix milliseconds, the same in
  every chunk of one VM), so a node's successive VMs sort by when each began.
- A chunk holds whole lines only, as one gzip member of the bytes the node wrote.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CHUNK_SUFFIX = ".gz"
# The store a run's node logs go to when the spec names none: beside its checkpoint copies.
DEFAULT_SUBDIR = "logs"

_PART_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}\Z")
_CHUNK_RE = re.compile(r"^(?P<seq>[0-9]{8})-(?P<started>[0-9]{1,15})\.gz\Z")


def _checked(what: str, value: str) -> str:
    if not _PART_RE.match(value) or value in (".", ".."):
        raise ValueError(
            f"{what} {value!r} cannot name a log object: use 1-128 letters, digits, '.', '_' or '-'"
        )
    return value


@dataclass(frozen=True, order=True)
class ChunkName:
    """One shipped chunk: ``started_ms`` first, so sorting orders a node's VMs by start."""

    started_ms: int
    vm: str
    seq: int
    run_id: str
    node: str

    def key(self) -> str:
        """The chunk's key, relative to the logs store."""
        if self.seq < 0 or self.seq >= 10**8:
            raise ValueError(f"chunk number {self.seq} is outside 0..99999999")
        return (
            f"{node_prefix(self.run_id, self.node)}{_checked('vm id', self.vm)}/"
            f"{self.seq:08d}-{self.started_ms}{CHUNK_SUFFIX}"
        )


def node_prefix(run_id: str, node: str) -> str:
    """The prefix under which every VM of ``node`` ships its chunks (ends with '/')."""
    return f"{_checked('run id', run_id)}/{_checked('node', node)}/"


def parse_chunk_key(key: str) -> ChunkName | None:
    """The chunk a key names, or ``None`` for a key that is not a chunk (skipped by readers)."""
    parts = key.split("/")
    if len(parts) != 4:
        return None
    run_id, node, vm, name = parts
    m = _CHUNK_RE.match(name)
    if m is None or not all(_PART_RE.match(p) for p in (run_id, node, vm)):
        return None
    return ChunkName(int(m["started"]), vm, int(m["seq"]), run_id, node)


def default_logs_url(copy_to: str | None) -> str | None:
    """Where logs go when the spec names no ``logs.to``: ``<checkpoint.copy_to>/logs``."""
    if not copy_to:
        return None
    return copy_to.rstrip("/") + "/" + DEFAULT_SUBDIR

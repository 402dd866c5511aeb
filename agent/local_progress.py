"""The workers' progress as the node itself shows it, for the agent's dead man's switch:
their newest step on the node's own disk, and the CPU time their processes used.

The SDK (local rank 0 of each node) writes its newest step to ``$SPOTTRAIN_PROGRESS_FILE``,
a file the agent names in a directory of its own, at most once a second. The agent reads it
to tell training that goes on from training that stopped without asking Redis: a Redis
outage must never look like a stalled job. A script that does not use the SDK writes no
step; for it the agent reads the CPU time of torchrun's process tree from ``/proc``
(:func:`tree_cpu_s`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable

from spottrain.fileio import atomic_write
from spottrain.process_group import descendants
from spottrain.protocol.env import ENV_PROGRESS_FILE


class ProgressFile:
    """Writes the newest step to ``path`` (nothing when ``path`` is empty).

    Args:
        path: the file (written by rename, so a reader never sees half a number).
        every_s: at most one write per this many seconds.
        clock: monotonic seconds.
    """

    def __init__(
        self, path: str | None, *, every_s: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.path = path or ""
        self.every_s = every_s
        self.clock = clock
        self._last_at = -float("inf")
        self._last_step: int | None = None

    @classmethod
    def from_env(cls) -> ProgressFile:
        """The file the agent named, for the node's local rank 0; a no-op elsewhere."""
        if os.environ.get("LOCAL_RANK", "0") != "0":
            return cls(None)
        return cls(os.environ.get(ENV_PROGRESS_FILE))

    def report(self, step: int) -> None:
        """Note ``step`` (cheap: a write at most once per ``every_s``; errors ignored, the
        training must never fail for this)."""
        if not self.path or step == self._last_step:
            return
        now = self.clock()
        if now - self._last_at < self.every_s:
            return
        self._last_at, self._last_step = now, step
        with contextlib.suppress(OSError):
            # A hint for the orphan watch, rewritten every few seconds: no fsync.
            atomic_write(self.path, f"{step}\n", durable=False)


def read_step(path: str) -> int | None:
    """The step in ``path``, or None when it holds none (not written yet, unreadable)."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def tree_cpu_s(root: int) -> float | None:
    """The CPU seconds (user and system) used by ``root`` and every descendant, alive or
    already reaped by its parent; None when ``root`` is gone or a zombie (its workers are
    then gone too).

    A process reaped by its parent has its time added to the parent's (children's time), and
    a dead one not yet reaped still shows its own, so the sum goes on growing across a worker
    restart. A process reaped between the reads of its parent and of itself is missed once:
    a reading may dip below the one before, never rise above the truth.
    """
    own = _cpu_ticks(root, zombie_ok=False)
    if own is None:
        return None
    ticks = own + sum(t for p in descendants(root) if (t := _cpu_ticks(p)) is not None)
    return ticks / os.sysconf("SC_CLK_TCK")


def _cpu_ticks(pid: int, *, zombie_ok: bool = True) -> int | None:
    """utime + stime + cutime + cstime of ``pid`` in clock ticks (None: gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    # The command name is in parentheses and may itself hold spaces or parentheses; after
    # it: state (field 3) ... utime, stime, cutime, cstime (fields 14 to 17).
    fields = stat[stat.rfind(")") + 2 :].split()
    if len(fields) < 15 or (fields[0] == "Z" and not zombie_ok):
        return None
    try:
        return sum(int(v) for v in fields[11:15])
    except ValueError:
        return None

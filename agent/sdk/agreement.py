"""How the ranks agree on whether to save at a step (see the package docstring): a tiny
all-reduce (MAX of six integers) on a gloo group of the SDK's own, started at one agreement
step and waited for at the next, while the steps in between compute."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# Positions in the agreement vector (all-reduced with MAX).
_DRAIN, _EARLY, _PERIODIC, _REQUEST, _SIGTERM, _EVERY = range(6)
_NFLAGS = 6
_MAX_AGREE_EVERY = 64
_ZEROS = [0] * _NFLAGS


def local_flags(
    sigterm: bool, request: tuple[int, bool] | None, periodic: bool
) -> list[int] | None:
    """A rank's flags from what it knows (a SIGTERM, the newest unserved request and whether
    it drains, a periodic save due by time), or None when all are zero."""
    flags: list[int] | None = None
    if sigterm:
        flags = [0] * _NFLAGS
        flags[_SIGTERM] = 1
    if request is not None:
        flags = flags or [0] * _NFLAGS
        req_id, drain = request
        flags[_REQUEST] = req_id
        flags[_DRAIN if drain else _EARLY] = 1
    if periodic:
        flags = flags or [0] * _NFLAGS
        flags[_PERIODIC] = 1
    return flags


def agreed_save(flags: list[int]) -> tuple[str, bool, int] | None:
    """The save the agreed ``flags`` ask for at this step, as (kind, whether it drains, the
    newest request id), or None: ``emergency`` for a drain (a notice's request or a rank's
    SIGTERM), ``requested`` for an early checkpoint, ``periodic`` for one due by time."""
    request_id = flags[_REQUEST]
    if flags[_DRAIN] or flags[_SIGTERM]:
        return "emergency", True, request_id
    if flags[_EARLY]:
        return "requested", False, request_id
    if flags[_PERIODIC]:
        return "periodic", False, request_id
    return None


class Agreement:
    """The reduce in flight and when the next agreement is due, the same on every rank.

    ``local_flags`` gives this rank's flags (None when all are zero); ``step_time`` its
    median seconds per step, from which it proposes the distance to the next agreement.
    Without a process group (one process) the local flags are the agreed ones.
    """

    def __init__(
        self,
        group: Any,
        interval: float,
        local_flags: Callable[[], list[int] | None],
        step_time: Callable[[], float],
    ) -> None:
        self.group = group
        self.interval = interval
        self._local_flags = local_flags
        self._step_time = step_time
        self.every = 1
        self.next = 0
        self.pending: tuple[Any, torch.Tensor] | None = None
        self._bufs = (
            torch.zeros(_NFLAGS, dtype=torch.int64),
            torch.zeros(_NFLAGS, dtype=torch.int64),
        )
        self._buf_index = 0

    def due(self, step: int) -> bool:
        return step >= self.next

    def agree(self, step: int) -> list[int]:
        """The agreed flags at an agreement step; schedules the next agreement."""
        flags = self.exchange()
        # Every rank got the same proposals, so every rank picks the same next step.
        self.every = max(1, flags[_EVERY])
        self.next = step + self.every
        return flags

    def exchange(self) -> list[int]:
        """Wait for the reduce started at the previous step; start the next one."""
        if self.group is None:
            return self._local_flags() or _ZEROS
        flags = _ZEROS
        if self.pending is not None:
            work, buf = self.pending
            work.wait()
            flags = buf.tolist()
        self.pending = None
        self.start_reduce()
        return flags

    def proposed_interval(self) -> int:
        """Steps until the next agreement, so that agreements come about every
        ``interval`` seconds: every step when steps are slow, every few when fast."""
        step_s = self._step_time()
        if step_s <= 0:
            return 1
        return max(1, min(_MAX_AGREE_EVERY, int(self.interval / step_s)))

    def start_reduce(self) -> None:
        # Two buffers in turn: one may still be read by the reduce in flight.
        self._buf_index ^= 1
        buf = self._bufs[self._buf_index]
        local = self._local_flags() or list(_ZEROS)
        local[_EVERY] = self.proposed_interval()
        buf.copy_(torch.tensor(local, dtype=torch.int64))
        work = dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self.pending = (work, buf)

    def drain(self) -> Any:
        """Finish the reduce in flight (a save's collectives must come after it on every
        rank); return what was pending, for :meth:`restart`."""
        pending = self.pending
        if pending is not None:
            pending[0].wait()
            self.pending = None
        return pending

    def restart(self, pending: Any) -> None:
        # The reduce drained before the save carried flags raised before this step; they
        # are served by this save, so the next reduce starts from the current flags.
        if pending is not None and self.group is not None:
            self.start_reduce()

"""Step and compute times of one rank: the median seconds per step, and the rank's own
compute seconds per step (see the package docstring), reported to its node's record."""

from __future__ import annotations

import contextlib
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from spottrain.protocol.keys import RunKeys


class StepTimer:
    """Recent step and compute times. ``compute()`` spans add up within a step; the step is
    closed by :meth:`close_step`."""

    def __init__(self) -> None:
        self.step_times: deque[float] = deque(maxlen=20)
        self.compute_times: deque[float] = deque(maxlen=20)
        self._compute_acc = 0.0  # this step's compute seconds so far (host clock)
        self._computed = False  # whether compute() ran in this step
        self._gpu_marks: list[tuple[Any, Any]] = []  # this step's CUDA event pairs
        # Where the span in progress's compute ended, when something marked it (a DDP
        # bucket hook: the backward's end, before the wait on the all-reduce).
        self._end_mark: Any = None
        self._in_span = False
        self.gpu_pending: deque[list[tuple[Any, Any]]] = deque()  # steps not yet read

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        start = end = None
        if cuda:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
        t0 = time.monotonic()
        self._end_mark, self._in_span = None, True
        try:
            yield
        finally:
            mark, self._end_mark, self._in_span = self._end_mark, None, False
            if cuda:
                end = mark
                if end is None:
                    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                    end.record()
                self._gpu_marks.append((start, end))
            else:
                self._compute_acc += (time.monotonic() if mark is None else mark) - t0
            self._computed = True

    def mark_compute_end(self) -> None:
        """The span in progress computed up to here; what follows in it is a wait (called
        as each DDP gradient bucket is ready: the last call is the backward's end). On a GPU
        the mark is an event on the current stream. Outside a span it does nothing."""
        if not self._in_span:
            return
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            mark = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            mark.record()
            self._end_mark = mark
        else:
            self._end_mark = time.monotonic()

    def close_compute(self, compute_s: float | None) -> None:
        """File the step's compute time; CUDA-timed steps are read once their events have
        completed, so reading never waits on the GPU (unless 8 steps are still pending)."""
        if compute_s is not None:
            if not (compute_s >= 0 and math.isfinite(compute_s)):
                raise ValueError(
                    f"compute_s={compute_s!r}: give this step's compute seconds, a finite "
                    "number >= 0"
                )
            self.compute_times.append(compute_s)
            self._gpu_marks = []
        elif self._gpu_marks:
            self.gpu_pending.append(self._gpu_marks)
            self._gpu_marks = []
        elif self._computed:
            self.compute_times.append(self._compute_acc)
        self._compute_acc = 0.0
        self._computed = False
        while self.gpu_pending and (
            len(self.gpu_pending) > 8 or all(e.query() for _, e in self.gpu_pending[0])
        ):
            pairs = self.gpu_pending.popleft()
            for _, e in pairs:
                e.synchronize()
            self.compute_times.append(sum(s.elapsed_time(e) for s, e in pairs) / 1000.0)

    @property
    def compute_time(self) -> float | None:
        """Median compute seconds per step over the recent steps (None: not timed)."""
        return statistics.median(self.compute_times) if self.compute_times else None

    @property
    def last_step_time(self) -> float:
        """Median seconds per step over the recent steps."""
        return statistics.median(self.step_times) if self.step_times else 0.0

    def report_loop(
        self,
        client: Any,
        keys: RunKeys | None,
        node: str,
        local_rank: int,
        every: float,
        stop: threading.Event,
    ) -> None:
        """Every ``every`` seconds until ``stop``, write this rank's compute time (and, from
        local rank 0, the node's step time) to the node's record."""
        while not stop.wait(every):
            if keys is None:
                continue
            fields = {}
            if local_rank == 0 and self.step_times:
                fields["step_time"] = f"{self.last_step_time:.4f}"
            compute = self.compute_time
            if compute is not None:
                # With the time it was measured: the controller ignores a rank that stopped
                # reporting (a round with fewer local ranks, a worker that holds).
                fields[f"compute:{local_rank}"] = f"{compute:.4f} {time.time():.0f}"
                # How many steps the figure is the median of: the controller judges no
                # node on its first few steps (a restart's, a joiner's, the slowest).
                fields[f"compute_n:{local_rank}"] = str(len(self.compute_times))
            if not fields:
                continue
            try:
                client.hset(keys.node(node), mapping=fields)
            except Exception:  # Redis away: the next report will do
                continue

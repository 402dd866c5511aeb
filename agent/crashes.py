"""The node's workers failing, as torchrun and the workers show it: torchrun's output followed
line by line, each failed worker turned into a :class:`~spottrain.protocol.crashes.Crash`, and
the decision that the workers crash-loop.

torchrun restarts a node's workers by itself when one fails, up to ``--max-restarts`` times
(a hundred): a script that cannot start (an import error, a bad argument) would cost a VM
that many restarts before torchrun gives up, and then another VM, and another. torchrun and
its workers write their output to a file of the agent's (:class:`OutputRelay`, which copies
it to the agent's own output, where the node's log goes as before: a file, not a pipe, so a
slow or dead agent never blocks or breaks a worker's write), and torchrun says each failure
in one line (``failed (exitcode: 1) local_rank: 0 (pid: 123) of binary: ...``). From those
:class:`OutputLines` makes a :class:`WorkerFailure` with the workers' last lines before it,
and :class:`CrashWatch` decides (pure: the clock, the step and the rendezvous' state are its
arguments) whether it continues the previous failure's streak. It does, unless:

- a peer left or died between the two failures (the rendezvous' gone version moved, or
  could not be read): a membership change explains the failure;
- the workers trained between them: a step beyond the previous failure's, when the workers
  report steps; else they ran :data:`~spottrain.protocol.crashes.TRAINED_S` before failing.

What the workers said does not break a streak: a worker that aborts on its way out
(``terminate called without an active exception``) after the error that matters must not
hide a loop. At :data:`~spottrain.protocol.crashes.CRASH_LOOP_FAILURES` in a row the agent
ends torchrun and its node fails with the crash as the reason: the reason most of the
streak's failures had (:func:`loop_crash`), which is what the controller compares between
VMs. A preemption never makes a loop: the survivors' failures come with a membership
change, and training between preemptions moves the step.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from spottrain.protocol.crashes import (
    CRASH_LOOP_FAILURES,
    TAIL_LINES,
    TRAINED_S,
    Crash,
    crash_key,
    failing_line,
    same_crash,
    worker_lines,
)

from .logship.tail import FileTail

# torchrun's line for the first failed worker of a group (torch/distributed/elastic/
# multiprocessing/api.py).
_WORKER_FAILED = re.compile(r"\] failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
# Lines of output kept to find the failing line in (a traceback is rarely longer).
KEEP_LINES = 40
# torchrun's output file is cut back to nothing once read past this (see FileTail).
OUTPUT_MAX_BYTES = 64 << 20


@dataclass(frozen=True)
class WorkerFailure:
    """torchrun's report of a failed worker: its exit code, its local rank, and the output
    lines (torchrun's own left out) since the workers' previous failure, the last
    :data:`KEEP_LINES`."""

    code: int
    rank: int
    lines: tuple[str, ...]


class OutputLines:
    """torchrun's output, one line at a time: keeps the last lines since the workers' last
    failure and turns torchrun's line for a failed worker into a :class:`WorkerFailure`.
    Pure."""

    def __init__(self, keep: int = KEEP_LINES) -> None:
        self._lines: deque[str] = deque(maxlen=keep)

    def feed(self, line: str) -> WorkerFailure | None:
        m = _WORKER_FAILED.search(line)
        if m is None:
            self._lines.append(line)
            return None
        failure = WorkerFailure(int(m.group(1)), int(m.group(2)), self.lines())
        self._lines.clear()  # what follows is the restarted workers'
        return failure

    def lines(self) -> tuple[str, ...]:
        """The workers' lines since their last failure (torchrun's own left out)."""
        return tuple(worker_lines(self._lines))

    def last(self) -> tuple[str, ...]:
        """Every line since the workers' last failure, torchrun's own included: what a
        torchrun that failed by itself (a bad argument, no rendezvous) said."""
        return tuple(x for x in self._lines if x.strip())


def trained_between(prev: Crash, crash: Crash) -> bool:
    """Whether the workers trained between two failures: with steps, a step beyond the
    previous failure's; without, :data:`TRAINED_S` of running before this one."""
    if crash.step is not None:
        return prev.step is None or crash.step > prev.step
    return crash.ran_s >= TRAINED_S


def continues(prev: Crash, gone_before: str | None, crash: Crash, gone_now: str | None) -> bool:
    """Whether ``crash`` continues ``prev``'s streak: no membership change between them
    (the rendezvous' gone version the same, and known) and no training between them."""
    if gone_now is None or gone_now != gone_before:
        return False
    return not trained_between(prev, crash)


def loop_crash(streak: Sequence[Crash]) -> Crash:
    """The crash a streak of failures in a row stands for: the newest of those with the
    reason most of them had (:func:`~spottrain.protocol.crashes.same_crash`: the same key,
    or the same known step), counted as the whole streak."""
    last = streak[-1]
    votes = [sum(same_crash(c.key, c.step, o.key, o.step) for o in streak) for c in streak]
    best = max(range(len(streak)), key=lambda i: (votes[i], i))
    return replace(streak[best], count=len(streak), loop=last.loop)


class CrashWatch:
    """The failures of one node's workers under one torchrun, in a row. Pure: the caller
    reads the clock, the workers' step and the rendezvous' gone version.

    Args:
        node: the node's name (blanked out of the failing line's key).
        started: when torchrun started (monotonic seconds).
        redact: applied to each line of output a crash keeps (the secrets the VM knows
            never reach Redis).
    """

    def __init__(
        self, node: str, started: float, redact: Callable[[str], str] = lambda line: line
    ) -> None:
        self.node = node
        self.redact = redact
        self.streak: list[Crash] = []  # the failures in a row, oldest first
        self.attempt_at = started
        self._gone: str | None = None
        self._trained = False

    @property
    def last(self) -> Crash | None:
        """The crash the streak so far stands for (:func:`loop_crash`), None before any."""
        return loop_crash(self.streak) if self.streak else None

    def failed(
        self, failure: WorkerFailure, now: float, step: int | None, gone: str | None
    ) -> Crash:
        """The crash ``failure`` makes, counted against the streak before it; once the
        streak is a loop, the crash the loop stands for (:func:`loop_crash`)."""
        lines = tuple(self.redact(x) for x in failure.lines)
        line = failing_line(lines)
        crash = Crash(
            code=failure.code,
            line=line,
            key=crash_key(failure.code, line, self.node),
            tail=lines[-TAIL_LINES:],
            rank=failure.rank,
            step=step,
            ran_s=max(0.0, now - self.attempt_at),
        )
        if not (self.streak and continues(self.streak[-1], self._gone, crash, gone)):
            self.streak = []
        crash = replace(crash, count=len(self.streak) + 1)
        crash = replace(crash, loop=crash.count >= CRASH_LOOP_FAILURES)
        self.streak.append(crash)
        self._gone, self.attempt_at, self._trained = gone, now, False
        return loop_crash(self.streak) if crash.loop else crash

    def gave_up(self, code: int, output: OutputLines) -> Crash:
        """The crash of a torchrun that exited with ``code`` by itself: its workers' last
        failure, or (none seen) what torchrun said last."""
        last = self.last
        if last is not None:
            return replace(last, loop=True)
        said = tuple(self.redact(x) for x in output.last())
        line = failing_line(said)
        return Crash(
            code=code,
            line=line,
            key=crash_key(code, line, self.node),
            tail=said[-TAIL_LINES:],
            loop=True,
        )

    def trains(self, now: float, joined: bool) -> bool:
        """True once per stretch without a failure, when the workers have run
        :data:`TRAINED_S` in it with the node in the rendezvous."""
        if self._trained or not joined or now - self.attempt_at < TRAINED_S:
            return False
        self._trained = True
        return True


class OutputRelay:
    """Copies the file torchrun writes its and its workers' output to into ``sink`` (the
    agent's own output), and passes each line to ``on_line``.

    Whole lines are copied (a line the writer left unfinished is copied once nothing more
    came for a look), so the agent's own log lines do not land inside a worker's. The file is cut
    back to nothing once read past ``max_bytes``
    (:class:`~spottrain.agent.logship.tail.FileTail`: its writers append).

    Args:
        path: the file (torchrun's stdout and stderr, opened for appending).
        sink: writes the output on (the agent's own).
        on_line: called with each line (without its end), in the relay's thread.
        interval: seconds between looks at the file.
    """

    def __init__(
        self,
        path: str,
        sink: Callable[[bytes], None],
        on_line: Callable[[str], None],
        *,
        max_bytes: int = OUTPUT_MAX_BYTES,
        interval: float = 0.1,
    ) -> None:
        self.tail = FileTail(path, max_bytes)
        self.sink = sink
        self.on_line = on_line
        self.interval = interval
        self._pending = b""
        self._idle = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spottrain-output", daemon=True)

    def start(self) -> OutputRelay:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Copy what is left (torchrun has exited), then stop."""
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            moved = self.pump()
            if stopping and not moved:
                self._flush_pending()
                self.tail.close()
                return
            if not moved:
                self._stop.wait(self.interval)

    def pump(self) -> bool:
        """Copy and pass on what was written since the last call; whether anything was."""
        data = self.tail.read()
        if not data:
            if self._idle:  # unfinished since the last look: the writer paused mid-line
                self._flush_pending()
            self._idle = True
            return False
        self._idle = False
        data = self._pending + data
        cut = data.rfind(b"\n") + 1
        self._pending = data[cut:]
        self._emit(data[:cut])
        return True

    def _flush_pending(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, b""
            self._emit(pending)

    def _emit(self, chunk: bytes) -> None:
        if not chunk:
            return
        with contextlib.suppress(OSError, ValueError):
            self.sink(chunk)
        text = chunk.decode(errors="replace")
        for line in re.split(r"\r\n|\r|\n", text.rstrip("\r\n")):
            self.on_line(line)

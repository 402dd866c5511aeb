"""A long wait said while it lasts (archiving and uploading the code at ``up``): on a
terminal one line redrawn in place, anywhere else a plain line every few seconds, so a log
shows the wait without filling with it. Written to standard error: standard output stays
what scripts read."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, TextIO

# A plain wait says where it is this often (the first line after as long: a short wait
# prints nothing at all).
EVERY_S = 5.0


def size(n: float) -> str:
    """Bytes for a person: 512 B, 3.4 MB, 1.20 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GB" else f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


class Waiting:
    """Says ``what`` is going on, with ``figures()`` (e.g. the bytes written so far), until
    the block ends; then the line given to :meth:`done` (on a terminal always; elsewhere
    only after a wait long enough to have been said).

    Args:
        what: the wait, e.g. "archiving /src".
        figures: where it stands now ("" when it cannot say); called from another thread.
        stream: where to say it (standard error).
        every_s: a plain line this often.
        tty: force the terminal's way (True) or the plain one (False); default: ask
            ``stream``.
    """

    def __init__(
        self,
        what: str,
        figures: Callable[[], str] = lambda: "",
        *,
        stream: TextIO | None = None,
        every_s: float = EVERY_S,
        tty: bool | None = None,
    ) -> None:
        self.what, self.figures, self.every_s = what, figures, every_s
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.started = time.monotonic()
        self.said = 0
        self._end = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spottrain-waiting", daemon=True)
        self._status: Any = None

    def line(self) -> str:
        try:
            now = self.figures()
        except OSError:
            now = ""  # a file the figures read went away: the wait goes on regardless
        elapsed = time.monotonic() - self.started
        return f"{self.what}: {now + ', ' if now else ''}{elapsed:.0f} s"

    def done(self, line: str) -> None:
        self._end = line

    def _run(self) -> None:
        while not self._stop.wait(0.2 if self.tty else self.every_s):
            if self._status is not None:
                self._status.update(self.line())
            else:
                print(self.line(), file=self.stream, flush=True)
                self.said += 1

    def __enter__(self) -> Waiting:
        if self.tty:
            from rich.console import Console

            self._status = Console(file=self.stream).status(self.what)
            self._status.start()
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        if self._status is not None:
            self._status.stop()
        if kind is None and self._end and (self.tty or self.said):
            print(self._end, file=self.stream, flush=True)

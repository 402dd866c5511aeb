"""The live view on a terminal: one frame redrawn in place (rich's ``Live``), sized to the
terminal at each redraw. Only for a terminal: a pipe, a file or ``--detach``'s log gets the
plain lines instead (:func:`LiveView.for_stdout` says which)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any

import redis
from rich.console import Console
from rich.live import Live

from spottrain.controller.reconcile.state import RunState
from spottrain.controller.reconcile.summary import Summary
from spottrain.controller.run.records import RunInfo
from spottrain.safetext import escape_lines

from .collect import Collector
from .model import ViewData
from .render import render

log = logging.getLogger("spottrain.controller")


def is_terminal(stream: object) -> bool:
    """``stream`` is a terminal that can redraw in place (not a dumb one)."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and os.environ.get("TERM", "") not in ("dumb", "unknown")


class LiveView:
    """One run's frames, redrawn in place; lines said meanwhile print above the frame.

    Started by the first :meth:`show`; :meth:`stop` leaves the last frame on the screen."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console()
        self._live: Live | None = None

    @classmethod
    def for_stdout(cls) -> LiveView | None:
        """A view on standard output when it is a terminal, else None (the plain lines)."""
        return cls() if is_terminal(sys.stdout) else None

    def show(self, data: ViewData) -> None:
        width, height = self.console.size
        frame = render(data, width, height)
        if self._live is None:
            # Anything printed meanwhile (a warning, a say()) goes above the frame instead of
            # through it; the frame is cut at the terminal's height, never scrolled.
            self._live = Live(
                frame,
                console=self.console,
                auto_refresh=False,
                redirect_stdout=True,
                redirect_stderr=True,
                vertical_overflow="crop",
            )
            self._live.start()
        self._live.update(frame, refresh=True)

    def passes(
        self, info: RunInfo, state: RunState, target: int, plain: Callable[[Summary], Any]
    ) -> Callable[[Summary], None]:
        """What shows each controller pass's summary here. A view that fails falls back to
        ``plain`` (the plain lines): it must never stop the controller of a week-long run."""
        collector = Collector(info, state, target)
        broken: list[str] = []

        def show(s: Summary) -> None:
            if broken:
                plain(s)
                return
            try:
                self.show(collector.frame(s))
            except redis.RedisError:
                pass  # the pass tells (and rides out) a Redis that went away
            except Exception as e:
                log.exception("the live view failed; plain lines from here")
                self.stop()
                broken.append(str(e))
                plain(s)

        return show

    def say(self, line: str) -> None:
        """A line above the frame (or plain, before the first frame or after the last),
        control characters escaped: its parts may come from a node."""
        self.console.print(escape_lines(line), markup=False, highlight=False, soft_wrap=True)

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def __enter__(self) -> LiveView:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

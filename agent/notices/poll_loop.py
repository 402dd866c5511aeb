"""Runs one metadata-service watcher in a daemon thread and relays what it finds.

:class:`PollLoop` only relays: every notice of every poll goes to a callback (the notice
handler dedups by the notice's id) and every error to another, each reported once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from .metadata_http import DEFAULT_TIMEOUT_S, RETRY, WatcherError
from .notice import Notice

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 2.0
MAX_INTERVAL_S = 5.0


class Watcher(Protocol):
    """What :class:`PollLoop` needs: one check per call, and the partial errors it left."""

    last_errors: list[str]

    def poll(self) -> list[Notice]: ...


class PollLoop:
    """Polls one watcher every ``interval`` seconds in a daemon thread.

    The loop only relays: every notice of every poll goes to ``on_notice`` (the handler
    dedups), and errors go to ``on_error`` as one-line messages, each reported once until it
    goes away or changes. No exception ends the loop; only :meth:`stop` does.

    Args:
        watcher: The watcher to poll.
        on_notice: Called in the loop's thread with each notice.
        on_error: Called in the loop's thread with each new error message.
        interval: Seconds from the start of one poll to the start of the next, > 0 and at
            most 5 (a two-minute warning leaves no room for slower polling).
        name: The thread's name.

    Raises:
        ValueError: On a bad interval.
    """

    def __init__(
        self,
        watcher: Watcher,
        on_notice: Callable[[Notice], None],
        on_error: Callable[[str], None],
        *,
        interval: float = DEFAULT_INTERVAL_S,
        name: str = "spottrain-watcher",
    ) -> None:
        if not 0 < interval <= MAX_INTERVAL_S:
            raise ValueError(
                f"poll interval must be > 0 and <= {MAX_INTERVAL_S:g} seconds, got {interval!r}"
            )
        self.watcher = watcher
        self.interval = interval
        self._on_notice = on_notice
        self._on_error = on_error
        self._stop = threading.Event()
        self._reported: set[str] = set()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> PollLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> bool:
        """Asks the loop to stop and waits for it.

        Args:
            timeout: Seconds to wait for an in-flight poll to end (default: the watcher's
                request timeout plus one second). The thread is a daemon, so one stuck past
                this does not keep the process alive.

        Returns:
            Whether the thread has ended.
        """
        self._stop.set()
        if not self._thread.is_alive():
            return True
        if timeout is None:
            timeout = float(getattr(self.watcher, "timeout", DEFAULT_TIMEOUT_S)) + 1.0
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> PollLoop:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def poll_once(self) -> None:
        """Runs one poll and relays its results, as the loop does on each tick."""
        messages: list[str] = []
        notices: list[Notice] = []
        try:
            notices = self.watcher.poll()
            messages = list(self.watcher.last_errors)
        except WatcherError as exc:
            messages = [str(exc)]
        except Exception as exc:
            messages = [f"watcher poll crashed: {type(exc).__name__}: {exc}; {RETRY}"]
        for notice in notices:
            try:
                self._on_notice(notice)
            except Exception as exc:
                messages.append(
                    f"notice callback failed on {notice.source}: {type(exc).__name__}: {exc}; "
                    "the notice is delivered again on the next poll"
                )
        current = set(messages)
        for message in dict.fromkeys(messages):
            if message not in self._reported:
                try:
                    self._on_error(message)
                except Exception:
                    log.exception("error callback failed on %r", message)
        self._reported = current

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            self.poll_once()
            next_at += self.interval
            now = time.monotonic()
            if next_at < now:
                # A slow poll (a timeout) must not be followed by a burst of catch-up polls.
                next_at = now
            self._stop.wait(next_at - now)

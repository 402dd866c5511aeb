"""The SIGTERM monitor: the agent was asked to stop (ACPI shutdown, systemd stop, Ctrl-C).

A Python signal handler runs on the main thread between two bytecodes, possibly while that
thread holds a lock of the Redis client: it only queues the signal (SimpleQueue's put is
safe there), and a thread of its own turns it into a notice. A signal carries no id of its
own: every SIGTERM or SIGINT is the one "stop" event (the first one starts the drain).
"""

from __future__ import annotations

import queue
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

from .notice import Notice, NoticeKind

SOURCE = "signal"


class SignalMonitor:
    """Turns SIGTERM and SIGINT into SIGTERM notices due ``grace`` seconds later.

    Args:
        on_notice: Called in the monitor's thread with each notice.
        grace: Seconds from the signal to the notice's deadline.
        on_signal: Called in the monitor's thread before each notice is handed on.

    Attributes:
        signalled: Set once a signal came.
    """

    def __init__(
        self,
        on_notice: Callable[[Notice], None],
        grace: float,
        on_signal: Callable[[], None] | None = None,
    ) -> None:
        self.on_notice = on_notice
        self.grace = grace
        self.on_signal = on_signal
        self.signalled = threading.Event()
        self._signals: queue.SimpleQueue[int] = queue.SimpleQueue()

    def install(self) -> SignalMonitor:
        """Starts the pump thread and installs the handlers (call on the main thread)."""
        threading.Thread(target=self._pump, name="spottrain-signals", daemon=True).start()
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals.put(signum)

    def _pump(self) -> None:
        while True:
            signum = self._signals.get()
            self.signalled.set()
            if self.on_signal is not None:
                self.on_signal()
            self.on_notice(
                Notice(
                    source=SOURCE,
                    kind=NoticeKind.SIGTERM,
                    deadline=time.time() + self.grace,
                    detail={"signal": signal.Signals(signum).name},
                )
            )

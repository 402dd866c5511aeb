"""SIGTERM handling for a worker, and the clean exit after an emergency checkpoint."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

from spottrain.tracking import Tracker

log = logging.getLogger("spottrain.sdk")

# How long an exiting worker gives wandb to write its last records (the checkpoint that
# matters is committed by then; the VM may have seconds left).
EXIT_TRACKING_S = 3.0


def exit_clean(why: str, tracker: Tracker | None = None, code: int = 0) -> None:
    log.warning("%s", why)
    if tracker is not None:
        tracker.finish(exit_code=code, timeout=EXIT_TRACKING_S)
    logging.shutdown()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    # The checkpoint is committed; skipping interpreter teardown avoids hanging in a
    # process-group shutdown whose peers are already gone.
    os._exit(code)


class SignalWatch:
    """SIGTERM handling that works even when the main thread is stuck in a collective.

    The Python handler only sets a flag (the main thread acts on it at the next step). The
    signal also wakes a thread through ``signal.set_wakeup_fd``, which runs even while the
    main thread is blocked in C++: if the loop is holding it exits at once, and if the loop
    is stuck (a peer died mid-collective) it exits after the grace, so torchrun's restart is
    not held up.

    Args:
        on_sigterm: Raises the worker's SIGTERM flag (a plain assignment: it runs in the
            signal handler, where no lock may be taken).
        holding: Set while the worker holds after an emergency checkpoint.
        stuck: Whether the training loop looks stuck (then the worker exits 143).
        idle_s: Seconds since the loop last made progress (for the log).
        tracker: Finished on a clean exit.
    """

    def __init__(
        self,
        on_sigterm: Callable[[], None],
        holding: threading.Event,
        stuck: Callable[[], bool],
        idle_s: Callable[[], float],
        tracker: Tracker | None = None,
    ) -> None:
        self._on_sigterm = on_sigterm
        self._holding = holding
        self._stuck = stuck
        self._idle_s = idle_s
        self._tracker = tracker
        self._r, self._w = socket.socketpair()
        self._r.setblocking(True)
        self._w.setblocking(False)
        self._stopped = False
        self._prev_handler = signal.signal(signal.SIGTERM, self._on_signal)
        self._prev_fd = signal.set_wakeup_fd(self._w.fileno(), warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._run, name="spottrain-sigterm", daemon=True)
        self._thread.start()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._on_sigterm()

    def _run(self) -> None:
        while not self._stopped:
            try:
                data = self._r.recv(64)
            except OSError:
                return
            if not data or self._stopped:
                return
            if signal.SIGTERM not in data:
                continue
            self._on_sigterm()
            while not self._stopped:
                if self._holding.is_set():
                    exit_clean(
                        "SIGTERM while holding after the emergency checkpoint", self._tracker
                    )
                if self._stuck():
                    log.error(
                        "SIGTERM and the training loop has not moved for %.1f s (a peer is "
                        "gone mid-collective): exiting without a checkpoint",
                        self._idle_s(),
                    )
                    logging.shutdown()
                    os._exit(143)
                time.sleep(0.1)

    def stop(self) -> None:
        self._stopped = True
        with contextlib.suppress(ValueError, TypeError):  # off the main thread: leave them
            signal.set_wakeup_fd(self._prev_fd)
            signal.signal(signal.SIGTERM, self._prev_handler)
        with contextlib.suppress(OSError):
            self._w.send(b"\0")
        self._r.close()
        self._w.close()

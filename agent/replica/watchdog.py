"""The watchdog: aborts the cross-replica process group when a peer of the collective in
flight stops heartbeating, so a frozen peer (a VM gone without closing its sockets) costs
about the heartbeat timeout, not the collective timeout (which stays long: a real multi-GB
all-reduce must not hit it).

A survivor blocked in an all-reduce asks no quorum, so the next quorum cannot tell it that
the peer is gone; the lighthouse's heartbeat table can. The watchdog reads it from the
lighthouse's status page (torchft 0.2.0 serves no machine-readable form; the page's
format is pinned with the version) only while a collective is in flight.
"""

from __future__ import annotations

import logging
import re
import threading
import urllib.request
from typing import Any

from .quorum import QuorumView

log = logging.getLogger("spottrain.replica")

_BEAT_RE = re.compile(r"([^\s<>]+): seen ([0-9.]+)(ns|µs|us|ms|s) ago")
_UNIT_S = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def heartbeat_ages(page: str) -> dict[str, float]:
    """Replica (``<id>:<uuid>``) -> seconds since the lighthouse last heard from it."""
    return {m.group(1): float(m.group(2)) * _UNIT_S[m.group(3)] for m in _BEAT_RE.finditer(page)}


def lost_peers(
    members: tuple[str, ...], me: str, ages: dict[str, float], timeout_s: float
) -> list[str]:
    """The members of the quorum (other than ``me``) whose heartbeats are older than
    ``timeout_s`` or missing."""
    return [m for m in members if m != me and ages.get(m, float("inf")) > timeout_s]


class Watchdog:
    """Polls the lighthouse while a collective is in flight (:meth:`enter`/:meth:`leave`)
    and aborts ``group`` once a member of the collective's quorum is lost."""

    def __init__(
        self,
        lighthouse_url: str,
        group: Any,
        recorder: Any,
        *,
        peer_timeout_s: float = 1.0,
        poll_s: float = 0.1,
    ) -> None:
        self.url = lighthouse_url.rstrip("/") + "/status"
        self.group, self.recorder = group, recorder
        self.peer_timeout_s, self.poll_s = peer_timeout_s, poll_s
        self.aborts = 0
        self.me: str | None = None
        self._view: QuorumView | None = None
        self._inflight = threading.Event()
        self._wake: threading.Event | None = None
        self._lost: threading.Event | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spottrain-watchdog", daemon=True)
        self._thread.start()

    def watch(self, view: QuorumView | None) -> None:
        self._view = view
        if view is not None and self.me is None:
            own = self.recorder._manager._store.get("replica_id").decode()
            self.me = own

    def enter(self, wake: threading.Event) -> None:
        """A collective starts; ``wake`` is set when it completes or a peer is lost."""
        self._wake, self._lost = wake, None
        self._inflight.set()

    def leave(self) -> None:
        self._inflight.clear()
        self._wake = None

    def lost_during(self, wake: threading.Event) -> bool:
        """Whether the watchdog (not the collective's completion) set ``wake``."""
        return self._lost is wake

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._inflight.wait(0.5):
                continue
            view = self._view
            if view is None or len(view.replica_ids) < 2:
                self._stop.wait(self.poll_s)
                continue
            try:
                with urllib.request.urlopen(self.url, timeout=2.0) as resp:
                    page = resp.read().decode("utf-8", "replace")
            except OSError:
                self._stop.wait(self.poll_s)  # the lighthouse is away: nothing to learn
                continue
            lost = lost_peers(
                view.replica_ids, self.me or "", heartbeat_ages(page), self.peer_timeout_s
            )
            if lost and self._inflight.is_set():
                log.warning(
                    "peer(s) %s stopped heartbeating during a collective: aborting the "
                    "cross-replica group (the step is discarded)",
                    ", ".join(lost),
                )
                self.aborts += 1
                wake = self._wake
                if wake is not None:
                    self._lost = wake
                    wake.set()
                self.group.abort_now()
                # The next quorum must rebuild the group even if it repeats the id.
                self.recorder.configured_digest = None
                self._inflight.clear()
            self._stop.wait(self.poll_s)

    def stop(self) -> None:
        self._stop.set()
        self._inflight.set()
        self._thread.join(timeout=5)

"""The watchdog: aborts the cross-replica process group when a peer of the collective in
flight stops heartbeating, so a frozen peer (a VM gone without closing its sockets) costs
about the heartbeat timeout, not the collective timeout (which stays long: a real multi-GB
all-reduce must not hit it).

A survivor blocked in an all-reduce asks no quorum, so the next quorum cannot tell it that
the peer is gone; the heartbeat table can. The watchdog reads it only while a collective is
in flight: with the Redis quorum from Redis (:func:`redis_ages`, the ages by Redis' clock;
a member that left or was dropped has none), with torchft's lighthouse from its status page
(:func:`lighthouse_ages`; 0.2.0 serves no machine-readable form, the page's format is
pinned with the version).
"""

from __future__ import annotations

import logging
import re
import threading
import urllib.request
from collections.abc import Callable
from typing import Any

from .quorum import QuorumView

log = logging.getLogger("spottrain.replica")

_BEAT_RE = re.compile(r"([^\s<>]+): seen ([0-9.]+)(ns|µs|us|ms|s) ago")
_UNIT_S = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def heartbeat_ages(page: str) -> dict[str, float]:
    """Replica (``<id>:<uuid>``) -> seconds since the lighthouse last heard from it."""
    return {m.group(1): float(m.group(2)) * _UNIT_S[m.group(3)] for m in _BEAT_RE.finditer(page)}


# Seconds since each of the given members last heartbeated (a member missing: no heartbeat);
# raises OSError (or a Redis error) when the source cannot be read.
Ages = Callable[[tuple[str, ...]], dict[str, float]]


def lighthouse_ages(lighthouse_url: str) -> Ages:
    url = lighthouse_url.rstrip("/") + "/status"

    def read(members: tuple[str, ...]) -> dict[str, float]:
        with urllib.request.urlopen(url, timeout=2.0) as resp:
            return heartbeat_ages(resp.read().decode("utf-8", "replace"))

    return read


def redis_ages(client: Any) -> Ages:
    """``client``: a :class:`spottrain.quorum.client.QuorumClient` of the run."""

    def read(members: tuple[str, ...]) -> dict[str, float]:
        ages = client.heartbeat_ages(list(members))
        return {m: a for m, a in ages.items() if a is not None}

    return read


def lost_peers(
    members: tuple[str, ...], me: str, ages: dict[str, float], timeout_s: float
) -> list[str]:
    """The members of the quorum (other than ``me``) whose heartbeats are older than
    ``timeout_s`` or missing."""
    return [m for m in members if m != me and ages.get(m, float("inf")) > timeout_s]


class Watchdog:
    """Polls the heartbeat ages while a collective is in flight (:meth:`enter`/:meth:`leave`)
    and aborts ``group`` once a member of the collective's quorum is lost. ``ages``: a
    lighthouse URL (its status page) or an :data:`Ages` reader."""

    def __init__(
        self,
        ages: str | Ages,
        group: Any,
        recorder: Any,
        *,
        peer_timeout_s: float = 1.0,
        poll_s: float = 0.1,
    ) -> None:
        self.ages = lighthouse_ages(ages) if isinstance(ages, str) else ages
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
                ages = self.ages(view.replica_ids)
            except Exception:
                self._stop.wait(self.poll_s)  # the lighthouse or Redis is away: nothing to learn
                continue
            lost = lost_peers(view.replica_ids, self.me or "", ages, self.peer_timeout_s)
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

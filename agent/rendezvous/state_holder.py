"""The ``redis`` rendezvous's state holder: torch's, with liveness from Redis heartbeats.

torch keeps the round in a pickled state blob with a timestamp per member; liveness lives in
the Redis heartbeat set instead (see :mod:`.backend`). After every sync this holder removes
members that are gone or whose heartbeat went stale, writes the removal back from one node
only, lets a round complete once every live node joined, and backs off after a lost
compare-and-set.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from datetime import UTC, datetime, timedelta

from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    _BackendRendezvousStateHolder,
    _NodeDesc,
    _remove_participant_epilogue,
)

from .backend import RedisRendezvousBackend
from .membership import GONE_DEAD

# Backoff after a lost compare-and-set: up to 2 ms after the first, doubling up to 100 ms
# (measured: a 1 s cap halved conflicts at 256 nodes but slowed forming and re-forming).
_BACKOFF_BASE_S = 0.001
_BACKOFF_CAP_S = 0.1

log = logging.getLogger(__name__)


def member_name(node: _NodeDesc) -> str:
    """The string a member is known by in Redis (torch's ``addr_pid_localid``)."""
    return repr(node)


class OwnMemberGoneError(RendezvousError):
    """This node's own member was declared dead (or left) while it was joining a round."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"this node's rendezvous member is gone ({reason})")
        self.reason = reason


class RedisStateHolder(_BackendRendezvousStateHolder):
    """torch's state holder, with liveness read from the Redis heartbeat set.

    After every sync it removes members that are gone or whose heartbeat is older than
    ``dead_after_s`` (by the Redis clock), and lets a round complete as soon as every live node
    has joined instead of sitting out the whole last call.
    """

    def __init__(
        self,
        backend: RedisRendezvousBackend,
        settings: RendezvousSettings,
        dead_after_s: float,
        cache_duration: int = 1,
    ) -> None:
        super().__init__(backend, settings, cache_duration)
        self._redis = backend
        self._dead_after_s = dead_after_s
        self._conflicts = 0
        self._rng = random.Random()
        self.own_node: _NodeDesc | None = None
        self.own_gone_reason: str | None = None
        # Set while the handler runs torch's join or exit: finding our own member gone then
        # must abort the operation (torch would re-add the dead identity at once, forever).
        self.joining = False
        self.live_count: int | None = None

    def sync(self) -> bool | None:
        has_set = super().sync()
        if has_set is False:
            # Our compare-and-set lost to another node's. When many nodes change the round at
            # once (a fleet forming, a mass re-form), retrying at once makes every attempt
            # collide again; jittered exponential backoff lets them through one by one.
            self._conflicts += 1
            cap = min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * 2 ** min(self._conflicts, 10))
            time.sleep(self._rng.uniform(0, cap))
        elif has_set:
            self._conflicts = 0
        return has_set

    def _sanitize(self) -> None:
        state = self._state
        now = datetime.now(UTC)
        # torch's join op writes a keep-alive into the state blob whenever our entry there is
        # older than the interval. Liveness lives in the heartbeat set instead, so keep our
        # own entry fresh locally and spare the blob those writes.
        if self.own_node is not None and self.own_node in state.last_heartbeats:
            state.last_heartbeats[self.own_node] = now
        try:
            live = self._redis.read_liveness(self._dead_after_s)
        except RendezvousConnectionError:
            self._dead_nodes = []
            return
        # A node that could not reach Redis itself cannot tell a dead peer from a peer that
        # was cut off too: after an outage, wait one full timeout before judging anyone.
        judge = self._redis.seconds_since_failure() >= self._dead_after_s
        members = (
            set(state.participants)
            | state.wait_list
            | state.redundancy_list
            | set(state.last_heartbeats)
        )
        dead = [
            node
            for node in members
            if member_name(node) in live.gone or (judge and member_name(node) in live.stale)
        ]
        own_reason: str | None = None
        if self.own_node is not None:
            own = member_name(self.own_node)
            own_reason = live.gone.get(own) or (GONE_DEAD if judge and own in live.stale else None)
        newly_dead = [member_name(n) for n in dead if member_name(n) not in live.gone]
        if newly_dead:
            # If this write fails the next sync records it; removing them locally is what
            # matters now.
            with contextlib.suppress(RendezvousConnectionError):
                self._redis.mark_gone(newly_dead, GONE_DEAD)
            log.warning("rendezvous %s: no heartbeat from %s", self._settings.run_id, newly_dead)
        removed_participant = False
        for node in dead:
            state.last_heartbeats.pop(node, None)
            if state.participants.pop(node, None) is not None:
                removed_participant = True
            state.wait_list.discard(node)
            state.redundancy_list.discard(node)
        if removed_participant:
            _remove_participant_epilogue(state, self._settings)
        if dead:
            # Every node drops gone members from its own copy at once; one of them writes the
            # removal back (the first remaining participant, by rank), so a loss in a large
            # fleet is one compare-and-set, not one per node racing for it.
            ranked = sorted((rank, node) for node, rank in state.participants.items())
            if not ranked or ranked[0][1] == self.own_node:
                self.mark_dirty()
        self._dead_nodes = dead
        self.live_count = live.live_count
        if (
            state.round > 0
            and not state.complete
            and state.deadline is not None
            and len(state.participants) >= max(self._settings.min_nodes, live.live_count)
        ):
            # Every live node has joined: move the last call's deadline to now (locally; the
            # participant that sees it marks the round complete and writes that). Not in the
            # first round: at launch, nodes come up over several seconds and some have not
            # beaten yet, while after a loss the survivors are all up already.
            state.deadline = min(state.deadline, now - timedelta(microseconds=1))
        if own_reason is not None:
            # Raised last, once the local state no longer holds the gone identity: the
            # handler starts the join over under a new one.
            self.own_gone_reason = own_reason
            if self.joining:
                raise OwnMemberGoneError(own_reason)

"""The shim's quorum backend with relays (see :mod:`.relay`): each shim serves the relay
(:mod:`.wire`: framed requests over one plain TCP connection per member VM) for its group,
and its requests go through the group's relay (its own batches when it holds the lease),
falling back to Redis directly on any failure.

- A request goes to the relay with a deadline of the join timeout plus the heartbeat
  timeout. On a failure of the relay (refused, reset, deadline, a bad frame or hello) it is
  asked directly (``QuorumClient.request``, idempotent: Redis re-marks it direct, so the
  relay's line no longer counts it) and that relay is avoided until the lease names
  another, or until a whole lease TTL later it still holds it (then it renewed the lease:
  it is alive).
- A Redis refusal the relay passes on (``QuorumRedisRefused``: Redis refused the batch's
  writes, or too few Redis replicas acknowledged them, until the hop's deadline) is not the
  relay's failure: the relay is kept and asked again until the request's deadline, then the
  refusal is raised, as a direct request would raise it. Asking directly would meet the same
  Redis, at one script call per replica instead of one per batch, just when Redis is
  struggling (a relay's own connection to a demoted primary reconnects by itself). A round
  that did not form by the hop's deadline (``QuorumNotFormed``: too few replicas asked) is
  not the relay's failure either: the same.
- A hop shorter than :func:`shortest_hop_s` is not asked for: the relay's batch would give up
  at once (no room left to block for the answer). With that little time left the request
  asks directly, or raises what the relay last passed on.
- Joins, heartbeats, leaves, rosters and ages stay direct (one variadic heartbeat per VM).
- A refusal (QuorumGone) from the relay is final, as it is directly.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from spottrain.quorum import confirm
from spottrain.quorum.errors import (
    QuorumGone,
    QuorumNotFormed,
    QuorumRedisRefused,
    QuorumTimeout,
)
from spottrain.quorum.model import Answer, BatchItem, Member, QuorumConfig, Roster

from . import relay as r
from . import wire
from .server import QuorumApi

log = logging.getLogger("spottrain.agent.quorum_shim.relay")

# The pause before asking the relay again after it passed a refusal on early.
_PAUSE_S = 0.05


def shortest_hop_s(wait_replicas: int) -> float:
    """The shortest relay hop worth asking for: the wire's margin (the relay's deadline ends
    first), a batch's wait for its group (:data:`.relay.MAX_WAIT_S`) and the shortest timeout
    in which the relay's batch still blocks once for its answer
    (:func:`~spottrain.quorum.confirm.shortest_timeout_s`: with ``wait_replicas``, a WAIT's
    share besides). With less, the relay gives up at once."""
    return wire.ASK_MARGIN_S + r.MAX_WAIT_S + confirm.shortest_timeout_s(wait_replicas)


class DirectApi(QuorumApi, r.BatchApi, Protocol):
    """CORE's ``QuorumClient``: the shim's backend plus ``request_batch``."""


class RelayedQuorum:
    """A :class:`.server.QuorumApi` whose requests travel through the group's relay.

    Args:
        direct: The blocking client (requests, batches, joins).
        lease: The group's lease, valued with this shim's relay address.
        config: The run's quorum settings (the hop deadline and the lease TTL derive from it).
        bind: host:port the relay listens on (other VMs reach it at ``lease.me``).
        wait_replicas: The run's ``wait_replicas`` (a relay's batch keeps a WAIT's share of
            its hop: :func:`shortest_hop_s`).
        on_lease: Called with True when this shim takes the group's lease and with False when
            it loses it (the agent's ``quorum-relay`` event); never under a lock.
    """

    def __init__(
        self,
        direct: DirectApi,
        lease: r.Lease,
        config: QuorumConfig,
        *,
        bind: str,
        gather_s: float = r.GATHER_S,
        wait_replicas: int = 0,
        on_lease: Callable[[bool], None] | None = None,
    ) -> None:
        self.direct, self.lease, self.config = direct, lease, config
        self.shortest_hop_s = shortest_hop_s(wait_replicas)
        self.hop_s = (config.join_timeout_ms + config.heartbeat_timeout_ms) / 1000.0
        self.ttl_s = lease.ttl_ms / 1000.0
        relay_id = f"{lease.key.rpartition(':')[2]}-{secrets.token_hex(3)}"
        window = config.heartbeat_timeout_ms / 1000.0  # a member silent this long is not waited for
        self.batcher = r.Batcher(direct, relay_id, gather_s=gather_s, window_s=window)
        self._lock = threading.Lock()
        self._holder: str | None = None
        self._avoid: tuple[str, float] | None = None  # (address, when it failed)
        self._next_read = 0.0
        self._connecting = threading.Lock()
        self._conns: dict[str, wire.RelayClient] = {}  # relay address -> our connection
        self.holding = False
        self._on_lease = on_lease
        self.relayed = 0  # requests answered through a relay (tests, logs)
        self.fallbacks = 0  # requests asked directly: a relay failed, was absent, or no hop fit
        self._stop = threading.Event()
        self._server = wire.RelayServer(bind, self.batcher.submit)
        self._thread = threading.Thread(target=self._renew_loop, name="spottrain-lease")

    @property
    def address(self) -> str:
        return self.lease.me

    def start(self) -> RelayedQuorum:
        self._server.start()
        self._thread.daemon = True
        self._thread.start()
        self.relay()  # members read the lease at start (and take it when absent)
        return self

    def stop(self) -> None:
        self._stop.set()
        self.batcher.stop()
        self._server.stop()
        if self.holding:  # the next member takes it at once, not a TTL later
            try:
                self.lease.release()
            except Exception as exc:
                log.warning("could not release the relay lease (it expires): %s", exc)
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for c in conns:
            c.close()

    # -- the lease --------------------------------------------------------------------------
    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            if not self.holding:
                continue
            try:
                held = self.lease.renew()
            except Exception as exc:
                log.warning("cannot renew the relay lease %s: %s", self.lease.key, exc)
                continue
            if not held:
                log.warning("lost the relay lease %s: members go to its new holder", self.lease.key)
                with self._lock:
                    self.holding, self._holder = False, None
                self._tell(False)

    def _tell(self, holding: bool) -> None:
        if self._on_lease is None:
            return
        try:
            self._on_lease(holding)
        except Exception as exc:  # an event that cannot be written must not stop the relay
            log.warning("cannot report the relay lease %s: %s", self.lease.key, exc)

    def relay(self) -> str | None:
        """The group's relay address to use now; None: ask directly."""
        now = time.monotonic()
        with self._lock:
            holder, avoid = self._holder, self._avoid
            if holder is not None and (avoid is None or avoid[0] != holder):
                return holder
            if now < self._next_read:
                return None
            self._next_read = now + self.ttl_s / 3
        holder = self.lease.take()
        with self._lock:
            was, self.holding = self.holding, holder == self.address
            answer: str | None = holder
            if holder is not None and avoid is not None and avoid[0] == holder:
                if now - avoid[1] < self.ttl_s:
                    answer = None  # the failed relay may be dead: its lease has not lapsed yet
                else:
                    self._avoid = None  # it renewed the lease a whole TTL on: alive
            if answer is not None or holder is None:
                self._holder = answer
        if self.holding != was:
            self._tell(self.holding)
        return answer

    # -- requests ---------------------------------------------------------------------------
    def request(
        self,
        replica_id: str,
        step: int,
        *,
        held_quorum_id: int = 0,
        commit_failures: int = 0,
        shrink_only: bool = False,
        timeout: float = 60.0,
    ) -> Answer:
        deadline = time.monotonic() + timeout
        # Refused here, not by the relay: on its connection it would fail the VM's others.
        item = r.check_item(
            BatchItem(replica_id, step, held_quorum_id, commit_failures, shrink_only)
        )
        answer = self._relayed(item, deadline)
        if answer is not None:
            return answer
        self.fallbacks += 1
        return self.direct.request(
            replica_id,
            step,
            held_quorum_id=held_quorum_id,
            commit_failures=commit_failures,
            shrink_only=shrink_only,
            timeout=max(0.05, deadline - time.monotonic()),
        )

    def _relayed(self, item: BatchItem, deadline: float) -> Answer | None:
        """``item``'s answer through the group's relay; None: ask directly (no relay, it
        failed, or too short a hop is left). Raises QuorumGone (final), and a Redis refusal
        or a round not formed that the relay passed on, once no hop is left to ask again."""
        passed: QuorumTimeout | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining < self.shortest_hop_s:
                if passed is not None:
                    raise passed
                return None  # the relay would give up at once: not its failure
            relay = self.relay()
            if relay is None:
                return None
            hop, asked = min(remaining, self.hop_s), time.monotonic()
            try:
                if relay == self.address:
                    answer = self.batcher.ask(item, hop)
                else:
                    answer = self._remote(relay, item, hop)
                self.relayed += 1
                return answer
            except QuorumGone:
                raise
            except (QuorumRedisRefused, QuorumNotFormed) as exc:
                # Redis's or the replicas', not the relay's failure: ask it again, at once
                # after a hop ridden out to its deadline, after a pause when it came back
                # early (so a relay that gives up early is not asked in a tight loop)
                passed = exc
                if time.monotonic() - asked < hop / 2:
                    left = deadline - time.monotonic() - self.shortest_hop_s
                    time.sleep(max(0.0, min(_PAUSE_S, left)))
            except Exception as exc:
                log.warning(
                    "quorum relay %s failed for %s (asking directly): %s",
                    relay,
                    item.replica_id,
                    exc,
                )
                if relay != self.address:
                    with self._lock:
                        self._avoid, self._holder = (relay, time.monotonic()), None
                        self._next_read = 0.0
                return None

    def _remote(self, address: str, item: BatchItem, timeout: float) -> Answer:
        with self._connecting:  # one connection per relay, however many replicas ask
            conn = self._conns.get(address)
            if conn is not None and conn.idle(wire.IDLE_TIMEOUT_S / 2):
                conn.close()  # before the relay closes it as idle, under a request
            if conn is None or conn.closed:
                conn = wire.RelayClient(address, timeout)  # OSError, QuorumError: fall back
                with self._lock:
                    self._conns[address] = conn
        try:
            return conn.ask(item, timeout)
        except (QuorumGone, QuorumRedisRefused, QuorumNotFormed):
            raise  # answers, passed on: the connection is fine
        except Exception:
            conn.close()  # a fresh connection next time (or another relay)
            raise

    # -- direct -----------------------------------------------------------------------------
    def join(self, member: Member, *, timeout: float = 0.0) -> None:
        self.direct.join(member, timeout=timeout)

    def heartbeat(self, replica_ids: Sequence[str]) -> list[str]:
        return self.direct.heartbeat(replica_ids)

    def leave(self, replica_id: str) -> None:
        self.direct.leave(replica_id)

    def roster(self) -> Roster:
        return self.direct.roster()

    def heartbeat_ages(self, replica_ids: Sequence[str]) -> dict[str, float | None]:
        return self.direct.heartbeat_ages(replica_ids)

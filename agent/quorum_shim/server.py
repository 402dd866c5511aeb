"""The lighthouse shim: torchft's ``LighthouseService`` (Quorum, Heartbeat) on a local port,
answered from the run's Redis through :class:`spottrain.quorum.client.QuorumClient`.

- **Quorum**: the requester joins (once per incarnation and Redis epoch), then one blocking
  ``request`` (a worker thread of the server waits on Redis, bounded by the call's gRPC
  deadline less :data:`ANSWER_MARGIN_S`; the join shares that deadline, so a Redis that
  refuses writes is waited out, not reported at once); the answer and the cached roster
  become the full participant list the Rust manager computes its ranks and healing from
  (:mod:`.roster`). The quorum id the shim last saw travels with every request, so ids
  never go back even if Redis lost its last second.
- **Heartbeat**: recorded locally; one thread sends ONE Redis heartbeat per interval for
  every local replica heard from recently (a frozen manager stops beating here, so Redis
  drops it after its timeout as it would have dropped a silent VM).
- **Leave** (:meth:`LighthouseShim.leave`, the agent's notice path): stall-free. The
  replica goes on training; its id leaves Redis the moment its manager stops heartbeating
  (the worker left at a step boundary), so the survivors' next round forms without waiting
  for a timeout. ``now=True`` leaves at once (the workers are already stopped).
- **HeartbeatAges** (``/spottrain.QuorumShim/HeartbeatAges``, ours): the local workers'
  watchdogs read their peers' heartbeat ages here, not from Redis, so a VM's ranks cost
  Redis no connections of their own; concurrent polls share one Redis read.
- **Refused** (``/spottrain.QuorumShim/Refused``, ours): whether this shim refused a
  replica id; the workers ask while a quorum call takes long, and exit to be restarted under
  a new id when it did (torchft's manager would retry the refused call for its whole quorum
  timeout).
- A replica id Redis dropped or that left is refused for good: its manager gets an error
  and must be restarted, which joins under a new id (torchft adds a fresh uuid). The shim
  also applies the quorum's rule itself: a manager heard from again after a silence longer
  than the heartbeat timeout (it was frozen) is dropped, whether or not a round in Redis
  swept it yet, so it can never slip back into a quorum under its old id.
"""

from __future__ import annotations

import functools
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import grpc
import redis

from spottrain.quorum.errors import QuorumCorrupt, QuorumError, QuorumGone, QuorumTimeout
from spottrain.quorum.model import Answer, Member, QuorumConfig, Roster

from . import proto
from .roster import RosterCache, StaleRoster

log = logging.getLogger("spottrain.agent.quorum_shim")

# A Quorum call without a deadline waits at most this long (torchft always sends one).
DEFAULT_WAIT_S = 60.0
# Kept from a Quorum call's gRPC deadline for what follows the quorum client's answer or
# error (a changed roster's read, the reply): the client ends by its own deadline, its last
# WAIT included, so the manager gets our message, not its own deadline's.
ANSWER_MARGIN_S = 0.1
# gRPC sends a deadline as a timeout rounded up to a short encoding, by up to about 1% (10 s
# arrives as 10.1 s, 100 s as 101 s): the caller's own deadline comes that much sooner.
DEADLINE_ROUNDING = 1.015


def answer_within_s(remaining_s: float | None, margin_s: float) -> float:
    """How long a Quorum call whose deadline is ``remaining_s`` away (as this server sees
    it) may wait for the quorum, leaving ``margin_s`` for the reply before the caller's own
    deadline."""
    if remaining_s is None:
        return DEFAULT_WAIT_S
    return max(0.0, remaining_s / DEADLINE_ROUNDING - margin_s)


AGES_METHOD = "/spottrain.QuorumShim/HeartbeatAges"
# Polls of the same members this close together share one Redis read.
_AGES_SHARE_S = 0.05


class _DaemonPool:
    """The server's worker threads, as daemons: a handler blocked on Redis (up to the
    manager's quorum deadline, minutes) must not hold up the agent's exit, which a
    ``ThreadPoolExecutor``'s threads would (they are joined at interpreter exit)."""

    def __init__(self, workers: int) -> None:
        self._tasks: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]]
        self._tasks = queue.SimpleQueue()
        for i in range(workers):
            threading.Thread(target=self._work, name=f"spottrain-shim-{i}", daemon=True).start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._tasks.put((future, functools.partial(fn, **kwargs), args))
        return future

    def _work(self) -> None:
        while True:
            future, fn, args = self._tasks.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)

    def shutdown(self, wait: bool = True, **_: Any) -> None:
        pass  # daemons: they end with the process


class QuorumApi(Protocol):
    """What the shim uses of CORE's ``QuorumClient``."""

    def join(self, member: Member, *, timeout: float = 0.0) -> None: ...
    def request(
        self,
        replica_id: str,
        step: int,
        *,
        held_quorum_id: int = 0,
        commit_failures: int = 0,
        shrink_only: bool = False,
        timeout: float = 60.0,
    ) -> Answer: ...
    def heartbeat(self, replica_ids: Sequence[str]) -> list[str]: ...
    def leave(self, replica_id: str) -> None: ...
    def roster(self) -> Roster: ...
    def heartbeat_ages(self, replica_ids: Sequence[str]) -> dict[str, float | None]: ...


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and message a Quorum call fails with for ``exc``."""
    if isinstance(exc, QuorumGone):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, QuorumTimeout):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)
    if isinstance(exc, QuorumCorrupt):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, StaleRoster):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        return grpc.StatusCode.UNAVAILABLE, f"the run's Redis is unreachable: {exc}"
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, (QuorumError, redis.RedisError)):
        return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"
    return grpc.StatusCode.INTERNAL, f"lighthouse shim bug: {type(exc).__name__}: {exc}"


class LighthouseShim:
    """Serves torchft's lighthouse protocol on ``bind`` from Redis.

    Args:
        blocking: The client whose requests block on Redis (it cuts each blocking command
            to end inside its connections' socket timeout).
        control: The client for heartbeats, leaves and rosters (short commands).
        config: The run's quorum settings (the heartbeat timeout paces the heartbeats).
        bind: host:port; port 0 picks a free one (:attr:`port` says which).
        heartbeat_interval_s: Seconds between two coalesced Redis heartbeats; default a
            fifth of the heartbeat timeout.
        fresh_s: A local manager heard from within this long is heartbeated; default the
            same fifth. A leaving replica silent this long leaves at once.
        answer_margin_s: Kept from a Quorum call's gRPC deadline for our reply
            (:data:`ANSWER_MARGIN_S`; tests on a loaded machine widen it).
    """

    def __init__(
        self,
        blocking: QuorumApi,
        control: QuorumApi,
        config: QuorumConfig,
        *,
        bind: str = "127.0.0.1:0",
        heartbeat_interval_s: float | None = None,
        fresh_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_workers: int = 32,
        answer_margin_s: float = ANSWER_MARGIN_S,
    ) -> None:
        self.blocking, self.control, self.config = blocking, control, config
        self.answer_margin_s = answer_margin_s
        fifth = config.heartbeat_timeout_ms / 5000.0
        self.timeout_s = config.heartbeat_timeout_ms / 1000.0
        self.interval_s = heartbeat_interval_s if heartbeat_interval_s is not None else fifth
        self.fresh_s = fresh_s if fresh_s is not None else fifth
        self.clock = clock
        self.cache = RosterCache()
        self._lock = threading.Lock()
        self._cache_lock = threading.Lock()
        self._beats: dict[str, float] = {}  # replica id -> last local heartbeat (clock)
        # replica id -> when its last quorum request went to Redis (clock): a request is a
        # heartbeat there too, so the coalesced heartbeat skips it within an interval.
        self._asked: dict[str, float] = {}
        self._joined: dict[str, tuple[Member, str]] = {}  # id -> (member, epoch joined in)
        self._epoch = ""
        self._gone: dict[str, str] = {}  # id -> why it is refused
        self._leaving: set[str] = set()
        self.held_quorum_id = 0
        self.refused: list[str] = []  # ids whose Quorum call was refused (tests, logs)
        self.heartbeats_sent = 0
        self._stop = threading.Event()
        self._server = grpc.server(_DaemonPool(max_workers))
        handler = grpc.method_handlers_generic_handler(
            "torchft.LighthouseService",
            {
                "Quorum": grpc.unary_unary_rpc_method_handler(
                    self._quorum,
                    request_deserializer=proto.LighthouseQuorumRequest.FromString,
                    response_serializer=bytes,
                ),
                "Heartbeat": grpc.unary_unary_rpc_method_handler(
                    self._heartbeat,
                    request_deserializer=proto.LighthouseHeartbeatRequest.FromString,
                    response_serializer=bytes,
                ),
            },
        )
        ours = grpc.method_handlers_generic_handler(
            "spottrain.QuorumShim",
            {
                "HeartbeatAges": grpc.unary_unary_rpc_method_handler(
                    self._ages, request_deserializer=bytes, response_serializer=bytes
                ),
                "Refused": grpc.unary_unary_rpc_method_handler(
                    self._refused, request_deserializer=bytes, response_serializer=bytes
                ),
            },
        )
        self._ages_lock = threading.Lock()
        self._ages_last: tuple[bytes, float, bytes] = (b"", 0.0, b"")
        self._server.add_generic_rpc_handlers((handler, ours))
        self.port = self._server.add_insecure_port(bind)
        if self.port == 0:
            raise OSError(f"the lighthouse shim cannot listen on {bind}: is the port taken?")
        self.host = bind.rpartition(":")[0] or "127.0.0.1"
        self._thread = threading.Thread(
            target=self._beat_loop, name="spottrain-quorum-heartbeats", daemon=True
        )

    @property
    def url(self) -> str:
        """What ``TORCHFT_LIGHTHOUSE`` is set to for the local workers."""
        return f"http://{self.host}:{self.port}"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> LighthouseShim:
        self._server.start()
        self._thread.start()
        log.info("lighthouse shim serving torchft's managers on %s from Redis", self.url)
        return self

    def stop(self, grace: float = 1.0) -> None:
        self._stop.set()
        self._server.stop(grace).wait(grace + 1)
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        stop_relay = getattr(self.blocking, "stop", None)  # a RelayedQuorum: its server, lease
        if callable(stop_relay):
            stop_relay()

    # -- Quorum -----------------------------------------------------------------------------
    def _quorum(self, request: Any, context: grpc.ServicerContext) -> bytes:
        m = request.requester
        rid = m.replica_id
        if not rid:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a quorum request needs a requester")
        why = self._seen(rid)  # a request is a heartbeat, as at the lighthouse
        if why is not None:
            self.refused.append(rid)
            context.abort(grpc.StatusCode.NOT_FOUND, self._gone_message(rid, why))
        timeout = answer_within_s(context.time_remaining(), self.answer_margin_s)
        try:
            answer = self._ask(m, timeout)
            with self._cache_lock:
                body = self.cache.response(answer, rid, self.control.roster)
        except Exception as exc:
            if isinstance(exc, QuorumGone):
                self._mark_gone(rid, "refused by the quorum")
                self.refused.append(rid)
            code, message = status_of(exc)
            log.warning("quorum for %s failed: %s", rid, message)
            context.abort(code, message)
        return body

    def _ask(self, m: Any, timeout: float) -> Answer:
        deadline = time.monotonic() + timeout  # Redis's time, not the heartbeats' clock
        member = Member(
            replica_id=m.replica_id,
            address=m.address,
            store_address=m.store_address,
            world_size=int(m.world_size),
            data=m.data,
        )
        with self._lock:
            joined = self._joined.get(m.replica_id)
            epoch = self._epoch
        if joined is None or joined != (member, epoch):
            # Under the request's deadline: a Redis refusing writes (a failover, a load) is
            # waited out here too, rather than failing the manager's call at once.
            self.blocking.join(member, timeout=timeout)
            with self._lock:
                self._joined[m.replica_id] = (member, epoch)
        with self._lock:
            self._asked[m.replica_id] = self.clock()
        answer = self.blocking.request(
            m.replica_id,
            int(m.step),
            held_quorum_id=self.held_quorum_id,
            commit_failures=int(m.commit_failures),
            shrink_only=bool(m.shrink_only),
            timeout=max(0.0, deadline - time.monotonic()),
        )
        with self._lock:
            self.held_quorum_id = max(self.held_quorum_id, answer.quorum_id)
            if answer.epoch != self._epoch:
                # Redis lost the quorum's state (or this is the first answer): members must
                # join again before their next request (their records went with it).
                if self._epoch:
                    log.warning(
                        "the quorum's state in Redis is new (epoch %s, was %s): rejoining",
                        answer.epoch,
                        self._epoch,
                    )
                self._epoch = answer.epoch
                self._joined = {k: (v[0], answer.epoch) for k, v in self._joined.items()}
        return answer

    def _gone_message(self, rid: str, why: str) -> str:
        return (
            f"replica {rid} is no longer in the run's quorum ({why}) and can never rejoin "
            "under this id: restart its training process, whose manager joins under a new id"
        )

    def _mark_gone(self, rid: str, why: str) -> None:
        with self._lock:
            self._gone.setdefault(rid, why)
            self._leaving.discard(rid)
            self._beats.pop(rid, None)
            self._asked.pop(rid, None)

    # -- Heartbeat --------------------------------------------------------------------------
    def _heartbeat(self, request: Any, context: grpc.ServicerContext) -> bytes:
        if request.replica_id:
            self._seen(request.replica_id)
        return b""  # an empty LighthouseHeartbeatResponse

    def _seen(self, rid: str) -> str | None:
        """Record a sign of life from ``rid``; why it is refused, if it is."""
        now = self.clock()
        with self._lock:
            why = self._gone.get(rid)
            if why is not None:
                return why
            last = self._beats.get(rid)
            self._beats[rid] = now
        if last is None or now - last < self.timeout_s:
            return None
        why = f"silent for {now - last:.1f} s, past the {self.timeout_s:g} s heartbeat timeout"
        log.error("%s", self._gone_message(rid, why))
        self._leave_one(rid, why)
        return why

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat_once()

    def beat_once(self) -> None:
        """One coalesced heartbeat for the local managers heard from recently; leaving
        replicas whose managers went quiet leave now."""
        now = self.clock()
        with self._lock:
            fresh = [r for r, t in self._beats.items() if now - t < self.fresh_s]
            quiet = [r for r in self._leaving if now - self._beats.get(r, 0.0) >= self.fresh_s]
            # Redis saw a request from these within the interval: no heartbeat needed (at
            # 12,500 VMs heartbeats would otherwise cost Redis N x 5 / timeout calls a second
            # on top of the per-step requests).
            asked = {r for r, t in self._asked.items() if now - t < self.interval_s}
        for rid in quiet:
            self._leave_one(rid, "left on a notice")
        fresh = [r for r in fresh if r not in quiet and r not in asked]
        if not fresh:
            return
        try:
            gone = self.control.heartbeat(fresh)
            self.heartbeats_sent += 1
        except (QuorumError, redis.RedisError) as exc:
            log.warning("quorum heartbeat to Redis failed (retrying): %s", exc)
            return
        for rid in gone:
            log.error("%s", self._gone_message(rid, "dropped by the quorum"))
            self._mark_gone(rid, "dropped by the quorum: its heartbeats stopped")

    # -- HeartbeatAges ----------------------------------------------------------------------
    def _ages(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """``request``: replica ids, one a line; the answer: JSON {id: seconds or null}."""
        with self._ages_lock:  # one Redis read at a time; a poll just behind reuses it
            key, at, answer = self._ages_last
            now = self.clock()
            if key == request and now - at < _AGES_SHARE_S:
                return answer
            ids = [i for i in request.decode().split("\n") if i]
            try:
                ages = self.control.heartbeat_ages(ids)
            except Exception as exc:
                code, message = status_of(exc)
                context.abort(code, message)
            answer = json.dumps(ages).encode()
            self._ages_last = (request, now, answer)
            return answer

    # -- Refused ----------------------------------------------------------------------------
    def refused_why(self, replica_id: str) -> str | None:
        """Why this shim refuses ``replica_id`` for good, or None."""
        with self._lock:
            return self._gone.get(replica_id)

    def _refused(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """``request``: a replica id; the answer: why it is refused, empty if it is not. The
        workers' refusal guard asks this while their quorum call hangs in torchft's retries
        (:mod:`spottrain.agent.replica.refusal`): answered locally, Redis is not read."""
        return (self.refused_why(request.decode()) or "").encode()

    # -- leave ------------------------------------------------------------------------------
    def local_ids(self) -> list[str]:
        """The replica ids this shim has heard from and that have not left."""
        with self._lock:
            return sorted(r for r in set(self._beats) | set(self._joined) if r not in self._gone)

    def leave(self, *, now: bool = False) -> list[str]:
        """A notice: every local replica leaves the quorum. ``now`` False (the workers are
        training): each leaves the moment its manager stops heartbeating, which a worker
        does at the step boundary where it leaves. ``now`` True: at once. Returns the ids."""
        ids = self.local_ids()
        if now:
            for rid in ids:
                self._leave_one(rid, "left on a notice")
        else:
            with self._lock:
                self._leaving.update(ids)
        return ids

    def _leave_one(self, rid: str, why: str) -> None:
        self._mark_gone(rid, why)
        try:
            self.control.leave(rid)
        except (QuorumError, redis.RedisError) as exc:
            log.warning(
                "could not leave the quorum for %s (dropped after its timeout): %s", rid, exc
            )

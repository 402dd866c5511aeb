"""The blocking client of the Redis quorum: the agent's lighthouse shim and the tests use it.

A request is one script call (O(1) bytes: the step and the quorum id held) and one BLPOP
for the answer line computed for this replica in Lua; the full membership is fetched with
``roster()`` only when an answer's ``roster_version`` changed.

With ``wait_replicas`` an answer is used only once that many Redis replicas hold it
(:mod:`.confirm`: a marker write and ``WAIT`` on one connection, again until the request's
deadline, the last ``WAIT`` ending by it).

A Redis that refuses the quorum's writes for a reason of its own (:func:`.errors.refusal`:
a replica after a failover, loading its data, busy with a script, full memory, a disk error,
``min-replicas-to-write``) is ridden out by a request like a lost connection, until its
deadline; then the :class:`.errors.QuorumRedisRefused` names the cause and the fix. A join
rides it out only when given a timeout; heartbeats, leaves and reads raise it at once.
"""

from __future__ import annotations

import math
import random
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NoReturn

import redis

from spottrain.protocol.keys import RunKeys
from spottrain.quorum import confirm, errors, scripts
from spottrain.quorum.errors import (
    QuorumCorrupt,
    QuorumError,
    QuorumGone,
    QuorumNotFormed,
    QuorumRedisRefused,
    QuorumTimeout,
)
from spottrain.quorum.model import Answer, BatchItem, Member, QuorumConfig, Roster

# Refusals that mean the connection reaches a demoted primary: reconnect on the next try.
_DEMOTED = ("READONLY", "UNBLOCKED")


class _RequestLost(Exception):
    """Redis no longer holds the request (it restarted): send it again."""


@dataclass(frozen=True)
class QuorumStatus:
    """The quorum at a glance (for status pages and tests)."""

    qid: int  # the current quorum id, 0 before the first quorum
    version: int  # the quorum id at the last membership change
    round: int  # the open round's number
    members: int  # replicas in the last formed quorum
    heartbeating: int  # replicas whose heartbeat is younger than the timeout
    epoch: str  # the state's generation ("" before the state exists)
    max_step: int = 0
    formed_ms: int = 0  # Redis clock at the last FORM

    @property
    def quorum_id(self) -> int:
        return self.qid


class QuorumClient:
    """The quorum of one run, through one ``redis.Redis`` (thread safe: its pool gives a
    blocked ``request`` its own connection).

    Args:
        redis: The client (its ``socket_timeout`` bounds every command: a blocking one is
            given at most :func:`.confirm.longest_block_s` of it).
        keys: The run's keys.
        config: The quorum's settings, the same for every replica of the run.
        wait_replicas: An answer is returned only once this many Redis replicas hold it
            (``WAIT``, repeated until the request's deadline and ending by it; 0: do not
            wait).
    """

    def __init__(
        self,
        redis: redis.Redis,
        keys: RunKeys,
        config: QuorumConfig,
        *,
        wait_replicas: int = 0,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._config = config
        self._wait_replicas = wait_replicas
        self._keys_list = scripts.script_keys(keys)
        self._config_args = scripts.config_args(keys, config, secrets.token_hex(4))
        self._scripts = {name: redis.register_script(src) for name, src in scripts.ALL.items()}
        self._lock = threading.Lock()
        self._members: dict[str, Member] = {}  # joined here: re-joined if Redis lost them
        self._held: dict[str, int] = {}  # the last quorum id each replica was answered
        self._roster: tuple[str, Roster] | None = None  # (epoch, roster) last read
        self._rank_of: tuple[tuple[str, int], dict[str, int]] | None = None  # a relay's
        kwargs = getattr(redis.connection_pool, "connection_kwargs", {})
        self._longest_block_s = confirm.longest_block_s(kwargs.get("socket_timeout"))

    # -- scripts ------------------------------------------------------------------------------
    def _call(self, name: str, *args: str) -> Any:
        try:
            return self._scripts[name](keys=self._keys_list, args=[*self._config_args, *args])
        except redis.ResponseError as e:
            raise self._error(e) from e

    def _error(self, e: Exception) -> Exception:
        message = str(e)
        head, _, rest = message.partition(" ")
        if head == "QGONE":
            replica_id, _, why = rest.partition(" ")
            return QuorumGone(
                f"replica {replica_id} is gone from the quorum ({why.split(' ')[0] or 'gone'}): "
                "it can never rejoin under this id; restart its manager, which joins under a "
                "new id"
            )
        refused = self._refused(e)  # the scripts pass these on (older ones as QCORRUPT)
        if refused is not None:
            return refused
        if head == "QCORRUPT":
            key, _, what = rest.partition(" ")
            return self._corrupt(key, what.split(" script: ")[0])
        if head == "WRONGTYPE":
            return self._corrupt("(one of the quorum's keys)", message)
        return e

    def _refusal(self, key: str, e: redis.ResponseError) -> QuorumError:
        """What an error reply to a plain command on ``key`` means."""
        return self._refused(e) or self._corrupt(key, str(e))

    def _refused(self, e: BaseException) -> QuorumRedisRefused | None:
        """``e`` as a Redis refusal (:func:`.errors.refusal`), or None."""
        refused = errors.refusal(e, self._where())
        if refused is not None and refused.cause in _DEMOTED:
            # A connection stays with the primary a failover demoted; a new one follows the
            # run's address (a name the failover moved) on the next try.
            self._redis.connection_pool.disconnect(inuse_connections=False)
        return refused

    def _where(self) -> str:
        kwargs = self._redis.connection_pool.connection_kwargs
        return f"{kwargs['host']}:{kwargs.get('port', 6379)}" if "host" in kwargs else ""

    def _corrupt(self, key: str, what: str) -> QuorumCorrupt:
        return QuorumCorrupt(
            f"Redis key {key} holds {what}, not what spottrain's quorum writes; stop the "
            f"run's replicas and delete the keys `{self._keys.quorum_base}:*` to reset the "
            "quorum"
        )

    # -- membership ---------------------------------------------------------------------------
    def join(self, member: Member, *, timeout: float = 0.0) -> None:
        """Record ``member`` (idempotent).

        Args:
            timeout: Ride out a Redis that is unreachable or refuses writes for this long,
                as ``request`` does (0: raise at once).

        Raises:
            QuorumGone: an id that left or was dropped.
            QuorumRedisRefused: Redis refused the write (until the deadline, with a timeout).
            QuorumTimeout: with a timeout, Redis was unreachable until the deadline.
        """
        scripts.check_replica_id(member.replica_id)
        with self._lock:
            self._members[member.replica_id] = member
        deadline, failures = time.monotonic() + timeout, 0
        while True:
            try:
                self._call("JOIN", member.replica_id, scripts.member_json(member))
                return
            except errors.RETRIED as e:
                if timeout <= 0:
                    raise
                failures += 1
                self._back_off(failures, deadline, e)

    def heartbeat(self, replica_ids: Sequence[str]) -> list[str]:
        """Stamp a heartbeat (Redis clock) for each id in one call; returns the ids that are
        gone (their owner must stop and restart under a new id)."""
        if not replica_ids:
            return []
        gone = self._call("HEARTBEAT", *replica_ids)
        return [g.decode() if isinstance(g, bytes) else str(g) for g in gone]

    def leave(self, replica_id: str) -> None:
        """Leave for good: a round waiting on this replica forms at once."""
        self._call("LEAVE", replica_id)
        with self._lock:
            self._members.pop(replica_id, None)
            self._held.pop(replica_id, None)

    # -- the per-step request -----------------------------------------------------------------
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
        """Ask for this step's quorum and block until it forms.

        Raises:
            QuorumGone: this replica id left or was dropped.
            QuorumNotReplicated: (a QuorumTimeout) with ``wait_replicas``, the answer was not
                on that many Redis replicas by the deadline; or Redis refused writes
                (``min-replicas-to-write``) until it.
            QuorumRedisRefused: (a QuorumTimeout) Redis refused the quorum's writes until
                the deadline (a replica, loading, busy, full memory, a disk error).
            QuorumNotFormed: (a QuorumTimeout) no quorum within ``timeout`` (too few
                replicas).
            QuorumTimeout: Redis unreachable until the deadline.
            QuorumCorrupt: a quorum key holds garbage.
        """
        scripts.check_replica_id(replica_id)
        deadline = time.monotonic() + timeout
        token = secrets.token_hex(6)
        with self._lock:
            held = max(held_quorum_id, self._held.get(replica_id, 0))
        args = scripts.request_args(
            replica_id, step, held, commit_failures, shrink_only, token
        )  # fmt: skip
        failures, answer_by = 0, confirm.answer_by(deadline, timeout, self._wait_replicas)
        while True:
            try:
                self._send_request(replica_id, args)
                answer = self._await_answer(replica_id, token, answer_by)
                break
            except errors.RETRIED as e:
                failures += 1
                self._back_off(failures, answer_by, e)
            except _RequestLost:
                continue
        # Held even if unconfirmed: should a failover lose this round, the next request
        # floors the counter past its id.
        with self._lock:
            if answer.quorum_id > self._held.get(replica_id, 0):
                self._held[replica_id] = answer.quorum_id
        self._confirm(deadline, f"quorum {answer.quorum_id} for replica {replica_id}")
        return answer

    def _confirm(self, deadline: float, what: str) -> None:
        confirm.confirm(self, deadline, what)

    def request_batch(
        self, relay_id: str, items: Sequence[BatchItem], timeout: float = 60.0
    ) -> dict[str, Answer | QuorumError]:
        """A relay's requests for many replicas at once (one script call per 500), blocking
        until each is answered, refused or timed out; the answers are those ``request``
        would give. Retries are idempotent; a replica that also asks directly is answered
        directly (its entry here is then a QuorumError).

        Returns:
            replica id -> its Answer, or the QuorumGone / QuorumTimeout / QuorumError
            ``request`` would have raised for it (QuorumNotReplicated for every answer when,
            with ``wait_replicas``, the batch's one WAIT fell short by the deadline; the
            QuorumRedisRefused for every open request when Redis refused until it).

        Raises:
            QuorumCorrupt: a quorum key holds garbage.
            QuorumTimeout: Redis was unreachable until the deadline.
        """
        from spottrain.quorum.relay import RelayBatch  # the relay's own module, on use

        return RelayBatch(self, relay_id, items, timeout).run()

    def _ranks(self, epoch: str, version: int) -> dict[str, int] | None:
        """Replica id -> rank in the roster at ``version`` of state ``epoch`` (None: the
        roster moved on). Read once per membership change, not per round."""
        with self._lock:
            cached = self._rank_of
        if cached is not None and cached[0] == (epoch, version):
            return cached[1]
        roster = self.roster()
        with self._lock:
            read = self._roster
        if roster.version != version or read is None or read[0] != epoch:
            return None
        ranks = {m.replica_id: i for i, m in enumerate(roster.members)}
        with self._lock:
            self._rank_of = ((epoch, version), ranks)
        return ranks

    def _send_request(self, replica_id: str, args: list[str]) -> None:
        try:
            self._call("REQUEST", *args)
        except redis.ResponseError as e:
            if not str(e).startswith("QJOIN"):
                raise self._error(e) from e
            # Redis lost this replica's record (restarted empty): join again, then ask.
            with self._lock:
                member = self._members.get(replica_id)
            if member is None:
                raise QuorumError(
                    f"replica {replica_id} has not joined the quorum: call join() first"
                ) from e
            self.join(member)
            self._call("REQUEST", *args)

    def _await_answer(self, replica_id: str, token: str, deadline: float) -> Answer:
        reply = scripts.reply_key(self._keys, replica_id)
        while True:
            wait = confirm.block_s(
                time.monotonic(), deadline, self._slice_s(random.uniform(0.8, 1.2))
            )
            if wait is None:
                return self._give_up(replica_id, token, reply)
            try:
                got = self._redis.blpop([reply], timeout=wait)
            except redis.ResponseError as e:
                raise self._refusal(reply, e) from e
            if got is None:
                if self._tick(replica_id, token) == "lost":
                    raise _RequestLost
                continue
            their_token, line = scripts.split_reply(got[1])
            if their_token != token:
                continue  # an answer to a request given up on earlier
            try:
                return scripts.parse_answer(line)
            except ValueError as e:
                raise self._corrupt(reply, f"{line!r}") from e

    def _give_up(self, replica_id: str, token: str, reply: str) -> Answer:
        # Withdraw the request, so no later round counts a replica that stopped waiting; if
        # its round formed meanwhile the others count on this replica: take the answer.
        if self._tick(replica_id, token, "withdraw") == "answered":
            for element in self._redis.lrange(reply, 0, -1):
                their_token, line = scripts.split_reply(element)
                if their_token == token:
                    self._redis.lrem(reply, 1, element)
                    return scripts.parse_answer(line)
        raise self._not_formed(replica_id)

    def _slice_s(self, jitter: float = 1.0) -> float:
        # Wake to TICK at the join timeout's scale, and at least twice per heartbeat timeout
        # so a silent loss is swept within the timeout plus a round; never past the socket
        # timeout, which would end the wait as a lost connection (a TICK more is cheaper).
        hb_ms = self._config.heartbeat_timeout_ms
        slice_s = min(max(self._config.join_timeout_ms, hb_ms / 4), hb_ms / 2) / 1000 * jitter
        return slice_s if self._longest_block_s is None else min(slice_s, self._longest_block_s)

    def _tick(self, replica_id: str, token: str, *withdraw: str) -> str:
        result = self._call("TICK", replica_id, token, *withdraw)
        return result.decode() if isinstance(result, bytes) else str(result)

    def _back_off(self, failures: int, deadline: float, error: Exception) -> None:
        """Sleep before the next try, at most until the last one that still fits before
        ``deadline`` (room to block once); once none fits, raise what ``error`` means. A try
        that could only send and give up would run commands that nothing but the socket
        timeout bounds, past the deadline when Redis hangs."""
        room = confirm.block_s(time.monotonic(), deadline, math.inf)
        if room is not None:
            pause = min(0.05 * 2 ** min(failures, 4), room - confirm.MIN_BLOCK_S)
            time.sleep(pause * random.uniform(0.5, 1.0))
        if confirm.block_s(time.monotonic(), deadline, math.inf) is None:
            self._raise_for(error)

    def _raise_for(self, error: Exception) -> NoReturn:
        """What ``error``, the last try's, means at a request's deadline."""
        refused = errors.refusal(error, self._where())  # LOADING: a "lost connection"
        if refused is error:
            raise error
        if refused is not None:
            raise refused from error
        raise QuorumTimeout(
            f"Redis was unreachable until the quorum request's deadline ({error}); check "
            "the run's Redis"
        ) from error

    def _not_formed(self, replica_id: str) -> QuorumNotFormed:
        return QuorumNotFormed(
            f"no quorum formed for replica {replica_id} in time: fewer than "
            f"{self._config.min_replicas} replicas asked, or not more than half of the "
            "heartbeating replicas did (see `status()`)"
        )

    # -- reading ------------------------------------------------------------------------------
    def roster(self) -> Roster:
        """The membership of the last quorum whose membership changed. The first call reads
        it whole (O(N)); later ones read O(1) when nothing changed and only the changes
        otherwise (the ``rlog`` deltas), falling back to the whole roster when the log does
        not reach back to the cached version (or Redis lost its state)."""
        state, rlog = self._keys.quorum_key("state"), self._keys.quorum_key("rlog")
        epoch, target = self._read(lambda: self._redis.hmget(state, "epoch", "version"), state)
        with self._lock:
            cached = self._roster
        if cached is not None and epoch is not None and cached[0] == epoch.decode():
            members = {m.replica_id: m for m in cached[1].members}
            version = cached[1].version
            while version < int(target or 0):
                doc = self._read(partial(self._redis.hget, rlog, str(version)), rlog)
                if doc is None:
                    break
                try:
                    version = scripts.apply_delta(members, doc)
                except (ValueError, TypeError, KeyError, IndexError) as e:
                    raise self._corrupt(rlog, f"{bytes(doc)[:80]!r}") from e
            if version == int(target or 0):
                return self._cache(epoch.decode(), version, members)
        return self._full_roster()

    def _full_roster(self) -> Roster:
        key, state = self._keys.quorum_key("roster"), self._keys.quorum_key("state")

        def read() -> list[Any]:
            pipe = self._redis.pipeline(transaction=True)  # the roster and its epoch together
            pipe.get(key)
            pipe.hget(state, "epoch")
            return list(pipe.execute())

        doc, epoch = self._read(read, key)
        if doc is None:
            return Roster(version=0, members=())
        try:
            version, members = scripts.parse_roster(doc)
        except (ValueError, TypeError, KeyError, IndexError) as e:
            raise self._corrupt(key, f"{bytes(doc)[:80]!r}") from e
        return self._cache(
            (epoch or b"").decode(), version, {m.replica_id: m for m in members}
        )  # fmt: skip

    def _cache(self, epoch: str, version: int, members: dict[str, Member]) -> Roster:
        roster = Roster(version=version, members=tuple(members[k] for k in sorted(members)))
        with self._lock:
            self._roster = (epoch, roster)
        return roster

    def heartbeat_ages(self, replica_ids: Sequence[str]) -> dict[str, float | None]:
        """Seconds since each replica's last heartbeat (Redis clock); None: none, or gone."""
        if not replica_ids:
            return {}
        hb, gone = self._keys.quorum_key("hb"), self._keys.quorum_key("gone")

        def read() -> list[Any]:
            pipe = self._redis.pipeline(transaction=False)
            pipe.time()
            pipe.zmscore(hb, list(replica_ids))
            pipe.hmget(gone, list(replica_ids))
            return list(pipe.execute())

        (sec, usec), scores, tombs = self._read(read, f"{hb} or {gone}")
        now_ms = sec * 1000 + usec / 1000
        return {
            rid: None if score is None or tomb is not None else max(0.0, (now_ms - score) / 1000)
            for rid, score, tomb in zip(replica_ids, scores, tombs, strict=True)
        }

    def status(self) -> QuorumStatus:
        """The quorum id, version, round, member and heartbeat counts, epoch."""
        state, prev, hb = (self._keys.quorum_key(p) for p in ("state", "prev", "hb"))
        timeout = self._config.heartbeat_timeout_ms

        def read() -> list[Any]:
            sec, usec = self._redis.time()
            now_ms = sec * 1000 + usec // 1000
            pipe = self._redis.pipeline(transaction=False)
            pipe.hgetall(state)
            pipe.scard(prev)
            pipe.zcount(hb, f"({now_ms - timeout}", "+inf")
            return list(pipe.execute())

        fields, members, heartbeating = self._read(read, f"{state}, {prev} or {hb}")
        values = {k.decode(): v.decode() for k, v in fields.items()}
        try:
            return QuorumStatus(
                qid=int(values.get("qid", 0)),
                version=int(values.get("version", 0)),
                round=int(values.get("round", 0)),
                members=int(members),
                heartbeating=int(heartbeating),
                epoch=values.get("epoch", ""),
                max_step=int(values.get("max_step", 0)),
                formed_ms=int(values.get("formed", 0)),
            )
        except ValueError as e:
            raise self._corrupt(state, str(values)[:200]) from e

    def _read(self, fn: Callable[[], Any], key: str) -> Any:
        try:
            return fn()
        except redis.ResponseError as e:  # OOM refuses even a read in MULTI
            raise self._refusal(key, e) from e

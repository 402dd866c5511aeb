"""Quorum relays between VMs (``train.replica.relay_group_size``): one shim per group of
replicas batches its group's per-step requests into one Redis script call
(``QuorumClient.request_batch``) and gets one reply back, which it fans out, so a steady
round costs Redis per relay, not per replica.

- **Which relay**: group ``g = slot index // group size``. The relay of ``g`` holds the
  lease key ``quorum_key("relay:<g>")`` = its address (``SET NX PX``, TTL three heartbeat
  timeouts, renewed at a third of it); any member takes it when it is absent.
- **Batching** (:class:`Batcher`), Nagle-style: the first request goes at once; requests
  arriving while a batch is being sent (a window of ``gather_s``) go in the next one. A
  batch blocks until its round forms, so several may be in flight in one round; each uses a
  relay id of its own (``<relay>.<n>``): one reply list per batch, never two waiters on one.
- **Wire** (:mod:`.wire`: length-prefixed frames on one plain TCP connection per member
  VM): the request is ``"<replica id> <step> <held qid> <commit failures> <shrink 0|1>
  <timeout ms>"``, the answer the quorum's own answer line (:func:`answer_line`).
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Protocol

import redis

from spottrain.protocol.keys import RunKeys
from spottrain.quorum import scripts
from spottrain.quorum.errors import QuorumError
from spottrain.quorum.model import Answer, BatchItem

log = logging.getLogger("spottrain.agent.quorum_shim.relay")

# The largest batch one script call carries (RCORE's request_batch splits above 500 too).
MAX_BATCH = 500
# Requests arriving this soon after a batch left join the next one (the order of one
# RELAY_REQUEST script call on the wire and in Redis: ~0.2 ms of Redis, plus the RTT).
GATHER_S = 0.002
# A batch waits at most this long for its expected members (see Batcher): a round missing
# one is not steady and waits on Redis's join or heartbeat timeout (>= 250 ms) anyway.
MAX_WAIT_S = 0.05


class BatchApi(Protocol):
    def request_batch(
        self, relay_id: str, items: Sequence[BatchItem], timeout: float
    ) -> dict[str, Answer | QuorumError]: ...


def relay_group(slot: str, group_size: int) -> int:
    """The relay group of replica slot ``replica-<j>``: ``j // group_size``."""
    index = slot.rpartition("-")[2]
    if not index.isdigit():
        raise ValueError(f"replica slot {slot!r} is not replica-<number>")
    return int(index) // group_size


def lease_key(keys: RunKeys, group: int) -> str:
    return keys.quorum_relay(group)


# A member's deadline for one relayed request, in ms: at most an hour (a hop is the join
# plus the heartbeat timeout), so a member cannot park a request at the relay for longer.
MAX_TIMEOUT_MS = 3_600_000
# A request's largest body: the widest replica id and the widest numbers (the frame limit,
# wire.MAX_REQUEST, derives from it, so an id check_replica_id accepts always fits).
MAX_REQUEST_BYTES = scripts.MAX_REPLICA_ID_BYTES + len(
    f" {-scripts.MAX_STEP} {scripts.MAX_HELD_QUORUM_ID} {scripts.MAX_STEP} 1 {MAX_TIMEOUT_MS}"
)
# Whole numbers as encode_request writes them: ASCII digits only (int() also reads other
# scripts' digits, a "+" and "_"), at most 16 of them (MAX_STEP has 16).
_INT = re.compile(r"-?[0-9]{1,16}")


def check_item(item: BatchItem) -> BatchItem:
    """Refuse a request the quorum could not take (its id, or a number its Lua cannot hold)
    before it travels: on a relay's connection it would fail its co-located replicas too.

    Raises:
        ValueError: naming what is wrong and the limit.
    """
    scripts.check_replica_id(item.replica_id)
    scripts.check_numbers(int(item.step), int(item.held_qid), max(0, int(item.commit_failures)))
    return item


def encode_request(item: BatchItem, timeout: float) -> bytes:
    """Raises ValueError for an item :func:`check_item` refuses."""
    check_item(item)
    timeout_ms = min(MAX_TIMEOUT_MS, max(1, round(timeout * 1000)))
    return (
        f"{item.replica_id} {item.step} {max(0, item.held_qid)} {max(0, item.commit_failures)} "
        f"{int(item.shrink_only)} {timeout_ms}"
    ).encode()


def _number(text: str, what: str, lo: int, hi: int) -> int:
    if not _INT.fullmatch(text) or not lo <= int(text) <= hi:
        raise ValueError(f"relay request: {what} {text[:24]!r} is not a whole number {lo}..{hi}")
    return int(text)


def decode_request(body: bytes) -> tuple[BatchItem, float]:
    """Raises ValueError for anything but :func:`encode_request`'s bytes: numbers in ASCII
    digits within the quorum's ranges, shrink_only 0 or 1, a timeout of 1 ms to
    :data:`MAX_TIMEOUT_MS`."""
    parts = body.decode().split(" ")
    if len(parts) != 6:
        raise ValueError(f"not a relay request: {body[:80]!r}")
    rid, step, held, failures, shrink, timeout_ms = parts
    if shrink not in ("0", "1"):
        raise ValueError(f"relay request: shrink_only {shrink[:8]!r} is not 0 or 1")
    item = BatchItem(
        rid,
        _number(step, "step", -scripts.MAX_STEP, scripts.MAX_STEP),
        _number(held, "held quorum id", 0, scripts.MAX_HELD_QUORUM_ID),
        _number(failures, "commit failures", 0, scripts.MAX_STEP),
        shrink == "1",
    )
    check_item(item)
    return item, _number(timeout_ms, "timeout (ms)", 1, MAX_TIMEOUT_MS) / 1000.0


def answer_line(a: Answer) -> bytes:
    """``a`` as the quorum's answer line (what :func:`scripts.parse_answer` reads)."""
    heal = -1 if a.heal_from is None else a.heal_from
    head = (
        f"{a.quorum_id} {a.replica_rank} {a.replica_count} {a.max_step} {heal} "
        f"{a.roster_version} {a.commit_failures} {a.epoch}"
    )
    return " ".join([head, *(f"{r}={s}" for r, s in a.behind.items())]).encode()


class Batcher:
    """A group's requests, batched into ``request_batch`` calls under relay ids
    ``<relay_id>.<n>`` (``n``: the smallest not in flight).

    When to send: a steady round forms only once every member asked, so sending early
    gains nothing but script calls. Members answered within ``window_s`` are *expected*: a
    batch leaves the moment every expected member is pending or in flight (the last arrival
    sends it: one script call per round, not one per arrival), or ``max_wait_s`` after its
    first request (a member that left, or a new one). With nobody expected (the first
    rounds), Nagle: the first request at once, the next ones ``gather_s`` later.
    """

    def __init__(
        self,
        client: BatchApi,
        relay_id: str,
        *,
        gather_s: float = GATHER_S,
        max_wait_s: float = MAX_WAIT_S,
        window_s: float = 1.0,
    ) -> None:
        self.client, self.relay_id, self.gather_s = client, relay_id, gather_s
        self.max_wait_s, self.window_s = max_wait_s, window_s
        self._cond = threading.Condition()
        self._pending: dict[str, tuple[BatchItem, float, list[Future[Answer]]]] = {}
        self._first = 0.0  # when the oldest pending request arrived
        self._answered: dict[str, float] = {}  # member -> when it was last answered
        self._flying: set[str] = set()
        self._busy: set[int] = set()
        self._stop = False
        self.batches = 0  # request_batch calls made (tests, logs)
        self.items = 0
        self._thread = threading.Thread(target=self._loop, name="spottrain-relay", daemon=True)
        self._thread.start()

    def submit(self, item: BatchItem, timeout: float) -> Future[Answer]:
        future: Future[Answer] = Future()
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._stop:
                raise QuorumError("this relay stopped: ask the quorum directly")
            if not self._pending:
                self._first = time.monotonic()
            old = self._pending.get(item.replica_id)
            waiters = old[2] if old else []
            self._pending[item.replica_id] = (item, max(deadline, old[1] if old else 0), waiters)
            waiters.append(future)
            self._cond.notify()
        return future

    def ask(self, item: BatchItem, timeout: float) -> Answer:
        return self.submit(item, timeout).result(timeout + 1.0)

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            pending, self._pending = self._pending, {}
            self._cond.notify_all()
        for _, _, waiters in pending.values():
            for f in waiters:
                if not f.done():
                    f.set_exception(QuorumError("this relay stopped: ask the quorum directly"))

    def _wait_s(self) -> float | None:
        """Seconds until the pending requests should leave (0: now; None: nothing pending)."""
        if self._stop:
            return 0.0
        if not self._pending:
            return None
        now = time.monotonic()
        late = self.max_wait_s - (now - self._first)
        expected = [r for r, t in self._answered.items() if now - t < self.window_s]
        if (
            late <= 0
            or len(self._pending) >= MAX_BATCH
            or all(r in self._pending or r in self._flying for r in expected)
        ):
            return 0.0
        return late

    def _loop(self) -> None:
        while True:
            with self._cond:
                while (wait := self._wait_s()) != 0.0:
                    self._cond.wait(wait)
                if self._stop:
                    return
                take = list(itertools.islice(self._pending, MAX_BATCH))
                batch = [self._pending.pop(r) for r in take]
                self._first = time.monotonic()
                self._flying.update(take)
                sub = next(n for n in itertools.count() if n not in self._busy)
                self._busy.add(sub)
            threading.Thread(
                target=self._run, args=(sub, batch), name=f"spottrain-relay-{sub}", daemon=True
            ).start()
            # Nagle: what arrives while this batch is being sent goes in the next one.
            time.sleep(self.gather_s)

    def _run(self, sub: int, batch: list[tuple[BatchItem, float, list[Future[Answer]]]]) -> None:
        timeout = max(0.05, max(d for _, d, _ in batch) - time.monotonic())
        self.batches += 1
        self.items += len(batch)
        results: dict[str, Answer | QuorumError] | dict[str, Exception] = {}
        try:
            results = self.client.request_batch(
                f"{self.relay_id}.{sub}", [i for i, _, _ in batch], timeout
            )
        except Exception as exc:  # every waiter learns it, and falls back directly
            results = {i.replica_id: exc for i, _, _ in batch}
        finally:
            with self._cond:
                self._busy.discard(sub)
                now = time.monotonic()
                for item, _, _ in batch:
                    self._flying.discard(item.replica_id)
                    if isinstance(results.get(item.replica_id), Answer):
                        self._answered[item.replica_id] = now
                    else:  # refused, or asked directly now: not expected here
                        self._answered.pop(item.replica_id, None)
                # Restarted managers join under new ids: forget the silent ones.
                for rid in [r for r, t in self._answered.items() if now - t > self.window_s]:
                    del self._answered[rid]
                self._cond.notify()
        for item, _, waiters in batch:
            got = results.get(item.replica_id)
            for f in waiters:
                if f.done():  # its asker gave up (a cancelled wait on the wire)
                    continue
                if isinstance(got, Answer):
                    f.set_result(got)
                else:
                    f.set_exception(got or QuorumError(f"the relay got no answer for {item}"))


class Lease:
    """The relay lease of one group, in the run's Redis."""

    _RENEW = (
        "if redis.call('GET', KEYS[1]) == ARGV[1] then "
        "return redis.call('PEXPIRE', KEYS[1], ARGV[2]) else return 0 end"
    )

    def __init__(self, client: redis.Redis, key: str, me: str, ttl_ms: int) -> None:
        self.client, self.key, self.me, self.ttl_ms = client, key, me, ttl_ms
        self._renew = client.register_script(self._RENEW)
        self._release = client.register_script(self._RELEASE)

    def take(self) -> str | None:
        """Take the lease if nobody holds it; its holder's address afterwards (None: lost
        between the two commands, or Redis unreachable)."""
        try:
            if self.client.set(self.key, self.me, nx=True, px=self.ttl_ms):
                return self.me
            got = self.client.get(self.key)
        except redis.RedisError as exc:
            log.warning("cannot read the relay lease %s (asking directly): %s", self.key, exc)
            return None
        return got.decode() if isinstance(got, bytes) else got

    _RELEASE = (
        "if redis.call('GET', KEYS[1]) == ARGV[1] then "
        "return redis.call('DEL', KEYS[1]) else return 0 end"
    )

    def release(self) -> None:
        """Give the lease up if this relay holds it (a clean stop)."""
        self._release(keys=[self.key], args=[self.me])

    def renew(self) -> bool:
        """Whether this relay still holds the lease (and it was extended)."""
        return bool(self._renew(keys=[self.key], args=[self.me, self.ttl_ms]))

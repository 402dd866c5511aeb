"""A relay's batched request (``QuorumClient.request_batch``): one RELAY_REQUEST script call
registers up to 500 replicas' requests, and the batch's answers come back on one list,
``relayreply:<relay id>:<batch token>``, one element per FORM:

- ``S <round> <qid> <version> <count> <max_step> <epoch>`` (the steady FORM): every request
  of the batch registered in rounds up to ``<round>`` is answered with the last quorum's
  membership at ``max_step``, nobody behind; a member's rank is its index in the roster at
  ``<version>`` (sorted by replica id, as the FORM ranks them).
- ``F <round>`` then one ``<replica id> <answer line>`` line per member of the batch that
  round answered (a full FORM).

Retries are idempotent: the batch keeps its token, a request already registered is not
counted again, and a batch whose answer already waits reads it before sending again.

With ``wait_replicas`` the batch's answers are confirmed together, by one ``WAIT`` (again
until the deadline, ending by it); when that fails, every answered member gets the
QuorumNotReplicated. When Redis refuses the batch's writes until the deadline (a replica,
loading, full memory, a disk error, ``min-replicas-to-write``: the client's refusals), every
member still open gets that QuorumRedisRefused.
"""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import redis

from spottrain.quorum import confirm, scripts
from spottrain.quorum.errors import RETRIED, QuorumError, QuorumGone, QuorumRedisRefused
from spottrain.quorum.model import Answer, BatchItem

if TYPE_CHECKING:
    from spottrain.quorum.client import QuorumClient

CHUNK = 500  # items per script call: bounds one call's time on Redis's thread


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


class RelayBatch:
    """One ``request_batch`` call: its items, what is registered and what is answered."""

    def __init__(
        self, client: QuorumClient, relay_id: str, items: Sequence[BatchItem], timeout: float
    ) -> None:
        scripts.check_replica_id(relay_id)
        self.c = client
        self.relay_id = relay_id
        self.items: dict[str, BatchItem] = {}
        for item in items:
            scripts.check_replica_id(item.replica_id)
            if item.replica_id in self.items:
                raise ValueError(
                    f"replica {item.replica_id} is twice in one batch: send one request each"
                )
            self.items[item.replica_id] = item
        self.batch = f"{relay_id}:{secrets.token_hex(6)}"
        self.key = scripts.relay_key(client._keys, self.batch)
        self.deadline = time.monotonic() + timeout
        # Answers are collected until then: the batch's WAIT ends by the deadline.
        self.answer_by = confirm.answer_by(self.deadline, timeout, client._wait_replicas)
        self.open = set(self.items)  # not answered yet
        self.sent: dict[str, int] = {}  # registered: id -> the round it joined last
        self.unsent = set(self.items)  # to send (again: after a connection error or a loss)
        self.out: dict[str, Answer | QuorumError] = {}

    def run(self) -> dict[str, Answer | QuorumError]:
        try:
            self._collect()
        except QuorumRedisRefused as e:  # Redis refused writes until the deadline
            self._fail(sorted(self.open), e)
        # Held even if unconfirmed: should a failover lose a round, the next request floors
        # the counter past its id.
        answered = {r: a for r, a in self.out.items() if isinstance(a, Answer)}
        with self.c._lock:
            for rid, a in answered.items():
                if a.quorum_id > self.c._held.get(rid, 0):
                    self.c._held[rid] = a.quorum_id
        if answered and self.c._wait_replicas > 0:
            qids = ", ".join(str(q) for q in sorted({a.quorum_id for a in answered.values()}))
            try:
                self.c._confirm(self.deadline, f"quorum {qids} for relay batch {self.batch}")
            except QuorumRedisRefused as e:
                self._fail(sorted(answered), e)
        return self.out

    def _collect(self) -> None:
        failures = 0
        while self.open:
            if confirm.block_s(time.monotonic(), self.answer_by, 1.0) is None:
                self._give_up()  # no BLPOP fits before the deadline any more
                return
            try:
                self._send()
                if self.open:
                    self._wait()
            except RETRIED as e:
                failures += 1
                self.c._back_off(failures, self.answer_by, e)
                self.unsent = set(self.open)  # send every open request again: idempotent

    def _fail(self, ids: list[str], error: QuorumRedisRefused) -> None:
        for rid in ids:
            self.open.discard(rid)
            self.out[rid] = error.for_replica(rid)

    # -- sending --------------------------------------------------------------------------
    def _send(self) -> None:
        while True:
            unsent = sorted(self.unsent & self.open)
            if not unsent:
                return
            for i in range(0, len(unsent), CHUNK):
                chunk = [self.items[r] for r in unsent[i : i + CHUNK]]
                with self.c._lock:
                    held = [max(x.held_qid, self.c._held.get(x.replica_id, 0)) for x in chunk]
                got = self.c._call(
                    "RELAY_REQUEST", *scripts.relay_args(self.batch, chunk, held)
                )  # fmt: skip
                if int(got[0]) < 0:  # an answer waits already: read it, then send the rest
                    self._drain()
                    break
                refused = {_text(k): _text(v) for k, v in zip(got[1::2], got[2::2], strict=True)}
                for x in chunk:
                    why = refused.get(x.replica_id)
                    self.unsent.discard(x.replica_id)
                    if why is None:
                        self.sent[x.replica_id] = int(got[0])
                    else:
                        self._refuse(x.replica_id, why)
            else:
                return

    def _refuse(self, rid: str, why: str) -> None:
        self.open.discard(rid)
        self.sent.pop(rid, None)
        if why.startswith("gone"):
            self.out[rid] = QuorumGone(
                f"replica {rid} is gone from the quorum ({why.split(' ')[1]}): it can never "
                "rejoin under this id; restart its manager, which joins under a new id"
            )
        elif why == "join":
            self.out[rid] = QuorumError(
                f"replica {rid} has not joined the quorum (Redis may have lost its record): "
                "ask directly (QuorumClient.request), which joins it again"
            )
        elif why == "direct":
            self.out[rid] = QuorumError(
                f"replica {rid} asked Redis directly this round: its answer goes to it, not "
                f"through relay {self.relay_id}"
            )
        else:
            self.out[rid] = QuorumError(f"replica {rid}: {why}")

    # -- waiting --------------------------------------------------------------------------
    def _wait(self) -> None:
        slice_s = self.c._slice_s(random.uniform(0.8, 1.2))
        wait = confirm.block_s(time.monotonic(), self.answer_by, slice_s)
        if wait is None:
            return  # out of time: the next pass gives up
        try:
            got = self.c._redis.blpop([self.key], timeout=wait)
        except redis.ResponseError as e:
            raise self.c._refusal(self.key, e) from e
        if got is not None:
            self._apply(got[1])
        else:
            self._tick("wait")

    def _tick(self, how: str) -> None:
        ids = sorted(self.open)
        got = [_text(x) for x in self.c._call("RELAY_TICK", self.batch, how, *ids)]
        if got == ["drain"]:
            self._drain()
            if how == "withdraw" and self.open:
                self._tick(how)
            return
        for rid, state in zip(ids, got, strict=True):
            if state == "lost":
                self.unsent.add(rid)  # Redis lost it (restarted): send it again
            elif state == "withdrawn":
                self.open.discard(rid)
                self.out[rid] = self.c._not_formed(rid)
            elif state != "pending":
                self._refuse(rid, state)

    def _give_up(self) -> None:
        # Withdraw, so no later round counts a replica that stopped waiting; an answer that
        # formed meanwhile is taken.
        self._tick("withdraw")
        for rid in list(self.open):
            self.open.discard(rid)
            self.out[rid] = self.c._not_formed(rid)

    def _drain(self) -> None:
        pipe = self.c._redis.pipeline(transaction=True)
        pipe.lrange(self.key, 0, -1)
        pipe.delete(self.key)
        try:
            elements, _ = pipe.execute()
        except redis.ResponseError as e:
            raise self.c._refusal(self.key, e) from e
        for element in reversed(elements):  # LPUSHed: the oldest is last
            self._apply(element)

    def _apply(self, element: bytes | str) -> None:
        text = _text(element)
        try:
            if text.startswith("S "):
                self._steady(text)
            elif text.startswith("F "):
                for line in text.split("\n")[1:]:
                    rid, _, answer = line.partition(" ")
                    if rid in self.open:
                        self.out[rid] = scripts.parse_answer(answer)
                        self.open.discard(rid)
            else:
                raise ValueError(text)
        except (ValueError, IndexError) as e:
            raise self.c._corrupt(self.key, f"{text[:80]!r}") from e

    def _steady(self, text: str) -> None:
        _, rnd, qid, version, count, max_step, epoch = text.split(" ")
        done = [r for r in self.open if self.sent.get(r, 1 << 62) <= int(rnd)]
        if not done:
            return
        ranks = self.c._ranks(epoch, int(version))
        for rid in done:
            self.open.discard(rid)
            rank = None if ranks is None else ranks.get(rid)
            if rank is None or len(ranks or ()) != int(count):
                self.out[rid] = QuorumError(
                    f"replica {rid}: the quorum's membership changed before its answer was "
                    "read; ask again"
                )
                continue
            self.out[rid] = Answer(
                quorum_id=int(qid),
                replica_rank=rank,
                replica_count=int(count),
                max_step=int(max_step),
                heal_from=None,
                roster_version=int(version),
                commit_failures=0,
                epoch=epoch,
            )

"""The participant list torchft's manager expects, rebuilt from a cached roster and one
step's O(1) answer.

torchft's Rust manager computes ranks and healing from the full ``Quorum.participants``
(every member with its step). Redis sends the membership only when it changed
(``Answer.roster_version``); every step it sends the quorum id, ``max_step`` and the few
members behind it. Every member not behind is at ``max_step``, so the list is the cached
members with one of two or three different tails.

Cheap by construction: each member's fixed fields are serialized once per roster, framed as
a ``participants`` entry whose length is fixed too, because the per-step fields (``step``,
``commit_failures``) are written as 10-byte varints (protobuf accepts a varint padded with
continuation bytes). All members at ``max_step`` then share one tail, and the whole list is
``tail.join(heads) + tail``: one copy of the bytes, no per-member Python work per step.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.timestamp_pb2 import Timestamp

from spottrain.quorum.model import Answer, Member, Roster

from . import proto

_STEP_TAG = bytes([4 << 3])  # QuorumMember.step, varint
_FAILURES_TAG = bytes([8 << 3])  # QuorumMember.commit_failures, varint
_PARTICIPANT_TAG = proto.varint(proto.QUORUM_PARTICIPANTS << 3 | 2)
_QUORUM_ID_TAG = bytes([1 << 3])
_U64 = (1 << 64) - 1


def padded_varint(n: int) -> bytes:
    """``n`` as an int64 varint always 10 bytes long (continuation bytes pad it)."""
    n &= _U64
    return bytes([(n >> (7 * i)) & 0x7F | 0x80 for i in range(9)]) + bytes([n >> 63])


def member_tail(step: int, commit_failures: int) -> bytes:
    """The per-step fields of one participant, always 22 bytes."""
    return _STEP_TAG + padded_varint(step) + _FAILURES_TAG + padded_varint(commit_failures)


_TAIL_LEN = len(member_tail(0, 0))


class StaleRoster(RuntimeError):
    """The membership changed again between the answer and reading the roster."""


@dataclass
class _Cached:
    epoch: str
    version: int
    ids: tuple[str, ...]
    index: dict[str, int]
    heads: list[bytes]  # tag + length + fixed fields of each member, sorted by replica id


class RosterCache:
    """The newest roster, pre-serialized; :meth:`response` answers one step from it."""

    def __init__(self) -> None:
        self._cached: _Cached | None = None
        self.fetches = 0  # rosters read from Redis (a membership change, or a new epoch)

    @property
    def version(self) -> int | None:
        return self._cached.version if self._cached else None

    def load(self, roster: Roster, epoch: str) -> None:
        heads = []
        for m in roster.members:
            fixed = proto.QuorumMember(
                replica_id=m.replica_id,
                address=m.address,
                store_address=m.store_address,
                world_size=m.world_size,
                data=m.data,
            ).SerializeToString()
            heads.append(_PARTICIPANT_TAG + proto.varint(len(fixed) + _TAIL_LEN) + fixed)
        ids = tuple(m.replica_id for m in roster.members)
        self._cached = _Cached(epoch, roster.version, ids, {r: i for i, r in enumerate(ids)}, heads)

    def _current(self, answer: Answer, fetch: Callable[[], Roster]) -> _Cached:
        c = self._cached
        if c is None or c.version != answer.roster_version or c.epoch != answer.epoch:
            self.fetches += 1
            self.load(fetch(), answer.epoch)
            c = self._cached
            assert c is not None
            if c.version != answer.roster_version:
                raise StaleRoster(
                    f"the quorum's membership changed again (roster version {c.version}, "
                    f"this answer's {answer.roster_version}) before it could be read; "
                    "the manager retries the quorum"
                )
        if len(c.ids) != answer.replica_count:
            raise StaleRoster(
                f"roster version {c.version} holds {len(c.ids)} members but the answer counts "
                f"{answer.replica_count}: the quorum's keys disagree; the manager retries"
            )
        return c

    def response(
        self,
        answer: Answer,
        requester: str,
        fetch: Callable[[], Roster],
        *,
        created: float | None = None,
    ) -> bytes:
        """The serialized ``LighthouseQuorumResponse`` for ``requester``'s ``answer``;
        ``fetch`` reads the roster when the cached one is not the answer's.

        Raises:
            StaleRoster: the roster in Redis is not the answer's (or lacks the requester).
        """
        c = self._current(answer, fetch)
        if requester not in c.index:
            raise StaleRoster(
                f"replica {requester} is not in roster version {c.version}: the manager "
                "retries the quorum"
            )
        tail = member_tail(answer.max_step, answer.commit_failures)
        parts: list[bytes] = []
        start = 0
        for pos, step in sorted((c.index[r], s) for r, s in answer.behind.items() if r in c.index):
            if pos > start:
                parts += (tail.join(c.heads[start:pos]), tail)
            parts += (c.heads[pos], member_tail(step, answer.commit_failures))
            start = pos + 1
        if start < len(c.heads):
            parts += (tail.join(c.heads[start:]), tail)
        now = time.time() if created is None else created
        seconds = int(now)
        created_ts = Timestamp(seconds=seconds, nanos=int((now - seconds) * 1e9))
        quorum = b"".join(
            [
                _QUORUM_ID_TAG + proto.varint(answer.quorum_id & _U64),
                *parts,
                proto.frame(proto.QUORUM_CREATED, created_ts.SerializeToString()),
            ]
        )
        return proto.frame(proto.RESPONSE_QUORUM, quorum)


def fake_roster(n: int, version: int = 1) -> Roster:
    """``n`` members shaped like a real run's (torchft ids, manager and store addresses)."""
    members = sorted(
        (
            Member(
                replica_id=f"replica-{j}:{uuid.UUID(int=j)}",
                address=f"http://10.0.{j // 250}.{j % 250}:29512",
                store_address=f"10.0.{j // 250}.{j % 250}:29500",
                world_size=8,
            )
            for j in range(n)
        ),
        key=lambda m: m.replica_id,
    )
    return Roster(version=version, members=tuple(members))


def rebuild_cost(n: int, *, repeats: int = 20) -> float:
    """Seconds the shim spends per step rebuilding the participant list of ``n`` members
    from its cache (the median of ``repeats``; one member behind, as when one heals)."""
    roster = fake_roster(n)
    cache = RosterCache()
    cache.load(roster, "e")
    behind = {roster.members[n // 2].replica_id: 9} if n > 1 else {}
    answer = Answer(
        quorum_id=7,
        replica_rank=0,
        replica_count=n,
        max_step=10_000,
        heal_from=None,
        roster_version=1,
        commit_failures=0,
        epoch="e",
        behind=behind,
    )
    me = roster.members[0].replica_id
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        cache.response(answer, me, lambda: roster)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def load_cost(n: int) -> float:
    """Seconds to pre-serialize a changed roster of ``n`` members (once per change)."""
    roster = fake_roster(n)
    t0 = time.perf_counter()
    RosterCache().load(roster, "e")
    return time.perf_counter() - t0


if __name__ == "__main__":
    for size in (100, 1000, 4000, 12500):
        print(
            f"members {size:6d}: rebuild {rebuild_cost(size) * 1e3:8.3f} ms/step, "
            f"roster load {load_cost(size) * 1e3:8.2f} ms/change"
        )

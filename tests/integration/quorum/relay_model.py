"""For the relay tests: the quorum's rules as a Python model (torchft's compute_quorum_results
and QUORUM.md's quorum ids) and a driver that asks through scripts without waiting, directly
or through relay batches, so every round is exact and fast."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from spottrain.quorum import scripts
from spottrain.quorum.client import QuorumClient
from spottrain.quorum.errors import QuorumError
from spottrain.quorum.model import Answer, BatchItem, Member
from spottrain.quorum.relay import RelayBatch


@dataclass
class Model:
    """The answers the quorum must give, from its rules alone."""

    prev: frozenset[str] = frozenset()
    qid: int = 0
    version: int = 0
    seq: int = 0
    dirty: bool = False
    waiting: dict[str, tuple[int, int, bool]] = field(default_factory=dict)  # left out

    def form(self, asks: dict[str, tuple[int, int, bool]]) -> dict[str, Answer]:
        """``asks``: id -> (step, commit failures, shrink_only); returns the answers of the
        round they form (requesters left out by shrink_only wait for the next)."""
        asks = {**self.waiting, **asks}
        ids = sorted(asks)
        if any(a[2] for a in asks.values()):
            ids = [r for r in ids if r in self.prev] or ids
        self.waiting = {r: a for r, a in asks.items() if r not in ids}
        changed = self.dirty or frozenset(ids) != self.prev
        cf = max(asks[r][1] for r in ids)
        if changed or cf > 0 or self.qid == 0:
            self.seq += 1
            self.qid = self.seq
        if changed:
            self.prev, self.version, self.dirty = frozenset(ids), self.qid, False
        steps = [asks[r][0] for r in ids]
        top = max(steps)
        up = [k for k, s in enumerate(steps) if s == top]
        behind = [k for k, s in enumerate(steps) if s != top]
        heal = {k: up[i % len(up)] for i, k in enumerate(behind)}
        late = {ids[k]: steps[k] for k in behind}
        return {
            r: Answer(self.qid, k, len(ids), top, heal.get(k), self.version, cf, "", late)
            for k, r in enumerate(ids)
        }

    def remove(self, rid: str) -> None:
        if rid in self.prev:
            self.dirty = True


def no_epoch(answers: dict[str, Answer]) -> dict[str, Answer]:
    return {r: replace(a, epoch="") for r, a in answers.items()}


class Asker:
    """Sends requests through one QuorumClient's scripts: direct ones (REQUEST, then the
    answer read off ``reply:<id>``) and relay batches (``RelayBatch`` sends, then reads its
    list), never blocking; answers are collected as rounds form."""

    def __init__(self, client: QuorumClient) -> None:
        self.c = client
        self.n = 0
        self.direct: dict[str, str] = {}  # id -> token of its open request
        self.batches: list[RelayBatch] = []

    def join(self, *ids: str) -> None:
        for rid in ids:
            self.c.join(Member(rid, address=f"h-{rid}"))
        self.c.heartbeat(list(ids))

    def ask_direct(self, rid: str, step: int, cf: int = 0, shrink: bool = False) -> None:
        self.n += 1
        token = f"t{self.n}"
        self.c._call("REQUEST", *scripts.request_args(rid, step, 0, cf, shrink, token))
        self.direct[rid] = token

    def ask_batch(self, relay: str, items: list[BatchItem]) -> RelayBatch:
        batch = RelayBatch(self.c, relay, items, timeout=30)
        batch._send()
        self.batches.append(batch)
        return batch

    def collect(self) -> dict[str, Answer | QuorumError]:
        """The answers that arrived since the last call."""
        got: dict[str, Answer | QuorumError] = {}
        r = self.c._redis
        for rid, token in list(self.direct.items()):
            for element in r.lrange(scripts.reply_key(self.c._keys, rid), 0, -1):
                their, line = scripts.split_reply(element)
                if their == token:
                    got[rid] = scripts.parse_answer(line)
                    del self.direct[rid]
        for batch in list(self.batches):
            batch._drain()
            for rid in list(batch.out):
                got[rid] = batch.out.pop(rid)
            if not batch.open:
                self.batches.remove(batch)
        return got


def split(rng: random.Random, ids: list[str], relays: int) -> list[tuple[str, list[str]]]:
    """``ids`` in order, cut into runs, each asked directly ("") or by one of the relays."""
    out: list[tuple[str, list[str]]] = []
    i = 0
    while i < len(ids):
        k = rng.randint(1, 4)
        via = rng.choice(["", *[f"relay-{j}" for j in range(relays)]])
        out.append((via, ids[i : i + k]))
        i += k
    return out

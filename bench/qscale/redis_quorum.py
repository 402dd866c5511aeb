"""The Redis quorum (``spottrain.quorum``) under N simulated replicas: the bench's own
``redis-server`` and ``procs`` client processes (``qscale/redis_clients.py``), each holding
N / procs replicas with a connection apiece, all running ``spottrain.quorum.scripts``' Lua.

A round: every live replica sends its request (and its BLPOP); the round is timed from the
LAST request sent (over all processes; CLOCK_MONOTONIC is shared) to the last answer
delivered, so the clients' own time to send N requests on these 2 cores is not counted as
the quorum's. Redis's CPU seconds, bytes and per-command times are read before and after
each round (``INFO``)."""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spottrain.quorum.model import QuorumConfig

from .redis_beats import beater
from .redis_calls import Calls, sources
from .redis_clients import worker
from .redis_server import BenchRedis, diff

RUN = "qscale"
ROUND_TIMEOUT_S = 60.0


@dataclass
class Round:
    """One round's figures (clients' and Redis's)."""

    n: int
    round_s: float
    spread_s: float  # first request sent to last request sent (the clients' own lag)
    sent: int
    recv: int
    counts: dict[int, int]
    qids: list[int]
    ticks: int
    errors: list[str]
    redis: dict[str, Any]
    last_sent: float
    last_recv: float


@dataclass
class Procs:
    """The client processes and their pipes."""

    pipes: list[Any] = field(default_factory=list)
    procs: list[Any] = field(default_factory=list)
    beat_pipes: list[Any] = field(default_factory=list)  # each client process's heartbeats
    beat_procs: list[Any] = field(default_factory=list)
    owner: dict[str, int] = field(default_factory=dict)


class RedisQuorum:
    """N simulated replicas of the Redis quorum, connected and joined (a context manager)."""

    name = "Redis quorum (spottrain.quorum)"

    def __init__(self, n: int, procs: int, config: QuorumConfig, block: int = 1) -> None:
        self.n = n
        self.config = config
        self.nprocs = max(1, min(procs, n))
        self.ids = [f"replica-{i:05d}" for i in range(n)]
        relays = n // block + self.nprocs if block > 1 else 0  # a connection per relay
        self.server = BenchRedis(maxclients=n + 4 * self.nprocs + 64 + relays)
        self.p = Procs()
        self.calls: Calls | None = None
        self.step = 0
        self.qid = 0
        self.live = list(self.ids)
        self.next_id = n  # a dropped replica's new id (rejoin_dropped)
        self.relay_group = 0  # > 0: rounds go through relays of this many replicas
        self.block = max(1, block)  # ids dealt to the processes in blocks: whole relay groups

    def __enter__(self) -> RedisQuorum:
        self.server.__enter__()
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        from spottrain.protocol.keys import RunKeys

        shas = {name: self.server.r.script_load(src) for name, src in sources().items()}
        self.calls = Calls(RunKeys(RUN), self.config, shas)
        for k in range(self.nprocs):
            mine = [r for i, r in enumerate(self.ids) if (i // self.block) % self.nprocs == k]
            self._spawn(worker, mine, self.p.pipes, self.p.procs)
            self.p.owner.update(dict.fromkeys(mine, k))
            self._spawn(beater, mine, self.p.beat_pipes, self.p.beat_procs)
        for pipe in self.p.pipes:
            pipe.send(("connect", shas))
        for pipe in self.p.pipes:
            self._recv(pipe, 300)
        self._all(self.p.beat_pipes, ("start", shas))

    def _spawn(self, target: Any, mine: list[str], pipes: list[Any], procs: list[Any]) -> None:
        """Start ``target`` (a client or a heartbeat process) for the replicas ``mine``."""
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=target, args=(child, self.server.port, RUN, mine, self.config), daemon=True
        )
        proc.start()
        pipes.append(parent)
        procs.append(proc)

    def _recv(self, pipe: Any, timeout: float) -> dict[str, Any]:
        if not pipe.poll(timeout):
            raise RuntimeError(f"a client process did not answer within {timeout:.0f} s")
        return pipe.recv()

    def __exit__(self, *exc: object) -> None:
        for pipe in [*self.p.pipes, *self.p.beat_pipes]:
            with contextlib.suppress(OSError):
                pipe.send(("stop",))
        for proc in [*self.p.procs, *self.p.beat_procs]:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self.server.__exit__()

    def set_config(self, config: QuorumConfig) -> None:
        self.config = config
        assert self.calls is not None
        self.calls.config = config
        self._all([*self.p.pipes, *self.p.beat_pipes], ("config", config))

    def _all(self, pipes: list[Any], msg: tuple[Any, ...]) -> list[dict[str, Any]]:
        for pipe in pipes:
            pipe.send(msg)
        return [self._recv(pipe, 60) for pipe in pipes]

    def silence(self, ids: list[str]) -> float:
        """Stop these replicas' requests and heartbeats; returns when the last stopped."""
        by: dict[int, list[str]] = {}
        for rid in ids:
            by.setdefault(self.p.owner[rid], []).append(rid)
        at = 0.0
        for k, mine in by.items():
            for pipe in (self.p.beat_pipes[k], self.p.pipes[k]):
                pipe.send(("silence", mine))
                at = max(at, self._recv(pipe, 60)["silenced"])
        self.live = [r for r in self.live if r not in ids]
        return at

    def round(
        self, between: Callable[[], None] | None = None, timeout_s: float = ROUND_TIMEOUT_S
    ) -> Round:
        """One round of every live replica; ``between`` runs once every request is sent."""
        self.step += 1
        before = self.server.snapshot()
        for pipe in self.p.pipes:
            if self.relay_group > 0:
                pipe.send(("relay_round", self.step, self.qid, timeout_s, self.relay_group))
            else:
                pipe.send(("round", self.step, self.qid, timeout_s))
        sent = [self._recv(pipe, ROUND_TIMEOUT_S)["sent"] for pipe in self.p.pipes]
        if between is not None:
            between()
        outs = [self._recv(pipe, ROUND_TIMEOUT_S + 30) for pipe in self.p.pipes]
        red = diff(before, self.server.snapshot())
        counts: dict[int, int] = {}
        for o in outs:
            for c, k in o["answers"].items():
                counts[c] = counts.get(c, 0) + k
        qids = sorted({q for o in outs for q in o["qids"]})
        if qids:
            self.qid = max(qids)
        last_recv = max(o["last_recv"] for o in outs)
        return Round(
            n=len(self.live),
            round_s=last_recv - max(sent),
            spread_s=max(sent) - min(o["first_sent"] for o in outs),
            sent=sum(o["sent"] for o in outs),
            recv=sum(o["recv"] for o in outs),
            counts=counts,
            qids=qids,
            ticks=sum(o["ticks"] for o in outs),
            errors=[e for o in outs for e in o["errors"]],
            redis=red,
            last_sent=max(sent),
            last_recv=last_recv,
        )

    def leave(self, rid: str) -> float:
        """The explicit leave of ``rid`` (its script, from the coordinator); returns when sent."""
        assert self.calls is not None
        t = time.monotonic()
        self.server.r.execute_command(*self.calls.leave(rid))
        return t

    def gone(self) -> dict[str, str]:
        assert self.calls is not None
        raw = self.server.r.hgetall(self.calls.keys.quorum_key("gone"))
        return {k.decode(): v.decode() for k, v in raw.items()}

    def rejoin_dropped(self) -> list[str]:
        """Every live replica the quorum dropped back under a new id, as a fleet's dropped
        replica restarts (its id is refused for good): renamed in its client and heartbeat
        processes (``replica-<n + k>``, on a new connection), joined and heartbeating.
        Returns the dropped ids."""
        live = set(self.live)
        dropped = sorted(
            r for r, why in self.gone().items() if r in live and why.startswith("dropped")
        )
        new_ids = {old: f"replica-{self.next_id + k:05d}" for k, old in enumerate(dropped)}
        self.next_id += len(dropped)
        if not new_ids:
            return []
        self._all(self.p.pipes, ("rename", new_ids))
        self._all(self.p.beat_pipes, ("rename", new_ids))
        for old, new in new_ids.items():
            self.p.owner[new] = self.p.owner.pop(old)
        self.ids = [new_ids.get(r, r) for r in self.ids]
        # Last: a round closes without a newcomer that asks after every member of the last
        # quorum did (the fast path), so a silent loss is measured on a member (live[0]).
        self.live = [r for r in self.live if r not in new_ids] + list(new_ids.values())
        return dropped

    def worker_stats(self) -> list[dict[str, Any]]:
        return self._all(self.p.beat_pipes, ("stats",))

    def pause_worker(self, k: int, seconds: float) -> threading.Thread:
        """SIGSTOP client process ``k`` and its heartbeats for ``seconds`` (in a thread, as
        a VM frozen whole), then SIGCONT."""
        pids = [self.p.procs[k].pid, self.p.beat_procs[k].pid]

        def run() -> None:
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            time.sleep(seconds)
            for pid in pids:
                os.kill(pid, signal.SIGCONT)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t


def check(r: Round, expect: int, what: str) -> None:
    if r.errors:
        raise RuntimeError(f"{what}: {len(r.errors)} replica(s) failed, e.g. {r.errors[0]}")
    if r.counts != {expect: expect}:
        raise RuntimeError(
            f"{what}: answers by quorum size {r.counts}, expected {expect} of {expect}"
        )


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank; with few values p99 is the largest)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def median(values: list[float]) -> float:
    return statistics.median(values)

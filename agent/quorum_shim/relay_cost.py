"""What the relay hop costs: ``members`` members on this machine each send one step's
request to one relay over its wire (:mod:`.wire`: each member on its own TCP connection,
as each VM has), the relay batches
them Nagle-style into ``request_batch`` calls on a stand-in quorum that forms the round the
moment every member asked (so Redis's part is zero), and fans the answers back.

``python -m spottrain.agent.quorum_shim.relay_cost [members] [rounds] [--redis=PORT
[--direct]]`` prints the round (the first request sent to the last answer back) and one
member's round trip, p50 and p99, and the relay's CPU per round. With ``--redis`` the relay
asks a real Redis through ``request_batch``; with ``--direct`` too, the members ask that
Redis themselves (no relay), for comparison.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from spottrain.ports import free_port
from spottrain.quorum.errors import QuorumError
from spottrain.quorum.model import Answer, BatchItem

from .relay import Batcher
from .wire import RelayClient, RelayServer

# (member index, step, timeout) -> the quorum's size it was answered with
Call = Callable[[int, int, float], int]
# A warm-up round can split the members (some formed a first quorum, the others wait for
# them in the next round, which they never ask while they wait at the barrier: up to the
# heartbeat timeout): those give up this soon and ask again in the next warm-up round.
WARM_UP_S = 3.0


class _InstantQuorum:
    """Forms a round the moment ``members`` requests arrived (any number of batches)."""

    def __init__(self, members: int) -> None:
        self.members = members
        self._cond = threading.Condition()
        self._asked: set[str] = set()
        self._round = 0
        self.batches = 0

    @property
    def rounds(self) -> int:
        return self._round

    def request_batch(
        self, relay_id: str, items: Sequence[BatchItem], timeout: float
    ) -> dict[str, Answer | QuorumError]:
        with self._cond:
            self.batches += 1
            mine = self._round
            self._asked.update(i.replica_id for i in items)
            if len(self._asked) >= self.members:
                self._asked.clear()
                self._round += 1
                self._cond.notify_all()
            else:
                self._cond.wait_for(lambda: self._round > mine, timeout)
        a = Answer(self._round, 0, self.members, 1, None, 1, 0, "e", {})
        return {i.replica_id: a for i in items}


def _one_round(calls: list[Call], step: int, warm_up: bool = False) -> tuple[list[float], ...]:
    """Every member asks at once (a barrier); when each asked and was answered, and the
    smallest quorum any was answered with (-1 in a warm-up round where one failed)."""
    start = threading.Barrier(len(calls) + 1)
    begins, ends = [0.0] * len(calls), [0.0] * len(calls)
    counts = [0.0] * len(calls)
    errors: list[str] = []

    def member(j: int) -> None:
        start.wait()
        begins[j] = time.perf_counter()
        try:
            counts[j] = calls[j](j, step, WARM_UP_S if warm_up else 30.0)
        except Exception as exc:  # reported, not a traceback per member
            counts[j] = -1
            errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
        ends[j] = time.perf_counter()

    threads = [threading.Thread(target=member, args=(j,)) for j in range(len(calls))]
    for t in threads:
        t.start()
    start.wait()
    for t in threads:
        t.join()
    if errors and not warm_up:
        raise RuntimeError(f"{len(errors)} member(s) failed in round {step}: {errors[0]}")
    return begins, ends, [min(counts)]


def _relayed(port: int, members: int) -> tuple[list[Call], list[Any]]:
    address = f"127.0.0.1:{port}"
    conns = [RelayClient(address, 20) for _ in range(members)]

    def call(j: int, step: int, timeout: float) -> int:
        if conns[j].closed:  # a warm-up deadline closed it: reconnect, as a member does
            conns[j] = RelayClient(address, 20)
        return conns[j].ask(BatchItem(f"m{j}", step), timeout).replica_count

    return [call] * members, conns


def _direct(redis_port: int, run_id: str, members: int) -> list[Call]:
    client = _client(redis_port, run_id, members)
    return [
        lambda j, step, timeout: client.request(f"m{j}", step, timeout=timeout).replica_count
    ] * members


def _measure(
    port: int, members: int, rounds: int, direct: tuple[int, str] | None = None
) -> tuple[list[float], list[float]]:
    """``rounds`` rounds once every member is in the quorum (through the relay on ``port``,
    or with ``direct`` = (Redis port, run id) straight to Redis)."""
    conns: list[Any] = []
    if direct is None:
        calls, conns = _relayed(port, members)
    else:
        calls = _direct(*direct, members)
    round_ms: list[float] = []
    rtt_ms: list[float] = []
    try:
        step = 0
        for step in range(1, 40):  # warm-up: until every member is in (and connected)
            if _one_round(calls, step, warm_up=True)[2][0] == members and step > 2:
                break
        for n in range(step + 1, step + 1 + rounds):
            begins, ends, _ = _one_round(calls, n)
            round_ms.append((max(ends) - min(begins)) * 1e3)
            rtt_ms += [(e - b) * 1e3 for b, e in zip(begins, ends, strict=True)]
    finally:
        for c in conns:
            c.close()
    return round_ms, rtt_ms


def _members(port: int, members: int, rounds: int, direct: Any, conn: Any) -> None:
    try:
        conn.send(_measure(port, members, rounds, direct))
    except Exception as exc:  # the parent raises it
        conn.send(f"{type(exc).__name__}: {exc}")


def _client(redis_port: int, run_id: str, members: int) -> Any:
    """A quorum client of run ``run_id`` with ``members`` joined (Redis on ``redis_port``):
    a 30 s heartbeat timeout and a 1 s join timeout, so this machine's lag drops nobody (a
    steady round forms the moment every member asked, waiting on neither)."""
    import redis

    from spottrain.protocol.keys import RunKeys
    from spottrain.quorum.client import QuorumClient
    from spottrain.quorum.model import Member, QuorumConfig

    r = redis.Redis(port=redis_port, max_connections=members + 8)
    config = QuorumConfig(heartbeat_timeout_ms=30_000, join_timeout_ms=1000)
    client = QuorumClient(r, RunKeys(run_id), config)
    for j in range(members):
        client.join(Member(f"m{j}"))
    return client


def hop_cost(
    members: int = 100, rounds: int = 20, *, redis_port: int = 0, direct: bool = False
) -> dict[str, float]:
    """Milliseconds: ``round_p50/p99`` (first request sent to the last answer back) and
    ``rtt_p50/p99`` (one member's request to its answer), ``batches_per_round`` and
    ``relay_cpu_ms_round`` (this process's CPU per round: the relay's; the members run in a
    process of their own, as on their own VMs). With ``redis_port`` the relay asks a real
    Redis (``request_batch``); with ``direct`` too, the members ask it without a relay."""
    run_id = f"relay-cost-{os.getpid()}-{int(time.time())}"
    quorum: Any = _InstantQuorum(members)
    if redis_port:
        quorum = _Counting(_client(redis_port, run_id, members))
    batcher = Batcher(quorum, "cost")
    port = free_port()
    server = RelayServer(f"127.0.0.1:{port}", batcher.submit).start()
    try:
        ctx = multiprocessing.get_context("spawn")
        here, there = ctx.Pipe()
        args = (port, members, rounds, (redis_port, run_id) if direct else None, there)
        child = ctx.Process(target=_members, args=args)
        cpu = time.process_time()
        child.start()
        got = here.recv()
        if isinstance(got, str):
            raise RuntimeError(f"the members failed: {got}")
        round_ms, rtt_ms = got
        cpu = time.process_time() - cpu
        child.join()
    finally:
        server.stop()
        batcher.stop()
    q = statistics.quantiles
    total = quorum.batches / max(1, quorum.rounds)
    return {
        "round_p50": statistics.median(round_ms),
        "round_p99": q(round_ms, n=100)[98] if len(round_ms) > 1 else round_ms[0],
        "rtt_p50": statistics.median(rtt_ms),
        "rtt_p99": q(rtt_ms, n=100)[98],
        "batches_per_round": total,
        "relay_cpu_ms_round": cpu * 1e3 / max(1, quorum.rounds),  # warm-ups included
    }


class _Counting:
    """A real client's ``request_batch``, counted (batches, rounds formed)."""

    def __init__(self, client: Any) -> None:
        self.client, self.batches = client, 0
        self._qids: set[tuple[int, int]] = set()

    @property
    def rounds(self) -> int:
        return len(self._qids) or 1

    def request_batch(
        self, relay_id: str, items: Sequence[BatchItem], timeout: float
    ) -> dict[str, Answer | QuorumError]:
        self.batches += 1
        got = self.client.request_batch(relay_id, items, timeout)
        self._qids.update((a.quorum_id, a.max_step) for a in got.values() if isinstance(a, Answer))
        return dict(got)


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:] if a.isdigit()]
    redis_port = next((int(a.split("=")[1]) for a in sys.argv if a.startswith("--redis=")), 0)
    got = hop_cost(*args, redis_port=redis_port, direct="--direct" in sys.argv)
    print(" ".join(f"{k} {v:.2f}" for k, v in got.items()))

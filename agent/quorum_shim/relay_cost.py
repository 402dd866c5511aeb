"""What the relay hop costs: ``members`` members on this machine each send one step's
request to one relay over gRPC (each on its own channel, as each VM has), the relay batches
them Nagle-style into ``request_batch`` calls on a stand-in quorum that forms the round the
moment every member asked (so Redis's part is zero), and fans the answers back.

``python -m spottrain.agent.quorum_shim.relay_cost [members] [rounds]`` prints the round
(the first request sent to the last answer back) and one member's round trip, p50 and p99.
"""

from __future__ import annotations

import multiprocessing
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc

from spottrain.ports import free_port
from spottrain.quorum.errors import QuorumError
from spottrain.quorum.model import Answer, BatchItem

from .relay import RELAY_METHOD, Batcher, encode_request, relay_handler
from .server import _DaemonPool


class _InstantQuorum:
    """Forms a round the moment ``members`` requests arrived (any number of batches)."""

    def __init__(self, members: int) -> None:
        self.members = members
        self._cond = threading.Condition()
        self._asked: set[str] = set()
        self._round = 0
        self.batches = 0

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


def _one_round(calls: list[grpc.UnaryUnaryMultiCallable], step: int) -> tuple[list[float], ...]:
    """Every member asks at once (a barrier); when each asked and was answered."""
    start = threading.Barrier(len(calls) + 1)
    begins, ends = [0.0] * len(calls), [0.0] * len(calls)

    def member(j: int) -> None:
        body = encode_request(BatchItem(f"m{j}", step), 5.0)
        start.wait()
        begins[j] = time.perf_counter()
        calls[j](body, timeout=10)
        ends[j] = time.perf_counter()

    threads = [threading.Thread(target=member, args=(j,)) for j in range(len(calls))]
    for t in threads:
        t.start()
    start.wait()
    for t in threads:
        t.join()
    return begins, ends


def _measure(port: int, members: int, rounds: int) -> tuple[list[float], list[float]]:
    opts = [("grpc.use_local_subchannel_pool", 1)]  # one connection per member, as per VM
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}", options=opts) for _ in range(members)]
    calls = [ch.unary_unary(RELAY_METHOD) for ch in channels]
    round_ms: list[float] = []
    rtt_ms: list[float] = []
    try:
        for n in range(rounds + 2):  # two warm-up rounds (connections, threads)
            begins, ends = _one_round(calls, n)
            if n >= 2:
                round_ms.append((max(ends) - min(begins)) * 1e3)
                rtt_ms += [(e - b) * 1e3 for b, e in zip(begins, ends, strict=True)]
    finally:
        for ch in channels:
            ch.close()
    return round_ms, rtt_ms


def _members(port: int, members: int, rounds: int, conn: Any) -> None:
    conn.send(_measure(port, members, rounds))


def hop_cost(members: int = 100, rounds: int = 20, *, split: bool = True) -> dict[str, float]:
    """Milliseconds: ``round_p50/p99`` (first request sent to the last answer back) and
    ``rtt_p50/p99`` (one member's request to its answer), plus ``batches_per_round``.
    ``split``: the members run in a child process (the relay's VM runs only the relay), and
    ``relay_cpu_ms_round`` is the relay process's CPU per round."""
    quorum = _InstantQuorum(members)
    batcher = Batcher(quorum, "cost")
    server = grpc.server(_DaemonPool(members + 8))
    server.add_generic_rpc_handlers((relay_handler(batcher.ask),))
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        cpu = time.process_time()
        if split:  # the members in a process of their own: the relay's CPU is its own
            ctx = multiprocessing.get_context("spawn")
            here, there = ctx.Pipe()
            child = ctx.Process(target=_members, args=(port, members, rounds, there))
            child.start()
            round_ms, rtt_ms = here.recv()
            child.join()
        else:
            round_ms, rtt_ms = _measure(port, members, rounds)
        cpu = time.process_time() - cpu
    finally:
        server.stop(0)
        batcher.stop()
    q = statistics.quantiles
    return {
        "round_p50": statistics.median(round_ms),
        "round_p99": q(round_ms, n=100)[98] if len(round_ms) > 1 else round_ms[0],
        "rtt_p50": statistics.median(rtt_ms),
        "rtt_p99": q(rtt_ms, n=100)[98],
        "batches_per_round": quorum.batches / (rounds + 2),
        # The relay's own CPU (with split: the relay process only; warm-ups included).
        "relay_cpu_ms_round": cpu * 1e3 / (rounds + 2),
    }


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:3]]
    got = hop_cost(*args, split="--one-process" not in sys.argv)
    print(" ".join(f"{k} {v:.2f}" for k, v in got.items()))

"""A quorum round, measured the same way for every implementation: ``n`` fake replicas, one
thread and one client each, ask for the quorum at the same moment (a barrier); a round runs
from the barrier's release to the last answer. The server's CPU seconds per round are read
beside it, because here the clients share the server's cores (on a real fleet each replica
is its own machine and only the server's work is serial)."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

# One quorum call for replica ``i`` at step ``step``: returns the member count it got.
QuorumCall = Callable[[int], int]


class QuorumServer(Protocol):
    """What a quorum implementation gives the bench (a context manager)."""

    name: str

    def __enter__(self) -> QuorumServer: ...

    def __exit__(self, *exc: object) -> None: ...

    def client(self, i: int) -> QuorumCall:
        """A client of its own for fake replica ``i``."""
        ...

    def cpu_s(self) -> float:
        """The server's CPU seconds so far (user + system)."""
        ...


@dataclass
class RoundFigures:
    n: int
    rounds_s: list[float] = field(default_factory=list)
    server_cpu_s: list[float] = field(default_factory=list)

    @property
    def median_s(self) -> float:
        return statistics.median(self.rounds_s)

    @property
    def median_cpu_s(self) -> float:
        return statistics.median(self.server_cpu_s)


def measure(
    make_server: Callable[[int], QuorumServer], n: int, rounds: int, warmup: int = 1
) -> RoundFigures:
    """``rounds`` rounds of ``n`` replicas on one fresh server, after ``warmup`` rounds that
    do not count (the first one also opens every client's connection)."""
    out = RoundFigures(n)
    with make_server(n) as server:
        calls = [server.client(i) for i in range(n)]
        start = threading.Barrier(n + 1)
        done: list[float] = [0.0] * n
        errors: list[BaseException] = []

        def replica(i: int) -> None:
            for step in range(warmup + rounds):
                start.wait()
                try:
                    members = calls[i](step)
                    if members != n:
                        raise RuntimeError(f"replica {i} got a quorum of {members}, not {n}")
                except BaseException as e:
                    errors.append(e)
                done[i] = time.perf_counter()
                start.wait()

        threads = [threading.Thread(target=replica, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        for step in range(warmup + rounds):
            cpu0 = server.cpu_s()
            start.wait()
            t0 = time.perf_counter()
            start.wait()  # every replica has its answer
            if errors:
                raise RuntimeError(f"{server.name}, {n} replicas: {errors[0]}")
            if step >= warmup:
                out.rounds_s.append(max(done) - t0)
                out.server_cpu_s.append(server.cpu_s() - cpu0)
        for t in threads:
            t.join()
    return out

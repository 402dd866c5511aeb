"""The cross-replica process-group rebuild every survivor pays at every quorum change:
torchft's own ``ProcessGroupGloo.configure`` (abort the old group, connect a store client,
build a gloo group over it), then one all-reduce, in ``n`` processes released at once.

One process per rank, all on this machine: at 16 ranks on 2 cores the ranks queue for the
CPU, so the slope is an upper bound of what separate machines would see."""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from spottrain.ports import free_port

TIMEOUT = timedelta(seconds=120)


@dataclass
class GroupFigures:
    n: int
    rebuilds_s: list[float] = field(default_factory=list)

    @property
    def median_s(self) -> float:
        return statistics.median(self.rebuilds_s)


def _rank(
    rank: int,
    sizes: list[int],
    reps: int,
    port: int,
    barriers: dict[int, Any],
    results: Any,
) -> None:
    os.environ.setdefault("RUST_LOG", "warn")
    import torch
    from torchft.process_group import ProcessGroupGloo

    torch.set_num_threads(1)
    pg = ProcessGroupGloo(timeout=TIMEOUT)
    for n in sizes:
        if rank >= n:
            continue
        for rep in range(reps + 1):  # the first one warms gloo's code paths; not counted
            barriers[n].wait()
            pg.configure(f"127.0.0.1:{port}/n{n}/q{rep}", f"replica-{rank}", rank, n)
            t = torch.ones(1)
            pg.allreduce([t], torch.distributed.ReduceOp.SUM).wait()
            if int(t.item()) != n:
                raise RuntimeError(f"rank {rank} of {n}: all-reduce gave {t.item()}")
            results.put((n, rep, rank, time.monotonic()))
            barriers[n].wait()
    pg.abort(errored=False)


def measure(sizes: list[int], reps: int) -> list[GroupFigures]:
    """Median-ready rebuild times at each group size in ``sizes``."""
    from torch.distributed import TCPStore

    ctx = mp.get_context("spawn")
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    barriers = {n: ctx.Barrier(n + 1) for n in sizes}
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, sizes, reps, port, barriers, results), daemon=True)
        for r in range(max(sizes))
    ]
    for p in procs:
        p.start()
    out: list[GroupFigures] = []
    try:
        for n in sizes:
            fig = GroupFigures(n)
            for rep in range(reps + 1):
                barriers[n].wait()
                t0 = time.monotonic()
                ends = [results.get(timeout=TIMEOUT.total_seconds())[3] for _ in range(n)]
                barriers[n].wait()
                if rep:
                    fig.rebuilds_s.append(max(ends) - t0)
            out.append(fig)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        del store
    return out

"""Benchmark of the Redis rendezvous at scale, with simulated agents.

Every simulated node is a real :class:`RedisRendezvousHandler` (its own Redis connection, its
own heartbeat thread) talking to one real ``redis-server`` that this script starts. There is
no training and no torchrun: the script plays the agent's part, calling ``next_rendezvous()``
to form a round and polling ``num_nodes_waiting()`` every 0.1 s the way torchrun's monitor
loop does. The nodes live in several worker processes (multiprocessing, spawn) so that one
interpreter's GIL does not serialise the whole fleet.

For each fleet size N it measures:

1. form: from the moment all N ``next_rendezvous()`` calls are released until every node
   holds a RendezvousInfo with world size N (``min_nodes=1``, ``max_nodes=N``);
2. loss: 1% of the nodes (at least one) are frozen, meaning their heartbeats stop and nothing
   calls them again. *detect* runs from the freeze until every survivor has seen
   ``num_nodes_waiting() > 0``; it includes the heartbeat timeout (1 s x 5 = 5 s) by design.
   *re-form* runs from the freeze until every survivor has finished a new
   ``next_rendezvous()`` with world size N - lost; a survivor starts it as soon as it has
   detected the loss, as torchrun does;
3. Redis commands/s in steady state (all formed, beating, polled), from the delta of
   ``INFO stats`` ``total_commands_processed`` (which counts the commands that Lua scripts
   run, too), with the client requests and Redis CPU beside it;
4. compare-and-set conflicts: ``set_state`` calls answered ``has_set`` False, of all calls.

Beside our steady-state load it prints the anchor: torch's own dynamic rendezvous writes the
whole pickled state by compare-and-set on every keep-alive (every 5 s by default), that is
N / 5 writes per second of a blob whose size is measured here from Redis.

Caveat: this machine's cores simulate the work of N machines. Every node's pickling,
unpickling and Python bookkeeping shares those cores (and Redis shares them too), so at large
N the times measured here are an upper bound set by the simulation's CPU; the table shows how
busy the CPU was and how late the 0.1 s polls ran.

Usage::

    .venv/bin/python bench/rendezvous_scale.py            # 64, 256 and 1,024 nodes
    .venv/bin/python bench/rendezvous_scale.py --quick    # 16 and 64 nodes, a smoke test

The last line printed is a JSON object of the figures.
"""

from __future__ import annotations

import math
import os
import sys
import time

from benchlib import parser, print_figures
from rdzv_scale.report import print_report, summary_figures
from rdzv_scale.run import run_size

from spottrain.controller.run.embedded_redis import RedisServer


def _default_procs(n: int) -> int:
    # About 32 nodes a process: with more threads behind one GIL, heartbeat threads wait
    # seconds for it while the join threads spin, and get declared dead. Measured on 2 cores
    # at 256 nodes: 2 processes formed in 32 s, 4 in 14 s, 8 in 16 s.
    return max(1, min(16, math.ceil(n / 32)))


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="64,256,1024", help="fleet sizes (default 64,256,1024)")
    ap.add_argument("--quick", action="store_true", help="only 16 and 64 nodes: a smoke test")
    ap.add_argument("--procs", type=int, default=0, help="worker processes (default: by size)")
    ap.add_argument("--steady-seconds", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=2.0, help="polling before measuring")
    ap.add_argument(
        "--form-timeout", type=float, default=0.0, help="default N/4 s within [60, 200]"
    )
    ap.add_argument(
        "--reform-timeout", type=float, default=0.0, help="default N/2 s within [120, 240]"
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--as-is",
        action="store_true",
        help="keep torch's inspect.stack() event naming (by default the simulation replaces "
        "it with an equivalent that costs microseconds, not milliseconds, per sync)",
    )
    args = ap.parse_args(argv)
    sizes = [16, 64] if args.quick else [int(x) for x in args.nodes.split(",") if x.strip()]
    cores = os.cpu_count() or 1
    started = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {msg}", flush=True)

    results = []
    with RedisServer() as server:
        log(f"redis-server on {server.endpoint}; sizes {sizes}; {cores} cores")
        for n in sizes:
            procs = args.procs or _default_procs(n)
            log(f"N={n}: {procs} worker processes")
            results.append(run_size(server, n, procs, args, log))
    runtime = time.monotonic() - started
    print_report(results, runtime, cores, args.as_is)
    print_figures(summary_figures(results, runtime, cores, args.as_is))
    return 0 if all("failure" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

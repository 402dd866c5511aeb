"""Recovery benchmark: the redis rendezvous against torchrun's own c10d, same workload.

Each repetition runs one elastic job of three torchrun nodes (examples/elastic_train.py on the
CPU, gloo) per backend and does to it, in order:

  (a) SIGKILL a node that neither holds rank 0 nor hosts c10d's store: seconds from the kill
      to the first step at world size 2;
  (b) start a new node: seconds from its start to the first step at world size 3;
  (d) redis only: the new node leaves explicitly (`spottrain-agent leave`): seconds to the
      first step at world size 2;
  (c) SIGKILL the node that hosts c10d's TCP store (the first one started; redis has no such
      node): seconds to the first step at the smaller size, capped; null if never.

c10d runs with torch's defaults except TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: torch's shared
agent store is known to break rejoining after the first round (--c10d-share-store adds one run
with it, reported apart).

    .venv/bin/python bench/rendezvous.py [--reps 3] [--cap 120]

Prints a table of medians and ends with one JSON line.
"""

from __future__ import annotations

import json
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from benchlib import median, parser, print_figures, ratio

from spottrain.agent.rendezvous.membership import leave_node
from spottrain.agent.testing.local_launcher import LocalElasticJob
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.ports import free_port
from spottrain.protocol.keys import RunKeys

REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "examples" / "elastic_train.py")
START_TIMEOUT = 180


def first_step_at(job: LocalElasticJob, world: int, since: float, cap: float) -> float | None:
    """Seconds from `since` to the first rank-0 step at `world`, or None within `cap`."""
    deadline = time.monotonic() + cap
    while time.monotonic() < deadline:
        hits = [r.t for r in job.records() if r.t >= since and r.world == world and r.rank == 0]
        if hits:
            return min(hits) - since
        time.sleep(0.05)
    return None


def run_once(
    backend: str, workdir: Path, server: RedisServer, cap: float, share_store: bool = False
) -> dict[str, float | None]:
    endpoint = server.endpoint if backend == "redis" else f"127.0.0.1:{free_port()}"
    redis_client = server.client()
    job = LocalElasticJob(
        workdir,
        endpoint,
        f"bench-{uuid.uuid4().hex[:8]}",
        script=SCRIPT,
        backend=backend,
        step_time=0.1,
    )
    if backend == "c10d" and not share_store:
        job.extra_env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    out: dict[str, float | None] = {}
    try:
        job.start_node("a")  # with c10d, the first node hosts the store
        time.sleep(1.0)
        job.start_node("b")
        job.start_node("c")
        if first_step_at(job, 3, 0.0, START_TIMEOUT) is None:
            raise RuntimeError(f"{backend}: the job never reached world size 3\n{job.diagnose()}")
        time.sleep(2.0)

        victim = next(n for n in ("b", "c") if n != job.rank0_node())
        t0 = time.time()
        job.nodes[victim].kill()
        out["loss_s"] = first_step_at(job, 2, t0, cap)
        if out["loss_s"] is None:
            return {**out, "join_s": None, "leave_s": None, "host_loss_s": None}
        time.sleep(2.0)

        t0 = time.time()
        job.start_node("d")
        out["join_s"] = first_step_at(job, 3, t0, cap)
        time.sleep(2.0)

        if backend == "redis" and out["join_s"] is not None:
            t0 = time.time()
            leave_node(redis_client, RunKeys(job.run_id), "d")
            out["leave_s"] = first_step_at(job, 2, t0, cap)
            job.nodes["d"].wait(timeout=60)
            time.sleep(2.0)
        else:
            out["leave_s"] = None

        world_now = 3 if (backend != "redis" and out["join_s"] is not None) else 2
        t0 = time.time()
        job.nodes["a"].kill()
        out["host_loss_s"] = first_step_at(job, world_now - 1, t0, cap)
        return out
    finally:
        job.close()


def main() -> None:
    ap = parser(__doc__, reps=3)
    ap.add_argument("--cap", type=float, default=120.0, help="longest wait for a recovery, s")
    ap.add_argument(
        "--c10d-share-store",
        action="store_true",
        help="also run c10d with torch's shared agent store (its true default), once",
    )
    args = ap.parse_args()

    results: dict[str, list[dict[str, float | None]]] = {"redis": [], "c10d": []}
    with RedisServer() as server, tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for backend in ("c10d", "redis"):
                r = run_once(backend, Path(tmp) / f"{backend}-{rep}", server, args.cap)
                results[backend].append(r)
                print(f"rep {rep} {backend:5s} {json.dumps(r)}", flush=True)
        shared: dict[str, float | None] | None = None
        if args.c10d_share_store:
            shared = run_once("c10d", Path(tmp) / "c10d-shared", server, args.cap, True)
            print(f"c10d with the shared agent store: {json.dumps(shared)}", flush=True)

    def med(backend: str, key: str) -> float | None:
        return median([r[key] for r in results[backend]])

    fmt: Callable[[float | None], str] = lambda v: "never" if v is None else f"{v:6.1f} s"  # noqa: E731
    rows = [
        ("(a) node loss -> training at world 2", "loss_s"),
        ("(b) new node start -> training at world 3", "join_s"),
        ("(c) loss of the c10d store host -> training", "host_loss_s"),
        ("(d) explicit leave -> training at world 2", "leave_s"),
    ]
    print(f"\nmedians of {args.reps} repetitions (cap {args.cap:.0f} s)")
    print(f"{'':45s} {'redis':>9s} {'c10d':>9s} {'ratio':>7s}")
    for label, key in rows:
        r, c = med("redis", key), med("c10d", key)
        rat = ratio(r, c)
        print(f"{label:45s} {fmt(r):>9s} {fmt(c):>9s} {'' if rat is None else rat:>7}")
    figures = {
        "loss_ratio": ratio(med("redis", "loss_s"), med("c10d", "loss_s")),
        "join_ratio": ratio(med("redis", "join_s"), med("c10d", "join_s")),
        "host_loss_s": med("redis", "host_loss_s"),
        "c10d_host_loss_s": med("c10d", "host_loss_s"),
        "leave_s": med("redis", "leave_s"),
        "redis_loss_s": med("redis", "loss_s"),
        "c10d_loss_s": med("c10d", "loss_s"),
        "redis_join_s": med("redis", "join_s"),
        "c10d_join_s": med("c10d", "join_s"),
        "reps": args.reps,
    }
    if shared is not None:
        figures["c10d_shared_store_join_s"] = shared.get("join_s")
    print_figures(figures)


if __name__ == "__main__":
    main()

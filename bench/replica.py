"""Replica mode against elastic mode: the survivors' pause through the same three events.

In one run, on the same machine and step pace:

  replica mode, on each quorum in turn: three replicas of examples/replica_train.py (one
      process each, gloo) on the Redis quorum (a lighthouse shim per replica, as each VM's
      agent runs it; a notice is also the explicit leave) and then beside the torchft
      lighthouse started as the controller starts it (its command line and flags); both
      with heartbeat timeout 1 s and join timeout 250 ms, and Redis for holder rows and
      drain requests. To replica-2 in turn: (a) a notice (the agent's drain request, SIGTERM
      after the grace if needed: the replica leaves), (b) SIGKILL, (c) SIGSTOP; a joiner is
      started after (a) and (b). Figures: the survivors' longest gap between committed
      steps through each event, the joiner's start to its first full-size step, its live
      state fetch (the heal's quorum wait), and a disk checkpoint load of the same state.
  elastic mode: three torchrun nodes on spottrain's Redis rendezvous running
      examples/elastic_train.py (replica_train.py has no elastic path yet; elastic_train.py
      is the closest: a 32-wide two-layer MLP at the same --step-time, gloo) and the same
      events to a node not holding rank 0: (a) the agent's leave, (b) SIGKILL, (c) SIGSTOP.
      Figure: the survivors' longest gap between steps through the re-form.

Each replica figure (the first quorum's: Redis by default) is printed beside the elastic
one, their ratio, and the issue's targets ((b), (c) <= 1.5 s + one step; (a) <= one step +
0.5 s; each <= 0.35 of elastic); then each event's pause on the Redis quorum beside the
lighthouse's.

    .venv/bin/python bench/replica.py [--reps 1] [--step-time 0.1] [--dim 32 --hidden 128]
        [--cap 90] [--quorum both|redis|lighthouse]

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("RUST_LOG", "warn")

from benchlib import median, parser, print_figures
from replica_parts import elastic_mode, replica_mode
from replica_parts.figures import EVENTS, MAX_SHARE_OF_ELASTIC, figures_of, verdicts

from spottrain.controller.run.embedded_redis import RedisServer


def _fmt(v: float | None, missing: str = "never") -> str:
    return missing if v is None else f"{v:7.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, reps=1)
    ap.add_argument("--step-time", type=float, default=0.1, help="extra seconds a step (0.1)")
    ap.add_argument("--dim", type=int, default=32, help="replica_train.py --dim (32)")
    ap.add_argument("--hidden", type=int, default=128, help="replica_train.py --hidden (128)")
    ap.add_argument("--cap", type=float, default=90.0, help="longest wait for a recovery, s")
    ap.add_argument(
        "--skip-elastic", action="store_true", help="replica mode only (no ratios; for tests)"
    )
    ap.add_argument(
        "--quorum",
        choices=("both", "redis", "lighthouse"),
        default="both",
        help="replica mode's quorum: the Redis quorum (spottrain's default), torchft's "
        "lighthouse, or both in turn (default); the first one measured gives the main figures",
    )
    args = ap.parse_args(argv)
    for flag in ("reps", "dim", "hidden"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag}: at least 1, got {getattr(args, flag)}")
    if args.step_time < 0 or args.cap <= 0:
        raise SystemExit("--step-time: 0 or more; --cap: more than 0 (seconds)")
    train_args = (
        *("--steps", "1000000", "--step-time", str(args.step_time)),
        *("--dim", str(args.dim), "--hidden", str(args.hidden), "--every-steps", "20"),
    )
    quorums = ("redis", "lighthouse") if args.quorum == "both" else (args.quorum,)
    runs: dict[str, list[replica_mode.ReplicaRun]] = {q: [] for q in quorums}
    els: list[elastic_mode.ElasticRun] = []
    with RedisServer() as server, tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for q in quorums:
                print(f"rep {rep}: replica mode on the {q} quorum ...", flush=True)
                runs[q].append(
                    replica_mode.run(
                        Path(tmp) / f"replica-{q}-{rep}", server, train_args, args.cap, q
                    )
                )
                print(f"rep {rep}: {runs[q][-1]}", flush=True)
            if args.skip_elastic:
                continue
            print(f"rep {rep}: elastic mode ...", flush=True)
            els.append(
                elastic_mode.run(Path(tmp) / f"elastic-{rep}", server, args.step_time, args.cap)
            )
            print(f"rep {rep}: {els[-1]}", flush=True)

    figures = report(runs[quorums[0]], els, args)
    figures["quorum"] = quorums[0]
    if len(quorums) > 1:
        figures.update(compare_quorums(runs, quorums))
    print_figures(figures)
    return 0


def compare_quorums(
    runs: dict[str, list[replica_mode.ReplicaRun]], quorums: tuple[str, ...]
) -> dict[str, object]:
    """The survivors' pause through each event on each quorum, side by side: the figures
    ``<quorum>_<event>_stall_s`` and ``<event>_<first>_vs_<second>``."""
    first, second = quorums
    stalls = {q: {e: median(r.stalls.get(e) for r in runs[q]) for e in EVENTS} for q in quorums}
    print(f"\n{'survivors pause, s':22s} {first:>10s} {second:>10s} {'ratio':>6s}")
    out: dict[str, object] = {}
    for e in EVENTS:
        a, b = stalls[first][e], stalls[second][e]
        r = None if a is None or not b else round(a / b, 2)
        print(f"{e:22s} {_fmt(a):>10s} {_fmt(b):>10s} {'-' if r is None else r:>6}")
        for q in quorums:
            v = stalls[q][e]
            out[f"{q}_{e}_stall_s"] = None if v is None else round(v, 3)
        out[f"{e}_{first}_vs_{second}"] = r
    return out


def report(
    reps: list[replica_mode.ReplicaRun],
    els: list[elastic_mode.ElasticRun],
    args: argparse.Namespace,
) -> dict[str, object]:
    """Print the medians side by side with the targets; return the JSON line's figures."""
    el_missing = "never" if els else "skipped"
    step_s = median(r.step_s for r in reps) or 0.0
    el_step = median(e.step_s for e in els)
    stalls = {e: median(r.stalls.get(e) for r in reps) for e in EVENTS}
    elastic = {e: median(x.stalls.get(e) for x in els) for e in EVENTS}
    results = verdicts(stalls, elastic, step_s)
    print(
        f"\nmedians of {args.reps} repetition(s); step: replica {_fmt(step_s)} s, "
        f"elastic {_fmt(el_step, el_missing)} s"
    )
    print(
        f"{'survivors pause, s':22s} {'replica':>8s} {'elastic':>8s} {'ratio':>6s} "
        f"{'target':>7s} met  (share <= {MAX_SHARE_OF_ELASTIC})"
    )
    for v in results:
        share = "-" if v.vs_elastic is None else v.vs_elastic
        print(
            f"{'(' + 'abc'[EVENTS.index(v.event)] + ') ' + v.event:22s} {_fmt(v.stall_s):>8s} "
            f"{_fmt(v.elastic_s, el_missing):>8s} {share:>6} "
            f"{v.target_s:7.3f} {'yes' if v.meets_absolute else 'NO':>3s}  "
            f"{'yes' if v.meets_share else 'NO'}"
        )
    join = median(j for r in reps for j in r.join_s)
    el_join = median(j for e in els for j in e.join_s)
    fetch = median(f for r in reps for f in r.fetch_s)
    load = median(r.load_s for r in reps)
    print(
        f"join (start -> first full-size step): replica {_fmt(join)} s, elastic "
        f"(start -> first step at world 3) {_fmt(el_join, el_missing)} s"
    )
    print(
        f"state of {reps[-1].state_bytes} bytes: live fetch {_fmt(fetch)} s, "
        f"checkpoint load {_fmt(load)} s"
    )
    figures = figures_of(step_s, el_step, results)
    figures.update(
        join_s=join,
        elastic_join_s=el_join,
        fetch_s=fetch,
        load_s=load,
        state_bytes=reps[-1].state_bytes,
        discarded={e: sum(r.discarded.get(e, 0) for r in reps) for e in EVENTS},
        reps=args.reps,
        model=f"replica_train.py --dim {args.dim} --hidden {args.hidden}; elastic: "
        "elastic_train.py --dim 32 (its Linear(32,32)+Linear(32,1)), same --step-time",
        cores=os.cpu_count(),
    )
    return figures


if __name__ == "__main__":
    sys.exit(main())

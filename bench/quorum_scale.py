"""The quorum's round time against the replica count, and the cross-replica process-group
rebuild against the group size, measured here (2 cores).

Quorum: the stock torchft lighthouse (``torchft_lighthouse`` 0.2.0 beside this interpreter,
``--quorum_tick_ms 10 --join_timeout_ms 60000 --heartbeat_timeout_ms 60000``, its INFO log
off) and N fake replicas, one thread and one ``LighthouseClient`` each, asking for the quorum
at the same moment; a round runs from that moment to the last answer (median of
``--rounds`` after one warm-up round). Its answer lists every member, so the lighthouse's
work per round grows with N^2: the bench fits ``round_s = a N + b N^2`` (least squares) and
extrapolates it to 4,000 and 12,500 replicas (extrapolated, not measured). The lighthouse's
own CPU seconds per round are printed beside it (the clients share these cores; on a fleet
only the lighthouse's part is serial). A second implementation is measured the same way by
adding a ``QuorumServer`` (``qscale/rounds.py``) to ``IMPLEMENTATIONS``.

Process group: torchft's ``ProcessGroupGloo.configure`` (what every survivor runs at every
quorum change) then one all-reduce, in 2..16 processes released at once; fitted as
``rebuild_s = c0 + c1 n`` (ranks queue for 2 cores at 16, so the slope is an upper bound).

    .venv/bin/python bench/quorum_scale.py [--replicas 10,100,300,1000] [--rounds 5]
        [--pg-ranks 2,4,8,16] [--pg-reps 3] [--no-pg]

The anchor, measured in the same run: the smallest count's round, against which each
count's round is given as a multiple beside N / N_min (linear) and (N / N_min)^2. The last
line is one JSON object of the figures.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("RUST_LOG", "warn")  # before torchft loads: see qscale/lighthouse.py

from benchlib import parser, print_figures
from qscale import pg
from qscale.fit import fit_linear, fit_quadratic, quadratic
from qscale.lighthouse import StockLighthouse
from qscale.rounds import QuorumServer, RoundFigures, measure

IMPLEMENTATIONS: dict[str, type[QuorumServer]] = {"lighthouse": StockLighthouse}
EXTRAPOLATE_TO = (4_000, 12_500)


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{flag}: comma-separated whole numbers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"{flag}: give counts of at least 1, got {text!r}")
    return sorted(set(values))


def quorum_figures(name: str, points: list[RoundFigures]) -> dict[str, object]:
    """Print one implementation's table and fit; return its figures."""
    ns = [p.n for p in points]
    a, b = fit_quadratic(ns, [p.median_s for p in points])
    ca, cb = fit_quadratic(ns, [p.median_cpu_s for p in points])
    anchor = points[0]
    print(f"\n{name}: quorum round (median of {len(anchor.rounds_s)}), measured")
    print(
        f"{'replicas':>9} {'round s':>9} {'fit s':>9} {'server CPU s':>13} "
        f"{'x anchor':>9} {'N/N0':>7} {'(N/N0)^2':>9}"
    )
    for p in points:
        k = p.n / anchor.n
        print(
            f"{p.n:>9,} {p.median_s:>9.4f} {quadratic(a, b, p.n):>9.4f} "
            f"{p.median_cpu_s:>13.3f} {p.median_s / anchor.median_s:>9.1f} {k:>7.0f} "
            f"{k * k:>9.0f}"
        )
    print(f"fit: round_s = {a:.3e} N + {b:.3e} N^2 (least squares on the points above)")
    print(f"fit of the server's CPU s: {ca:.3e} N + {cb:.3e} N^2")
    extra = {n: quadratic(a, b, n) for n in EXTRAPOLATE_TO}
    for n, s in extra.items():
        print(f"EXTRAPOLATED, not measured: {n:,} replicas -> {s:,.1f} s a round")
    return {
        "replicas": ns,
        "round_s": [round(p.median_s, 5) for p in points],
        "server_cpu_s": [round(p.median_cpu_s, 4) for p in points],
        "fit_a_s": a,
        "fit_b_s": b,
        "fit_cpu_a_s": ca,
        "fit_cpu_b_s": cb,
        "extrapolated_round_s": {str(n): round(s, 2) for n, s in extra.items()},
    }


def pg_figures(points: list[pg.GroupFigures]) -> dict[str, object]:
    ns = [p.n for p in points]
    c0, c1 = fit_linear(ns, [p.median_s for p in points])
    print("\nprocess-group rebuild (torchft ProcessGroupGloo.configure + one all-reduce), measured")
    print(f"{'ranks':>6} {'rebuild s':>10} {'fit s':>9} {'x anchor':>9}")
    for p in points:
        print(
            f"{p.n:>6} {p.median_s:>10.4f} {c0 + c1 * p.n:>9.4f} "
            f"{p.median_s / points[0].median_s:>9.1f}"
        )
    print(f"fit: rebuild_s = {c0:.4f} + {c1:.5f} n (least squares)")
    extra = {n: c0 + c1 * n for n in EXTRAPOLATE_TO}
    for n, s in extra.items():
        print(f"EXTRAPOLATED, not measured: {n:,} ranks -> {s:,.1f} s a rebuild")
    return {
        "ranks": ns,
        "rebuild_s": [round(p.median_s, 4) for p in points],
        "fit_c0_s": c0,
        "fit_c1_s": c1,
        "extrapolated_rebuild_s": {str(n): round(s, 2) for n, s in extra.items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--replicas", default="10,100,300,1000", help="replica counts")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds per count (5)")
    ap.add_argument("--pg-ranks", default="2,4,8,16", help="process-group sizes")
    ap.add_argument("--pg-reps", type=int, default=3, help="rebuilds per size (3)")
    ap.add_argument("--no-pg", action="store_true", help="skip the process-group rebuild")
    ap.add_argument(
        "--impl", default=",".join(IMPLEMENTATIONS), help="quorum implementations to measure"
    )
    args = ap.parse_args(argv)
    counts = _ints(args.replicas, "--replicas")
    if args.rounds < 1:
        raise SystemExit(f"--rounds: at least 1, got {args.rounds}")
    names = [x.strip() for x in args.impl.split(",") if x.strip()]
    unknown = [x for x in names if x not in IMPLEMENTATIONS]
    if unknown or not names:
        raise SystemExit(f"--impl: {unknown or 'none'}; choose from {', '.join(IMPLEMENTATIONS)}")
    out: dict[str, object] = {"cores": os.cpu_count()}
    for name in names:
        impl = IMPLEMENTATIONS[name]
        points = []
        for n in counts:
            print(f"[{name}] {n:,} replicas ...", flush=True)
            points.append(measure(impl, n, args.rounds))
        out[name] = quorum_figures(impl.name, points)
    if not args.no_pg:
        ranks = _ints(args.pg_ranks, "--pg-ranks")
        print(f"[process group] {ranks} ranks ...", flush=True)
        out["pg_gloo"] = pg_figures(pg.measure(ranks, args.pg_reps))
    print()
    print_figures(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The quorum's round time against the replica count for torchft's lighthouse and the Redis
quorum side by side (issue 16), and the cross-replica process-group rebuild against the group
size, measured here (2 cores).

Lighthouse: the stock torchft lighthouse (``torchft_lighthouse`` 0.2.0 beside this
interpreter, ``--quorum_tick_ms 10 --join_timeout_ms 60000 --heartbeat_timeout_ms 60000``,
its INFO log off) and N fake replicas, one thread and one ``LighthouseClient`` each, asking
for the quorum at the same moment; a round runs from that moment to the last answer (median
of ``--rounds`` after one warm-up round). Its answer lists every member, so its work per
round grows with N^2: fitted ``round_s = a N + b N^2`` and extrapolated. A size it cannot
hold (its fit predicts a round over ``--lighthouse-cap-s``, or it needs more threads than
``--lighthouse-max-threads``: 3 per client) is ``null`` with the reason printed.

Redis quorum (``qscale/redis_*.py``): the bench's own ``redis-server`` (``maxclients``
raised, AOF everysec) and ``--procs`` client processes, each holding N / procs replicas
with a ``redis.asyncio`` connection apiece, running ``spottrain.quorum.scripts``' Lua and
answer parser. A round runs from the LAST request sent to the last answer delivered (p50
and p99 of ``--redis-rounds``, at most ``--redis-seconds`` a size). Per size: the bytes one
replica sends and receives per step, Redis's CPU per round (INFO cpu) and per command (INFO
commandstats, LATENCY), the time from a leave and from a silent loss to a quorum without
that replica. At each of ``--fault-replicas`` (1,000 and the largest size): healthy replicas
falsely dropped while Redis forks for BGREWRITEAOF with ``--fill-mib`` loaded and while a
client process is SIGSTOPped (for 0.6 x the heartbeat timeout unless ``--pause-s``).

What the simulation leaves out: a fleet's network (here every byte crosses loopback), its
replicas' own machines (here the clients share 2 cores with Redis, so the measured round is
bounded by Python reading N answers; Redis's CPU per replica, extrapolated to 12,500, is the
figure a fleet's round cannot go under), per-VM heartbeats (here one call carries 64
replicas' ids), and the steps' compute (rounds run back to back). ``--join-timeout-ms``
(default 30000, the steady rounds' and the leave's) is above the clients' own time to send
N requests on these shared cores: a shorter one would form quorums short of replicas that
are merely late in this simulation (the fast path forms a round as soon as every member of
the last quorum asked, so it does not lengthen a round). The silent loss runs at a join
timeout of the heartbeat timeout, or 3x the clients' send time where longer (the waiters'
TICKs come every max(join, heartbeat / 4)). The steady rounds and the leave run at a
heartbeat timeout of ``--steady-heartbeat-timeout-ms`` (5000): a heartbeat process starved
for a second by this machine's load would otherwise leave its replicas out of a round (they
are not late on a fleet); the silent loss and the false drops run at the heartbeat timeout
the product chooses for a fleet of that size (``spottrain.spec.heartbeat``'s
``auto_heartbeat_timeout_s``: 1 s up to 2,500 replicas, 2 s at 4,000, 5 s at 12,500), or at
``--heartbeat-timeout-ms`` for every size, where such starvation is what they count. A
silent loss that fails at it (healthy replicas dropped) is measured again at the steady
timeout where that is longer, once the replicas it dropped are back under new ids (a dropped
id is refused for good). The heartbeat processes run at nice -10 where allowed. A size that
fails is printed, and null.

Relayed (``--relay-group``, default 100; 0: off): after the direct steady rounds, the same
replicas ask through relays of that many (``qscale/redis_relays.py``: per relay one
RELAY_REQUEST for the whole group and one BLPOP, in one write, as
``QuorumClient.request_batch`` does; the replicas are dealt to the client processes in whole
groups). A round runs from the LAST batch sent to every relay's answer delivered; the bytes
are the relays' to and from Redis per replica (the member <-> relay hop is RSHIM's). Keys
``redis_relay_round_ms_p50_N``, ``redis_relay_round_ms_p99_N``, ``redis_relay_cpu_ms_round_N``
(Redis's CPU per round, INFO cpu), ``redis_relay_bytes_per_replica_step_N``.
``--relay-only`` skips the direct rounds, the leave, the loss and the false drops.

Process group: torchft's ``ProcessGroupGloo.configure`` (what every survivor runs at every
quorum change) then one all-reduce, in 2..16 processes released at once; fitted as
``rebuild_s = c0 + c1 n`` (ranks queue for 2 cores at 16, so the slope is an upper bound).

    .venv/bin/python bench/quorum_scale.py [--sizes 100,1000,4000,12500] [--rounds 5]
        [--impl lighthouse,redis] [--fault-replicas 1000,max] [--pg-ranks 2,4,8,16] [--no-pg]
        [--relay-group 100] [--relay-only]

The last line is one JSON object of the figures: per implementation its own object, and
flat ``redis_round_ms_p50_N``, ``lighthouse_round_ms_p50_N`` (null where not reached),
``redis_silent_loss_heartbeat_timeout_ms_N`` (the timeout the silent loss ran at),
``redis_false_drops_aof_rewrite_N``, ``redis_false_drops_paused_client_N``,
``redis_false_drop_rate_N`` (and unsuffixed, the smallest fault size's), ...
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

os.environ.setdefault("RUST_LOG", "warn")  # before torchft loads: see qscale/lighthouse.py

from benchlib import parser, print_figures
from qscale import redis_report
from qscale.fit import fit_linear, fit_quadratic, quadratic
from qscale.redis_measure import false_drops, heartbeat_timeout_ms, measure_size
from qscale.rounds import QuorumServer, RoundFigures, measure

from spottrain.quorum.model import QuorumConfig

if TYPE_CHECKING:
    from qscale.pg import GroupFigures

IMPLEMENTATIONS = ("lighthouse", "redis")


def lighthouse() -> type[QuorumServer]:
    """torchft's lighthouse, imported only when measured: the Redis side's client
    processes (spawned, so they import this module again) do without torch."""
    from qscale.lighthouse import StockLighthouse

    return StockLighthouse


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


def pg_figures(points: list[GroupFigures]) -> dict[str, object]:
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


def _redis_args(ap: argparse.ArgumentParser) -> None:
    """The Redis quorum's options."""
    ap.add_argument("--redis-rounds", type=int, default=100, help="Redis rounds per size (100)")
    ap.add_argument(
        "--redis-seconds",
        type=float,
        default=20.0,
        help="at most this long per size once 5 rounds are in (20)",
    )
    ap.add_argument("--procs", type=int, default=4, help="Redis client processes (4)")
    ap.add_argument(
        "--relay-group",
        type=int,
        default=100,
        help="also measure rounds through relays of this many replicas; 0: off (100)",
    )
    ap.add_argument(
        "--relay-only",
        action="store_true",
        help="Redis: only the relayed rounds (no direct rounds, leave, loss or false drops)",
    )
    ap.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=None,
        help="the silent loss's and the false drops' at every size (the product's auto "
        "timeout for each size: 1000 up to 2,500 replicas, 5000 at 12,500)",
    )
    ap.add_argument("--join-timeout-ms", type=int, default=30_000, help="(30000; see above)")
    ap.add_argument(
        "--steady-heartbeat-timeout-ms",
        type=int,
        default=5000,
        help="the steady rounds' and the leave's (5000; see above)",
    )
    ap.add_argument(
        "--fault-replicas",
        default="1000,max",
        help="sizes of the false-drop runs, max: the largest of --sizes; 0 skips them (1000,max)",
    )
    ap.add_argument(
        "--fill-mib",
        type=int,
        default=1024,
        help="MiB loaded into Redis before the BGREWRITEAOF fork (1024)",
    )
    ap.add_argument(
        "--pause-s",
        type=float,
        default=None,
        help="SIGSTOP of a client process (0.6 x the heartbeat timeout)",
    )


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = parser(__doc__)
    ap.add_argument(
        "--sizes",
        "--replicas",
        dest="sizes",
        default="100,1000,4000,12500",
        help="replica counts, for every implementation (100,1000,4000,12500)",
    )
    ap.add_argument("--rounds", type=int, default=5, help="lighthouse rounds per count (5)")
    ap.add_argument("--impl", default="lighthouse,redis", help="implementations to measure")
    ap.add_argument(
        "--lighthouse-cap-s",
        type=float,
        default=30.0,
        help="skip (null) a size whose predicted lighthouse round is longer (30)",
    )
    ap.add_argument(
        "--lighthouse-max-threads",
        type=int,
        default=15_000,
        help="skip (null) a size needing more threads, 3 a client (15000)",
    )
    _redis_args(ap)
    ap.add_argument("--pg-ranks", default="2,4,8,16", help="process-group sizes")
    ap.add_argument("--pg-reps", type=int, default=3, help="rebuilds per size (3)")
    ap.add_argument("--no-pg", action="store_true", help="skip the process-group rebuild")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.redis_rounds < 1:
        raise SystemExit(
            f"--rounds/--redis-rounds: at least 1, got {args.rounds}/{args.redis_rounds}"
        )
    return args


def lighthouse_skip(n: int, points: list[RoundFigures], cap_s: float, max_threads: int) -> str:
    """Why the lighthouse is not run at ``n`` ("" to run it)."""
    if 3 * n > max_threads:
        return (
            f"needs {3 * n:,} threads (a LighthouseClient runs 2 tokio threads beside "
            f"its caller's), over --lighthouse-max-threads {max_threads:,}"
        )
    if points:
        ns = [p.n for p in points]
        ys = [p.median_s for p in points]
        a, b = fit_quadratic(ns, ys) if len(points) > 1 else (0.0, ys[0] / ns[0] ** 2)
        predicted = quadratic(a, b, n)
        if predicted > cap_s:
            return (
                f"its fit on {ns} predicts {predicted:,.0f} s a round, over the "
                f"{cap_s:g} s cap (--lighthouse-cap-s)"
            )
    return ""


def run_lighthouse(args: argparse.Namespace, counts: list[int], out: dict[str, object]) -> None:
    points: list[RoundFigures] = []
    skipped: dict[str, str] = {}
    for n in counts:
        reason = lighthouse_skip(n, points, args.lighthouse_cap_s, args.lighthouse_max_threads)
        if reason:
            print(f"[lighthouse] {n:,} replicas: null, {reason}", flush=True)
            skipped[str(n)] = reason
            continue
        print(f"[lighthouse] {n:,} replicas ...", flush=True)
        try:
            points.append(measure(lighthouse(), n, args.rounds))
        except OSError as e:  # e.g. the file-descriptor limit: 4,000 clients need ~20,000
            reason = f"this machine could not hold it: {e}"
            print(f"[lighthouse] {n:,} replicas: null, {reason}", flush=True)
            skipped[str(n)] = reason
    figures = quorum_figures(lighthouse().name, points) if points else {}
    figures["null_reasons"] = skipped
    out["lighthouse"] = figures
    by_n = {p.n: p.median_s for p in points}
    for n in counts:
        s = by_n.get(n)
        out[f"lighthouse_round_ms_p50_{n}"] = None if s is None else round(s * 1000, 2)


def fault_sizes(text: str, counts: list[int]) -> list[int]:
    """``--fault-replicas``: the sizes of the false-drop runs (``max``: the largest of
    ``counts``; ``0``: none)."""
    words = [x.strip() for x in text.split(",") if x.strip()]
    if words == ["0"]:
        return []
    return _ints(",".join(str(max(counts)) if w == "max" else w for w in words), "--fault-replicas")


def run_faults(
    args: argparse.Namespace, counts: list[int], sized: Callable[[int], QuorumConfig]
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The false-drop runs, each at its size's heartbeat timeout; returns them and the
    reasons of those that failed."""
    faults: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    for n in fault_sizes(args.fault_replicas, counts):
        config = sized(n)
        hb_s = config.heartbeat_timeout_ms / 1000
        pause_s = args.pause_s if args.pause_s is not None else 0.6 * hb_s
        print(
            f"[redis] false drops at {n:,} replicas, heartbeat timeout {hb_s:g} s ...", flush=True
        )
        try:
            faults.append(false_drops(n, args.procs, config, args.fill_mib, pause_s))
        except RuntimeError as e:
            print(f"[redis] false drops at {n:,} replicas: null, {e}", flush=True)
            failed[str(n)] = str(e)
    return faults, failed


def run_redis(args: argparse.Namespace, counts: list[int], out: dict[str, object]) -> None:
    base = QuorumConfig(join_timeout_ms=args.join_timeout_ms)

    def sized(n: int) -> QuorumConfig:  # the silent loss's and the false drops' at n
        return replace(
            base, heartbeat_timeout_ms=heartbeat_timeout_ms(n, args.heartbeat_timeout_ms)
        )

    config = {
        **asdict(base),
        "heartbeat_timeout_ms": args.heartbeat_timeout_ms or "auto",
        "heartbeat_timeout_ms_by_size": {str(n): sized(n).heartbeat_timeout_ms for n in counts},
        "steady_heartbeat_timeout_ms": args.steady_heartbeat_timeout_ms,
    }
    sizes = []
    failed: dict[str, str] = {}
    for n in counts:
        print(f"[redis] {n:,} replicas ...", flush=True)
        try:
            steady_hb = args.steady_heartbeat_timeout_ms
            sizes.append(
                measure_size(
                    n, args.procs, sized(n), args.redis_rounds, args.redis_seconds, steady_hb,
                    relay_group=args.relay_group, direct=not args.relay_only,
                )
            )  # fmt: skip
        except RuntimeError as e:
            print(f"[redis] {n:,} replicas: null, {e}", flush=True)
            failed[str(n)] = str(e)
    if not sizes:
        raise SystemExit(f"the Redis quorum could not be measured at any size: {failed}")
    if args.relay_only:
        redis_report.print_relays(sizes)
        out["redis"] = {"config": config, "sizes": sizes, "null_reasons": failed}
        out.update(redis_report.flat_relays(sizes))
        return
    faults, faults_failed = run_faults(args, counts, sized)
    redis_report.print_sizes(sizes)
    redis_report.print_relays(sizes)
    extra = redis_report.extrapolate(sizes)
    for f in faults:
        redis_report.print_faults(f)
    out["redis"] = {
        "config": config,
        "sizes": sizes,
        **extra,
        "faults": faults[0] if faults else None,  # the first size's (1,000 by default)
        "faults_by_size": {str(f["n"]): f for f in faults},
        "null_reasons": failed,
        "faults_null_reasons": faults_failed,
    }
    out.update(redis_report.flat(sizes, extra, faults, [int(n) for n in faults_failed]))
    out.update(redis_report.flat_relays(sizes))
    for size in failed:
        for key in ("round_ms_p50", "round_ms_p99", "bytes_per_replica_step", "leave_to_quorum_s"):
            out[f"redis_{key}_{size}"] = None
        out[f"redis_silent_loss_to_quorum_s_{size}"] = None
    out.update(redis_report.shim_costs(counts))


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    counts = _ints(args.sizes, "--sizes")
    names = [x.strip() for x in args.impl.split(",") if x.strip()]
    unknown = [x for x in names if x not in IMPLEMENTATIONS]
    if unknown or not names:
        raise SystemExit(f"--impl: {unknown or 'none'}; choose from {', '.join(IMPLEMENTATIONS)}")
    out: dict[str, object] = {"cores": os.cpu_count(), "sizes": counts}
    if "lighthouse" in names:
        run_lighthouse(args, counts, out)
    if "redis" in names:
        run_redis(args, counts, out)
    if not args.no_pg:
        ranks = _ints(args.pg_ranks, "--pg-ranks")
        print(f"[process group] {ranks} ranks ...", flush=True)
        from qscale import pg  # torch: only when measured

        out["pg_gloo"] = pg_figures(pg.measure(ranks, args.pg_reps))
    print()
    print_figures(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

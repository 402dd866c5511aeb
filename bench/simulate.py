"""How long ``spottrain simulate`` takes for 100,000 GPUs over one simulated week with tens of
thousands of preemptions, beside what planning alone would cost without the incremental
planner index, measured in the same run.

The scenario: 12,500 p5.48xlarge VMs (8 GPUs each) for 168 h, preempted at 0.012 per VM-hour
(about 25,000 preemptions, every one with AWS's 120 s notice) plus one zone-wide reclaim a
day (5% of the VMs at once, then 30 minutes without spot capacity), every other setting at
its default; the four policies watch the same fleet. Target: under 120 s on 2 cores.

The anchor: one plain ``plan()`` over the simulation's final 12,500 nodes given as a list
(the planner's own pass, no index; median of ``--reps``), times the passes the simulation
made. Without the index every pass would also rebuild 12,500 ``NodeObs``; that rebuild is
timed too and reported beside it.

    .venv/bin/python bench/simulate.py [--gpus 100000] [--days 7] [--rate 0.012] [--reps 5]

The last line is one JSON object: ``wall_s``, ``passes``, ``plan_s``, ``plain_plan_ms``,
``anchor_s`` (plain plan x passes), ``planning_speedup`` (anchor / time in the indexed
planner), ``anchor_over_wall`` (anchor / the whole simulation's wall time), the preemption
counts and each policy's figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchlib import print_figures

from spottrain.cloud.base import Instance
from spottrain.controller.reconcile.types import NodeObs
from spottrain.controller.sim.command import add_parser
from spottrain.controller.sim.config import config_from_args
from spottrain.controller.sim.engine import simulate
from spottrain.controller.sim.model import SimConfig
from spottrain.controller.sim.plan_timing import plain_plan_seconds
from spottrain.controller.sim.report import figures, replica_lines

TARGET_S = 120.0


def rebuild_seconds(nodes: list[NodeObs], reps: int) -> float:
    """Median seconds to build every node's observation afresh (what a pass without the
    index would do before planning)."""
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        [
            NodeObs(
                name=n.name,
                instance=Instance(**n.instance.__dict__) if n.instance is not None else None,
                offer=n.offer,
                launched_at=n.launched_at,
                agent_state=n.agent_state,
                alive_beat=n.alive_beat,
            )
            for n in nodes
        ]
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpus", type=int, default=100_000)
    parser.add_argument("--days", type=float, default=7.0)
    parser.add_argument("--rate", type=float, default=0.012, help="preemptions per VM-hour")
    parser.add_argument("--reclaims", type=float, default=1.0, help="zone reclaims per day")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()

    cli = argparse.ArgumentParser()
    add_parser(cli.add_subparsers(dest="command"))
    sim_args = cli.parse_args(
        [
            "simulate",
            "--gpus",
            str(args.gpus),
            "--days",
            str(args.days),
            "--rate-per-node-hour",
            str(args.rate),
            "--zone-reclaims-per-day",
            str(args.reclaims),
            "--seed",
            str(args.seed),
        ]
    )
    cfg: SimConfig = config_from_args(sim_args)
    res = simulate(cfg)
    fig = figures(res)

    plain_s = plain_plan_seconds(cfg, res.final_nodes, reps=args.reps)
    rebuild_s = rebuild_seconds(res.final_nodes, args.reps)
    anchor_s = plain_s * res.passes
    anchor_rebuild_s = (plain_s + rebuild_s) * res.passes
    per_pass_ms = res.plan_s / max(res.passes, 1) * 1000

    print(
        f"{fig['gpus']:,} GPUs ({cfg.nodes:,} VMs) for {cfg.hours:g} simulated hours: "
        f"{res.preemptions:,} preemptions ({res.with_notice:,} with notice, "
        f"{res.reclaims} zone reclaims), {res.launches:,} backfills, "
        f"{res.capacity_errors:,} refused for capacity"
    )
    print()
    print(f"{'':<44} {'seconds':>10}")
    print(f"{'simulation, wall (4 policies, 1 fleet)':<44} {res.wall_s:>10.1f}")
    print(
        f"{'  of which planning (' + format(res.passes, ',') + ' passes)':<44} {res.plan_s:>10.2f}"
    )
    print(f"{'  per pass, ms':<44} {per_pass_ms:>10.3f}")
    print(
        f"{'anchor: one plain plan() at ' + format(cfg.nodes, ',') + ' nodes, ms':<44} "
        f"{plain_s * 1000:>10.2f}"
    )
    print(f"{'anchor: plain plan() x passes':<44} {anchor_s:>10.1f}")
    print(f"{'anchor: (rebuild nodes + plain plan) x passes':<44} {anchor_rebuild_s:>10.1f}")
    print(
        f"{'speedup of planning (plain / indexed)':<44} {anchor_s / max(res.plan_s, 1e-9):>9.0f}x"
    )
    verdict = "met" if res.wall_s <= TARGET_S else "MISSED"
    print(f"target: under {TARGET_S:.0f} s -> {verdict} ({res.wall_s / TARGET_S:.2f} of it)")
    print()
    for name, p in fig["policies"].items():
        usd = p["usd_per_useful_gpu_h"]
        print(
            f"{name:<13} effective {p['effective'] * 100:5.1f}%  "
            f"${'-' if usd is None else format(usd, ',.2f')}/useful GPU-h  "
            f"lost {p['lost_gpu_h_per_preemption']:,.2f} GPU-h/preemption"
        )
    if fig["replica_parameters"] is not None:
        print()
        print("\n".join(replica_lines(fig["replica_parameters"])))
    out = {
        "gpus": fig["gpus"],
        "hours": cfg.hours,
        "preemptions": res.preemptions,
        "with_notice": res.with_notice,
        "zone_reclaims": res.reclaims,
        "launches": res.launches,
        "passes": res.passes,
        "wall_s": round(res.wall_s, 2),
        "plan_s": round(res.plan_s, 3),
        "plan_ms_per_pass": round(per_pass_ms, 4),
        "plain_plan_ms": round(plain_s * 1000, 3),
        "rebuild_ms": round(rebuild_s * 1000, 3),
        "anchor_s": round(anchor_s, 1),
        "anchor_with_rebuild_s": round(anchor_rebuild_s, 1),
        "planning_speedup": round(anchor_s / max(res.plan_s, 1e-9), 1),
        "anchor_over_wall": round(anchor_s / max(res.wall_s, 1e-9), 1),
        "target_s": TARGET_S,
        "effective": {k: v["effective"] for k, v in fig["policies"].items()},
        "usd_per_useful_gpu_h": {k: v["usd_per_useful_gpu_h"] for k, v in fig["policies"].items()},
        "lost_gpu_h_per_preemption": {
            k: v["lost_gpu_h_per_preemption"] for k, v in fig["policies"].items()
        },
        "replica_at_replicas": (fig["replica_parameters"] or {}).get("at_replicas"),
    }
    print_figures(out)


if __name__ == "__main__":
    main()

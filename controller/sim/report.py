"""The figures of a simulation: one dict (``--json``), a table, and a PNG."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from spottrain.controller.sim.model import PolicyResult, SimResult
from spottrain.controller.sim.replica_params import describe


def policy_figures(res: SimResult, p: PolicyResult) -> dict[str, Any]:
    """One policy's figures: the share of wall time on steps that count, the dollars per
    useful GPU-hour (and against on-demand), and the work each preemption cost."""
    cfg = res.config
    horizon = cfg.hours * 3600.0
    gpus = cfg.nodes * cfg.gpus_per_node
    useful_h = p.progress_s / 3600.0 * gpus
    od_per_gpu_h = cfg.on_demand.price_per_hour / cfg.gpus_per_node
    usd_per_useful = res.cost_usd / useful_h if useful_h > 0 else None
    n = res.preemptions
    return {
        "effective": round(p.progress_s / horizon, 5),
        "useful_gpu_h": round(useful_h, 1),
        "usd_per_useful_gpu_h": None if usd_per_useful is None else round(usd_per_useful, 4),
        "vs_on_demand": None if usd_per_useful is None else round(usd_per_useful / od_per_gpu_h, 4),
        "lost_gpu_h": round(p.lost_s / 3600.0 * gpus, 1),
        "lost_gpu_h_per_preemption": round(p.lost_s / 3600.0 * gpus / n, 3) if n else 0.0,
        "shortfall_gpu_h_per_preemption": (
            round((horizon - p.progress_s) / 3600.0 * gpus / n, 3) if n else 0.0
        ),
        "rollbacks": p.rollbacks,
        "checkpoints": p.checkpoints,
    }


def figures(res: SimResult) -> dict[str, Any]:
    """Everything a run reports, as one JSON-ready dict."""
    cfg = res.config
    g = cfg.gpus_per_node
    return {
        "gpus": cfg.nodes * g,
        "nodes": cfg.nodes,
        "hours": cfg.hours,
        "seed": cfg.seed,
        "instance": f"{cfg.spot.cloud} {cfg.spot.zone} {cfg.spot.instance_type}",
        "preemptions": res.preemptions,
        "with_notice": res.with_notice,
        "zone_reclaims": res.reclaims,
        "launches": res.launches,
        "on_demand_launches": res.on_demand_launches,
        "capacity_errors": res.capacity_errors,
        "terminated_by_planner": res.terminated,
        "planner_passes": res.passes,
        "plan_s": round(res.plan_s, 3),
        "wall_s": round(res.wall_s, 3),
        "vm_hours": round(res.vm_hours, 1),
        "cost_usd": round(res.cost_usd, 2),
        "spot_usd_per_gpu_h": round(cfg.spot.price_per_hour / g, 4),
        "on_demand_usd_per_gpu_h": round(cfg.on_demand.price_per_hour / g, 4),
        "stop_reason": res.stop_reason,
        "policies": {p.name: policy_figures(res, p) for p in res.policies},
        "replica_parameters": (
            describe(cfg.replica, cfg.costs().replicas, cfg.costs().catch_up_s)
            if "replica" in cfg.policies
            else None
        ),
    }


def _money(x: float | None) -> str:
    return "-" if x is None else f"${x:,.2f}"


def table(res: SimResult) -> str:
    """The human-readable summary: what was simulated, then one row per policy."""
    cfg = res.config
    f = figures(res)
    lines = [
        f"{f['gpus']:,} GPUs ({cfg.nodes:,} x {cfg.spot.instance_type}, {cfg.spot.cloud} "
        f"{cfg.spot.zone}) for {cfg.hours:g} h, seed {cfg.seed}",
        f"preemptions: {res.preemptions:,} ({res.with_notice:,} with a {cfg.notice_s:g} s notice), "
        f"{res.reclaims:,} zone reclaims; {res.launches:,} backfills launched "
        f"({res.on_demand_launches:,} on-demand), {res.capacity_errors:,} refused for capacity",
        f"fleet: {res.vm_hours:,.0f} VM-hours, ${res.cost_usd:,.0f}; spot "
        f"{_money(f['spot_usd_per_gpu_h'])}/GPU-h, on-demand "
        f"{_money(f['on_demand_usd_per_gpu_h'])}/GPU-h",
        f"controller: {res.passes:,} planner passes, {res.plan_s:.2f} s planning; "
        f"simulated in {res.wall_s:.1f} s",
    ]
    if res.terminated:
        lines.append(
            f"the planner ended {res.terminated:,} VMs (not healthy within its boot timeout, "
            "or otherwise bad): is --launch-latency-s longer than 900 s?"
        )
    if res.stop_reason:
        lines.append(f"the planner stopped the job: {res.stop_reason}")
    header = (
        f"{'policy':<13} {'effective':>9} {'useful GPU-h':>14} {'$/useful GPU-h':>15} "
        f"{'x on-demand':>12} {'lost GPU-h/preempt':>19} {'short GPU-h/preempt':>20}"
    )
    lines += ["", header, "-" * len(header)]
    for name, p in f["policies"].items():
        vs = p["vs_on_demand"]
        lines.append(
            f"{name:<13} {p['effective'] * 100:>8.1f}% {p['useful_gpu_h']:>14,.0f} "
            f"{_money(p['usd_per_useful_gpu_h']):>15} "
            f"{'-' if vs is None else f'{vs:.2f}x':>12} "
            f"{p['lost_gpu_h_per_preemption']:>19,.2f} "
            f"{p['shortfall_gpu_h_per_preemption']:>20,.2f}"
        )
    lines += [
        "",
        "effective: share of wall time on steps that count (at the full fleet's rate); "
        "lost: work rolled back to a checkpoint; short: every GPU-hour the full fleet "
        "did not train (lost, stalls, missing nodes, checkpoint writes)",
    ]
    if f["replica_parameters"] is not None:
        lines += ["", *replica_lines(f["replica_parameters"])]
    return "\n".join(lines)


def replica_lines(params: dict[str, Any]) -> list[str]:
    """The replica policy's parameters, each with its source, and what they cost at the
    simulated replica count."""
    at = params["at_replicas"]
    n = at["replicas"]
    lines = [f"replica policy (torchft 0.2.0, quorum: {at['quorum']}): parameters and sources"]
    for name, p in params.items():
        if name != "at_replicas":
            lines.append(f"  {name:<13} {p['value']:<10.4g} [{p['kind']}] {p['source']}")
    lines += [
        f"  at {n:,} replicas: a quorum round {at['quorum_s_per_step']:,.3f} s per step "
        f"({at['quorum_kind']}), so steps train {at['step_share'] * 100:.1f}% of the time; "
        f"a process-group rebuild {at['pg_rebuild_s']:,.2f} s per quorum change "
        f"({at['pg_kind']}); a loss stalls the survivors {at['notice_stall_s']:g} s with "
        f"notice, {at['kill_stall_s']:g} s without, plus the rebuild; a joiner is ready "
        f"{at['join_s']:g} s after its start plus the rebuild "
        f"(catch-up {at['catch_up_s']:g} s: modelled, checkpoint / nodes / --peer-gbps)",
    ]
    return lines


def plot(res: SimResult, path: str | Path) -> None:
    """Write a PNG: effective training time per policy (bars, with $ per useful GPU-hour)
    beside each policy's useful throughput over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = figures(res)
    names = list(f["policies"])
    colors = {
        "sync": "#c0504d",
        "elastic": "#4f81bd",
        "replica": "#9bbb59",
        "replica-ideal": "#8064a2",
    }
    fig, (ax1, ax2) = plt.subplots(
        1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1, 2]}, layout="constrained"
    )
    eff = [f["policies"][n]["effective"] * 100 for n in names]
    bars = ax1.bar(names, eff, color=[colors.get(n, "#888888") for n in names])
    for bar, name in zip(bars, names, strict=True):
        p = f["policies"][name]
        usd = p["usd_per_useful_gpu_h"]
        label = f"{bar.get_height():.1f}%\n" + (
            f"${usd:,.2f}/GPU-h\n{p['vs_on_demand']:.2f}x on-demand" if usd is not None else "-"
        )
        ax1.annotate(
            label,
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax1.set_ylim(0, 125)
    ax1.set_ylabel("effective training time (%)")
    ax1.set_title("share of wall time on steps that count", fontsize=10)
    hours = res.sample_hours
    for p in res.policies:
        ax2.plot(
            hours,
            [x * 100 for x in p.timeline],
            label=p.name,
            color=colors.get(p.name, "#888888"),
            lw=1.2,
        )
    ax2.set_xlim(0, res.config.hours)
    low = min((x for p in res.policies for x in p.timeline), default=0.0)
    ax2.set_ylim(min(0.0, low * 100) - 2, 105)
    ax2.set_xlabel("simulated hours")
    ax2.set_ylabel("useful throughput (% of the full fleet)")
    step = res.config.hours / max(len(hours), 1)
    ax2.set_title(
        f"{f['gpus']:,} GPUs, {res.preemptions:,} preemptions "
        f"(averaged over {_span(step)} bins, rollbacks subtracted)",
        fontsize=10,
    )
    ax2.legend(loc="center right", fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _span(hours: float) -> str:
    if hours >= 1 and math.isclose(hours, round(hours)):
        return f"{round(hours)} h"
    return f"{hours * 60:.0f} min"

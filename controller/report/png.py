"""The report's PNG: four panels (world size, step rate, preemptions, cost) sharing the time
axis. matplotlib is imported only here, when a PNG is drawn."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from spottrain.controller.report.model import ReportData
from spottrain.lazy_import import lazy_import


def _unit(data: ReportData) -> tuple[float, str]:
    """The time axis: minutes for a run of up to 3 hours, hours beyond."""
    return (60.0, "minutes") if data.end - data.start <= 3 * 3600 else (3600.0, "hours")


def _minutes(data: ReportData, ts: Iterable[float]) -> list[float]:
    """Times on the plot's axis (in :func:`_unit`'s unit) since the run started."""
    div = _unit(data)[0]
    return [(t - data.start) / div for t in ts]


def render_png(data: ReportData, path: Path | str) -> Path:
    """Draw the four panels (world size, step rate, preemptions, cost) sharing the time
    axis (minutes, or hours past 3 hours, since the run started) into a PNG at ``path``.

    Raises:
        ImportError: matplotlib is missing; the message says which extra installs it.
        OSError: the file cannot be written.
    """
    lazy_import("matplotlib", needs="the PNG needs matplotlib", extra="report")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    end_m = _minutes(data, [data.end])[0]
    fig = Figure(figsize=(10, 10), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_world, ax_rate, ax_pre, ax_cost = fig.subplots(4, 1, sharex=True)
    f = data.figures
    fig.suptitle(
        f"{data.run_id}: {f.phase}, step {f.final_step if f.final_step is not None else f.step}, "
        f"{f.preemptions} preemption(s), ${f.spent_usd:,.2f} spent"
    )
    _draw_world(data, ax_world, end_m)
    _draw_rate(data, ax_rate)
    _draw_preemptions(data, ax_pre, (ax_world, ax_rate, ax_cost))
    _draw_cost(data, ax_cost)
    ax_cost.set_xlim(0, max(end_m, 1e-3))
    fig.savefig(path, format="png")
    return path


def _draw_world(data: ReportData, ax_world: Any, end_m: float) -> None:
    """1. world size: nodes training, and ranks in the newest round."""
    from matplotlib.ticker import MaxNLocator

    f = data.figures
    xs = [*_minutes(data, [p.at for p in data.nodes]), end_m]
    ys = [p.nodes for p in data.nodes] + [data.nodes[-1].nodes if data.nodes else 0]
    ax_world.step(xs, ys, where="post", color="tab:blue", label="nodes training")
    ax_world.set_ylabel("nodes")
    ax_world.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_world.set_ylim(bottom=0, top=max(1, f.max_nodes) + 0.5)
    if data.world and f.max_world_size > 0:
        ranks = ax_world.twinx()
        xs = [*_minutes(data, [p.at for p in data.world]), end_m]
        ys = [p.world_size for p in data.world] + [data.world[-1].world_size]
        ranks.step(xs, ys, where="post", color="tab:orange", linestyle="--", label="ranks")
        ranks.set_ylabel("ranks")
        ranks.yaxis.set_major_locator(MaxNLocator(integer=True))
        ranks.set_ylim(bottom=0, top=max(1, f.max_world_size) * 1.15)
        ranks.legend(loc="upper right", fontsize="small")
    ax_world.legend(loc="upper left", fontsize="small")
    ax_world.set_title("world size", loc="left", fontsize="medium")


def _draw_rate(data: ReportData, ax_rate: Any) -> None:
    """2. step rate (segments), with the step itself on the right."""
    from matplotlib.ticker import MaxNLocator

    if data.rate:
        ax_rate.hlines(
            [s.per_minute for s in data.rate],
            _minutes(data, [s.start for s in data.rate]),
            _minutes(data, [s.end for s in data.rate]),
            color="tab:green",
            linewidth=2,
        )
    ax_rate.set_ylabel("steps / min")
    ax_rate.set_ylim(bottom=0, top=max([s.per_minute for s in data.rate], default=1) * 1.15)
    if data.steps:
        step_ax = ax_rate.twinx()
        step_ax.plot(
            _minutes(data, [p.at for p in data.steps]),
            [p.step for p in data.steps],
            color="tab:gray",
            linewidth=1,
            marker="." if len(data.steps) <= 200 else None,
        )
        step_ax.set_ylabel("step")
        step_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_rate.set_title("step rate (between checkpoints and restarts)", loc="left", fontsize="medium")


def _draw_preemptions(data: ReportData, ax_pre: Any, others: tuple[Any, ...]) -> None:
    """3. preemptions: a line and a marker (its zone) at each, a triangle at its notice.
    One call per kind of mark: a run can have thousands."""
    f = data.figures
    zones = sorted({p.zone for p in data.preemptions}) or [""]
    row = {z: i for i, z in enumerate(zones)}
    px = _minutes(data, [p.at for p in data.preemptions])
    py = [row[p.zone] for p in data.preemptions]
    if data.preemptions:
        ax_pre.vlines(px, -0.5, len(zones) - 0.5, color="tab:red", linewidth=1)
        ax_pre.plot(px, py, linestyle="none", marker="X", color="tab:red", markersize=9)
        if len(data.preemptions) <= 40:
            for ax in others:
                ax.vlines(px, 0, 1, transform=ax.get_xaxis_transform(), color="tab:red", alpha=0.25)
        noticed = [p for p in data.preemptions if p.notice_at is not None]
        ax_pre.plot(
            _minutes(data, [p.notice_at or p.at for p in noticed]),
            [row[p.zone] for p in noticed],
            linestyle="none",
            marker="v",
            color="tab:purple",
        )
    if len(data.preemptions) <= 40:
        for p, x, y in zip(data.preemptions, px, py, strict=True):
            ax_pre.annotate(p.node, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax_pre.set_yticks(range(len(zones)), [z or "?" for z in zones])
    ax_pre.set_ylim(-0.5, len(zones) - 0.5)
    ax_pre.set_title(f"preemptions ({f.preemptions}; v: notice)", loc="left", fontsize="medium")


def _draw_cost(data: ReportData, ax_cost: Any) -> None:
    """4. cumulative cost against the on-demand equivalent."""
    xs = _minutes(data, [p.at for p in data.cost])
    ax_cost.plot(xs, [p.spent_usd for p in data.cost], color="tab:blue", label="spent")
    if data.cost and all(p.on_demand_usd is not None for p in data.cost):
        od = [p.on_demand_usd or 0.0 for p in data.cost]
        ax_cost.plot(xs, od, color="tab:gray", linestyle="--", label="on-demand equivalent")
        ax_cost.fill_between(
            xs, [p.spent_usd for p in data.cost], od, color="tab:green", alpha=0.15
        )
    ax_cost.set_ylabel("USD")
    ax_cost.set_ylim(bottom=0)
    ax_cost.legend(loc="upper left", fontsize="small")
    ax_cost.set_title(f"cumulative cost ({data.cost_source})", loc="left", fontsize="medium")
    ax_cost.set_xlabel(f"{_unit(data)[1]} since the run started")

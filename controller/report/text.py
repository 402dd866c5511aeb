"""The report as a few lines of text."""

from __future__ import annotations

import time

from spottrain.controller.report.model import ReplicaReportData, ReportData
from spottrain.controller.report.replica import replica_text


def _dur(seconds: float) -> str:
    s = round(max(0.0, seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _clock(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


def text_summary(data: ReportData) -> str:
    """The report as a few lines of text."""
    f = data.figures
    origin = "its Redis" if data.source == "redis" else "its archive"
    lines = [f"run {data.run_id} ({f.phase}, from {origin})"]
    lines.append(
        f"  time          {_dur(data.end - data.start)} "
        f"({_clock(data.start)} to {_clock(data.end)})"
    )
    trained = f"{f.final_step} trained, finished" if f.final_step is not None else f"{f.step}"
    lines.append(f"  steps         {trained}; {f.steps_lost} lost to restarts")
    if f.mean_steps_per_minute is not None:
        best = max(s.per_minute for s in data.rate)
        lines.append(
            f"  step rate     {f.mean_steps_per_minute:.1f}/min on average, {best:.1f}/min at best"
        )
    lines.append(f"  world size    {f.max_nodes} node(s), {f.max_world_size} rank(s) at most")
    pre = f"  preemptions   {f.preemptions} ({f.preemptions_with_notice} with notice)"
    if data.preemptions:
        pre += ": " + ", ".join(
            f"{p.node} in {p.zone or '?'} at +{_dur(p.at - data.start)}" for p in data.preemptions
        )
    lines.append(pre)
    if isinstance(data, ReplicaReportData) and data.replica is not None:
        lines += replica_text(data.replica, data.start, _dur)
    cost = f"  cost          ${f.spent_usd:,.2f} spent"
    if f.on_demand_usd is not None and f.saved_usd is not None:
        share = f" ({f.saved_usd / f.on_demand_usd:.0%})" if f.on_demand_usd > 0 else ""
        cost += f", ${f.on_demand_usd:,.2f} on-demand, ${f.saved_usd:,.2f} saved{share}"
    elif f.saved_usd is not None:
        cost += f", ${f.saved_usd:,.2f} saved against on-demand"
    lines.append(cost)
    if f.reason:
        lines.append(f"  reason        {f.reason}")
    for note in data.notes:
        lines.append(f"  note: {note}")
    return "\n".join(lines)

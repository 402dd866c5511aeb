"""The live view as a pure function: :func:`render` draws one frame of :class:`ViewData` for
a terminal of a given size, and does no I/O (``live`` puts it on the screen).

Every line is cut at the terminal's width (an ellipsis, never a wrap), and the frame never
takes more lines than the terminal has: the fleet table keeps the zones that fit (one row
per cloud, zone, type and market) and the events take what is left (the newest last).

Every text drawn has its control characters escaped here, whatever the data's maker did:
most of it came from the run's Redis, which any node can write."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from spottrain.safetext import escape_controls

from .model import EventRow, NodeRow, ViewData

# A terminal narrower than this gets the compact table (no market column).
WIDE = 100
# A zone row names its nodes up to this many, and counts them beyond.
NAMED_NODES = 4
# The fewest event lines kept when the fleet table competes for the height.
MIN_EVENTS = 2
MAX_AT_RISK = 3
# The most boot lines (failed, then booting) a frame shows; a line counts the rest.
MAX_BOOT = 4


def _line(text: str, style: str = "") -> Text:
    return Text(escape_controls(text), style=style, no_wrap=True, overflow="ellipsis", end="\n")


def _duration(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _figures(data: ViewData) -> list[Text]:
    s = data.summary
    loss = f"{s.loss:.3f}" if s.loss is not None else "-"
    rate = f"  {data.step_rate:.2f} steps/s" if data.step_rate is not None else ""
    head = Text(no_wrap=True, overflow="ellipsis")
    head.append("step ", "dim").append(str(s.step), "bold").append(rate)
    head.append("  loss ", "dim").append(loss, "bold")
    head.append("  world ", "dim").append(str(s.world_size))
    money = Text(no_wrap=True, overflow="ellipsis")
    money.append("preemptions ", "dim").append(str(s.preemptions), "bold")
    money.append(f" (steps lost {s.steps_lost})")
    money.append(f"  ${s.spent_usd:,.2f}", "bold").append(" spent", "dim")
    money.append(f"  ${s.saved_usd:,.2f}", "bold green").append(" saved against on-demand", "dim")
    return [head, money]


@dataclass(frozen=True)
class _Zone:
    cloud: str
    zone: str
    instance_type: str
    market: str
    nodes: tuple[NodeRow, ...]

    def states(self) -> str:
        if len(self.nodes) <= NAMED_NODES:
            return ", ".join(f"{n.node} {n.state}" for n in self.nodes)
        counts = Counter(n.state for n in self.nodes)
        return ", ".join(f"{c} {state}" for state, c in counts.most_common())


def _zones(nodes: list[NodeRow]) -> list[_Zone]:
    groups: dict[tuple[str, str, str, str], list[NodeRow]] = {}
    for n in nodes:
        groups.setdefault((n.cloud, n.zone, n.instance_type, n.market), []).append(n)
    return [_Zone(*k, tuple(v)) for k, v in sorted(groups.items())]


def _fleet(nodes: list[NodeRow], rows: int, wide: bool) -> Table:
    """The fleet by zone and state, in at most ``rows`` rows (the header apart)."""
    table = Table(box=None, pad_edge=False, header_style="bold", show_edge=False)
    for name in ("zone", "type", *(("market",) if wide else ()), "nodes", "states"):
        table.add_column(
            name,
            no_wrap=True,
            overflow="ellipsis",
            justify="right" if name == "nodes" else "left",
            ratio=1 if name == "states" else None,
        )
    zones = _zones(nodes)
    shown = zones if len(zones) <= rows else zones[: max(0, rows - 1)]
    for z in shown:
        kind = [z.instance_type, z.market] if wide else [f"{z.instance_type} {z.market}"]
        cells = [f"{z.cloud}/{z.zone}", *kind, str(len(z.nodes)), z.states()]
        table.add_row(*(Text(escape_controls(c)) for c in cells))
    if len(shown) < len(zones):
        rest = zones[len(shown) :]
        counts = Counter(n.state for z in rest for n in z.nodes)
        table.add_row(
            f"+{len(rest)} more zones" if shown else f"{len(rest)} zones",
            *([""] * (2 if wide else 1)),
            str(sum(counts.values())),
            Text(escape_controls(", ".join(f"{c} {s}" for s, c in counts.most_common()))),
        )
    return table


def _event(e: EventRow) -> Text:
    line = Text(no_wrap=True, overflow="ellipsis")
    line.append(time.strftime("%H:%M:%S", time.localtime(e.at)), "dim")
    node, kind, detail = (escape_controls(x) for x in (e.node, e.kind, e.detail))
    line.append(f" {node:<10} ").append(f"{kind:<20}", "cyan").append(f" {detail}")
    return line


def _boot(data: ViewData) -> list[Text]:
    """What the VMs said of their boot: failures (red) before the stages (dim), at most
    :data:`MAX_BOOT` lines and one that counts the rest."""
    lines = [(x, "red") for x in data.boot_failed] + [(x, "dim") for x in data.booting]
    if len(lines) > MAX_BOOT:
        rest = len(lines) - (MAX_BOOT - 1)
        lines = [*lines[: MAX_BOOT - 1], (f"... {rest} more boot lines (spottrain status)", "dim")]
    return [_line(x, style) for x, style in lines]


def render(data: ViewData, width: int, height: int) -> RenderableType:
    """One frame of the live view for a ``width`` x ``height`` terminal."""
    s = data.summary
    budget = max(3, height - 1)  # the line under the frame holds the cursor
    elapsed = f"  {_duration(data.elapsed_s)}" if data.elapsed_s is not None else ""
    top: list[Text] = [
        _line(f"spottrain  run {data.run_id}  {s.phase}{elapsed}", "bold"),
        *_figures(data),
        *(_line(x) for x in data.replica[:2]),
    ]
    bottom: list[Text] = []
    if data.short:
        bottom.append(_line(data.short, "yellow"))
    bottom += _boot(data)  # why the fleet may be short: before the at-risk lines
    risk = s.at_risk if len(s.at_risk) <= MAX_AT_RISK else s.at_risk[: MAX_AT_RISK - 1]
    bottom += [_line(x, "yellow") for x in risk]
    if len(risk) < len(s.at_risk):
        bottom.append(_line(f"... {len(s.at_risk) - len(risk)} more nodes at risk", "yellow"))
    bottom += [_line(x, "red") for x in data.notes]
    reason = _line(f"{s.phase}: {s.reason or '-'}", "italic")
    # Too short a terminal: the fleet (a header and a row) before the warnings, the last
    # warnings (notes, at risk, boots) first to go; the reason before any of them.
    while bottom and len(top) + len(bottom) + 1 + 2 > budget:
        bottom.pop()
    bottom.append(reason)
    top = top[: max(1, budget - len(bottom) - 2)]

    left = budget - len(top) - len(bottom)
    # The replica rows, the fleet table (header + rows) and the events share what is left.
    extra = data.replica[2:]
    events_min = min(len(data.events), MIN_EVENTS) + (1 if data.events else 0)
    table_rows = max(1, min(len(_zones(data.nodes)) or 1, left - 1 - events_min))
    left -= 1 + table_rows
    replica_rows = extra[: max(0, min(len(extra), left - events_min))]
    left -= len(replica_rows)
    events = data.events[-max(0, left - 1) :] if left > 1 else []

    parts: list[RenderableType] = [*top, *(_line(x) for x in replica_rows)]
    if data.nodes:
        parts.append(_fleet(data.nodes, table_rows, width >= WIDE))
    else:
        parts.append(_line("fleet: no nodes yet", "dim"))
    parts += bottom
    if events:
        parts.append(_line("recent events", "bold"))
        parts += [_event(e) for e in events]
    return Group(*parts)

"""The replica bench's figures, from step times alone (no I/O): the step time, the survivors'
longest pause through an event, the issue's targets and whether each is met."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from benchlib import ratio

EVENTS = ("notice", "kill", "freeze")
# Issue 15's targets: a loss without notice (kill, freeze) costs the survivors at most
# 1.5 s plus one step; a noticed one (a working leave) at most one step plus 0.5 s; and each
# at most this share of the elastic re-form for the same event.
UNNOTICED_ALLOWANCE_S = 1.5
NOTICED_ALLOWANCE_S = 0.5
MAX_SHARE_OF_ELASTIC = 0.35


def step_time(times: Iterable[float]) -> float | None:
    """The median time between consecutive steps (None with fewer than two)."""
    ordered = sorted(times)
    gaps = [b - a for a, b in itertools.pairwise(ordered)]
    return statistics.median(gaps) if gaps else None


def pause_through(times: Iterable[float], event_t: float, until_t: float) -> float | None:
    """The longest time between consecutive steps from the last step before ``event_t``
    to ``until_t``: what the survivors lost to the event. None when no step came after it."""
    ordered = sorted(times)
    before = [t for t in ordered if t < event_t]
    after = [t for t in ordered if event_t <= t <= until_t]
    if not after:
        return None
    window = ([before[-1]] if before else []) + after
    return max((b - a for a, b in itertools.pairwise(window)), default=None)


def target_s(event: str, step_s: float) -> float:
    allowance = NOTICED_ALLOWANCE_S if event == "notice" else UNNOTICED_ALLOWANCE_S
    return step_s + allowance


@dataclass(frozen=True)
class Verdict:
    event: str
    stall_s: float | None
    elastic_s: float | None
    target_s: float
    vs_elastic: float | None

    @property
    def meets_absolute(self) -> bool:
        return self.stall_s is not None and self.stall_s <= self.target_s

    @property
    def meets_share(self) -> bool:
        return self.vs_elastic is not None and self.vs_elastic <= MAX_SHARE_OF_ELASTIC


def verdicts(
    stalls: Mapping[str, float | None], elastic: Mapping[str, float | None], step_s: float
) -> list[Verdict]:
    """Each event's replica stall beside the elastic re-form and the issue's targets."""
    return [
        Verdict(
            e,
            stalls.get(e),
            elastic.get(e),
            target_s(e, step_s),
            ratio(stalls.get(e), elastic.get(e)),
        )
        for e in EVENTS
    ]


def figures_of(
    step_s: float, elastic_step_s: float | None, results: list[Verdict]
) -> dict[str, object]:
    """The JSON line's stall figures: ``<event>_stall_s``, ``elastic_<event>_s``,
    ``<event>_stall_vs_elastic``, and per event its targets and whether they are met."""
    out: dict[str, object] = {
        "step_s": round(step_s, 4),
        "elastic_step_s": None if elastic_step_s is None else round(elastic_step_s, 4),
    }
    for v in results:
        out[f"{v.event}_stall_s"] = None if v.stall_s is None else round(v.stall_s, 3)
        out[f"elastic_{v.event}_s"] = None if v.elastic_s is None else round(v.elastic_s, 3)
        out[f"{v.event}_stall_vs_elastic"] = v.vs_elastic
        out[f"{v.event}_target_s"] = round(v.target_s, 3)
        out[f"{v.event}_target_met"] = v.meets_absolute
        out[f"{v.event}_share_met"] = v.meets_share
    return out

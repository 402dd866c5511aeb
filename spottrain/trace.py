"""Preemption traces: the local cloud's scripted preemptions, read from a YAML or JSON list.

A trace names when (seconds after the job starts) a node is preempted, which node (or any),
and whether a notice comes first. The local cloud replays one (``local.preemptions.trace``),
the simulator replays one, and ``spottrain validate`` reads the file to check it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml


@dataclass(frozen=True)
class TracedPreemption:
    """One preemption of a trace: when (seconds after the job starts), which node (or any),
    and whether it comes with a notice."""

    at_s: float
    node: str | None = None
    notice: bool = True


def load_trace(path: str | Path) -> list[TracedPreemption]:
    """Read a preemption trace: a YAML or JSON list of ``{at_s, node, notice}``.

    Raises:
        ValueError: unreadable, or a row that is not that shape (its index named).
    """
    try:
        rows = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"preemption trace {path}: cannot read it: {e}") from None
    if not isinstance(rows, list):
        raise ValueError(f"preemption trace {path}: expected a list of {{at_s, node, notice}}")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or set(row) - {"at_s", "node", "notice"}:
            raise ValueError(
                f"preemption trace {path}: row {i} must be a mapping with at_s and optional "
                f"node, notice; got {row!r}"
            )
        at = row.get("at_s")
        if not isinstance(at, int | float) or isinstance(at, bool) or at < 0:
            raise ValueError(f"preemption trace {path}: row {i}: at_s must be seconds >= 0")
        out.append(TracedPreemption(float(at), row.get("node"), bool(row.get("notice", True))))
    return sorted(out, key=lambda p: p.at_s)

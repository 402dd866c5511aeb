"""What the benches share: their command line (description, common flags), medians that
tolerate a missing figure, ratios, and the last line every bench prints: one JSON object of
its figures (what the README's tables and the tests read).

A bench runs as ``.venv/bin/python bench/NAME.py``, so this folder is on ``sys.path`` and
``import benchlib`` finds this module.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterable, Mapping
from typing import Any


def parser(doc: str | None, *, reps: int | None = None) -> argparse.ArgumentParser:
    """The bench's argument parser: ``doc`` as its help text, kept as written, and
    ``--reps`` (repetitions; the figures are medians) when ``reps`` gives its default."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    if reps is not None:
        p.add_argument("--reps", type=int, default=reps, help=f"repetitions (default {reps})")
    return p


def median(values: Iterable[float | None]) -> float | None:
    """The median, or None when any value is missing (a recovery that never came)."""
    values = list(values)
    got = [v for v in values if v is not None]
    if len(got) < len(values) or not got:
        return None
    return statistics.median(got)


def ratio(a: float | None, b: float | None, digits: int = 3) -> float | None:
    """``a / b`` rounded, or None when either is missing or ``b`` is zero."""
    return None if a is None or b is None or b == 0 else round(a / b, digits)


def print_figures(figures: Mapping[str, Any]) -> None:
    """The bench's last line: its figures as one JSON object."""
    print(json.dumps(figures), flush=True)

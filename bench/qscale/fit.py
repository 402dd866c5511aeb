"""Least-squares fits of the bench's models (pure: no I/O, tested without a lighthouse)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def fit_quadratic(ns: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """``(a, b)`` of ``y = a n + b n^2`` by least squares, both kept >= 0.

    A negative coefficient (noise at the small counts) would make the extrapolation go
    below zero somewhere; then the other term alone is fitted, which is the least-squares
    optimum under the constraint."""
    n = np.asarray(ns, dtype=float)
    y = np.asarray(ys, dtype=float)
    design = np.column_stack([n, n * n])
    (a, b), *_ = np.linalg.lstsq(design, y, rcond=None)
    if a >= 0 and b >= 0:
        return float(a), float(b)
    only_b = float(np.dot(n * n, y) / np.dot(n * n, n * n))
    only_a = float(np.dot(n, y) / np.dot(n, n))
    err_b = float(np.sum((y - only_b * n * n) ** 2))
    err_a = float(np.sum((y - only_a * n) ** 2))
    return (0.0, max(only_b, 0.0)) if err_b <= err_a else (max(only_a, 0.0), 0.0)


def fit_linear(ns: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """``(c0, c1)`` of ``y = c0 + c1 n`` by least squares, both kept >= 0 (a negative
    intercept, noise, refits the line through the origin)."""
    n = np.asarray(ns, dtype=float)
    y = np.asarray(ys, dtype=float)
    design = np.column_stack([np.ones_like(n), n])
    (c0, c1), *_ = np.linalg.lstsq(design, y, rcond=None)
    if c0 < 0:
        return 0.0, max(float(np.dot(n, y) / np.dot(n, n)), 0.0)
    return float(c0), max(float(c1), 0.0)


def quadratic(a: float, b: float, n: float) -> float:
    return a * n + b * n * n

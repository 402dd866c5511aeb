"""The integrations benchmark runs end to end (--quick) and ends with its JSON figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[3] / "bench" / "integrations.py"
PER_FRAMEWORK = (
    "cost_us",
    "cost_medians_us",
    "cost_share_100ms",
    "hook_us",
    "hook_share_step",
    "hook_share_100ms",
    "step_s",
    "notice_to_commit_s",
)


def test_quick_bench_ends_with_one_json_line_of_figures_for_each_framework() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--quick"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    lines = out.stdout.strip().splitlines()
    figures = json.loads(lines[-1])
    # The Trainer callback and the SDK anchor are always measured; the others when their
    # module imports (a framework left out is named with the reason).
    assert "hf" in figures["measured"]
    assert set(figures["measured"]) | set(figures["left_out"]) == {
        "hf",
        "lightning",
        "accelerate",
        "plain",
    }
    for name in ["sdk", *figures["measured"]]:
        for key in PER_FRAMEWORK:
            assert isinstance(figures[f"{name}_{key}"], float), f"{name}_{key}"
        assert figures[f"{name}_step_s"] > 0 and figures[f"{name}_notice_to_commit_s"] > 0
        assert figures[f"{name}_hook_us"] > 0
    for name in figures["measured"]:
        assert isinstance(figures[f"{name}_notice_vs_sdk"], float), name
    # Each figure is printed beside its anchor before the JSON line.
    text = "\n".join(lines[:-1])
    assert "% of a 100 ms step" in text and "x the SDK's" in text and "(anchor)" in text

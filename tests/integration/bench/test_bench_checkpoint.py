"""The checkpoint benchmark runs end to end (--quick) and ends with its JSON figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[3] / "bench" / "checkpoint.py"
KEYS = {
    "emergency_vs_raw",
    "emergency_vs_dcp",
    "notice_to_commit_s",
    "step_overhead",
    "raw_gbps",
    "dcp_gbps",
    "emergency_gbps",
    "step_s",
    "dcp_cpu_s_per_gb",
    "emergency_cpu_s_per_gb",
    "emergency_cpu_vs_dcp",
}


def test_quick_bench_ends_with_one_json_line_of_figures(tmp_path: Path) -> None:
    workdir = tmp_path / "bench"
    out = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--dir", str(workdir)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    lines = out.stdout.strip().splitlines()
    figures = json.loads(lines[-1])
    assert figures.keys() >= KEYS
    for key in KEYS:
        assert isinstance(figures[key], float), key
    assert figures["raw_gbps"] > 0 and figures["emergency_gbps"] > 0
    assert figures["notice_to_commit_s"] > 0
    assert figures["dcp_cpu_s_per_gb"] > 0 and figures["emergency_cpu_s_per_gb"] > 0
    # Each figure is printed beside its anchor before the JSON line.
    text = "\n".join(lines[:-1])
    assert "x raw" in text and "x DCP" in text and "notice -> committed" in text
    assert "CPU-seconds per GB" in text and "cores busy while writing" in text
    assert not workdir.exists()  # the scratch directory is removed


def test_the_writes_alone_end_with_their_figures_and_no_notice_or_steps(tmp_path: Path) -> None:
    """``--writes-only``: (a)-(c) with their CPU per GB, as on tmpfs, where that CPU is all a
    save costs."""
    workdir = tmp_path / "bench"
    out = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--writes-only", "--dir", str(workdir)],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["emergency_cpu_s_per_gb"] > 0 and figures["emergency_gbps"] > 0
    assert "notice_to_commit_s" not in figures and "step_s" not in figures
    assert "notice -> committed" not in out.stdout and not workdir.exists()

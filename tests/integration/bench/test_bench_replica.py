"""The replica bench: its figures from known step times, and a short real run of replica
mode (the Redis quorum through a shim per replica, real replicas and Redis) ending with its
JSON figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[3] / "bench"
sys.path.insert(0, str(BENCH_DIR))

from replica_parts.figures import (  # noqa: E402
    figures_of,
    pause_through,
    step_time,
    target_s,
    verdicts,
)


def test_the_pause_spans_the_last_step_before_the_event() -> None:
    times = [0.0, 0.2, 0.4, 2.0, 2.2, 2.4, 9.0]
    assert step_time(times) == pytest.approx(0.2)
    # The event at 0.5: the gap 0.4 -> 2.0 is the survivors' pause; steps after the window
    # (9.0) do not count.
    assert pause_through(times, 0.5, 3.0) == pytest.approx(1.6)
    assert pause_through(times, 3.0, 4.0) is None  # no step after the event yet
    assert pause_through([5.0, 5.1], 0.0, 6.0) == pytest.approx(0.1)  # none before it
    assert step_time([1.0]) is None


def test_targets_ratios_and_verdicts() -> None:
    assert target_s("notice", 0.2) == pytest.approx(0.7)
    assert target_s("kill", 0.2) == pytest.approx(1.7)
    stalls = {"notice": 0.5, "kill": 1.8, "freeze": 1.0}
    elastic = {"notice": 10.0, "kill": 4.0, "freeze": None}
    by = {v.event: v for v in verdicts(stalls, elastic, 0.2)}
    assert by["notice"].meets_absolute and by["notice"].meets_share
    assert by["notice"].vs_elastic == 0.05
    assert not by["kill"].meets_absolute and not by["kill"].meets_share  # 1.8 > 1.7; 0.45
    assert by["freeze"].meets_absolute and by["freeze"].vs_elastic is None
    assert not by["freeze"].meets_share  # no elastic figure: not shown to be met
    figs = figures_of(0.2, 0.11, list(by.values()))
    for key in ("step_s", "notice_stall_s", "kill_stall_s", "freeze_stall_s"):
        assert key in figs
    assert figs["kill_stall_vs_elastic"] == 0.45 and figs["freeze_stall_vs_elastic"] is None


@pytest.mark.slow
def test_short_run_of_replica_mode_ends_with_its_figures(tmp_path: Path) -> None:
    pytest.importorskip("torchft")
    out = subprocess.run(
        [
            *(sys.executable, str(BENCH_DIR / "replica.py"), "--skip-elastic"),
            *("--cap", "120", "--quorum", "redis"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("notice_stall_s", "kill_stall_s", "freeze_stall_s", "join_s", "fetch_s"):
        assert isinstance(figures[key], float) and figures[key] > 0, (key, figures)
    assert isinstance(figures["load_s"], float) and figures["state_bytes"] > 0
    assert figures["step_s"] > 0
    assert figures["elastic_kill_s"] is None and figures["kill_stall_vs_elastic"] is None
    assert figures["discarded"]["kill"] >= 0
    assert figures["quorum"] == "redis"

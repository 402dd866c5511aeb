"""The quorum bench: its fits against known curves, and a small run of the real torchft
lighthouse and gloo process groups ending with its JSON figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[3] / "bench"
sys.path.insert(0, str(BENCH_DIR))

from qscale.fit import fit_linear, fit_quadratic, quadratic  # noqa: E402


def test_fits_recover_the_coefficients_and_stay_non_negative() -> None:
    ns = [10, 100, 300, 1000]
    a, b = fit_quadratic(ns, [quadratic(4e-4, 1.5e-6, n) for n in ns])
    assert a == pytest.approx(4e-4) and b == pytest.approx(1.5e-6)
    # A pure square plus a slightly low small point: the linear term would go negative.
    a, b = fit_quadratic(ns, [1e-6 * n * n - (1e-3 if n == 10 else 0.0) for n in ns])
    assert a == 0.0 and b == pytest.approx(1e-6, rel=1e-3)
    c0, c1 = fit_linear([2, 4, 8, 16], [0.01 + 0.0125 * n for n in (2, 4, 8, 16)])
    assert (c0, c1) == (pytest.approx(0.01), pytest.approx(0.0125))
    c0, c1 = fit_linear([2, 4, 8, 16], [0.0125 * n - 0.01 for n in (2, 4, 8, 16)])
    assert c0 == 0.0 and c1 > 0


@pytest.mark.slow
def test_small_run_measures_the_lighthouse_and_process_groups() -> None:
    pytest.importorskip("torchft")
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH_DIR / "quorum_scale.py"),
            *("--replicas", "2,4,8", "--rounds", "2", "--pg-ranks", "2,3", "--pg-reps", "1"),
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    # torchft's per-client INFO lines are off.
    assert "Creating LighthouseClient" not in out.stderr
    assert "EXTRAPOLATED, not measured: 12,500 replicas" in out.stdout
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    quorum = figures["lighthouse"]
    assert quorum["replicas"] == [2, 4, 8] and len(quorum["round_s"]) == 3
    assert all(s > 0 for s in quorum["round_s"])
    assert quorum["fit_a_s"] >= 0 and quorum["fit_b_s"] >= 0
    assert set(quorum["extrapolated_round_s"]) == {"4000", "12500"}
    pg = figures["pg_gloo"]
    assert pg["ranks"] == [2, 3] and all(s > 0 for s in pg["rebuild_s"])

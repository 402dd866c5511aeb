"""The quorum bench: its fits against known curves, a tiny run of the Redis quorum (real
redis-server, client and heartbeat processes, spottrain.quorum's scripts) ending with its
JSON figures, and a small run of the real torchft lighthouse and gloo process groups."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[3] / "bench"
sys.path.insert(0, str(BENCH_DIR))

from qscale.fit import fit_linear, fit_quadratic, quadratic  # noqa: E402
from qscale.redis_clients import resp_len  # noqa: E402
from qscale.redis_measure import heartbeat_timeout_ms, silent_loss  # noqa: E402
from qscale.redis_quorum import RedisQuorum, check, pct  # noqa: E402
from quorum_scale import fault_sizes  # noqa: E402

from spottrain.quorum.model import QuorumConfig  # noqa: E402


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
    # The bytes a reply took on the wire, from what redis-py parsed; nearest-rank percentiles.
    assert resp_len(7) == len(b":7\r\n") and resp_len(None) == len(b"$-1\r\n")
    assert resp_len([b"k", b"v1"]) == len(b"*2\r\n$1\r\nk\r\n$2\r\nv1\r\n")
    assert pct([1.0, 2.0, 3.0, 4.0], 50) == 2.0 and pct([1.0, 2.0, 3.0], 99) == 3.0


def test_tiny_run_measures_the_redis_quorum() -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH_DIR / "quorum_scale.py"),
            *("--impl", "redis", "--sizes", "3,6", "--redis-rounds", "3", "--procs", "1"),
            *("--fault-replicas", "3,max", "--fill-mib", "1", "--pause-s", "0.2", "--no-pg"),
            *("--heartbeat-timeout-ms", "600", "--steady-heartbeat-timeout-ms", "600"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "EXTRAPOLATED from Redis's side: 12,500 x" in out.stdout
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    for n in (3, 6):
        assert figures[f"redis_round_ms_p50_{n}"] > 0
        assert figures[f"redis_round_ms_p99_{n}"] >= figures[f"redis_round_ms_p50_{n}"]
        # O(1) per replica: the same bytes a step at 3 and 6 replicas, give or take ids.
        assert 100 < figures[f"redis_bytes_per_replica_step_{n}"] < 2000
        assert 0 < figures[f"redis_leave_to_quorum_s_{n}"] < 5
        assert 0 < figures[f"redis_silent_loss_to_quorum_s_{n}"] < 5
        assert figures[f"shim_rebuild_ms_{n}"] >= 0
    assert (
        abs(figures["redis_bytes_per_replica_step_3"] - figures["redis_bytes_per_replica_step_6"])
        < 20
    )
    size = figures["redis"]["sizes"][1]
    assert size["commands"]["evalsha"]["calls_per_round"] >= 6 and size["roster_bytes"] > 0
    # The leaver is tombstoned "left"; the silent one "dropped" only once its heartbeat expired.
    assert figures["redis"]["sizes"][0]["gone"]["replica-00002"].startswith("left ")
    # The timeout given wins at every size; false drops at the smallest fault size
    # unsuffixed (1,000 in the full run), and per size measured (here also the largest).
    assert figures["redis_silent_loss_heartbeat_timeout_ms_6"] == 600
    assert figures["redis_false_drops_aof_rewrite"] == 0
    assert figures["redis_false_drops_paused_client"] == 0
    assert figures["redis_false_drop_replicas"] == 3
    for n in (3, 6):
        assert figures[f"redis_false_drops_aof_rewrite_{n}"] == 0
        assert figures[f"redis_false_drops_paused_client_{n}"] == 0
        assert figures[f"redis_false_drop_rate_{n}"] == 0
        assert figures[f"redis_false_drop_heartbeat_timeout_ms_{n}"] == 600
    assert figures["redis_serial_round_ms_extrapolated_12500"] > 0


def test_silent_loss_and_false_drops_run_at_the_products_timeout_for_each_size() -> None:
    assert [heartbeat_timeout_ms(n) for n in (100, 1000, 2500, 4000, 12_500)] == [
        1000,
        1000,
        1000,
        2000,
        5000,
    ]
    assert heartbeat_timeout_ms(12_500, 1000) == 1000  # --heartbeat-timeout-ms wins
    assert fault_sizes("1000,max", [100, 12_500]) == [1000, 12_500]
    assert fault_sizes("3", [3, 6]) == [3] and fault_sizes("0", [3]) == []


def test_a_silent_loss_retry_starts_with_the_dropped_replicas_under_new_ids() -> None:
    """What a failed silent loss's retry starts from: the healthy replicas the quorum dropped
    (here a client process frozen past the heartbeat timeout) are back under new ids, and the
    round after the next silent loss holds every other replica, the rejoined ones too."""
    config = QuorumConfig(heartbeat_timeout_ms=300, join_timeout_ms=300)
    with RedisQuorum(4, 2, config) as q:
        check(q.round(), 4, "the first round")
        q.pause_worker(0, 1.2).join()
        q.round(timeout_s=10)  # the frozen replicas' requests: refused, they were dropped
        assert q.rejoin_dropped() == ["replica-00000", "replica-00002"]
        assert q.live == ["replica-00001", "replica-00003", "replica-00004", "replica-00005"]
        r, silenced, error = silent_loss(q, config, "4 replicas")
        assert error == "" and r.counts == {3: 3} and r.last_recv > silenced
        assert q.rejoin_dropped() == []
        assert q.gone()["replica-00001"].startswith("dropped")


@pytest.mark.slow
def test_small_run_measures_the_lighthouse_and_process_groups() -> None:
    pytest.importorskip("torchft")
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH_DIR / "quorum_scale.py"),
            *("--impl", "lighthouse", "--lighthouse-max-threads", "20"),
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
    # 8 clients need 24 threads, over the cap: null, with the reason.
    assert quorum["replicas"] == [2, 4] and len(quorum["round_s"]) == 2
    assert figures["lighthouse_round_ms_p50_8"] is None and figures["lighthouse_round_ms_p50_2"] > 0
    assert "over --lighthouse-max-threads 20" in quorum["null_reasons"]["8"]
    assert all(s > 0 for s in quorum["round_s"])
    assert quorum["fit_a_s"] >= 0 and quorum["fit_b_s"] >= 0
    assert set(quorum["extrapolated_round_s"]) == {"4000", "12500"}
    pg = figures["pg_gloo"]
    assert pg["ranks"] == [2, 3] and all(s > 0 for s in pg["rebuild_s"])

"""``spottrain simulate``'s heartbeat timeout: the Redis quorum's grows with the simulated
fleet as the spec's ``heartbeat_timeout_s: auto`` does, a loss without notice costs about it
(scaled as measured), a noticed loss never waits for it with the Redis quorum, and the
lighthouse keeps its fixed 1 s. Closed forms against the engine, no I/O."""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

import pytest

from spottrain.cloud.base import Market, Offer
from spottrain.controller.sim.command import add_parser
from spottrain.controller.sim.config import config_from_args
from spottrain.controller.sim.engine import simulate
from spottrain.controller.sim.model import SimConfig
from spottrain.controller.sim.replica_params import ReplicaParams, describe
from spottrain.spec.heartbeat import auto_heartbeat_timeout_s
from spottrain.trace import TracedPreemption

SPOT = Offer("aws", "us-east-1", "us-east-1a", "p5.48xlarge", 8, "H100", Market.SPOT, 24.77, 0.25)
OD = replace(SPOT, market=Market.ON_DEMAND, price_per_hour=55.04, interruption_risk=0.0)
LIGHTHOUSE = ReplicaParams(quorum="lighthouse")


def test_the_redis_quorums_heartbeat_timeout_is_the_specs_auto_for_the_fleet() -> None:
    d = ReplicaParams()
    assert d.quorum == "redis" and d.heartbeat_s is None and d.kill_stall_s is None
    for fleet, timeout in ((1, 1.0), (2_500, 1.0), (2_501, 1.5), (12_500, 5.0)):
        assert d.heartbeat_timeout_s(fleet) == timeout == auto_heartbeat_timeout_s(fleet)
    # A silent loss: 1.08 x the timeout (5.40 s measured at 5 s, 1.01-1.11 s at 1 s).
    assert d.kill_stall(12_500) == pytest.approx(5.40)
    assert d.kill_stall(100) == pytest.approx(1.08)
    assert d.kill_stall_total_s(12_500) == pytest.approx(5.40 + d.step_s)
    # The lighthouse keeps the 1 s the controller gives it, whatever the fleet; its
    # measured silent loss is 1.1 s at it.
    assert LIGHTHOUSE.heartbeat_timeout_s(12_500) == 1.0
    assert LIGHTHOUSE.kill_stall(12_500) == pytest.approx(1.1)
    # Given values win, and a given heartbeat carries the kill stall with it.
    given = replace(d, heartbeat_s=3.0)
    assert given.heartbeat_timeout_s(12_500) == 3.0
    assert given.kill_stall(12_500) == pytest.approx(3.24)
    assert replace(LIGHTHOUSE, heartbeat_s=3.0).kill_stall(1) == pytest.approx(3.1)
    assert replace(d, kill_stall_s=2.0).kill_stall(12_500) == 2.0


def test_a_noticed_loss_with_the_redis_quorum_costs_a_round_not_the_heartbeat() -> None:
    """At 12,500 replicas the timeout is 5 s; the leave lands within one (relayed) round."""
    d = ReplicaParams()
    assert d.notice_stall_s(12_499) == pytest.approx(d.quorum_s(12_499))
    assert d.quorum_s(12_499) < 0.1
    assert replace(d, heartbeat_s=60.0).notice_stall_s(12_499) == d.notice_stall_s(12_499)
    # The lighthouse has no leave: its timeout and the step in flight.
    assert LIGHTHOUSE.notice_stall_s(12_499) == pytest.approx(1.0 + LIGHTHOUSE.step_s)


def _progress(params: ReplicaParams, *, nodes: int, notice: bool) -> float:
    """The replica policy's progress over an hour of ``nodes`` one-node replicas, one of
    them preempted at 30 minutes (with or without notice) and backfilled."""
    res = simulate(
        SimConfig(
            nodes=nodes,
            spot=SPOT,
            on_demand=OD,
            hours=1.0,
            trace=(TracedPreemption(1800.0, "n3", notice),),
            rate_per_node_hour=0.0,
            notice_s=120.0,
            launch_latency_s=300.0,
            ckpt_gb=10.0,
            peer_gbps=1.0,
            ckpt_every_s=math.inf,
            pass_s=0.0,
            replica=params,
            policies=("replica",),
            samples=24,
        )
    )
    assert res.preemptions == 1 and res.with_notice == int(notice)
    return next(p for p in res.policies if p.name == "replica").progress_s


def test_a_silent_loss_in_a_big_fleet_costs_its_longer_heartbeat_timeout() -> None:
    """10,001 replicas: the auto timeout is 4.5 s (the fleet's: the 10,000 survivors' would
    be 4 s), so a SIGKILL stops the survivors 1.08 x 4.5 = 4.86 s (+ the step redone)
    instead of the 1.08 s at a given 1 s: the run loses the 3.78 s difference at the
    survivors' rate, (n - 1) / n x share(n - 1) of the full fleet. With notice the timeout
    costs nothing; with the lighthouse it stays 1 s."""
    n = 10_001
    base = ReplicaParams(pg_c0_s=0.0, pg_c1_s=0.0)
    at_1s = replace(base, heartbeat_s=1.0)
    rate = (n - 1) / n * base.step_share(n - 1)
    extra = base.kill_stall(n) - at_1s.kill_stall(n)
    assert extra == pytest.approx(4.86 - 1.08)
    lost = _progress(at_1s, nodes=n, notice=False) - _progress(base, nodes=n, notice=False)
    assert lost == pytest.approx(rate * extra, rel=1e-6)
    assert _progress(base, nodes=n, notice=True) == pytest.approx(
        _progress(at_1s, nodes=n, notice=True), rel=1e-12
    )
    lighthouse = replace(base, quorum="lighthouse", quorum_a_s=0.0, quorum_b_s=0.0)
    assert _progress(lighthouse, nodes=n, notice=False) == pytest.approx(
        _progress(replace(lighthouse, heartbeat_s=1.0), nodes=n, notice=False), rel=1e-12
    )


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="spottrain")
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["simulate", *argv])


def test_the_command_line_resolves_the_timeout_for_the_simulated_replicas() -> None:
    """100,000 GPUs are 12,500 one-node replicas: 5 s, and the printed parameters say it is
    the spec's auto; --heartbeat-s and --kill-stall-s win and are said to be given; two-node
    replicas halve the fleet (6,250 replicas: 2.5 s); the lighthouse keeps 1 s."""
    cases = {
        (): (5.0, 5.4, "auto at 12,500 replicas", "measured"),
        ("--replica-nodes", "2"): (2.5, 2.7, "auto at 6,250 replicas", "modelled"),
        ("--gpus", "800"): (1.0, 1.08, "auto at 100 replicas", "measured"),
        ("--heartbeat-s", "2"): (2.0, 2.16, "given (--heartbeat-s", "modelled"),
        ("--quorum", "lighthouse"): (1.0, 1.1, "controller/run/lighthouse.py", "measured"),
    }
    for argv, (timeout, kill, said, kind) in cases.items():
        cfg = config_from_args(_args(*argv, "--hours", "1"))
        fleet = cfg.costs().replicas
        assert cfg.replica.heartbeat_timeout_s(fleet) == timeout, argv
        params = describe(cfg.replica, fleet, cfg.costs().catch_up_s)
        assert params["heartbeat_s"]["value"] == timeout and said in params["heartbeat_s"]["source"]
        assert params["heartbeat_s"]["kind"] == "setting"
        assert params["kill_stall_s"]["value"] == pytest.approx(kill), argv
        assert params["kill_stall_s"]["kind"] == kind, argv
        assert params["at_replicas"]["kill_stall_s"] == pytest.approx(kill + cfg.replica.step_s)
    given = describe(config_from_args(_args("--kill-stall-s", "9")).replica, 12_500, 0.0)
    assert given["kill_stall_s"]["value"] == 9.0 and given["kill_stall_s"]["kind"] == "setting"

"""``spottrain simulate``: the engine against closed forms, the policies' bookkeeping, and the
incremental planner index against the plain planner."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest

from spottrain.cloud.base import Instance, InstanceState, Market, Offer
from spottrain.controller.reconcile.fleet import FleetIndex
from spottrain.controller.reconcile.planner import plan
from spottrain.controller.reconcile.types import NodeObs, Observed, Policy, ZoneHistory
from spottrain.controller.sim.engine import simulate
from spottrain.controller.sim.model import SimConfig, SimResult
from spottrain.controller.sim.replica_params import ReplicaParams
from spottrain.controller.sim.report import figures, table
from spottrain.spec import SpotPolicy
from spottrain.trace import TracedPreemption

SPOT = Offer("aws", "us-east-1", "us-east-1a", "p5.48xlarge", 8, "H100", Market.SPOT, 24.77, 0.25)
OD = replace(SPOT, market=Market.ON_DEMAND, price_per_hour=55.04, interruption_risk=0.0)


def _cfg(**kw: object) -> SimConfig:
    base: dict[str, object] = {"nodes": 100, "spot": SPOT, "on_demand": OD, "hours": 24.0}
    base.update(kw)
    return SimConfig(**base)  # type: ignore[arg-type]


def _policy(res: SimResult, name: str) -> tuple[float, float]:
    """(effective share, lost full-fleet seconds) of one policy."""
    p = next(p for p in res.policies if p.name == name)
    return p.progress_s / (res.config.hours * 3600.0), p.lost_s


# --- closed forms -----------------------------------------------------------------------


def _renewal_se(lam: float, tau: float, d: float, horizon: float, n: int = 200_000) -> float:
    """Standard error of the useful fraction measured over ``horizon`` for the renewal
    process of the sync policy (Monte Carlo of the cycles, then the ratio estimator's
    delta-method error: sd(Y - f C) / (E[C] sqrt(cycles)))."""
    rng = np.random.default_rng(7)
    up = rng.exponential(1 / lam, n)
    useful = tau * np.floor(up / tau)
    # The wait for a gap of d with no failure: a geometric number of failures that come
    # sooner than d (each a truncated exponential), then d.
    short = rng.geometric(math.exp(-lam * d), n) - 1
    total = int(short.sum())
    u = rng.random(total)
    gaps = -np.log1p(-u * (1 - math.exp(-lam * d))) / lam  # Exp(lam) conditioned on < d
    owner = np.repeat(np.arange(n), short)
    wait = d + np.bincount(owner, weights=gaps, minlength=n)
    cycle = up + wait
    f = useful.sum() / cycle.sum()
    cycles = horizon / cycle.mean()
    return float(np.std(useful - f * cycle) / (cycle.mean() * math.sqrt(cycles)))


def test_sync_matches_the_renewal_formula() -> None:
    """Sync, Poisson failures at fleet rate L, no notice, a checkpoint every tau of training
    (free), and a fixed restart D (launch latency + rendezvous) that starts over whenever
    another VM is lost before it completes.

    Renewal-reward over one cycle (an up period U ~ Exp(L), then the wait W for a gap of D
    with no failure): the work kept is tau * floor(U / tau), whose mean is
    tau / (e^(L tau) - 1); E[U] = 1/L and E[W] = (e^(L D) - 1) / L. So the useful fraction is

        f = L tau e^(-L D) / (e^(L tau) - 1)  ~=  1 / (1 + L (tau/2 + D))  for small L tau, L D.
    """
    nodes, lam_h = 1000, 4.0  # 4 failures an hour over the fleet
    tau, latency, rdzv = 900.0, 300.0, 150.0
    hours = 1500.0  # about 6,000 failures
    cfg = _cfg(
        nodes=nodes,
        hours=hours,
        rate_per_node_hour=lam_h / nodes,
        notice_fraction=0.0,
        ckpt_gb=0.0,
        ckpt_every_s=tau,
        launch_latency_s=latency,
        rendezvous_s=rdzv,
        pass_s=0.0,
        policies=("sync",),
        seed=3,
    )
    res = simulate(cfg)
    lam, d = lam_h / 3600.0, latency + rdzv
    expected = lam * tau * math.exp(-lam * d) / math.expm1(lam * tau)
    se = _renewal_se(lam, tau, d, hours * 3600.0)
    got, lost = _policy(res, "sync")
    assert res.preemptions == pytest.approx(lam_h * hours, rel=0.05)
    print(f"sync: simulated {got:.4f}, formula {expected:.4f}, standard error {se:.4f}")
    assert abs(got - expected) < 4 * se, (got, expected, se)
    assert 0.003 < se < 0.01  # the tolerance is a few percent of f, not a blanket one
    # At small rates the formula is the familiar 1 / (1 + L (tau/2 + D)).
    small = lam / 100
    exact_small = small * tau * math.exp(-small * d) / math.expm1(small * tau)
    assert exact_small == pytest.approx(1 / (1 + small * (tau / 2 + d)), rel=1e-4)
    # Work lost per cycle: the part of the up period past its last checkpoint.
    assert lost > 0


def test_elastic_with_notice_and_an_instant_save_loses_nothing() -> None:
    """Every preemption with notice, an emergency checkpoint that costs nothing: no work is
    ever rolled back, and each preemption costs two re-forms (the leave and the backfill's
    join) plus the missing node's share until its replacement takes the slot, so

        f = 1 - L (2 R + (max(latency, notice) - R) / N)

    to first order (re-forms that overlap merge, a second-order gain)."""
    nodes, lam_h, rdzv, latency, notice = 1000, 4.0, 10.0, 300.0, 120.0
    hours = 500.0
    cfg = _cfg(
        nodes=nodes,
        hours=hours,
        rate_per_node_hour=lam_h / nodes,
        notice_fraction=1.0,
        notice_s=notice,
        ckpt_gb=0.0,
        ckpt_every_s=math.inf,
        launch_latency_s=latency,
        rendezvous_s=rdzv,
        pass_s=0.0,
        policies=("elastic",),
        seed=5,
    )
    res = simulate(cfg)
    got, lost = _policy(res, "elastic")
    assert lost == 0.0
    assert figures(res)["policies"]["elastic"]["lost_gpu_h_per_preemption"] == 0.0
    per = 2 * rdzv + (max(latency, notice) - rdzv) / nodes
    expected = 1 - lam_h / 3600.0 * per
    # The count of preemptions is Poisson: its spread is the spread of the stall time.
    se = 2 * rdzv * math.sqrt(lam_h * hours) / (hours * 3600.0)
    assert abs(got - expected) < 4 * se + 2e-4, (got, expected, se)


def test_ideal_replica_loses_only_the_missing_replicas_share() -> None:
    """Ideal replica policy, notices always, a backfill ready before the VM dies: a replica is out
    from its VM's death until it has copied the state from a peer (rendezvous + size / peer
    bandwidth). By Little's law the mean number out is L x that time, so
    f = 1 - L T / N; nothing is rolled back and nobody else stops."""
    nodes, lam_h, rdzv, ckpt_gb, peer = 100, 4.0, 10.0, 100.0, 0.1
    hours = 500.0
    cfg = _cfg(
        nodes=nodes,
        hours=hours,
        rate_per_node_hour=lam_h / nodes,
        notice_fraction=1.0,
        notice_s=120.0,
        launch_latency_s=60.0,
        ckpt_gb=ckpt_gb,
        peer_gbps=peer,
        ckpt_every_s=math.inf,
        rendezvous_s=rdzv,
        pass_s=0.0,
        policies=("replica-ideal",),
        seed=11,
    )
    res = simulate(cfg)
    got, lost = _policy(res, "replica-ideal")
    t_out = (rdzv + ckpt_gb / peer) / 3600.0  # hours
    expected = 1 - lam_h * t_out / nodes
    se = t_out * math.sqrt(lam_h / hours) / nodes  # M/D/infinity's time average
    assert lost == 0.0
    assert abs(got - expected) < 4 * se, (got, expected, se)


def _poisson_mean(mean: float, f: Callable[[int], float], kmax: int = 60) -> float:
    """E[f(K)] for K ~ Poisson(mean)."""
    return sum(math.exp(-mean) * mean**k / math.factorial(k) * f(k) for k in range(kmax))


def test_replica_pays_the_measured_stalls_rebuilds_and_quorum() -> None:
    """The ``replica`` policy (torchft's measured costs), notices always, a backfill ready
    before the VM dies. Three things cost:

    - every step waits for a quorum round q(n) = a n + b n^2 of the n live replicas, so
      training runs at (n / R) x step / (step + q(n)) of the full fleet;
    - each preemption stops everyone for S = heartbeat + step + pg(n - 1) at the loss and
      pg(n) when the joiner enters the quorum, with pg(n) = c0 + c1 n (stops queue, so
      they add up);
    - the lost replica is out for T = join_start + pg + catch-up.

    By Little's law the replicas out K are Poisson with mean m = L T (M/D/infinity), so to
    first order in L S

        f = E[(R - K) / R x share(R - K)] x (1 - L E[S]),

    with E[S] = heartbeat + step + pg(R - m - 1) + pg(R - m) (pg is linear). Nothing is
    rolled back."""
    nodes, lam_h, hours = 100, 4.0, 500.0
    params = ReplicaParams(
        step_s=1.0,
        heartbeat_s=1.0,
        kill_stall_s=1.1,
        join_start_s=4.9,
        quorum_a_s=0.001,
        quorum_b_s=1e-5,
        pg_c0_s=2.0,
        pg_c1_s=0.05,
        quorum="lighthouse",
    )
    ckpt_gb, peer = 100.0, 0.1  # a 1,000 s catch-up: a few replicas out at once
    cfg = _cfg(
        nodes=nodes,
        hours=hours,
        rate_per_node_hour=lam_h / nodes,
        notice_fraction=1.0,
        notice_s=120.0,
        launch_latency_s=60.0,
        ckpt_gb=ckpt_gb,
        peer_gbps=peer,
        ckpt_every_s=math.inf,
        pass_s=0.0,
        replica=params,
        policies=("replica",),
        seed=11,
    )
    res = simulate(cfg)
    got, lost = _policy(res, "replica")
    lam = lam_h / 3600.0
    t_out = params.join_start_s + params.pg_rebuild_s(nodes) + ckpt_gb / peer
    m = lam * t_out
    running = _poisson_mean(
        m, lambda k: (nodes - k) / nodes * params.step_share(nodes - k) if k < nodes else 0.0
    )
    stall = (
        params.heartbeat_timeout_s(nodes)
        + params.step_s
        + params.pg_rebuild_s(round(nodes - m - 1))
        + params.pg_rebuild_s(round(nodes - m))
    )
    expected = running * (1 - lam * stall)
    # Two Poisson sources of spread: the count of stalls, and the replicas out over time.
    se_stall = running * stall * math.sqrt(lam_h * hours) / (hours * 3600.0)
    se_out = (t_out / 3600.0) * math.sqrt(lam_h / hours) / nodes
    se = math.hypot(se_stall, se_out)
    assert lost == 0.0
    assert 0.05 < 1 - expected < 0.3  # each of the three costs is a visible share
    print(f"replica: simulated {got:.5f}, formula {expected:.5f}, standard error {se:.5f}")
    assert abs(got - expected) < 4 * se + 5e-4, (got, expected, se)


def test_replica_quorum_per_step_costs_its_share_without_preemptions() -> None:
    """No preemptions, no checkpoints: replica trains step / (step + q(R)) of the time,
    replica-ideal all of it. Here q(100) = 4 s = the step: the lighthouse's 0.01 x 100 +
    3e-4 x 100^2, or the Redis quorum's (the default) 1 + 0.03 x 100."""
    lighthouse = ReplicaParams(step_s=4.0, quorum_a_s=0.01, quorum_b_s=3e-4, quorum="lighthouse")
    redis = ReplicaParams(step_s=4.0, redis_a_s=1.0, redis_b_s=0.03)
    assert redis.quorum == "redis" and ReplicaParams().quorum == "redis"
    for params in (lighthouse, redis):
        res = simulate(
            _cfg(
                rate_per_node_hour=0.0,
                ckpt_gb=0.0,
                ckpt_every_s=math.inf,
                replica=params,
                policies=("replica", "replica-ideal"),
            )
        )
        assert params.quorum_s(100) == pytest.approx(4.0)
        assert _policy(res, "replica")[0] == pytest.approx(0.5, abs=1e-9)
        assert _policy(res, "replica-ideal")[0] == pytest.approx(1.0, abs=1e-9)
    # The measured defaults: the Redis quorum is linear in the replicas, the lighthouse
    # quadratic, so at 12,500 replicas (100,000 GPUs) their rounds are far apart.
    d = ReplicaParams()
    assert d.quorum_s(12_500) < 0.1 * replace(d, quorum="lighthouse").quorum_s(12_500)
    # From 1,000 replicas the Redis quorum goes through relays (the spec's auto): the round
    # is the relays' hop plus Redis's batches, far below a request per replica at 12,500.
    relayed, direct = d.quorum_s(12_500), replace(d, relay_from=0).quorum_s(12_500)
    assert relayed == pytest.approx(d.relay_hop_s + d.relay_b_s * 12_500)
    assert direct == pytest.approx(d.redis_b_s * 12_500) and relayed < 0.2 * direct
    assert d.quorum_s(999) == pytest.approx(d.redis_b_s * 999)
    with pytest.raises(ValueError, match="quorum 'zk'"):
        ReplicaParams(quorum="zk")


def test_each_quorum_change_costs_every_survivor_one_rebuild() -> None:
    """One noticed preemption of 10 one-node replicas. Against the same run with free
    process groups, the survivors lose one rebuild at the leave (at 9 replicas, training at
    0.9 x share(9)) and one at the join (which delays the rest of the run by pg(10) at
    share(10)): 0.9 share(9) pg(9) + share(10) pg(10) full-fleet seconds. A longer heartbeat
    timeout costs 0.9 share(9) per second of it with the lighthouse, nothing with the Redis
    quorum (the leave lands within a round: the noticed loss costs one round instead)."""
    base = ReplicaParams(
        step_s=1.0, quorum_a_s=0.0, quorum_b_s=0.01, pg_c0_s=0.0, pg_c1_s=0.0, quorum="lighthouse"
    )
    costly = replace(base, pg_c0_s=5.0, pg_c1_s=0.5)
    slow_beat = replace(base, heartbeat_s=11.0)
    trace = (TracedPreemption(1800.0, "n3", True),)

    def progress(params: ReplicaParams) -> float:
        res = simulate(
            _cfg(
                nodes=10,
                hours=3.0,
                trace=trace,
                rate_per_node_hour=0.0,
                notice_s=120.0,
                launch_latency_s=300.0,
                ckpt_gb=10.0,
                peer_gbps=1.0,
                ckpt_every_s=math.inf,
                pass_s=0.0,
                replica=params,
                policies=("replica",),
            )
        )
        assert res.preemptions == 1 and res.launches == 1
        return next(p for p in res.policies if p.name == "replica").progress_s

    free = progress(base)
    share9, share10 = base.step_share(9), base.step_share(10)
    rebuilds = 0.9 * share9 * costly.pg_rebuild_s(9) + share10 * costly.pg_rebuild_s(10)
    assert free - progress(costly) == pytest.approx(rebuilds, rel=1e-9)
    assert free - progress(slow_beat) == pytest.approx(0.9 * share9 * 10.0, rel=1e-9)
    redis = replace(base, quorum="redis", redis_a_s=0.0, redis_b_s=0.01)
    assert redis.notice_stall_s(9) == pytest.approx(redis.quorum_s(9))
    assert progress(replace(redis, heartbeat_s=11.0)) == pytest.approx(progress(redis))
    # The Redis quorum's notice costs one round (0.09 s) where the lighthouse's costs the
    # heartbeat and the step in flight (2 s): the same run with it makes more progress.
    assert progress(redis) > progress(replace(redis, quorum="lighthouse"))


# --- the policies' behaviour -------------------------------------------------------------


def test_an_emergency_save_that_misses_the_window_falls_back_to_the_last_checkpoint() -> None:
    fits = simulate(_cfg(rate_per_node_hour=0.01, ckpt_gb=84, write_gbps=4, seed=2))
    misses = simulate(_cfg(rate_per_node_hour=0.01, ckpt_gb=840, write_gbps=4, seed=2))
    assert fits.preemptions == misses.preemptions > 0
    assert _policy(fits, "elastic")[1] == 0.0
    assert _policy(misses, "elastic")[1] > 0.0  # 210 s does not fit 120 - 10 s


def test_without_notice_elastic_loses_the_work_since_the_last_checkpoint() -> None:
    res = simulate(_cfg(rate_per_node_hour=0.01, notice_fraction=0.0, seed=4))
    assert res.with_notice == 0
    sync_eff, sync_lost = _policy(res, "sync")
    el_eff, el_lost = _policy(res, "elastic")
    rep_eff, rep_lost = _policy(res, "replica")
    assert el_lost > 0 and sync_lost > 0
    assert rep_lost == 0.0
    assert sync_eff < el_eff < rep_eff <= 1.0


def test_policies_see_the_same_fleet_whatever_else_runs() -> None:
    cfg = _cfg(rate_per_node_hour=0.01, zone_reclaims_per_day=2, seed=9)
    alone = simulate(replace(cfg, policies=("sync",)))
    together = simulate(cfg)
    again = simulate(cfg)
    assert alone.preemptions == together.preemptions == again.preemptions > 0
    assert alone.cost_usd == pytest.approx(together.cost_usd)
    assert alone.policies[0].progress_s == together.policies[0].progress_s
    assert figures(together)["policies"] == figures(again)["policies"]


def test_a_fleet_without_preemptions_only_pays_for_checkpoints() -> None:
    res = simulate(_cfg(rate_per_node_hour=0.0, ckpt_gb=84, write_gbps=4))
    assert res.preemptions == 0 and res.launches == 0
    # One 21 s write per 20 minutes of training; replica also waits for a quorum a step.
    expected = 1200 / (1200 + 21)
    quorum_share = res.config.replica.step_share(100)
    for p in res.policies:
        share = quorum_share if p.name == "replica" else 1.0
        assert p.progress_s / (24 * 3600) == pytest.approx(expected * share, abs=2e-3)
        assert p.lost_s == 0.0
    assert res.cost_usd == pytest.approx(100 * 24 * SPOT.price_per_hour)


def test_replicas_of_several_nodes_go_down_together() -> None:
    one = simulate(_cfg(nodes=96, rate_per_node_hour=0.02, replica_nodes=1, seed=1))
    four = simulate(_cfg(nodes=96, rate_per_node_hour=0.02, replica_nodes=4, seed=1))
    assert one.preemptions == four.preemptions
    # A lost node idles its three replica peers too: more capacity out per preemption.
    assert _policy(four, "replica-ideal")[0] < _policy(one, "replica-ideal")[0]
    # With the stock lighthouse a quarter of the replicas also pays a sixteenth of its
    # quadratic quorum, which here outweighs it (the Redis quorum's is linear and small).
    lh = ReplicaParams(quorum="lighthouse")
    one = simulate(_cfg(nodes=96, rate_per_node_hour=0.02, replica_nodes=1, seed=1, replica=lh))
    four = simulate(_cfg(nodes=96, rate_per_node_hour=0.02, replica_nodes=4, seed=1, replica=lh))
    assert _policy(four, "replica")[0] > _policy(one, "replica")[0]
    assert _policy(four, "elastic")[0] < _policy(one, "elastic")[0]


def test_a_trace_preempts_the_named_node_at_its_time() -> None:
    trace = (
        TracedPreemption(3600.0, "n7", True),
        TracedPreemption(7200.0, None, False),
        TracedPreemption(99 * 3600.0, "n1", True),  # past the horizon
    )
    res = simulate(_cfg(trace=trace, rate_per_node_hour=0.0, pass_s=0.0))
    assert (res.preemptions, res.with_notice, res.launches) == (2, 1, 2)
    assert "n7" not in {n.name for n in res.final_nodes}
    assert {"n100", "n101"} <= {n.name for n in res.final_nodes}


# --- the real planner in the loop --------------------------------------------------------


def test_a_zone_reclaim_blocks_the_offer_and_falls_back_to_on_demand() -> None:
    base = _cfg(
        nodes=200,
        hours=48.0,
        rate_per_node_hour=0.0,
        zone_reclaims_per_day=1.0,
        reclaim_share=0.1,
        reclaim_outage_s=3600.0,
        seed=1,
    )
    spot_only = simulate(base)
    assert spot_only.reclaims > 0 and spot_only.capacity_errors > 0
    assert spot_only.on_demand_launches == 0
    fallback = simulate(
        replace(base, spot_policy=SpotPolicy.SPOT_THEN_ON_DEMAND, fallback_after_s=600.0)
    )
    assert fallback.on_demand_launches > 0
    # Back to full size sooner: more useful work, at on-demand prices for the fallback.
    assert _policy(fallback, "elastic")[0] > _policy(spot_only, "elastic")[0]


def test_passes_coalesce_and_only_run_on_change() -> None:
    quiet = simulate(_cfg(rate_per_node_hour=0.0))
    assert quiet.passes == 0
    busy = simulate(_cfg(rate_per_node_hour=0.05, pass_s=0.0, seed=2))
    coalesced = simulate(_cfg(rate_per_node_hour=0.05, pass_s=30.0, seed=2))
    assert busy.preemptions == coalesced.preemptions
    assert coalesced.passes < busy.passes <= 4 * busy.preemptions
    assert busy.launches == busy.preemptions  # one backfill per preemption, from the planner


def test_table_names_every_policy() -> None:
    res = simulate(_cfg(rate_per_node_hour=0.01))
    text = table(res)
    for name in ("sync", "elastic", "replica", "replica-ideal", "$/useful GPU-h", "x on-demand"):
        assert name in text
    # The replica policy's parameters, each marked measured or modelled, with its source.
    assert "quorum_b_s" in text and "[measured] bench/quorum_scale.py" in text
    assert "step_s" in text and "[modelled]" in text


# --- FleetIndex: the same plans as a plain list ------------------------------------------

_STATES = list(InstanceState)
_AGENTS = [None, "booting", "healthy", "joined", "joined", "joined", "checkpointing"]
_AGENTS += ["draining", "left", "failed", "weird"]


def _offers() -> list[Offer]:
    out: list[Offer] = []
    for zone in ("us-east-1a", "us-east-1b", "us-east-1c"):
        for market, price in ((Market.SPOT, 10.0), (Market.ON_DEMAND, 30.0)):
            out.append(replace(SPOT, zone=zone, market=market, price_per_hour=price + len(out)))
    return out


def _node(rng: random.Random, i: int, offers: list[Offer], now: float) -> NodeObs:
    offer = rng.choice([*offers, None]) if rng.random() < 0.2 else offers[0]
    state = rng.choice(_STATES) if rng.random() < 0.3 else InstanceState.RUNNING
    inst = None
    if rng.random() > 0.05:
        base = offer or offers[0]
        inst = Instance(
            id=f"i-{i}",
            cloud=base.cloud,
            region=base.region,
            zone=base.zone,
            instance_type=base.instance_type,
            market=base.market,
            state=state,
            job="j",
            node=f"n{i}",
            request_id=f"r{i}",
        )
    return NodeObs(
        name=f"n{i}",
        instance=inst,
        offer=offer,
        launched_at=now - rng.uniform(0, 2000),
        agent_state=rng.choice(_AGENTS) if rng.random() < 0.4 else "joined",
        alive_beat=rng.random() < 0.9,
        compute_s=rng.choice([None, 1.0, 1.1, 0.9, 5.0]) if rng.random() < 0.3 else None,
        health_failed=rng.random() < 0.03,
    )


@pytest.mark.parametrize("seed", range(40))
def test_fleet_index_plans_exactly_like_a_plain_list(seed: int) -> None:
    rng = random.Random(seed)
    now = 10_000.0
    offers = _offers()
    nodes = {f"n{i}": _node(rng, i, offers, now) for i in range(rng.randint(0, 40))}
    index = FleetIndex(nodes.values())
    for step in range(15):
        # Change a few nodes in place, drop some, add some: the index follows.
        for _ in range(rng.randint(0, 5)):
            if nodes and rng.random() < 0.3:
                gone = rng.choice(list(nodes))
                del nodes[gone]
                assert index.remove(gone) is not None
            else:
                i = rng.randint(0, 60)
                n = _node(rng, i, offers, now)
                nodes[n.name] = n
                index.put(n)
        plain = list(nodes.values())
        assert list(index) == plain and len(index) == len(plain)
        policy = Policy(
            min_nodes=1,
            max_nodes=rng.choice([1, 5, 20, 40]),
            same_zone=rng.random() < 0.7,
            spot_policy=rng.choice(list(SpotPolicy)),
            budget_usd=rng.choice([math.inf, 500.0, 2000.0]),
        )
        obs = Observed(
            now=now + step,
            nodes=plain,
            offers=offers,
            blocked={offers[0].key: now + 100} if rng.random() < 0.3 else {},
            history={("aws", "us-east-1a", "p5.48xlarge"): ZoneHistory(3, 100.0)},
            spent_usd=rng.choice([0.0, 400.0]),
            home=rng.choice([None, ("aws", "us-east-1a", "p5.48xlarge")]),
            spot_short_since=rng.choice([None, now - 4000]),
            next_index=100,
        )
        assert plan(policy, replace(obs, nodes=index)) == plan(policy, obs)


def test_fleet_index_is_a_sequence_in_first_put_order() -> None:
    rng = random.Random(0)
    offers = _offers()
    a, b, c = (_node(rng, i, offers, 0.0) for i in range(3))
    index = FleetIndex([a, b])
    index.put(c)
    b2 = replace(b, agent_state="draining")
    index.put(b2)
    assert list(index) == [a, b2, c] and index[1] == b2 and index[-1] == c
    assert b2 in index and b not in index
    assert index.remove("n0") == a and index.remove("n0") is None
    assert list(index[0:2]) == [b2, c]


def test_on_demand_vms_are_never_taken_back() -> None:
    res = simulate(_cfg(spot_policy=SpotPolicy.ON_DEMAND, rate_per_node_hour=0.05))
    assert res.preemptions == 0
    assert res.cost_usd == pytest.approx(100 * 24 * OD.price_per_hour)
    for p in res.policies:
        assert p.lost_s == 0.0


def test_a_launch_slower_than_the_boot_timeout_is_ended_by_the_planner() -> None:
    """The real planner's rule, not the simulator's: a VM not healthy 900 s after its launch
    is ended and replaced (and its zone penalised), so a slower launch never fills a slot."""
    res = simulate(
        _cfg(hours=3.0, launch_latency_s=1200.0, trace=(TracedPreemption(60.0, "n1", False),))
    )
    assert res.preemptions == 1
    assert res.terminated >= 2 and res.launches == res.terminated + 1
    assert _policy(res, "sync")[0] < 0.1  # never whole again
    assert "boot timeout" in table(res)

"""The reconcile loop against the local cloud and a real Redis, one pass at a time: what it
observes from the agents' records reaches the planner, and what the planner decides reaches
the cloud and the ledger."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import redis
import yaml
from spec_samples import LOCAL, spec_with

from spottrain.agent.lifecycle import Lifecycle
from spottrain.agent.node_record import NodeInfo, NodeRecord
from spottrain.agent.notices import Notice, NoticeKind
from spottrain.agent.notices.handler import NoticeHandler
from spottrain.agent.replica_slots import claim_slot, read_slots
from spottrain.agent.sdk import ENV_NODE, TrainSession
from spottrain.cloud.base import InstanceState, LaunchRequest, Offer, OfferQuery
from spottrain.cloud.local.compute import LocalProvider
from spottrain.cloud.local.settings import LocalSettings
from spottrain.controller.reconcile.controller import Controller, policy_from_spec
from spottrain.controller.reconcile.drive import ControllerError
from spottrain.controller.reconcile.state import RunState
from spottrain.controller.reconcile.summary import summarize
from spottrain.controller.reconcile.types import StragglerPolicy
from spottrain.controller.run.drive import format_summary
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys
from spottrain.protocol.states import LedgerStatus
from spottrain.spec import parse_spec

SLEEP_BOOT = json.dumps({"argv": ["sleep", "600"]})


@pytest.fixture
def cloud(tmp_path: Path) -> Iterator[LocalProvider]:
    p = LocalProvider(
        LocalSettings(tmp_path / "cloud", zones={"local-a": 4, "local-b": 4}, notice_s=2)
    )
    yield p
    for rec in p.store.all():
        if rec["state"] != "terminated":
            p.preempt(rec["id"], notice=False)


def _controller(
    cloud: LocalProvider,
    client: redis.Redis,
    keys: RunKeys,
    max_nodes: int = 4,
    **train: object,
) -> Controller:
    data = spec_with(LOCAL, "nodes", {"min": 1, "max": max_nodes, "gpus": 0})
    for key, value in train.items():
        data = spec_with(data, f"train.{key}", value)
    data = spec_with(data, "budget", {"max_usd": 1000})
    spec = parse_spec(yaml.safe_dump(data)).spec
    return Controller(
        spec=spec,
        run_id=keys.run_id,
        providers={"local": cloud},
        state=RunState(client, keys),
        boot=lambda node, offer: SLEEP_BOOT,
        policy=policy_from_spec(spec),
        interval_s=0.1,
    )


def _events(client: redis.Redis, keys: RunKeys, kind: str) -> list[dict[str, str]]:
    out = []
    for _id, fields in client.xrange(keys.events):
        f = {k.decode(): v.decode() for k, v in fields.items()}
        if f["type"] == kind:
            out.append(f)
    return out


def _join(client: redis.Redis, keys: RunKeys, node: str) -> None:
    client.hset(keys.node(node), mapping={"state": "joined"})
    client.set(keys.heartbeat(node), "joined", px=60_000)


def _train_steps(
    tmp_path: Path, redis_url: str, keys: RunKeys, node: str, compute_s: float, wall_s: float
) -> TrainSession:
    """A node's trainer: steps whose compute (timed by the SDK) takes ``compute_s``, padded
    to ``wall_s`` outside it as a synchronous all-reduce pads every rank to the slowest.
    Returns the session, still reporting."""
    (tmp_path / node).mkdir()
    os.environ[ENV_NODE] = node
    try:
        session = TrainSession(
            tmp_path / node,
            redis_url=redis_url,
            run_id=keys.run_id,
            install_signal_handlers=False,
            tracking=False,
            report_interval=0.05,
        )
    finally:
        del os.environ[ENV_NODE]
    for step in range(1, 4):
        t0 = time.monotonic()
        with session.compute():
            time.sleep(compute_s)
        time.sleep(max(0.0, wall_s - (time.monotonic() - t0)))  # the all-reduce's wait
        session.step(step, {})
    return session


def test_a_pass_launches_the_fleet_and_records_every_launch(
    cloud: LocalProvider, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    ctl = _controller(cloud, redis_client, run_keys)
    p = ctl.step()
    assert "launching 4 on local-a local-cpu spot" in p.reason
    ledger = ctl.state.ledger()
    assert sorted(ledger.records) == ["n0", "n1", "n2", "n3"]
    assert {r.status for r in ledger.records.values()} == {LedgerStatus.LAUNCHED}
    listed = {i.node for i in cloud.list(run_keys.run_id)}
    assert listed == {"n0", "n1", "n2", "n3"}
    # The next pass has nothing to do, and says so once in the event stream.
    assert ctl.step().reason == "4 of 4 node(s): nothing to do"
    assert len(_events(redis_client, run_keys, "launched")) == 4


def test_a_straggler_reported_by_its_trainers_is_replaced(
    cloud: LocalProvider,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    run_keys: RunKeys,
    tmp_path: Path,
) -> None:
    """Every node steps at the same wall pace (the all-reduce); n3's compute is 5x the
    others', as its trainers measure and report it."""
    ctl = _controller(cloud, redis_client, run_keys)
    # One report decides here, however few steps it covers (the unit tests check the wait
    # for a sustained signal): this checks what reaches the planner from the reports.
    ctl.policy = replace(
        ctl.policy, straggler=StragglerPolicy(observations=1, sustain_s=0, min_samples=1)
    )
    ctl.step()
    sessions = []
    for node, secs in (("n0", 0.04), ("n1", 0.04), ("n2", 0.04), ("n3", 0.2)):
        _join(redis_client, run_keys, node)
        sessions.append(
            _train_steps(tmp_path, redis_server.endpoint, run_keys, node, secs, wall_s=0.25)
        )
    try:
        for node in ("n0", "n1", "n2", "n3"):
            _wait(lambda n=node: redis_client.hget(run_keys.node(n), "compute:0") is not None)
    finally:
        for sess in sessions:
            sess.close()
    p = ctl.step()
    found = re.search(
        r"n3 is a straggler: ([\d.]+) s of compute per step against the fleet's median", p.reason
    )
    assert found and float(found[1]) >= 0.2, p.reason
    # Its wall time per step was the fleet's: only the compute time tells it apart.
    walls = [float(redis_client.hget(run_keys.node(n), "step_time") or 0) for n in ("n0", "n3")]
    assert walls[1] < 2 * walls[0]
    (report,) = _events(redis_client, run_keys, "report")
    assert "n3 is a straggler" in report["message"]
    ended = next(e for e in _events(redis_client, run_keys, "terminate") if e["node_name"] == "n3")
    assert ended["why"] == "straggler"
    assert "n4" in ctl.state.ledger().records


def test_a_preemption_is_counted_against_its_zone_and_backfilled(
    cloud: LocalProvider, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    ctl = _controller(cloud, redis_client, run_keys, max_nodes=2)
    ctl.step()
    victim = ctl.state.ledger().records["n0"].instance_id
    cloud.preempt(victim, notice=False)
    ctl.step()
    history = ctl.state.history()
    assert history[("local", "local-a", "local-cpu")]["preemptions"] == 1
    (ev,) = _events(redis_client, run_keys, "preempted")
    assert ev["node_name"] == "n0"
    records = ctl.state.ledger().records
    assert records["n0"].status == "ended" and records["n0"].interrupted
    assert records["n2"].status == LedgerStatus.LAUNCHED


def test_a_replica_vm_gone_frees_its_slot_for_the_backfill(
    cloud: LocalProvider, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    ctl = _controller(cloud, redis_client, run_keys, max_nodes=2, fault_tolerance="replica")
    ctl.step()
    # The agents' claims, through the agent's own Lua; their heartbeats still live (a dead
    # agent's key outlives its VM by up to its TTL).
    for node in ("n0", "n1"):
        _join(redis_client, run_keys, node)
        claim_slot(redis_client, run_keys, node, nodes_per_replica=1)
    assert read_slots(redis_client, run_keys) == {"replica-0": ["n0"], "replica-1": ["n1"]}
    cloud.preempt(ctl.state.ledger().records["n1"].instance_id, notice=False)
    ctl.step()
    (ev,) = _events(redis_client, run_keys, "replica-slot-freed")
    assert (ev["node_name"], ev["slot"]) == ("n1", "replica-1")
    assert ctl.state.ledger().records["n2"].status == LedgerStatus.LAUNCHED
    # The backfill becomes a new member of the dead node's slot, not a slot of its own.
    _join(redis_client, run_keys, "n2")
    claim = claim_slot(redis_client, run_keys, "n2", nodes_per_replica=1)
    assert claim.slot == "replica-1" and claim.gen == 2


def test_an_elastic_vm_gone_touches_no_replica_slot(
    cloud: LocalProvider, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    ctl = _controller(cloud, redis_client, run_keys, max_nodes=2)
    ctl.step()
    redis_client.hset(run_keys.replica_slots, "replica-0", json.dumps({"nodes": ["n0"]}))
    cloud.preempt(ctl.state.ledger().records["n0"].instance_id, notice=False)
    ctl.step()
    assert not _events(redis_client, run_keys, "replica-slot-freed")
    assert read_slots(redis_client, run_keys) == {"replica-0": ["n0"]}


def test_a_capacity_error_blocks_the_offer_and_fails_the_launch(
    cloud: LocalProvider, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    cloud.set_capacity("local-a", 1)
    ctl = _controller(cloud, redis_client, run_keys, max_nodes=2)
    ctl.step()
    records = ctl.state.ledger().records
    assert records["n0"].status == LedgerStatus.LAUNCHED and records["n1"].status == "failed"
    assert "capacity" in records["n1"].reason
    blocked = ctl.state.blocked()
    assert ("local", "local-a", "local-cpu", "spot") in blocked
    assert ctl.state.ctl().get("spot_short_since")


def test_a_vm_the_ledger_does_not_know_is_adopted(
    cloud: LocalProvider, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    ctl = _controller(cloud, redis_client, run_keys, max_nodes=1)
    offer: Offer = cloud.offers(OfferQuery())[0]
    cloud.launch(LaunchRequest("stray-1", run_keys.run_id, "n7", offer, SLEEP_BOOT))
    p = ctl.step()
    records = ctl.state.ledger().records
    assert records["n7"].status == LedgerStatus.LAUNCHED and records["n7"].reason == "adopted"
    assert "1 of 1 node(s): nothing to do" in p.reason
    assert [
        i.node for i in cloud.list(run_keys.run_id) if i.state is not InstanceState.TERMINATED
    ] == ["n7"]


def test_a_second_controller_is_refused_while_one_holds_the_run(
    cloud: LocalProvider, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    first = _controller(cloud, redis_client, run_keys)
    assert first.state.acquire("ctl-first", 30)
    second = _controller(cloud, redis_client, run_keys)
    with pytest.raises(ControllerError, match="driven by another controller"):
        second.run()
    first.state.release("ctl-first")
    assert first.state.lease_holder() is None


def _rebalance(client: redis.Redis, keys: RunKeys, node: str) -> NodeRecord:
    """The node's agent takes a rebalance recommendation: its handler marks the record."""
    lifecycle = Lifecycle()
    record = NodeRecord(client, keys, NodeInfo(node, "local"))
    # Not joined in this handler's view: no early checkpoint is asked of trainers that do
    # not run here, but the node is marked at risk all the same.
    handler = NoticeHandler(client, keys, node, lifecycle, record, lambda _s: None)
    handler.submit(Notice("aws-imds:rebalance", NoticeKind.REBALANCE, None, time.time()))
    return record


def test_an_at_risk_node_gets_a_replacement_then_drains(
    cloud: LocalProvider, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    ctl = _controller(cloud, redis_client, run_keys, max_nodes=3)
    ctl.step()
    for n in ("n0", "n1", "n2"):
        _join(redis_client, run_keys, n)
    _rebalance(redis_client, run_keys, "n1")
    assert redis_client.hget(run_keys.node("n1"), "at_risk") == b"rebalance recommendation"

    p = ctl.step()
    assert "n1 at risk: launching replacement n3" in p.reason
    records = ctl.state.ledger().records
    assert records["n3"].status == LedgerStatus.LAUNCHED and records["n3"].replaces == "n1"
    launched = _events(redis_client, run_keys, "launched")
    assert launched[-1]["node_name"] == "n3" and launched[-1]["replaces"] == "n1"
    assert all("replaces" not in e for e in launched[:-1])
    status = summarize(ctl.state, time.time())
    assert status.at_risk == ["n1 at risk (rebalance recommendation): replacement n3 launching"]
    assert "  n1 at risk (rebalance recommendation): replacement n3 launching" in (
        format_summary(status)
    )
    # The surplus holds while the replacement boots: nothing more launched, nothing ended.
    p = ctl.step()
    assert "replacement n3 launching" in p.reason
    assert sorted(ctl.state.ledger().records) == ["n0", "n1", "n2", "n3"]
    assert _events(redis_client, run_keys, "terminate") == []

    _join(redis_client, run_keys, "n3")
    ctl.step()
    (drain,) = _events(redis_client, run_keys, "drain")
    assert drain["node_name"] == "n1" and "replacement n3 joined" in drain["why"]
    (asked,) = redis_client.lrange(run_keys.notices("n1"), 0, -1)
    # A drain the controller asks for is not its cloud taking the VM back: no preemption.
    kind = NoticeKind(json.loads(asked)["kind"])
    assert kind.drains and not kind.reclaims

    # Its agent drained and left: its VM ends, and the fleet is back at max without a launch.
    redis_client.hset(run_keys.node("n1"), "state", "left")
    ctl.step()
    (ended,) = _events(redis_client, run_keys, "terminate")
    assert ended["node_name"] == "n1"
    assert len(_events(redis_client, run_keys, "launched")) == 4
    assert summarize(ctl.state, time.time()).at_risk == []


def _wait(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_a_nodes_compute_time_is_its_slowest_fresh_rank(
    cloud: LocalProvider, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    ctl = _controller(cloud, redis_client, run_keys, max_nodes=1)
    ctl.step()
    now = time.time()
    redis_client.hset(
        run_keys.node("n0"),
        mapping={
            "state": "joined",
            "compute:0": f"0.1000 {now:.0f}",
            "compute:1": f"0.5000 {now - 5:.0f}",
            # A rank of an older, wider round that no longer reports.
            "compute:2": f"9.0000 {now - 600:.0f}",
            "compute:3": "garbled",
        },
    )
    obs, _ledger, _listed = ctl.observe(now)
    (n0,) = obs.nodes
    assert n0.compute_s == 0.5
    redis_client.hdel(run_keys.node("n0"), "compute:0", "compute:1")
    obs, _ledger, _listed = ctl.observe(now)
    assert obs.nodes[0].compute_s is None

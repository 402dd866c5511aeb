"""Replica mode's pure decisions: which slot a node takes, what its workers get, and which
settings the agent refuses."""

from __future__ import annotations

import json

import pytest
from replica_slot_cases import CASES

from spottrain.agent.config import AgentConfig, AgentConfigError
from spottrain.agent.replica_launch import ReplicaLaunch, check_lighthouse, replica_rdzv_id
from spottrain.agent.replica_slots import (
    SlotClaim,
    choose_slot,
    claim_gen,
    slot_index,
    slot_name,
)
from spottrain.protocol.env import (
    ENV_FAULT_TOLERANCE,
    ENV_LIGHTHOUSE,
    ENV_MANAGER_PORT,
    ENV_MIN_REPLICAS,
    ENV_NODES_PER_REPLICA,
    ENV_QUORUM,
    ENV_REPLICA_ID,
)


@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
def test_choose_slot(case: tuple) -> None:
    slots, live, node, k, expected = case
    assert choose_slot(slots, live, node, k) == SlotClaim(*expected)


@pytest.mark.parametrize(
    ("members", "record", "issued", "gen"),
    [
        (("me",), 0, 0, 1),  # a slot never claimed: the first generation
        (("me",), 3, 3, 4),  # a vacated slot: its rendezvous may be closed, start afresh
        (("me",), 3, 5, 6),  # never a number given before, even if the record lags
        (("me",), 7, 2, 8),  # nor one the record already used (the counter was lost)
        (("peer", "me"), 3, 5, 3),  # a live member: rendezvous with it
    ],
)
def test_a_claim_starts_a_new_generation_only_without_a_live_peer(
    members: tuple[str, ...], record: int, issued: int, gen: int
) -> None:
    assert claim_gen(members, "me", record, issued) == gen


def test_the_generation_of_a_slot_follows_its_record() -> None:
    slots = {"replica-0": ["a"], "replica-1": ["b"]}
    gens = {"replica-0": 4, "replica-1": 9}
    # b is lost: c starts replica-1's tenth generation; d joins c's and a's as they are.
    c = choose_slot(slots, {"a"}, "c", 2, gens)
    assert c == SlotClaim("replica-0", ("a", "c"), 4)
    assert choose_slot(slots, {"a"}, "c", 1, gens) == SlotClaim("replica-1", ("c",), 10)


def test_the_status_view_reads_a_record_with_a_generation() -> None:
    from spottrain.controller.run.replica_view import replica_rows

    record = json.dumps({"nodes": ["a", "b"], "at": 1.0, "gen": 3})
    [row] = replica_rows({b"replica-0": record.encode()}, {})
    assert (row.replica_id, row.nodes, row.state) == ("replica-0", ("a", "b"), "joining")


def test_a_live_node_is_never_double_booked() -> None:
    slots: dict[str, list[str]] = {}
    for i in range(7):
        node = f"n{i}"
        claim = choose_slot(slots, set(slots_nodes(slots)), node, 3)
        slots[claim.slot] = list(claim.members)
    assert {s: len(n) for s, n in slots.items()} == {"replica-0": 3, "replica-1": 3, "replica-2": 1}
    assert sorted(slots_nodes(slots)) == sorted(f"n{i}" for i in range(7))


def slots_nodes(slots: dict[str, list[str]]) -> list[str]:
    return [n for nodes in slots.values() for n in nodes]


def test_slot_names_round_trip() -> None:
    assert slot_index(slot_name(12)) == 12
    assert slot_index("replica-") is None and slot_index("replica-1x") is None


def test_each_replica_has_its_own_rendezvous_id() -> None:
    assert replica_rdzv_id("job-1700000000", "replica-3") == "job-1700000000.replica-3"
    assert replica_rdzv_id("job-1", "replica-0") != replica_rdzv_id("job-1", "replica-1")
    # Each generation its own too; the first keeps the plain id.
    assert replica_rdzv_id("job-1", "replica-3", 1) == "job-1.replica-3"
    assert replica_rdzv_id("job-1", "replica-3", 2) == "job-1.replica-3.g2"
    assert ReplicaLaunch("job-1", "replica-3", 1, 1, "h:1", 1, gen=7).rdzv_id == (
        "job-1.replica-3.g7"
    )


def test_the_workers_get_the_replica_variables_and_torchfts_own() -> None:
    launch = ReplicaLaunch("job-1", "replica-2", 2, 3, "10.0.0.5:29510", 29512)
    assert launch.nnodes == "2:2"
    assert launch.worker_env() == {
        ENV_FAULT_TOLERANCE: "replica",
        ENV_REPLICA_ID: "replica-2",
        ENV_NODES_PER_REPLICA: "2",
        ENV_MIN_REPLICAS: "3",
        ENV_LIGHTHOUSE: "10.0.0.5:29510",
        ENV_MANAGER_PORT: "29512",
        ENV_QUORUM: "lighthouse",
        "TORCHFT_LIGHTHOUSE": "http://10.0.0.5:29510",
        "TORCHFT_MANAGER_PORT": "29512",
    }
    # With the Redis quorum the "lighthouse" is the agent's own shim.
    shim = ReplicaLaunch("job-1", "replica-2", 2, 3, "127.0.0.1:29511", 29512, quorum="redis")
    assert shim.worker_env()[ENV_QUORUM] == "redis"
    assert shim.worker_env()["TORCHFT_LIGHTHOUSE"] == "http://127.0.0.1:29511"
    # Its heartbeat timeout too: the workers' watchdog counts a peer silent that long lost.
    assert shim.worker_env()["SPOTTRAIN_QUORUM_HEARTBEAT_TIMEOUT"] == "1"
    slow = ReplicaLaunch(
        "job-1", "replica-2", 2, 3, "127.0.0.1:1", 1, quorum="redis", heartbeat_timeout_s=5.0
    )
    assert slow.worker_env()["SPOTTRAIN_QUORUM_HEARTBEAT_TIMEOUT"] == "5"


def test_a_lighthouse_address_is_host_and_port() -> None:
    assert check_lighthouse("http://h:1", "x") == "h:1"
    for bad in ("h", "h:", ":1", "h:99999", "h:port"):
        with pytest.raises(ValueError, match=r"^where .* is not HOST:PORT"):
            check_lighthouse(bad, "where")


def _cfg(**kw: object) -> AgentConfig:
    return AgentConfig(redis_url="127.0.0.1:1", run_id="r-1", node_id="n", train_cmd=["t"], **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "names"),
    [
        ({"fault_tolerance": "replicas"}, "--fault-tolerance, SPOTTRAIN_FAULT_TOLERANCE"),
        ({"nodes_per_replica": 0}, "nodes-per-replica 0 (SPOTTRAIN_NODES_PER_REPLICA)"),
        ({"min_replicas": 0}, "min-replicas 0 (SPOTTRAIN_MIN_REPLICAS)"),
        ({"lighthouse": "nohost"}, "--lighthouse, SPOTTRAIN_LIGHTHOUSE"),
        ({"manager_port": 70000}, "manager port 70000"),
        ({"quorum": "raft"}, "quorum 'raft' (--quorum, SPOTTRAIN_QUORUM)"),
        ({"quorum_port": -1}, "quorum port -1 (--quorum-port)"),
        (
            {"quorum_heartbeat_timeout_s": 0.1},
            "quorum heartbeat timeout 0.1 s (--quorum-heartbeat-timeout, "
            "SPOTTRAIN_QUORUM_HEARTBEAT_TIMEOUT)",
        ),
        (
            {"quorum_wait_replicas": 17},
            "quorum wait replicas 17 (--quorum-wait-replicas, SPOTTRAIN_QUORUM_WAIT_REPLICAS)",
        ),
        (
            {"quorum_join_timeout_ms": 10},
            "quorum join timeout 10 ms (--quorum-join-timeout, SPOTTRAIN_QUORUM_JOIN_TIMEOUT)",
        ),
        (
            {"quorum_relay_group": 1},
            "quorum relay group 1 (--quorum-relay-group, SPOTTRAIN_QUORUM_RELAY_GROUP)",
        ),
        (
            {"quorum_relay_port": 65536},
            "quorum relay port 65536 (--quorum-relay-port, SPOTTRAIN_QUORUM_RELAY_PORT)",
        ),
    ],
)
def test_bad_replica_settings_are_refused_in_one_line(kw: dict, names: str) -> None:
    with pytest.raises(AgentConfigError) as err:
        _cfg(**kw).validate()
    assert names in str(err.value) and "\n" not in str(err.value)


def test_elastic_is_the_default() -> None:
    cfg = _cfg()
    cfg.validate()
    assert cfg.fault_tolerance == "elastic" and not cfg.replica_mode
    # The Redis quorum is replica mode's default.
    assert cfg.quorum == "redis" and not cfg.redis_quorum
    assert _cfg(fault_tolerance="replica").redis_quorum
    assert cfg.quorum_wait_replicas == 0


def test_the_quorum_wait_flag_reaches_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from spottrain.agent.cli import build_parser

    monkeypatch.setenv("SPOTTRAIN_QUORUM_WAIT_REPLICAS", "2")
    args = build_parser().parse_args(["run", "--redis=127.0.0.1:1"])
    assert args.quorum_wait_replicas == "2"
    args = build_parser().parse_args(["run", "--redis=127.0.0.1:1", "--quorum-wait-replicas=1"])
    assert args.quorum_wait_replicas == "1"
    # The join timeout: the spec's resolved value through the env, or the flag.
    monkeypatch.setenv("SPOTTRAIN_QUORUM_JOIN_TIMEOUT", "1350")
    args = build_parser().parse_args(["run", "--redis=127.0.0.1:1"])
    assert args.quorum_join_timeout == "1350"
    args = build_parser().parse_args(["run", "--redis=127.0.0.1:1", "--quorum-join-timeout=400"])
    assert args.quorum_join_timeout == "400"
    assert _cfg().quorum_join_timeout_ms == 250
    # Relays: the spec's resolved group size through the env (0: none), and their port.
    args = build_parser().parse_args(["run", "--redis=127.0.0.1:1"])
    assert (args.quorum_relay_group, args.quorum_relay_port) == ("0", "29513")
    monkeypatch.setenv("SPOTTRAIN_QUORUM_RELAY_GROUP", "100")
    monkeypatch.setenv("SPOTTRAIN_QUORUM_RELAY_PORT", "29600")
    args = build_parser().parse_args(["run", "--redis=127.0.0.1:1"])
    assert (args.quorum_relay_group, args.quorum_relay_port) == ("100", "29600")


def test_a_nodes_relay_plan_follows_its_slot_and_its_cloud() -> None:
    from spottrain.agent.replica_node import ReplicaNode
    from spottrain.agent.replica_slots import SlotClaim

    def plan(**kw: object) -> object:
        node = ReplicaNode(None, None, _cfg(fault_tolerance="replica", **kw), None)  # type: ignore[arg-type]
        node.slot = SlotClaim("replica-5", ("n",))
        return node._relay_plan()

    assert plan() is None  # no relays unless a group size is given
    aws = plan(quorum_relay_group=2, cloud="aws", address="10.0.0.7")
    assert (aws.group, aws.bind, aws.address) == (2, "0.0.0.0:29513", "10.0.0.7:29513")  # type: ignore[attr-defined]
    local = plan(quorum_relay_group=100, cloud="local")
    assert local.group == 0 and local.bind == local.address  # type: ignore[attr-defined]
    assert local.address.startswith("127.0.0.1:") and not local.address.endswith(":29513")  # type: ignore[attr-defined]

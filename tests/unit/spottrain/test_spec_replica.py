"""Replica mode in the job spec (issue 15): ``train.fault_tolerance`` and ``train.replica``,
their defaults, and every combination the spec refuses, with the exact line a user sees."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from spec_samples import FLEET_AWS, LOCAL, VALID, spec_with

from spottrain.catalog import bundled
from spottrain.protocol import env as env_names
from spottrain.spec import (
    FaultTolerance,
    JobSpec,
    QuorumKind,
    ReplicaSpec,
    SpecError,
    TrainSpec,
    describe_replica,
    parse_spec,
    replica_agent_env,
)
from spottrain.spec.replica import (
    allowed_gpu_types,
    auto_join_timeout_ms,
    join_timeout_ms,
    relay_group_size,
)

README = Path(__file__).resolve().parents[3] / "README.md"


def _parse(data: dict[str, Any]) -> JobSpec:
    return parse_spec(yaml.safe_dump(data, sort_keys=False), "job.yaml").spec


def _problems(data: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as err:
        parse_spec(yaml.safe_dump(data, sort_keys=False), "job.yaml")
    return err.value.problems


def _replica(base: dict[str, Any], size: Any = None, **replica: Any) -> dict[str, Any]:
    """``base`` in replica mode, with ``train.replica`` and (``size``) ``nodes`` set."""
    data = spec_with(base, "train.fault_tolerance", "replica")
    if replica:
        data = spec_with(data, "train.replica", replica)
    if size is not None:
        data = spec_with(data, "nodes", size)
    return data


def test_a_spec_without_the_keys_is_elastic_with_default_replica_settings() -> None:
    for base in (VALID, LOCAL):
        spec = _parse(base)
        assert spec.train.fault_tolerance is FaultTolerance.ELASTIC
        assert spec.train.replica == ReplicaSpec(
            nodes_per_replica=1, min_replicas=1, quorum=QuorumKind.REDIS
        )
        assert replica_agent_env(spec) == {}
        assert describe_replica(spec) is None
    # Saying elastic out loud, or giving the defaults, is the same spec.
    assert _parse(spec_with(VALID, "train.fault_tolerance", "elastic")) == _parse(VALID)
    same = spec_with(VALID, "train.replica", {"nodes_per_replica": 1, "min_replicas": 1})
    assert _parse(same) == _parse(VALID)


def test_replica_mode_parses_with_its_settings() -> None:
    spec = _parse(_replica(LOCAL, {"min": 4, "max": 8, "gpus": 0}, nodes_per_replica=2))
    assert spec.train.fault_tolerance is FaultTolerance.REPLICA
    assert spec.train.fault_tolerance == "replica"  # a str enum: the agent's env word
    assert spec.train.replica == ReplicaSpec(nodes_per_replica=2, min_replicas=1)
    spec = _parse(_replica(LOCAL, {"min": 3, "max": 6, "gpus": 0}, min_replicas=3))
    assert spec.train.replica == ReplicaSpec(nodes_per_replica=1, min_replicas=3)
    # The quorum: Redis unless the spec asks for torchft's lighthouse; saying redis is the same.
    assert spec.train.replica.quorum is QuorumKind.REDIS
    assert _parse(_replica(LOCAL, quorum="redis")) == _parse(_replica(LOCAL))
    lighthouse = _parse(_replica(LOCAL, quorum="lighthouse"))
    assert lighthouse.train.replica.quorum == "lighthouse"  # a str enum: the agent's env word


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            spec_with(LOCAL, "train.replica", {"min_replicas": 2}),
            "train (line 5): replica (nodes_per_replica 1, min_replicas 2) applies only in "
            "replica mode: set fault_tolerance: replica, or drop the replica block",
        ),
        (
            spec_with(LOCAL, "train.fault_tolerance", "quorum"),
            "train.fault_tolerance (line 7): use 'elastic' or 'replica' (got 'quorum')",
        ),
        (
            _replica(LOCAL, nodes_per_replica=0),
            "train.replica.nodes_per_replica (line 9): must be greater than or equal to 1 (got 0)",
        ),
        (
            _replica(LOCAL, min_replicas=0),
            "train.replica.min_replicas (line 9): must be greater than or equal to 1 (got 0)",
        ),
        (
            _replica(LOCAL, nodes=2),
            "train.replica.nodes (line 9): unknown key; allowed here: nodes_per_replica, "
            "min_replicas, quorum, heartbeat_timeout_s, wait_replicas, join_timeout_ms, "
            "relay_group_size",
        ),
        (
            _replica(LOCAL, quorum="etcd"),
            "train.replica.quorum (line 9): use 'redis' or 'lighthouse' (got 'etcd')",
        ),
        (
            spec_with(LOCAL, "train.replica", {"quorum": "lighthouse"}),
            "train (line 5): replica (nodes_per_replica 1, min_replicas 1, quorum lighthouse) "
            "applies only in replica mode: set fault_tolerance: replica, or drop the replica "
            "block",
        ),
        (
            _replica(LOCAL, quorum="lighthouse", wait_replicas=1),
            "(top level): train.replica.wait_replicas: applies to the Redis quorum only "
            "(quorum: redis); torchft's lighthouse runs with its own fixed settings: remove it "
            "or use quorum: redis",
        ),
        (
            _replica(LOCAL, quorum="lighthouse", heartbeat_timeout_s=5),
            "(top level): train.replica.heartbeat_timeout_s: 5 s, but torchft's lighthouse "
            "drops a replica after its own fixed 1 s (the controller starts it with that "
            "timeout): remove it (or write 1), or use quorum: redis for a timeout of your own",
        ),
        (
            _replica(LOCAL, quorum="lighthouse", join_timeout_ms=500),
            "(top level): train.replica.join_timeout_ms: applies to the Redis quorum only "
            "(quorum: redis); torchft's lighthouse runs with its own fixed settings: remove it "
            "or use quorum: redis",
        ),
        (
            _replica(LOCAL, quorum="lighthouse", relay_group_size=0),
            "(top level): train.replica.relay_group_size: applies to the Redis quorum only "
            "(quorum: redis); torchft's lighthouse runs with its own fixed settings: remove it "
            "or use quorum: redis",
        ),
        (
            _replica(LOCAL, relay_group_size=1),
            "train.replica.relay_group_size (line 9): use auto, 0 (no relays) or a whole "
            "number of replicas 2..1000 (got 1)",
        ),
        (
            spec_with(LOCAL, "train.replica", {"relay_group_size": 50}),
            "train (line 5): replica (nodes_per_replica 1, min_replicas 1, relay_group_size "
            "50) applies only in replica mode: set fault_tolerance: replica, or drop the "
            "replica block",
        ),
        (
            _replica(LOCAL, join_timeout_ms=10),
            "train.replica.join_timeout_ms (line 9): must be from 50 to 60000 ms (or auto): "
            "below 50 ms every changed round forms before its replicas are served; past 60 s "
            "it nears the workers' 120 s quorum timeout (got 10)",
        ),
        (
            _replica(LOCAL, join_timeout_ms="soon"),
            "train.replica.join_timeout_ms (line 9): use auto or a whole number of "
            "milliseconds from 50 to 60000 (got 'soon')",
        ),
        (
            spec_with(LOCAL, "train.replica", {"join_timeout_ms": 500}),
            "train (line 5): replica (nodes_per_replica 1, min_replicas 1, join_timeout_ms "
            "500) applies only in replica mode: set fault_tolerance: replica, or drop the "
            "replica block",
        ),
        (
            _replica(LOCAL, wait_replicas=-1),
            "train.replica.wait_replicas (line 9): must be greater than or equal to 0 (got -1)",
        ),
        (
            _replica(LOCAL, {"min": 1, "max": 4, "gpus": 0}, nodes_per_replica=2),
            "(top level): nodes.min: 1 is below train.replica.min_replicas x nodes_per_replica "
            "(1 x 2 = 2), so the job could run with too few nodes for a quorum and train "
            "nothing: raise nodes.min to 2",
        ),
        (
            _replica(LOCAL, {"min": 2, "max": 4, "gpus": 0}, min_replicas=3),
            "(top level): nodes.min: 2 is below train.replica.min_replicas x nodes_per_replica "
            "(3 x 1 = 3), so the job could run with too few nodes for a quorum and train "
            "nothing: raise nodes.min to 3, or lower train.replica.min_replicas",
        ),
        (
            _replica(LOCAL, {"min": 2, "max": 5, "gpus": 0}, nodes_per_replica=2),
            "(top level): nodes.max (5): not a multiple of train.replica.nodes_per_replica "
            "(2); a partial replica cannot train: use whole replicas, e.g. nodes.min 2 and "
            "nodes.max 4",
        ),
        (
            _replica(LOCAL, {"min": 3, "max": 3, "gpus": 0}, nodes_per_replica=2),
            "(top level): nodes.min (3) and nodes.max (3): not a multiple of "
            "train.replica.nodes_per_replica (2); a partial replica cannot train: use whole "
            "replicas, e.g. nodes.min 4 and nodes.max 4",
        ),
    ],
)
def test_what_replica_mode_cannot_run_is_refused_in_one_line(
    data: dict[str, Any], expected: str
) -> None:
    assert _problems(data) == [expected]


def test_spread_placement_that_would_mix_gpu_types_across_replicas_is_refused() -> None:
    mixed = spec_with(_replica(VALID), "resources.placement", "spread")
    mixed = spec_with(mixed, "resources.instance_types", ["p4d.24xlarge", "a3-highgpu-8g"])
    assert _problems(mixed) == [
        "resources.placement: spread in replica mode would mix GPU types across replicas "
        "(A100-40GB: p4d.24xlarge; H100: a3-highgpu-8g): list instance types of one GPU "
        "type in resources.instance_types, or use placement: same-zone"
    ]
    # No instance types: the planner may pick any type with nodes.gpus GPUs.
    (line,) = _problems(spec_with(mixed, "resources.instance_types", []))
    every = sorted(
        allowed_gpu_types(_parse(spec_with(VALID, "resources.instance_types", [])), bundled())
    )
    assert len(every) > 1
    assert line.startswith(
        f"resources.placement: spread in replica mode would mix GPU types across replicas "
        f"({', '.join(every)}: resources.instance_types is empty, so all)"
    )


def test_what_replica_mode_can_run_is_accepted() -> None:
    # Spread over types of one GPU (p4d.24xlarge and a2-highgpu-8g are both A100-40GB).
    one_gpu = spec_with(_replica(VALID), "resources.placement", "spread")
    assert allowed_gpu_types(_parse(VALID), bundled()) == {
        "A100-40GB": ["p4d.24xlarge", "a2-highgpu-8g"]
    }
    _parse(one_gpu)
    # Same-zone keeps every node on one type, whatever the list allows.
    _parse(
        spec_with(_replica(VALID), "resources.instance_types", ["p4d.24xlarge", "a3-highgpu-8g"])
    )
    # The local cloud has one type: spread over its zones is fine.
    _parse(
        spec_with(_replica(LOCAL, {"min": 2, "max": 4, "gpus": 0}), "resources.placement", "spread")
    )
    # A Terraform fleet: the module renders the replica settings (it checks they match).
    _parse(_replica(FLEET_AWS))
    # Whole replicas from nodes.min up, with a quorum that fits in nodes.min.
    _parse(_replica(LOCAL, {"min": 4, "max": 6, "gpus": 0}, nodes_per_replica=2, min_replicas=2))


def test_an_elastic_job_keeps_todays_rules() -> None:
    # Neither spread over GPU types, nor a fleet, nor any node count is refused for it.
    spread = spec_with(VALID, "resources.placement", "spread")
    _parse(spec_with(spread, "resources.instance_types", ["p4d.24xlarge", "a3-highgpu-8g"]))
    _parse(FLEET_AWS)
    _parse(spec_with(LOCAL, "nodes", {"min": 1, "max": 3, "gpus": 0}))


def test_the_agent_settings_of_a_replica_job() -> None:
    spec = _parse(
        _replica(LOCAL, {"min": 4, "max": 8, "gpus": 0}, nodes_per_replica=2, min_replicas=2)
    )
    assert replica_agent_env(spec) == {
        env_names.ENV_FAULT_TOLERANCE: "replica",
        env_names.ENV_NODES_PER_REPLICA: "2",
        env_names.ENV_MIN_REPLICAS: "2",
        env_names.ENV_QUORUM: "redis",
    }
    # The lighthouse moves when it restarts: the agent reads it from Redis, not from here.
    assert env_names.ENV_LIGHTHOUSE not in replica_agent_env(spec)
    lighthouse = _parse(_replica(LOCAL, quorum="lighthouse"))
    assert replica_agent_env(lighthouse)[env_names.ENV_QUORUM] == "lighthouse"
    # WAIT for a Redis replica only when asked: the boot env stays as it was otherwise.
    waits = _parse(_replica(LOCAL, wait_replicas=1))
    assert replica_agent_env(waits)[env_names.ENV_QUORUM_WAIT_REPLICAS] == "1"
    assert env_names.ENV_QUORUM_WAIT_REPLICAS not in replica_agent_env(spec)
    slow = _parse(_replica(LOCAL, heartbeat_timeout_s=5))
    assert replica_agent_env(slow)[env_names.ENV_QUORUM_HEARTBEAT_TIMEOUT] == "5"
    assert env_names.ENV_QUORUM_HEARTBEAT_TIMEOUT not in replica_agent_env(spec)
    # The join timeout: sent only when it is not 250 ms (auto at 4 replicas is 250).
    assert env_names.ENV_QUORUM_JOIN_TIMEOUT not in replica_agent_env(spec)
    patient = _parse(_replica(LOCAL, join_timeout_ms=800))
    assert replica_agent_env(patient)[env_names.ENV_QUORUM_JOIN_TIMEOUT] == "800"
    big = _parse(_replica(VALID, {"min": 16, "max": 10_000, "gpus": 8}))
    assert replica_agent_env(big)[env_names.ENV_QUORUM_JOIN_TIMEOUT] == "1080"
    assert (
        "with a 1080 ms join timeout (auto) and a 4 s heartbeat timeout (auto), relayed by one "
        "VM per 100 replicas;" in str(describe_replica(big))
    )
    # Relays: auto is 100 from 1,000 replicas at nodes.max, off below; 0 turns them off.
    assert replica_agent_env(big)[env_names.ENV_QUORUM_RELAY_GROUP] == "100"
    assert env_names.ENV_QUORUM_RELAY_GROUP not in replica_agent_env(spec)
    below = _parse(_replica(VALID, {"min": 16, "max": 999, "gpus": 8}))
    assert relay_group_size(below) == 0 and "relayed" not in str(describe_replica(below))
    off = _parse(_replica(VALID, {"min": 16, "max": 10_000, "gpus": 8}, relay_group_size=0))
    assert env_names.ENV_QUORUM_RELAY_GROUP not in replica_agent_env(off)
    small = _parse(_replica(LOCAL, relay_group_size=2))
    assert replica_agent_env(small)[env_names.ENV_QUORUM_RELAY_GROUP] == "2"
    fixed = _parse(_replica(VALID, {"min": 16, "max": 10_000, "gpus": 8}, join_timeout_ms=300))
    assert "with a 300 ms join timeout and a 4 s heartbeat timeout (auto), relayed" in str(
        describe_replica(fixed)
    )


def test_the_automatic_join_timeout_grows_with_the_fleet_past_250_ms() -> None:
    # 54 µs of Redis CPU per replica per round (bench/quorum_scale.py), twice over.
    assert [auto_join_timeout_ms(n) for n in (0, 1, 100, 2314, 2315)] == [250] * 4 + [251]
    assert auto_join_timeout_ms(3000) == 324  # exact: no float rounding up to 325
    assert auto_join_timeout_ms(12_500) == 1350
    assert auto_join_timeout_ms(10_000_000) == 60_000  # the spec's bound
    # The spec's replicas are nodes.max / nodes_per_replica.
    spec = _parse(_replica(VALID, {"min": 16, "max": 9_600, "gpus": 8}, nodes_per_replica=2))
    assert join_timeout_ms(spec) == auto_join_timeout_ms(4800) == 519
    assert _parse(_replica(LOCAL, join_timeout_ms="auto")) == _parse(_replica(LOCAL))


def test_validates_line_names_the_mode_the_replicas_and_where_torchft_comes_from() -> None:
    local = _parse(
        _replica(LOCAL, {"min": 4, "max": 8, "gpus": 0}, nodes_per_replica=2, min_replicas=2)
    )
    assert describe_replica(local) == (
        "fault tolerance replica: 2 node(s) per replica, 2-4 replicas, a step commits with at "
        "least 2 replica(s), its quorum in the run's Redis with a 250 ms join timeout (auto) "
        "and a 1 s heartbeat timeout (auto); the local VMs run in this venv, which needs "
        "spottrain[replica] (torchft)"
    )
    image = _parse(_replica(VALID))
    assert describe_replica(image) == (
        "fault tolerance replica: 1 node(s) per replica, 2-4 replicas, a step commits with at "
        "least 1 replica(s), its quorum in the run's Redis with a 250 ms join timeout (auto) "
        "and a 1 s heartbeat timeout (auto); the image must hold torchft (pip install "
        "'spottrain[agent,replica]'): nothing installs it at boot"
    )
    lighthouse = _parse(_replica(VALID, quorum="lighthouse"))
    assert "its quorum from torchft's lighthouse, which the controller runs;" in str(
        describe_replica(lighthouse)
    )
    git = _parse(spec_with(_replica(VALID), "code", {"archive": {"path": "."}}))
    assert str(describe_replica(git)).endswith("; each VM installs spottrain[replica] (torchft)")


def test_the_readme_reference_documents_every_replica_key() -> None:
    text = README.read_text()
    table = text[text.index("## The job spec") : text.index("## Clouds")]
    rows = {m[1]: m[2] for m in re.finditer(r"^\| `([a-z_.]+)` \| (.*)$", table, re.M)}
    for name in TrainSpec.model_fields:
        assert f"train.{name}" in rows, f"train.{name} has no row in the README's table"
    for name in ReplicaSpec.model_fields:
        assert name in rows["train.replica"], f"train.replica.{name} is not in its row"
    assert "### Replica mode" in table

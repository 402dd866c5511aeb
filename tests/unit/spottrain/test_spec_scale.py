"""The spec at the scale the project is built for: 12,500 one-node replicas (100,000 GPUs at 8
a node) validate, and ``train.replica.heartbeat_timeout_s: auto`` (the default) grows with the
fleet so heartbeats stay a bounded share of Redis's one core; an explicit number wins."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from spec_samples import LOCAL, VALID, spec_with

from spottrain.controller.run import lighthouse as lighthouse_run
from spottrain.protocol import env as env_names
from spottrain.spec import JobSpec, SpecError, describe_replica, parse_spec, replica_agent_env
from spottrain.spec.fields import MAX_NODES
from spottrain.spec.heartbeat import (
    HEARTBEAT_REDIS_SHARE_PCT,
    HEARTBEATS_PER_TIMEOUT,
    REDIS_HEARTBEAT_US,
    auto_heartbeat_timeout_s,
)
from spottrain.spec.replica import (
    LIGHTHOUSE_HEARTBEAT_S,
    heartbeat_timeout_s,
    join_timeout_ms,
    relay_group_size,
    replica_problem,
)

HEARTBEAT = env_names.ENV_QUORUM_HEARTBEAT_TIMEOUT


def _parse(data: dict[str, Any]) -> JobSpec:
    return parse_spec(yaml.safe_dump(data, sort_keys=False), "job.yaml").spec


def _problems(data: dict[str, Any]) -> list[str]:
    """The spec's problems, without the line numbers (the fixtures' layouts differ)."""
    with pytest.raises(SpecError) as err:
        parse_spec(yaml.safe_dump(data, sort_keys=False), "job.yaml")
    return [re.sub(r" \(line \d+\)", "", p) for p in err.value.problems]


def _fleet(nodes_max: int, nodes_per_replica: int = 1, **replica: Any) -> dict[str, Any]:
    """VALID in replica mode with up to ``nodes_max`` 8-GPU nodes."""
    data = spec_with(VALID, "train.fault_tolerance", "replica")
    data = spec_with(data, "train.replica", {"nodes_per_replica": nodes_per_replica, **replica})
    return spec_with(data, "nodes", {"min": 16, "max": nodes_max, "gpus": 8})


def _share_of_a_core(replicas: int, timeout_s: float) -> float:
    """The README's cost model: replicas x 5 / timeout calls a second at 28 µs each."""
    return replicas * HEARTBEATS_PER_TIMEOUT / timeout_s * REDIS_HEARTBEAT_US / 1e6


def test_twelve_thousand_five_hundred_one_node_replicas_validate() -> None:
    spec = _parse(_fleet(12_500))
    assert (spec.nodes.max, spec.nodes.max * spec.nodes.gpus) == (12_500, 100_000)
    assert replica_problem(spec) is None
    assert (join_timeout_ms(spec), heartbeat_timeout_s(spec), relay_group_size(spec)) == (
        1350,
        5.0,
        100,
    )
    # A quorum floor of every replica, and replicas of many nodes, are within the caps too.
    whole = _parse(spec_with(_fleet(12_500, min_replicas=12_500), "nodes.min", 12_500))
    assert replica_problem(whole) is None
    halves = spec_with(_fleet(MAX_NODES, nodes_per_replica=MAX_NODES // 2), "nodes.min", MAX_NODES)
    assert replica_problem(_parse(halves)) is None


def test_counts_of_nodes_stop_at_one_hundred_thousand() -> None:
    assert _problems(_fleet(MAX_NODES + 1)) == [
        "nodes.max: must be less than or equal to 100000 (got 100001)"
    ]
    assert _problems(_fleet(16, nodes_per_replica=MAX_NODES + 1)) == [
        "train.replica.nodes_per_replica: must be less than or equal to 100000 (got 100001)"
    ]
    local = spec_with(LOCAL, "local.zones", {"local-a": {"capacity": MAX_NODES}})
    assert _parse(local).local is not None


def test_the_automatic_heartbeat_timeout_keeps_heartbeats_under_a_third_of_a_core() -> None:
    assert [auto_heartbeat_timeout_s(n) for n in (100, 1_500, 2_500, 12_500)] == [1, 1, 1, 5]
    # Whole half-seconds from 2,500 replicas on; 1 s below; the spec's 300 s bound above.
    assert [auto_heartbeat_timeout_s(n) for n in (0, -5, 2_501, 3_750, 3_751)] == [
        1,
        1,
        1.5,
        1.5,
        2,
    ]
    assert auto_heartbeat_timeout_s(10_000) == 4
    assert auto_heartbeat_timeout_s(MAX_NODES) == 40
    assert auto_heartbeat_timeout_s(10_000_000) == 300
    share = HEARTBEAT_REDIS_SHARE_PCT / 100
    for n in (100, 1_500, 2_500, 2_501, 5_000, 12_500, MAX_NODES):
        t = auto_heartbeat_timeout_s(n)
        assert _share_of_a_core(n, t) <= share + 1e-12, n
        # The shortest such timeout: half a second less would cost more (or go below 1 s).
        assert t == 1 or _share_of_a_core(n, t - 0.5) > share, n
    # A fixed 1 s at 12,500 is the two cores the README warns of; auto is ~35 % of one.
    assert _share_of_a_core(12_500, 1) == pytest.approx(1.75)
    assert _share_of_a_core(12_500, auto_heartbeat_timeout_s(12_500)) == pytest.approx(0.35)


def test_the_spec_resolves_auto_from_nodes_max_over_nodes_per_replica() -> None:
    small = _parse(_fleet(64))
    assert small.train.replica.heartbeat_timeout_s == "auto"  # the default
    assert _parse(_fleet(64, heartbeat_timeout_s="auto")) == small
    assert heartbeat_timeout_s(small) == 1.0
    assert HEARTBEAT not in replica_agent_env(small)  # the agent's own default: 1 s
    # 12,500 replicas of 2 nodes, as 12,500 of one.
    pairs = _parse(_fleet(25_000, nodes_per_replica=2))
    assert heartbeat_timeout_s(pairs) == 5.0
    assert replica_agent_env(pairs)[HEARTBEAT] == "5"
    assert heartbeat_timeout_s(_parse(_fleet(7_500))) == 3.0
    assert replica_agent_env(_parse(_fleet(3_000)))[HEARTBEAT] == "1.5"


def test_an_explicit_heartbeat_timeout_wins_over_auto() -> None:
    fixed = _parse(_fleet(12_500, heartbeat_timeout_s=2))
    assert heartbeat_timeout_s(fixed) == 2.0
    assert replica_agent_env(fixed)[HEARTBEAT] == "2"
    assert "and a 2 s heartbeat timeout, relayed" in str(describe_replica(fixed))
    # 1 s, the agent's default, is sent as nothing, as before.
    one = _parse(_fleet(12_500, heartbeat_timeout_s=1))
    assert heartbeat_timeout_s(one) == 1.0
    assert HEARTBEAT not in replica_agent_env(one)
    assert heartbeat_timeout_s(_parse(_fleet(64, heartbeat_timeout_s=0.2))) == 0.2


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (
            0.1,
            "must be from 0.2 to 300 s (or auto): below 0.2 s each replica would heartbeat "
            "Redis more often than every 40 ms; past 300 s a replica lost without notice "
            "stalls the others for minutes (got 0.1)",
        ),
        (301, "must be from 0.2 to 300 s (or auto)"),
        ("fast", "use auto or a number of seconds from 0.2 to 300"),
        ("Auto", "use auto or a number of seconds from 0.2 to 300"),
        (True, "use auto or a number of seconds from 0.2 to 300"),
    ],
)
def test_a_heartbeat_timeout_outside_its_range_is_refused(value: Any, expected: str) -> None:
    (problem,) = _problems(_fleet(64, heartbeat_timeout_s=value))
    assert problem.startswith("train.replica.heartbeat_timeout_s: " + expected)


def test_the_lighthouse_and_elastic_mode_take_no_heartbeat_timeout() -> None:
    # auto means nothing to torchft's lighthouse (its own 1 s): accepted, and sent as nothing.
    lighthouse = _parse(_fleet(12_500, quorum="lighthouse"))
    assert HEARTBEAT not in replica_agent_env(lighthouse)
    assert "heartbeat" not in str(describe_replica(lighthouse))
    # Exactly the lighthouse's own 1 s (specs from when it was the default say so) is
    # accepted and changes nothing; any other number is refused, saying why.
    for one in (1, 1.0):
        spelled = _parse(_fleet(12_500, quorum="lighthouse", heartbeat_timeout_s=one))
        assert replica_agent_env(spelled) == replica_agent_env(lighthouse)
        assert describe_replica(spelled) == describe_replica(lighthouse)
    assert LIGHTHOUSE_HEARTBEAT_S * 1000 == lighthouse_run.HEARTBEAT_TIMEOUT_MS
    for other in (0.5, 1.5, 5):
        (problem,) = _problems(_fleet(64, quorum="lighthouse", heartbeat_timeout_s=other))
        assert f"train.replica.heartbeat_timeout_s: {other:g} s, but torchft's lighthouse " in (
            problem
        )
        assert "its own fixed 1 s" in problem and "use quorum: redis" in problem
    # In elastic mode even 1 is refused: the replica block applies to replica mode only.
    elastic = spec_with(LOCAL, "train.replica", {"heartbeat_timeout_s": 1})
    (problem,) = _problems(elastic)
    assert "heartbeat_timeout_s 1) applies only in replica mode" in problem
    assert _parse(spec_with(LOCAL, "train.replica", {"heartbeat_timeout_s": "auto"})) == _parse(
        LOCAL
    )


def test_validate_prints_the_resolved_heartbeat_timeout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from spottrain.controller.cli.validate import validate

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_fleet(12_500)))
    validate(argparse.Namespace(spec=str(path), json=False, check_clouds=False))
    out = capsys.readouterr().out
    assert "nodes 16-12500 x 8 GPUs" in out
    assert (
        "its quorum in the run's Redis with a 1350 ms join timeout (auto) and a 5 s heartbeat "
        "timeout (auto), relayed by one VM per 100 replicas;" in out
    )
    validate(argparse.Namespace(spec=str(path), json=True, check_clouds=False))
    replica = json.loads(capsys.readouterr().out)["replica"]
    assert replica == {
        "nodes_per_replica": 1,
        "min_replicas": 1,
        "replicas_min": 16,
        "replicas_max": 12_500,
        "quorum": "redis",
        "join_timeout_ms": 1350,
        "heartbeat_timeout_s": 5.0,
    }
    path.write_text(yaml.safe_dump(_fleet(12_500, heartbeat_timeout_s=7.5)))
    validate(argparse.Namespace(spec=str(path), json=False, check_clouds=False))
    assert "and a 7.5 s heartbeat timeout, relayed" in capsys.readouterr().out

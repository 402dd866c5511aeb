"""The lighthouse's pure decisions (where it listens, its flags) and the replica rows of
`status`, without processes or Redis."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from spec_samples import LOCAL

from spottrain.controller.run.lighthouse import (
    HEARTBEAT_TIMEOUT_MS,
    choose_hosts,
    find_torchft,
    lighthouse_command,
    min_replicas,
    place_lighthouse,
    placement_from_env,
    replica_mode,
    uses_lighthouse,
)
from spottrain.controller.run.records import RunError, RunInfo
from spottrain.controller.run.replica_view import (
    ReplicaRow,
    ReplicaStatus,
    format_replicas,
    quorum_line,
    replica_rows,
)
from spottrain.quorum.client import QuorumStatus
from spottrain.spec import parse_spec


@pytest.mark.parametrize(
    ("redis_host", "local", "expected"),
    [
        ("127.0.0.1", True, ("127.0.0.1", "127.0.0.1")),
        ("localhost", True, ("127.0.0.1", "127.0.0.1")),
        ("", False, ("127.0.0.1", "127.0.0.1")),
        # The controller VM's Redis: the VMs reach that host already.
        ("10.0.0.5", True, ("0.0.0.0", "10.0.0.5")),
        # Redis elsewhere: this machine by name.
        ("redis.internal", False, ("0.0.0.0", "ctl.example")),
    ],
)
def test_the_lighthouse_listens_beside_the_runs_redis(
    redis_host: str, local: bool, expected: tuple[str, str]
) -> None:
    assert choose_hosts(redis_host, local, "ctl.example") == expected


def test_the_lighthouse_expires_a_silent_replica_after_a_second() -> None:
    cmd = lighthouse_command("/venv/bin/torchft_lighthouse", "127.0.0.1:5000", 3)
    flags = dict(zip(cmd[-10::2], cmd[-9::2], strict=True))
    assert flags == {
        "--bind": "127.0.0.1:5000",
        "--min_replicas": "3",
        "--heartbeat_timeout_ms": str(HEARTBEAT_TIMEOUT_MS),
        "--join_timeout_ms": "250",
        "--quorum_tick_ms": "100",
    }
    assert HEARTBEAT_TIMEOUT_MS == 1000
    assert cmd[1].endswith("lighthouse_exec.py")  # torchft's lighthouse without torch


def test_an_elastic_spec_has_no_lighthouse(tmp_path: Path) -> None:
    spec = parse_spec(yaml.safe_dump(LOCAL), "job.yaml", tmp_path).spec
    assert not replica_mode(spec) and min_replicas(spec) == 1 and not uses_lighthouse(spec)
    # A replica spec runs the lighthouse only when its quorum says so (Redis by default).
    replica = {**LOCAL, "train": {**LOCAL["train"], "fault_tolerance": "replica"}}
    spec = parse_spec(yaml.safe_dump(replica), "job.yaml", tmp_path).spec
    assert replica_mode(spec) and not uses_lighthouse(spec)
    replica["train"]["replica"] = {"quorum": "lighthouse"}
    assert uses_lighthouse(parse_spec(yaml.safe_dump(replica), "job.yaml", tmp_path).spec)


def test_a_local_redis_quorum_run_without_torchft_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RunError) as e:
        find_torchft()
    assert "\n" not in str(e.value) and "pip install 'spottrain[replica]'" in str(e.value)


def test_a_run_json_from_before_the_lighthouse_still_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPOTTRAIN_HOME", str(tmp_path))
    old = {
        "run_id": "r-old",
        "spec_text": "",
        "spec_source": "job.yaml",
        "base_dir": ".",
        "redis_url": "redis://127.0.0.1:1/0",
        "embedded_redis": True,
        "created_at": 0.0,
    }
    (tmp_path / "runs" / "r-old").mkdir(parents=True)
    (tmp_path / "runs" / "r-old" / "run.json").write_text(json.dumps(old))
    info = RunInfo.load("r-old")
    assert info.lighthouse == "" and info.lighthouse_bind == ""


def test_replica_rows_join_slots_and_holders_in_replica_order() -> None:
    slots = {
        b"replica-10": json.dumps({"nodes": ["n10"], "at": 1.0}).encode(),
        b"replica-2": json.dumps(["n2a", "n2b"]).encode(),
        b"replica-3": b"{not json",
    }
    holders = {
        b"replica-2": json.dumps(
            {"state": "live", "step": 7, "quorum_id": 2, "participants": 2, "discarded": 0,
             "at": 100.0}
        ).encode(),
        b"replica-9": json.dumps({"state": "leaving", "step": 6}).encode(),
    }  # fmt: skip
    rows = replica_rows(slots, holders)
    assert [r.replica_id for r in rows] == ["replica-2", "replica-3", "replica-9", "replica-10"]
    assert rows[0] == ReplicaRow("replica-2", ("n2a", "n2b"), "live", 7, 2, 2, 0, 100.0)
    assert rows[1] == ReplicaRow("replica-3", (), "joining")
    assert rows[2].state == "leaving" and rows[2].nodes == () and rows[2].quorum_id is None
    assert rows[3] == ReplicaRow("replica-10", ("n10",), "joining")


def test_format_replicas_says_where_the_lighthouse_is_and_each_replicas_figures() -> None:
    rows = [
        ReplicaRow("replica-0", ("n0", "n1"), "live", 12, 4, 2, 3, 95.0),
        ReplicaRow("replica-1", ("n2",), "joining"),
    ]
    lines = format_replicas(rows, "10.0.0.5:29510", True, now=100.0)
    assert lines[0] == "lighthouse 10.0.0.5:29510 up"
    assert lines[1] == "replicas: 2 (1 live)"
    assert " ".join(lines[2].split()) == (
        "replica-0 live nodes n0,n1 step 12 quorum 4 (2 taking part) discarded 3 seen 5s ago"
    )
    assert " ".join(lines[3].split()) == (
        "replica-1 joining nodes n2 step - quorum - (- taking part) discarded -"
    )
    assert format_replicas([], "", False, now=0.0)[0] == "lighthouse - DOWN"


def test_the_redis_quorums_line_stands_where_the_lighthouses_was() -> None:
    q = QuorumStatus(qid=12, version=9, round=40, members=3, heartbeating=4, epoch="5f3a")
    assert quorum_line(q) == (
        "quorum redis: id 12 (membership since 9), 3 member(s), 4 heartbeating, round 40, "
        "epoch 5f3a"
    )
    fresh = QuorumStatus(qid=0, version=0, round=0, members=0, heartbeating=2, epoch="")
    assert quorum_line(fresh) == "quorum redis: none formed yet; 2 heartbeating, round 0"
    assert quorum_line(None, "Redis key k holds x") == (
        "quorum redis: cannot read it: Redis key k holds x"
    )
    rows = [ReplicaRow("replica-0", ("n0",), "live", 12, 12, 3, 0, 99.0)]
    status = ReplicaStatus("", False, rows, kind="redis", quorum=q)
    assert status.lines(now=100.0)[:2] == [quorum_line(q), "replicas: 1 (1 live)"]
    doc = status.to_json()
    figures = doc["quorum"]
    assert (figures["kind"], figures["qid"], figures["members"], figures["epoch"]) == (
        "redis",
        12,
        3,
        "5f3a",
    )
    assert "lighthouse" not in doc and doc["replicas"][0]["replica_id"] == "replica-0"
    unread = ReplicaStatus("", False, [], kind="redis", quorum_error="refused").to_json()
    assert unread["quorum"] == {"kind": "redis", "error": "refused"}
    lighthouse = ReplicaStatus("h:1", True, rows).to_json()
    assert lighthouse["quorum"] == {"kind": "lighthouse"}
    assert lighthouse["lighthouse"] == {"address": "h:1", "up": True}


def test_terraforms_address_for_the_controller_wins() -> None:
    env = {"SPOTTRAIN_LIGHTHOUSE": "127.0.0.1:29510"}
    placed = place_lighthouse("redis://10.0.0.9:6379/0", env)
    assert placed.address == placed.bind == "127.0.0.1:29510"
    # An address of another machine is still advertised; it is bound on every interface.
    placed = placement_from_env("192.0.2.7:29510")
    assert placed.address == "192.0.2.7:29510" and placed.bind == "0.0.0.0:29510"


@pytest.mark.parametrize("value", ["10.0.0.5", "10.0.0.5:http", ":29510", "10.0.0.5:0"])
def test_a_bad_lighthouse_address_is_refused_in_one_line(value: str) -> None:
    with pytest.raises(RunError, match=r"SPOTTRAIN_LIGHTHOUSE=.*host:port") as e:
        placement_from_env(value)
    assert "\n" not in str(e.value)

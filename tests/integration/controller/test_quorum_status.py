"""`status` of a replica run on the Redis quorum (the default): the quorum's own figures read
from the run's (real) Redis through the quorum's client, beside the replicas' rows; garbage in
the quorum's keys is a line saying so, never a failed or hanging `status`."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from spec_samples import LOCAL

from spottrain.controller.run.records import RunInfo
from spottrain.protocol.keys import RunKeys
from spottrain.quorum.client import QuorumClient
from spottrain.quorum.model import Member, QuorumConfig


def test_status_shows_the_redis_quorum(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    redis_server: Any,
    redis_client: redis.Redis,
    run_keys: RunKeys,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from spottrain.controller.cli import main as cli

    monkeypatch.setenv("SPOTTRAIN_HOME", str(tmp_path / "home"))
    job = {**LOCAL, "train": {**LOCAL["train"], "fault_tolerance": "replica"}}
    info = RunInfo(
        run_id=run_keys.run_id,
        spec_text=yaml.safe_dump(job),
        spec_source="job.yaml",
        base_dir=str(tmp_path),
        redis_url=redis_server.endpoint,
        embedded_redis=False,
        created_at=time.time(),
    )
    info.save()
    # Before any replica asked: no quorum yet, and no lighthouse anywhere.
    assert cli.main(["status", info.run_id]) == 0
    out = capsys.readouterr().out
    assert "  quorum redis: none formed yet; 0 heartbeating, round 0\n" in out
    assert "lighthouse" not in out
    assert "relays:" not in out  # auto: no relays below 1,000 replicas

    # Two replicas form a quorum, as their shims would.
    quorum = QuorumClient(
        redis_server.client(), run_keys, QuorumConfig(heartbeat_timeout_ms=60_000)
    )
    for rid in ("replica-0", "replica-1"):
        quorum.join(Member(rid, address=f"http://{rid}", store_address=f"{rid}:1"))
    quorum.heartbeat(["replica-0", "replica-1"])  # both count: the quorum waits for both
    with ThreadPoolExecutor(2) as pool:
        asked = [pool.submit(quorum.request, r, 5, timeout=30) for r in ("replica-0", "replica-1")]
        (qid,) = {f.result(40).quorum_id for f in asked}
    redis_client.hset(
        run_keys.replica_holders,
        "replica-0",
        json.dumps({"state": "live", "step": 5, "quorum_id": qid, "at": time.time()}),
    )
    assert cli.main(["status", info.run_id]) == 0
    out = capsys.readouterr().out.splitlines()
    now = quorum.status()
    assert now.epoch and now.round >= 1
    # Heartbeats count for 1 s (the quorum's default): a loaded machine may see them lapse.
    (at,) = [
        i
        for i, line in enumerate(out)
        if re.fullmatch(
            rf"  quorum redis: id {qid} \(membership since {qid}\), 2 member\(s\), [012] "
            rf"heartbeating, round {now.round}, epoch {now.epoch}",
            line,
        )
    ]
    assert out[at + 1] == "  replicas: 1 (1 live)"
    assert cli.main(["status", info.run_id, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["quorum"]["kind"] == "redis" and "lighthouse" not in doc
    figures = doc["quorum"]
    assert (figures["qid"], figures["members"], figures["epoch"]) == (qid, 2, now.epoch)
    assert doc["replicas"][0]["replica_id"] == "replica-0"

    # Garbage in a quorum key: status says which key and how to reset, and still exits 0.
    redis_client.delete(run_keys.quorum_key("state"))
    redis_client.set(run_keys.quorum_key("state"), "garbage")
    assert cli.main(["status", info.run_id]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if "quorum redis" in ln]
    assert line.startswith("  quorum redis: cannot read it: Redis key ")
    assert f"delete the keys `{run_keys.quorum_base}:*`" in line


def test_status_shows_where_each_relay_group_is_relayed(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    redis_server: Any,
    redis_client: redis.Redis,
    run_keys: RunKeys,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Relay groups of 2 over five claimed slots: groups 0 and 2 hold a lease (as the shims
    write it), group 1 has none, so its members ask Redis directly; status names both."""
    from spottrain.controller.cli import main as cli

    monkeypatch.setenv("SPOTTRAIN_HOME", str(tmp_path / "home"))
    replica = {"relay_group_size": 2}
    job = {**LOCAL, "train": {**LOCAL["train"], "fault_tolerance": "replica", "replica": replica}}
    info = RunInfo(
        run_id=run_keys.run_id,
        spec_text=yaml.safe_dump(job),
        spec_source="job.yaml",
        base_dir=str(tmp_path),
        redis_url=redis_server.endpoint,
        embedded_redis=False,
        created_at=time.time(),
    )
    info.save()
    for j in range(5):
        redis_client.hset(run_keys.replica_slots, f"replica-{j}", json.dumps({"nodes": [f"n{j}"]}))
    redis_client.set(run_keys.quorum_relay(0), "10.0.0.4:29513", px=60_000)
    redis_client.set(run_keys.quorum_relay(2), "10.0.0.9:29513", px=60_000)
    assert cli.main(["status", info.run_id]) == 0
    out = capsys.readouterr().out.splitlines()
    (at,) = [i for i, line in enumerate(out) if line.startswith("  quorum redis:")]
    assert out[at + 1] == (
        "  relays: 2 of 3 group(s) held (2 a group): 0 at 10.0.0.4:29513, 2 at "
        "10.0.0.9:29513; asking Redis directly: group 1"
    )
    assert cli.main(["status", info.run_id, "--json"]) == 0
    relays = json.loads(capsys.readouterr().out)["relays"]
    assert relays == {
        "group_size": 2,
        "held": {"0": "10.0.0.4:29513", "2": "10.0.0.9:29513"},
        "unheld": [1],
    }


@pytest.mark.parametrize(
    ("nodes_max", "replica", "heartbeating"),
    [
        # auto at 12,500 one-node replicas: 5 s, so a 2 s old heartbeat counts
        (12_500, {}, 1),
        # an explicit 5 s on a small fleet, likewise
        (2, {"heartbeat_timeout_s": 5}, 1),
        # auto at 2 replicas: 1 s, so the 2 s old heartbeat has lapsed
        (2, {}, 0),
    ],
)
def test_status_counts_heartbeats_by_the_specs_own_timeout(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    redis_server: Any,
    redis_client: redis.Redis,
    run_keys: RunKeys,
    capsys: pytest.CaptureFixture[str],
    nodes_max: int,
    replica: dict[str, Any],
    heartbeating: int,
) -> None:
    """A replica whose last heartbeat is 2 s old still heartbeats where the run's shims drop
    a replica after 5 s (the spec's heartbeat timeout, auto resolved for its fleet), and not
    where they drop it after 1 s; one 6 s old has lapsed at either."""
    from spottrain.controller.cli import main as cli

    monkeypatch.setenv("SPOTTRAIN_HOME", str(tmp_path / "home"))
    train = {**LOCAL["train"], "fault_tolerance": "replica", "replica": replica}
    job = {**LOCAL, "nodes": {**LOCAL["nodes"], "max": nodes_max}, "train": train}
    info = RunInfo(
        run_id=run_keys.run_id,
        spec_text=yaml.safe_dump(job),
        spec_source="job.yaml",
        base_dir=str(tmp_path),
        redis_url=redis_server.endpoint,
        embedded_redis=False,
        created_at=time.time(),
    )
    info.save()
    quorum = QuorumClient(redis_server.client(), run_keys, QuorumConfig())
    for rid in ("replica-0", "replica-1"):
        quorum.join(Member(rid, address=f"http://{rid}", store_address=f"{rid}:1"))
    quorum.heartbeat(["replica-0", "replica-1"])
    # Their last heartbeats, aged as a shim's would be: by Redis's clock, as the quorum's.
    sec, usec = redis_client.time()
    now_ms = sec * 1000 + usec // 1000
    aged = {"replica-0": now_ms - 2000, "replica-1": now_ms - 6000}
    assert redis_client.zadd(run_keys.quorum_key("hb"), aged, xx=True, ch=True) == 2
    assert cli.main(["status", info.run_id]) == 0
    out = capsys.readouterr().out
    beats = rf"\n  quorum redis: none formed yet; {heartbeating} heartbeating, round \d+\n"
    assert re.search(beats, out)
    assert cli.main(["status", info.run_id, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["quorum"]["heartbeating"] == heartbeating

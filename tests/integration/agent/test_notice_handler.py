"""The notice handler against a real Redis, with the trainers played by the test: what it
asks for, what it accepts as the answer, when it gives up, and what it does when Redis is
gone."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from spottrain.agent.checkpoint import dcp_io
from spottrain.agent.checkpoint.directory import CheckpointDir
from spottrain.agent.lifecycle import Lifecycle
from spottrain.agent.node_record import NodeInfo, NodeRecord
from spottrain.agent.notices.handler import NoticeHandler, _covers
from spottrain.agent.notices.notice import Notice, NoticeKind
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys
from spottrain.protocol.states import NodeState
from spottrain.redis_conn import RedisSettings, connect


class Harness:
    def __init__(self, client: redis.Redis, keys: RunKeys, ckpt_dir: str = "") -> None:
        self.keys = keys
        self.client = client
        self.lifecycle = Lifecycle()
        for s in (NodeState.HEALTHY, NodeState.JOINED):
            self.lifecycle.advance(s)
        self.record = NodeRecord(client, keys, NodeInfo("n1", "local"))
        self.stops: list[tuple[float, float]] = []
        self.handler = NoticeHandler(
            client,
            keys,
            "n1",
            self.lifecycle,
            self.record,
            self.stop,
            margin=1.0,
            ckpt_dir=ckpt_dir,
        )

    def stop(self, timeout: float) -> None:
        self.stops.append((time.time(), timeout))

    def requests(self) -> dict[str, dict[str, object]]:
        raw = self.client.hgetall(self.keys.ckpt_requests)
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    def events(self) -> list[str]:
        return [
            f[b"type"].decode()
            for _, f in self.client.xrange(self.keys.events)
            if f.get(b"node") == b"n1"
        ]


@pytest.fixture
def harness(redis_client: redis.Redis) -> Iterator[Harness]:
    keys = RunKeys(f"nh-{uuid.uuid4().hex[:8]}")
    yield Harness(redis_client, keys)
    found = list(redis_client.scan_iter(match=keys.pattern))
    if found:
        redis_client.delete(*found)


def notice(kind: NoticeKind = NoticeKind.TERMINATE, seconds: float = 30.0) -> Notice:
    now = time.time()
    return Notice("test", kind, None if kind is NoticeKind.REBALANCE else now + seconds, now)


def wait_for(pred: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_drain_asks_waits_for_the_commit_then_stops_the_workers(harness: Harness) -> None:
    harness.handler.submit(notice())
    wait_for(lambda: "n1" in harness.requests())
    req = harness.requests()["n1"]
    assert req["drain"] is True and req["id"] == 1 and req["deadline"] is not None
    assert harness.lifecycle.state is NodeState.DRAINING
    time.sleep(0.3)
    assert not harness.stops, "workers stopped before the checkpoint committed"
    harness.client.hset(
        harness.keys.ckpt_last,
        mapping={"step": 42, "request_id": 1, "drain": 1, "at": time.time()},
    )
    assert harness.handler.done.wait(10)
    assert harness.handler.outcome is not None and harness.handler.outcome.committed_step == 42
    assert harness.requests() == {}, "the request must be withdrawn"
    assert len(harness.stops) == 1 and harness.lifecycle.state is NodeState.LEFT
    for want in ("notice", "checkpoint-requested", "checkpoint-seen", "drained"):
        assert want in harness.events()


def test_a_repeated_notice_is_one_drain_and_an_earlier_deadline_wins(harness: Harness) -> None:
    first = notice(seconds=60)
    harness.handler.submit(first)
    harness.handler.submit(first)
    sooner = Notice("other", NoticeKind.SIGTERM, time.time() + 3.0, time.time())
    harness.handler.submit(sooner)
    t0 = time.monotonic()
    assert harness.handler.done.wait(10)
    # Nobody commits: it gives up at the sooner deadline minus the margin (about 2 s).
    assert 1.0 < time.monotonic() - t0 < 5.0
    assert "checkpoint-missed" in harness.events()
    assert harness.events().count("notice") == 2
    assert len(harness.stops) == 1


def test_a_refused_drain_checkpoint_is_reported_by_the_agent(
    harness: Harness, redis_server: RedisServer
) -> None:
    from spottrain.agent.sdk.channel import RequestChannel as _RequestPoller

    harness.handler.submit(notice(seconds=3.0))
    wait_for(lambda: "n1" in harness.requests())
    # Rank 0 saved for the request, and its commit was refused (its generation is stale).
    rank0 = _RequestPoller(redis_server.endpoint, harness.keys.run_id, 1.0, active=False)
    refusal = "refused to commit step 7 from rendezvous round 3 (fencing epoch 0): stale"
    result = dcp_io.SaveResult(7, None, None, refusal, 0.1, 0.0)
    rank0.report_refused(result, "emergency", True, 1, 3, 0)
    assert harness.handler.done.wait(10)
    outcome = harness.handler.outcome
    assert outcome is not None and outcome.committed_step is None
    assert outcome.refused == f"step 7: {refusal}"
    events = {
        f[b"type"].decode(): {k.decode(): v.decode() for k, v in f.items()}
        for _, f in harness.client.xrange(harness.keys.events)
        if f.get(b"node") == b"n1"
    }
    assert events["drain-checkpoint-refused"]["step"] == "7"
    assert events["drain-checkpoint-refused"]["reason"] == refusal
    assert events["drained"]["refused"] == f"step 7: {refusal}"


def test_an_early_checkpoint_by_another_request_does_not_answer_a_drain() -> None:
    early_save = {"step": "9", "request_id": "8", "drain": "0", "at": str(time.time())}
    assert not _covers(early_save, 5, time.time() - 1, drain=True)
    assert _covers(early_save, 5, time.time() - 1, drain=False)
    drain_save = {"step": "9", "request_id": "0", "drain": "1", "at": str(time.time())}
    assert _covers(drain_save, 5, time.time() - 1, drain=True)
    stale = {"step": "3", "request_id": "0", "drain": "1", "at": str(time.time() - 60)}
    assert not _covers(stale, 5, time.time(), drain=True)


def test_a_rebalance_asks_for_an_early_checkpoint_and_keeps_the_node(harness: Harness) -> None:
    harness.handler.submit(notice(NoticeKind.REBALANCE))
    wait_for(lambda: "n1:early" in harness.requests())
    assert harness.requests()["n1:early"]["drain"] is False
    assert harness.lifecycle.state is NodeState.CHECKPOINTING
    harness.client.hset(
        harness.keys.ckpt_last,
        mapping={"step": 7, "request_id": 1, "drain": 0, "at": time.time()},
    )
    wait_for(lambda: harness.lifecycle.state is NodeState.JOINED)
    assert harness.requests() == {} and not harness.stops
    assert "early-checkpoint" in harness.events()
    # At risk in its record, where the controller reads it to launch a replacement; every
    # beat writes it again (a Redis that restarted has it back).
    record_key = harness.keys.node("n1")
    assert harness.client.hget(record_key, "at_risk") == b"rebalance recommendation"
    harness.client.hdel(record_key, "at_risk")
    assert harness.record.beat()
    assert harness.client.hget(record_key, "at_risk") == b"rebalance recommendation"


def test_a_drain_and_an_early_request_of_one_node_do_not_erase_each_other(
    harness: Harness,
) -> None:
    harness.handler.submit(notice(NoticeKind.REBALANCE))
    wait_for(lambda: "n1:early" in harness.requests())
    harness.handler.submit(notice(seconds=30))
    wait_for(lambda: "n1" in harness.requests())
    time.sleep(0.5)  # the early thread gives way to the drain and withdraws its own field
    assert "n1" in harness.requests()


def test_with_redis_gone_the_workers_are_signalled_and_the_commit_is_read_from_disk(
    tmp_path: Path,
) -> None:
    """Redis is down when the notice comes: the request cannot be written, so the agent
    stops the workers at once (they save on SIGTERM) and finds the commit on disk."""
    server = RedisServer().start()
    try:
        client = connect(RedisSettings(host="127.0.0.1", port=server.port, socket_timeout=0.5))
        h = Harness(client, RunKeys(f"nh-{uuid.uuid4().hex[:8]}"), ckpt_dir=str(tmp_path))
        server.stop()
        noticed = notice(seconds=30)
        h.handler.submit(noticed)
        wait_for(lambda: bool(h.stops), timeout=15)
        assert h.stops[0][0] - noticed.seen_at < 10, "workers were not stopped at once"
        # The workers' emergency save lands on disk (no Redis to report it to).
        dcp_io.save(
            {"w": torch.ones(4)},
            CheckpointDir(tmp_path),
            step=17,
            round_=-1,
            kind="emergency",
            extra={"drain": True},
        )
        assert h.handler.done.wait(20)
        assert h.handler.outcome is not None and h.handler.outcome.committed_step == 17
    finally:
        server.close()


def test_concurrent_heartbeats_never_overwrite_the_final_state(harness: Harness) -> None:
    rec = harness.record
    rec.register("joined")
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            rec.beat()

    t = threading.Thread(target=beat)
    t.start()
    rec.set_state("left", "test")
    time.sleep(0.2)
    stop.set()
    t.join()
    assert harness.client.hget(harness.keys.node("n1"), "state") == b"left"


def test_notices_are_deduplicated_by_the_events_own_id(harness: Harness) -> None:
    """Two different events of one source are two notices; one event polled again is one.
    A second recommendation does not move the time the node became at risk."""
    now = time.time()
    first = Notice("aws-imds:rebalance", NoticeKind.REBALANCE, None, now, id="2026-11-22T14:40:00Z")
    harness.handler.submit(first)
    harness.handler.submit(first)
    wait_for(lambda: harness.events().count("notice") == 1)
    since = harness.client.hget(harness.keys.node("n1"), "at_risk_since")
    assert since is not None
    other = Notice(
        "aws-imds:rebalance", NoticeKind.REBALANCE, None, now + 1, id="2026-11-22T14:45:00Z"
    )
    harness.handler.submit(other)
    harness.handler.submit(other)
    wait_for(lambda: harness.events().count("notice") == 2)
    time.sleep(0.2)
    assert harness.events().count("notice") == 2
    assert harness.client.hget(harness.keys.node("n1"), "at_risk_since") == since


def test_a_cloud_reclaim_notice_marks_the_node_preempted_even_during_another_drain(
    harness: Harness,
) -> None:
    """GCE's preemption comes with the ACPI shutdown (SIGTERM): the drain may start on the
    signal, and the preempted notice that follows still marks the node, so the controller
    counts the preemption though it ends the VM before the cloud does."""
    harness.handler.submit(notice(NoticeKind.SIGTERM))
    wait_for(lambda: harness.lifecycle.state is NodeState.DRAINING)
    node = harness.keys.node("n1")
    assert harness.client.hget(node, "preempted") is None  # a stop is not a preemption
    harness.handler.submit(Notice("gcp-metadata", NoticeKind.PREEMPTED, time.time() + 30, 0.0))
    wait_for(lambda: harness.client.hget(node, "preempted") is not None)
    assert harness.client.hget(node, "preempted") == b"preempted from gcp-metadata"

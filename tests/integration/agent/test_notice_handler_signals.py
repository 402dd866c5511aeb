"""When the notice handler signals the workers, against a real Redis (issue 27): a plain
script's (``train.integration: plain``) at once, with the window less the margin and never
past torchrun's shutdown timeout; every other integration's after the request-and-wait, at
the deadline minus the margin. Each says so in the node's events (``workers-signalled``)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from spottrain.agent.lifecycle import Lifecycle
from spottrain.agent.node_record import NodeInfo, NodeRecord
from spottrain.agent.notices.handler import NoticeHandler
from spottrain.agent.notices.notice import Notice, NoticeKind
from spottrain.protocol.keys import RunKeys
from spottrain.protocol.states import NodeState

MARGIN = 1.0


class Node:
    """One node's handler, its workers played by the test (each stop is recorded)."""

    def __init__(self, client: redis.Redis, keys: RunKeys, **kw: object) -> None:
        self.client, self.keys = client, keys
        self.lifecycle = Lifecycle()
        for s in (NodeState.HEALTHY, NodeState.JOINED):
            self.lifecycle.advance(s)
        self.stops: list[tuple[float, float]] = []
        self.handler = NoticeHandler(
            client,
            keys,
            "n1",
            self.lifecycle,
            NodeRecord(client, keys, NodeInfo("n1", "local")),
            lambda timeout: self.stops.append((time.time(), timeout)),
            margin=MARGIN,
            **kw,  # type: ignore[arg-type]
        )

    def events(self) -> list[dict[str, str]]:
        return [
            {k.decode(): v.decode() for k, v in f.items()}
            for _, f in self.client.xrange(self.keys.events)
        ]


@pytest.fixture
def keys(redis_client: redis.Redis) -> Iterator[RunKeys]:
    keys = RunKeys(f"sig-{uuid.uuid4().hex[:8]}")
    yield keys
    found = list(redis_client.scan_iter(match=keys.pattern))
    if found:
        redis_client.delete(*found)


def _notice(seconds: float) -> Notice:
    now = time.time()
    return Notice("test", NoticeKind.TERMINATE, now + seconds, now)


def test_the_window_ends_the_margin_before_the_deadline_within_torchruns_timeout() -> None:
    from spottrain.agent.notices.handler import worker_window

    assert worker_window(deadline=160.0, now=100.0, margin=5.0, cap=150.0) == 55.0
    assert worker_window(deadline=400.0, now=100.0, margin=5.0, cap=150.0) == 150.0
    # Past the margin already: a second still, not a kill at once.
    assert worker_window(deadline=103.0, now=100.0, margin=5.0, cap=150.0) == 1.0


def test_a_plain_scripts_workers_are_signalled_at_once_with_the_window_less_the_margin(
    redis_client: redis.Redis, keys: RunKeys
) -> None:
    node = Node(redis_client, keys, signal_first=True, max_window=150.0)
    notice = _notice(60.0)
    node.handler.submit(notice)
    assert node.handler.done.wait(10)
    ((at, window),) = node.stops
    assert notice.deadline is not None
    assert window <= notice.deadline - MARGIN - notice.seen_at
    assert notice.deadline - at >= 30, "signalled at once, not near the deadline"
    assert window >= 30  # the whole window less the margin, not the margin alone
    events = node.events()
    types = [e["type"] for e in events]
    assert "checkpoint-requested" not in types, "nobody answers a request in a plain script"
    (signalled,) = [e for e in events if e["type"] == "workers-signalled"]
    assert float(signalled["window_s"]) == pytest.approx(window, abs=0.01)
    assert float(signalled["margin_s"]) == MARGIN
    assert json.loads(signalled["deadline"]) == pytest.approx(notice.deadline)
    assert types.index("workers-signalled") < types.index("drained")
    assert node.lifecycle.state is NodeState.LEFT


def test_a_plain_scripts_window_stops_at_torchruns_shutdown_timeout(
    redis_client: redis.Redis, keys: RunKeys
) -> None:
    node = Node(redis_client, keys, signal_first=True, max_window=20.0)
    node.handler.submit(_notice(600.0))
    assert node.handler.done.wait(10)
    ((_, window),) = node.stops
    assert window == 20.0


def test_an_sdk_jobs_workers_are_signalled_at_the_deadline_minus_the_margin(
    redis_client: redis.Redis, keys: RunKeys
) -> None:
    node = Node(redis_client, keys)  # the SDK, as today
    notice = _notice(2.5)
    node.handler.submit(notice)
    assert node.handler.done.wait(15)
    ((at, window),) = node.stops
    assert notice.deadline is not None
    # Nobody committed: the wait ends at the margin, and the workers get what is left.
    assert at >= notice.deadline - MARGIN
    assert window <= MARGIN
    events = node.events()
    types = [e["type"] for e in events]
    assert types.index("checkpoint-requested") < types.index("checkpoint-missed")
    signals = [e for e in events if e["type"] == "workers-signalled"]
    assert len(signals) == 1, "the node's events must say when the workers were signalled"
    signalled = signals[0]
    assert signalled["why"] == "no checkpoint by the margin"
    assert float(signalled["window_s"]) == pytest.approx(window, abs=0.01)


def test_a_plain_scripts_rebalance_asks_for_no_early_checkpoint(
    redis_client: redis.Redis, keys: RunKeys
) -> None:
    node = Node(redis_client, keys, signal_first=True, max_window=150.0)
    now = time.time()
    node.handler.submit(Notice("test", NoticeKind.REBALANCE, None, now))
    skipped = [e for e in node.events() if e["type"] == "early-checkpoint-skipped"]
    deadline = time.monotonic() + 10
    while not skipped and time.monotonic() < deadline:
        time.sleep(0.05)
        skipped = [e for e in node.events() if e["type"] == "early-checkpoint-skipped"]
    assert [e["reason"] for e in skipped] == [
        "integration plain: nothing answers a checkpoint request"
    ]
    assert not redis_client.exists(keys.ckpt_requests)
    # Still at risk, so the controller starts a replacement; the node trains on meanwhile.
    assert redis_client.hget(keys.node("n1"), "at_risk") is not None
    assert node.lifecycle.state is NodeState.JOINED and not node.stops

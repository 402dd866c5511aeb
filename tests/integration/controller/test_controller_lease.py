"""The controller's lease and its Redis: renewal is one compare-and-extend, a controller that
loses the lease mid-pass makes no further cloud call, and a Redis that goes away and comes
back under a running controller loop is retried and reported, not fatal (up to a limit)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from spec_samples import LOCAL, spec_with

from spottrain.cloud.base import Instance, LaunchRequest
from spottrain.cloud.local.compute import LocalProvider
from spottrain.cloud.local.settings import LocalSettings
from spottrain.controller.reconcile.controller import Controller, policy_from_spec
from spottrain.controller.reconcile.drive import ControllerError, RedisOutage, drive_passes
from spottrain.controller.reconcile.state import LeaseLost, RunState
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys
from spottrain.spec import parse_spec

SLEEP_BOOT = '{"argv": ["sleep", "600"]}'


class CountingCloud:
    """The local cloud, with its launch and terminate calls counted (and a hook run after
    each launch)."""

    def __init__(self, inner: LocalProvider, after_launch: Callable[[], None] = lambda: None):
        self.inner = inner
        self.after_launch = after_launch
        self.launches: list[str] = []
        self.terminations: list[str] = []

    def offers(self, query: Any) -> Any:
        return self.inner.offers(query)

    def list(self, job: str) -> list[Instance]:
        return self.inner.list(job)

    def launch(self, request: LaunchRequest) -> Instance:
        inst = self.inner.launch(request)
        self.launches.append(request.node)
        self.after_launch()
        return inst

    def terminate(self, instance_ids: Sequence[str]) -> None:
        self.terminations.extend(instance_ids)
        self.inner.terminate(instance_ids)

    def console_output(self, instance_id: str) -> str:
        return self.inner.console_output(instance_id)


@pytest.fixture
def cloud(tmp_path: Path) -> Iterator[LocalProvider]:
    p = LocalProvider(LocalSettings(tmp_path / "cloud", zones={"local-a": 8}, notice_s=2))
    yield p
    for rec in p.store.all():
        if rec["state"] != "terminated":
            p.preempt(rec["id"], notice=False)


def _controller(provider: Any, client: redis.Redis, keys: RunKeys, nodes: int) -> Controller:
    data = spec_with(LOCAL, "nodes", {"min": 1, "max": nodes, "gpus": 0})
    data = spec_with(data, "budget", {"max_usd": 1000})
    spec = parse_spec(yaml.safe_dump(data)).spec
    return Controller(
        spec=spec,
        run_id=keys.run_id,
        providers={"local": provider},
        state=RunState(client, keys),
        boot=lambda node, offer: SLEEP_BOOT,
        policy=policy_from_spec(spec),
        interval_s=0.1,
        owner="ctl-mine",
    )


def test_renewal_never_extends_a_lease_another_controller_took(
    redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    state = RunState(redis_client, run_keys)
    assert state.acquire("ctl-a", 30)
    assert state.renew("ctl-a", 60)
    assert 50_000 < redis_client.pttl(run_keys.ctl_lease) <= 60_000
    redis_client.set(run_keys.ctl_lease, "ctl-b", px=5_000)
    assert not state.renew("ctl-a", 60)
    assert not state.acquire("ctl-a", 60)
    assert state.lease_holder() == "ctl-b"
    assert redis_client.pttl(run_keys.ctl_lease) <= 5_000
    # A lease that lapsed is lost too: renewing it does not bring it back.
    redis_client.delete(run_keys.ctl_lease)
    assert not state.renew("ctl-a", 60)
    assert state.lease_holder() is None


def test_fence_stops_the_holder_once_its_lease_is_gone(
    redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    state = RunState(redis_client, run_keys)
    state.fence()  # holding no lease: nothing to check (a pass run by hand)
    assert state.acquire("ctl-a", 30)
    state.hold("ctl-a", 30)
    state.fence()
    redis_client.set(run_keys.ctl_lease, "ctl-b")
    with pytest.raises(LeaseLost, match="ctl-b"):
        state.fence()


def test_a_controller_that_loses_its_lease_mid_pass_makes_no_further_cloud_call(
    cloud: LocalProvider, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    def taken_over() -> None:
        # Another controller takes the run while this one is between two launches.
        redis_client.set(run_keys.ctl_lease, "ctl-other", px=60_000)

    counting = CountingCloud(cloud, after_launch=taken_over)
    ctl = _controller(counting, redis_client, run_keys, nodes=4)
    with pytest.raises(ControllerError, match=r"lost the lease .*\(ctl-other\)"):
        drive_passes(ctl)
    assert counting.launches == ["n0"] and counting.terminations == []
    assert len(cloud.list(run_keys.run_id)) == 1
    # The lease stays the new holder's: the old controller did not release it.
    assert redis_client.get(run_keys.ctl_lease) == b"ctl-other"


def test_each_pass_stamps_the_controller_heartbeat(
    cloud: LocalProvider, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    ctl = _controller(cloud, redis_client, run_keys, nodes=1)
    passes: list[int] = []

    def on_pass(summary: object) -> None:
        passes.append(1)
        assert redis_client.get(run_keys.ctl_alive) == b"ctl-mine"
        assert redis_client.pttl(run_keys.ctl_alive) > 0
        if len(passes) == 2:
            redis_client.set(run_keys.ctl_lease, "ctl-other")

    with pytest.raises(ControllerError, match="lost the lease"):
        drive_passes(ctl, on_pass)
    assert len(passes) == 2


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as server:
        yield server


def _wait(what: str, ok: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_the_controller_loop_rides_out_a_redis_restart_and_reports_it(
    cloud: LocalProvider, own_redis: RedisServer
) -> None:
    client = own_redis.client(socket_timeout=2)
    keys = RunKeys("outage-1")
    ctl = _controller(cloud, client, keys, nodes=1)
    lines: list[str] = []
    passes: list[float] = []
    outcome: dict[str, Any] = {}

    def drive() -> None:
        try:
            outcome["summary"] = drive_passes(
                ctl, lambda s: passes.append(time.monotonic()), on_report=lines.append
            )
        except BaseException as e:
            outcome["error"] = e

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    _wait("a first pass", lambda: len(passes) >= 1)
    own_redis.stop()
    _wait("the outage reported", lambda: any("Redis does not answer" in x for x in lines))
    assert thread.is_alive(), outcome
    before = len(passes)
    own_redis.start()
    _wait("Redis reported back", lambda: any("Redis answers again" in x for x in lines))
    _wait("passes again", lambda: len(passes) > before)
    assert thread.is_alive(), outcome
    back = [f for _, f in client.xrange(keys.events) if f[b"type"] == b"redis-back"]
    assert back and float(back[0][b"down_s"]) > 0
    # End the loop: another controller takes the run.
    client.set(keys.ctl_lease, "ctl-other")
    thread.join(30)
    assert isinstance(outcome.get("error"), ControllerError), outcome
    assert len(cloud.list(keys.run_id)) == 1  # the outage launched nothing twice


def test_the_controller_gives_up_after_the_configured_redis_outage(
    cloud: LocalProvider, own_redis: RedisServer
) -> None:
    client = own_redis.client(socket_timeout=2)
    keys = RunKeys("outage-2")
    ctl = _controller(cloud, client, keys, nodes=1)
    lines: list[str] = []

    def on_pass(summary: object) -> None:
        own_redis.stop()

    with pytest.raises(ControllerError, match=r"Redis has not answered for \d+ s.*resume"):
        drive_passes(ctl, on_pass, redis_outage_s=2.0, on_report=lines.append)
    assert any("retries for up to 2 s" in x for x in lines)


def test_redis_retries_back_off_with_jitter_up_to_a_cap_and_the_limit() -> None:
    outage = RedisOutage(limit_s=100.0)
    err = redis.ConnectionError("refused")
    waits = [outage.failed(float(t), err) for t in range(8)]
    # 1, 2, 4, 8, 16, 30, 30, 30 s at most, each at least half of that (the jitter).
    for wait, top in zip(waits, (1, 2, 4, 8, 16, 30, 30, 30), strict=True):
        assert top / 2 <= wait <= top
    assert outage.failed(95.0, err) <= 5.0  # never past the limit
    with pytest.raises(ControllerError, match="Redis has not answered for 100 s"):
        outage.failed(100.0, err)
    assert outage.answered(101.0) == 101.0 and outage.answered(102.0) is None

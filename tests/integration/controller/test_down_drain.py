"""``spottrain down`` on a launched (local cloud) fleet: it asks every node to drain through
Redis, waits up to the drain timeout for each to leave, and only then ends the VMs;
``--now`` ends them at once. The agents here are stand-ins (their records in the run's
Redis): one leaves when its drain notice reaches it, one never answers."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import yaml
from spec_samples import LOCAL, spec_with

from spottrain.agent.node_record import NodeInfo, NodeRecord
from spottrain.cloud.base import InstanceState, LaunchRequest, OfferQuery
from spottrain.cloud.local.compute import LocalProvider
from spottrain.controller.cli import main as cli
from spottrain.controller.run.create import create_run
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.controller.run.providers import build_providers
from spottrain.controller.run.records import RunInfo
from spottrain.protocol.keys import RunKeys
from spottrain.spec import load_spec

SLEEP_BOOT = '{"argv": ["sleep", "600"]}'


class StandIn:
    """A node's agent reduced to its record: joined; leaves on a drain notice if it is
    ``answering``."""

    def __init__(self, client: redis.Redis, keys: RunKeys, node: str, answering: bool) -> None:
        self.client, self.keys, self.node = client, keys, node
        self.record = NodeRecord(client, keys, NodeInfo(node_id=node, cloud="local"))
        self.record.register("joined")
        self.answering = answering
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            if self.answering and self.client.llen(self.keys.notices(self.node)):
                self.record.set_state("left", "drained")
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def run(
    tmp_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[RunInfo, LocalProvider, list[StandIn]]]:
    monkeypatch.setenv("SPOTTRAIN_HOME", str(tmp_path / "home"))
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.py").write_text("print('hi')\n")
    data = spec_with(LOCAL, "redis", {"url": redis_server.url})
    data = spec_with(data, "code", {"archive": {"path": "code"}})
    data = spec_with(data, "local", {"zones": {"local-a": {"capacity": 4}}, "notice_s": 2})
    spec_path = tmp_path / "job.yaml"
    spec_path.write_text(yaml.safe_dump(data))
    info = create_run(load_spec(spec_path))
    cloud = build_providers(info.spec(), local_state_dir=Path(info.local_state_dir))["local"]
    assert isinstance(cloud, LocalProvider)
    offer = next(o for o in cloud.offers(OfferQuery()) if o.zone == "local-a")
    client = redis_server.client()
    keys = RunKeys(info.run_id)
    agents = []
    for node, answering in (("n0", True), ("n1", False)):
        cloud.launch(LaunchRequest(f"req-{node}", info.run_id, node, offer, SLEEP_BOOT))
        agents.append(StandIn(client, keys, node, answering))
    yield info, cloud, agents
    for a in agents:
        a.close()
    for rec in cloud.store.all():
        if rec["state"] != "terminated":
            cloud.preempt(rec["id"], notice=False)
    stale = list(client.scan_iter(match=keys.pattern))
    if stale:
        client.delete(*stale)


def _events(client: redis.Redis, keys: RunKeys) -> list[dict[str, str]]:
    return [{k.decode(): v.decode() for k, v in f.items()} for _, f in client.xrange(keys.events)]


def test_down_drains_every_node_before_it_ends_the_vms(
    run: tuple[RunInfo, LocalProvider, list[StandIn]],
    redis_server: RedisServer,
    capsys: pytest.CaptureFixture[str],
) -> None:
    info, cloud, _ = run
    client, keys = redis_server.client(), RunKeys(info.run_id)
    assert cli.main(["down", info.run_id, "--drain-timeout", "3"]) == 0
    out, err = capsys.readouterr()
    assert "draining 2 node(s)" in out and "every VM is gone" in out
    # n1 never answered: the drain timeout bounded the wait, then its VM ended anyway.
    assert "n1 did not drain within 3 s" in err and "n0" not in err
    assert all(i.state is InstanceState.TERMINATED for i in cloud.list(info.run_id))
    events = _events(client, keys)
    kinds = [(e["type"], e.get("node_name", e["node"])) for e in events]
    # Each node was asked to drain, and n0 had left, before any VM was ended.
    first_end = min(i for i, (t, _) in enumerate(kinds) if t == "terminate")
    assert ("drain", "n0") in kinds[:first_end] and ("drain", "n1") in kinds[:first_end]
    left = next(i for i, e in enumerate(events) if e["type"] == "state" and e["node"] == "n0")
    assert left < first_end and events[left]["state"] == "left"
    assert sorted(n for t, n in kinds if t == "terminate") == ["n0", "n1"]


def test_down_asks_no_drain_of_an_agent_that_stopped_beating(
    run: tuple[RunInfo, LocalProvider, list[StandIn]],
    redis_server: RedisServer,
    capsys: pytest.CaptureFixture[str],
) -> None:
    info, cloud, _ = run
    client, keys = redis_server.client(), RunKeys(info.run_id)
    client.delete(keys.heartbeat("n1"))  # n1's agent is dead: nobody would answer
    assert cli.main(["down", info.run_id, "--drain-timeout", "600"]) == 0
    out, err = capsys.readouterr()
    assert "draining 1 node(s)" in out and "did not drain" not in err
    assert [e["node_name"] for e in _events(client, keys) if e["type"] == "drain"] == ["n0"]
    assert all(i.state is InstanceState.TERMINATED for i in cloud.list(info.run_id))


def test_down_now_ends_the_vms_without_a_drain(
    run: tuple[RunInfo, LocalProvider, list[StandIn]],
    redis_server: RedisServer,
    capsys: pytest.CaptureFixture[str],
) -> None:
    info, cloud, _ = run
    client, keys = redis_server.client(), RunKeys(info.run_id)
    assert cli.main(["down", info.run_id, "--now"]) == 0
    assert "draining" not in capsys.readouterr().out
    assert all(i.state is InstanceState.TERMINATED for i in cloud.list(info.run_id))
    assert client.llen(keys.notices("n0")) == 0 and client.llen(keys.notices("n1")) == 0
    assert not [e for e in _events(client, keys) if e["type"] == "drain"]


def test_down_refuses_a_negative_drain_timeout(
    run: tuple[RunInfo, LocalProvider, list[StandIn]], capsys: pytest.CaptureFixture[str]
) -> None:
    info, cloud, _ = run
    assert cli.main(["down", info.run_id, "--drain-timeout", "-1"]) == 2
    assert "--drain-timeout -1: give seconds >= 0" in capsys.readouterr().err
    assert all(i.state.alive for i in cloud.list(info.run_id))


def test_down_deletes_a_gcp_vm_that_stopped_itself(no_egress: None) -> None:
    """A GCP VM that shut itself down (its dead man's switch) is stopped, not deleted, and
    its disks are billed until it is: `down` deletes it too."""
    from harnesses.gcp import GcpHarness

    from spottrain.controller.reconcile.execute import end_run_vms

    h = GcpHarness()
    try:
        offer = next(o for o in h.provider.offers(h.query()) if o.market.value == "spot")
        inst = h.provider.launch(LaunchRequest("r-1", "job-a", "n0", offer, "#!/bin/bash\n"))
        h.fake.stop(inst.id)  # the guest's `shutdown -h now`
        [listed] = h.provider.list("job-a")
        assert listed.state is InstanceState.TERMINATED
        assert end_run_vms("job-a", {"gcp": h.provider}, None, 30) == []
        assert h.fake.instances() == []
    finally:
        h.close()

"""The command line on a Terraform fleet: `spottrain up` adopts the group (its controller a
background process reaching moto with an IAM key, as on a controller VM), `spottrain scale`
grows it by its desired capacity, `spottrain status` shows its VMs, and `spottrain down` drains
every node and removes each VM by name, leaving the group at size 0.

The agents are stood in for by their records in the run's Redis: each registers when its VM
is in service and leaves when the controller's drain notice reaches it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import yaml
from harnesses.asg import AsgFleet
from harnesses.aws import AwsHarness
from spec_samples import FLEET_AWS, spec_with

from spottrain.agent.node_record import NodeInfo, NodeRecord
from spottrain.controller.cli import main as cli
from spottrain.controller.reconcile.state import RunState
from spottrain.controller.reconcile.summary import summarize
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys

pytestmark = pytest.mark.slow


class FakeAgents:
    """An agent per in-service VM: registers as joined; leaves on a drain notice."""

    def __init__(self, fleet: AsgFleet, client: redis.Redis, keys: RunKeys) -> None:
        self.fleet, self.client, self.keys = fleet, client, keys
        self.records: dict[str, NodeRecord] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FakeAgents:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(0.3):
            for iid in self.fleet.in_service():
                if iid not in self.records:
                    rec = NodeRecord(
                        self.client,
                        self.keys,
                        NodeInfo(node_id=iid, cloud="aws"),
                        heartbeat_ttl=600,
                    )
                    rec.register("joined")
                    self.records[iid] = rec
            for iid, rec in self.records.items():
                if rec.state != "left" and self.client.llen(self.keys.notices(iid)):
                    rec.set_state("left", "drained")


def wait(what: str, ok: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.3)


@pytest.fixture
def fleet(run_id: str) -> Iterator[AsgFleet]:
    aws = AwsHarness()
    f = AsgFleet(aws, run_id, size=2, max_size=4)
    yield f
    f.close()
    aws.close()


@pytest.fixture
def run_id() -> str:
    return f"fleet-{int(time.time() * 1000) % 10**9}"


def test_up_scale_status_down_on_a_terraform_fleet(
    fleet: AsgFleet,
    run_id: str,
    redis_server: RedisServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for k, v in fleet.process_env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("SPOTTRAIN_HOME", str(tmp_path / "home"))
    data = spec_with(FLEET_AWS, "fleet.run_id", run_id)
    data = spec_with(data, "fleet.group", fleet.name)
    data = spec_with(data, "fleet.lifecycle_hook", fleet.hook_name)
    data = spec_with(data, "nodes", {"min": 1, "max": 4, "gpus": 8})
    data = spec_with(data, "redis", {"url": f"redis://{redis_server.endpoint}"})
    spec = tmp_path / "fleet.yaml"
    spec.write_text(yaml.safe_dump(data))
    client = redis_server.client()
    keys = RunKeys(run_id)
    with FakeAgents(fleet, client, keys):
        assert cli.main(["up", str(spec), "--detach"]) == 0
        assert f"run {run_id}" in capsys.readouterr().out
        # nodes.max is 4: the controller grows the group to 4 by its size.
        wait("the group at 4", lambda: len(fleet.in_service()) == 4 and fleet.desired == 4)
        assert cli.main(["scale", "3", run_id]) == 0
        wait("a drained VM removed", lambda: fleet.desired == 3, timeout=90)
        [gone] = fleet.terminations
        assert gone.decrement and gone.instance_id not in fleet.in_service()
        assert len(fleet.in_service()) == 3
        state = RunState(client, keys)
        wait("the removed VM ended in the ledger", lambda: len(summarize(state, 0).nodes) == 3)
        capsys.readouterr()
        assert cli.main(["status", run_id, "--json"]) == 0
        status = json.loads(capsys.readouterr().out)
        assert sorted(status["nodes"]) == fleet.in_service()
        assert cli.main(["scale", "9", run_id]) == 2
        assert "between 1 and 4 nodes" in capsys.readouterr().err
        assert cli.main(["down", run_id, "--timeout", "90"]) == 0
        assert "the group is at size 0" in capsys.readouterr().out
    assert fleet.desired == 0 and not fleet.in_service()
    assert all(t.decrement for t in fleet.terminations) and len(fleet.terminations) == 4
    # A second `up` of the same fleet says to resume instead of starting over.
    assert cli.main(["up", str(spec)]) == 1
    assert f"spottrain resume {run_id}" in capsys.readouterr().err

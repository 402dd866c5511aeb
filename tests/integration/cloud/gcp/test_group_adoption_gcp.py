"""The controller adopting a Terraform-built GCP managed instance group: the real
google-cloud-compute client against the HTTP fake of the Compute API (its MIG acts only when a
test lets it, so every in-between state is seen), with agents stood in for by their records
in a real Redis.

GCP names a member for life: a member the group recreates (after a preemption, or because the
controller replaced a broken VM) comes back under the same name, so these tests check that the
old VM's cost is kept and its agent's last state is not read as the new VM's.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
import yaml
from fakes.gce import GceFake
from google.auth.credentials import AnonymousCredentials
from spec_samples import FLEET_AWS

from spottrain.agent.node_record import NodeInfo, NodeRecord
from spottrain.cloud.gcp.group import GcpMigGroup
from spottrain.controller.groups.controller import GroupController, group_policy_from_spec
from spottrain.controller.reconcile.state import RunState
from spottrain.protocol.keys import RunKeys
from spottrain.protocol.states import LedgerStatus
from spottrain.spec import parse_spec

ZONE = "us-central1-a"
DELETE = "instanceGroupManagers.deleteInstances"
RECREATE = "instanceGroupManagers.recreateInstances"
RESIZE = "instanceGroupManagers.resize"


@pytest.fixture(autouse=True)
def _no_calls_leave_this_machine(no_egress: None) -> None:
    """No call reaches a real cloud (see the ``no_egress`` fixture)."""


@pytest.fixture
def gce() -> Iterator[GceFake]:
    fake = GceFake(auto_reconcile=False).start()
    yield fake
    fake.close()
    assert fake.internal_errors == []


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def fleet_spec(fake: GceFake, keys: RunKeys, nodes_max: int) -> dict[str, object]:
    data = {k: v for k, v in FLEET_AWS.items() if k != "fleet"}
    data["resources"] = {"clouds": ["gcp"]}
    data["nodes"] = {"min": 1, "max": nodes_max, "gpus": 8}
    data["fleet"] = {
        "managed_by": "terraform",
        "cloud": "gcp",
        "group": "fleet",
        "run_id": keys.run_id,
        "project": fake.project,
        "zone": ZONE,
    }
    return data


def controller(
    fake: GceFake, client: redis.Redis, keys: RunKeys, clock: Clock, *, size: int, nodes_max: int
) -> GroupController:
    fake.create_group(
        "fleet",
        ZONE,
        machine_type="a2-highgpu-8g",
        target_size=size,
        base_instance_name="st-fleet",
        labels={"spottrain-job": keys.run_id},
    )
    spec = parse_spec(yaml.safe_dump(fleet_spec(fake, keys, nodes_max))).spec
    group = GcpMigGroup(
        fake.project, ZONE, "fleet", api_endpoint=fake.url, credentials=AnonymousCredentials()
    )
    return GroupController(
        spec=spec,
        run_id=keys.run_id,
        group=group,
        state=RunState(client, keys),
        policy=group_policy_from_spec(spec),
        clock=clock,
    )


def settle(fake: GceFake, ctl: GroupController, count: int) -> list[str]:
    """Let the group act and its VMs boot until ``count`` members run; their names."""
    for _ in range(8):
        fake.reconcile_groups()
        running = sorted(m.id for m in ctl.group.describe().members if m.state.value == "running")
        if len(running) == count:
            return running
    raise AssertionError(f"the group never ran {count} members: {ctl.group.describe()}")


def changes(fake: GceFake) -> list[str]:
    """The calls that change the group, in order (reads left out)."""
    return [c for c in fake.group_calls("fleet") if c in (RESIZE, DELETE, RECREATE)]


def agent(client: redis.Redis, keys: RunKeys, node: str, state: str = "joined") -> NodeRecord:
    rec = NodeRecord(client, keys, NodeInfo(node_id=node, cloud="gcp"), heartbeat_ttl=600)
    rec.register(state)
    return rec


def test_adopting_grows_the_mig_by_its_target_size(
    gce: GceFake, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    clock = Clock()
    ctl = controller(gce, redis_client, run_keys, clock, size=2, nodes_max=3)
    names = settle(gce, ctl, 2)
    ctl.step()
    assert changes(gce) == [RESIZE]
    assert gce.group("fleet")["targetSize"] == 3
    assert sorted(ctl.state.ledger().records) == names
    assert len(settle(gce, ctl, 3)) == 3


def test_scaling_in_deletes_exactly_the_drained_member(
    gce: GceFake, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    clock = Clock()
    ctl = controller(gce, redis_client, run_keys, clock, size=3, nodes_max=3)
    names = settle(gce, ctl, 3)
    agents = {n: agent(redis_client, run_keys, n) for n in names}
    ctl.step()
    drained = names[2]
    agents[drained].set_state("left", "drained")
    ctl.state.set_ctl(target_nodes="2")
    clock.now += 5
    ctl.step()
    assert changes(gce) == [DELETE]
    assert gce.group("fleet")["targetSize"] == 2
    left = settle(gce, ctl, 2)
    assert left == [n for n in names if n != drained]
    clock.now += 5
    ctl.step()
    assert changes(gce) == [DELETE]
    assert ctl.state.ledger().records[drained].status == LedgerStatus.ENDED


def test_a_broken_member_is_recreated_in_place_and_its_new_vm_counted_afresh(
    gce: GceFake, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    clock = Clock()
    ctl = controller(gce, redis_client, run_keys, clock, size=2, nodes_max=2)
    names = settle(gce, ctl, 2)
    agents = {n: agent(redis_client, run_keys, n) for n in names}
    ctl.step()
    broken = names[0]
    agents[broken].set_state("failed", "health check: 7 of 8 GPUs")
    clock.now += 60
    ctl.step()
    assert changes(gce) == [RECREATE]
    assert gce.group("fleet")["targetSize"] == 2
    clock.now += 5
    ctl.step()  # the recreated VM boots; its old agent's "failed" is not read again
    assert changes(gce) == [RECREATE]
    assert settle(gce, ctl, 2) == names  # the same names: GCP names members for life
    agent(redis_client, run_keys, broken, "booting")  # the new VM's agent
    clock.now += 5
    ctl.step()
    records = ctl.state.ledger().records
    assert (
        records[broken].status == LedgerStatus.LAUNCHED and records[broken].launched_at == clock.now
    )
    [old] = [r for n, r in records.items() if n.startswith(f"{broken}@")]
    assert old.status == LedgerStatus.ENDED and old.cost(clock.now) > 0
    assert changes(gce) == [RECREATE]


def test_a_preempted_member_is_counted_and_its_return_adopted_as_a_new_vm(
    gce: GceFake, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    clock = Clock()
    ctl = controller(gce, redis_client, run_keys, clock, size=2, nodes_max=2)
    names = settle(gce, ctl, 2)
    agents = {n: agent(redis_client, run_keys, n) for n in names}
    ctl.step()
    lost = names[1]
    agents[lost].set_state("left", "drained")  # it drained on its notice, then stopped
    gce.preempt(lost)
    clock.now += 5
    ctl.step()
    records = ctl.state.ledger().records
    assert records[lost].status == LedgerStatus.ENDED and records[lost].interrupted
    assert not redis_client.exists(run_keys.node(lost))
    assert ctl.summary().preemptions == 1
    settle(gce, ctl, 2)  # the MIG recreates it under the same name
    clock.now += 5
    ctl.step()
    records = ctl.state.ledger().records
    assert records[lost].status == LedgerStatus.LAUNCHED
    assert any(n.startswith(f"{lost}@") for n in records)
    # Not mistaken for a spent node (its old agent left): nothing removed or resized.
    assert changes(gce) == []

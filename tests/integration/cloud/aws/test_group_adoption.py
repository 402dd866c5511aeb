"""The controller adopting a Terraform-built Auto Scaling group, against moto.

moto's group replaces a lost instance by itself, so a group that ends at the right size
proves nothing; these tests check the controller's own calls (which instance it removed,
with or without lowering the desired capacity, when it completed a lifecycle action) and
what moto holds afterwards. Agents are stood in for by their records in a real Redis (the
real agent completing the lifecycle action is in tests/e2e/test_asg_lifecycle.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import yaml
from harnesses.asg import AsgFleet
from harnesses.aws import AwsHarness
from spec_samples import FLEET_AWS, spec_with

from spottrain.agent.node_record import NodeInfo, NodeRecord
from spottrain.cloud.base import BadRequestError
from spottrain.cloud.base.groups import MemberState
from spottrain.controller.groups.controller import GroupController, group_policy_from_spec
from spottrain.controller.reconcile.state import RunState
from spottrain.protocol.keys import RunKeys
from spottrain.protocol.states import LedgerStatus
from spottrain.spec import parse_spec


@pytest.fixture
def aws() -> Iterator[AwsHarness]:
    h = AwsHarness()
    yield h
    h.close()


@pytest.fixture
def fleet(aws: AwsHarness, run_keys: RunKeys) -> Iterator[AsgFleet]:
    f = AsgFleet(aws, run_keys.run_id, size=3, max_size=6)
    yield f
    f.close()


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def controller(
    fleet: AsgFleet, client: redis.Redis, keys: RunKeys, clock: Clock, nodes_max: int = 3
) -> GroupController:
    data = spec_with(FLEET_AWS, "fleet.run_id", keys.run_id)
    data = spec_with(data, "fleet.group", fleet.name)
    data = spec_with(data, "nodes", {"min": 1, "max": nodes_max, "gpus": 8})
    spec = parse_spec(yaml.safe_dump(data)).spec
    return GroupController(
        spec=spec,
        run_id=keys.run_id,
        group=fleet.group(),
        state=RunState(client, keys),
        policy=group_policy_from_spec(spec),
        clock=clock,
        region=fleet.aws.region,
    )


def agent(client: redis.Redis, keys: RunKeys, node: str, state: str = "joined") -> NodeRecord:
    """An agent's record and a fresh heartbeat, as `spottrain-agent run` writes them."""
    rec = NodeRecord(client, keys, NodeInfo(node_id=node, cloud="aws"), heartbeat_ttl=600)
    rec.register(state)
    return rec


def all_joined(fleet: AsgFleet, client: redis.Redis, keys: RunKeys) -> dict[str, NodeRecord]:
    return {i: agent(client, keys, i) for i in fleet.in_service()}


def event_types(client: redis.Redis, keys: RunKeys) -> list[dict[str, str]]:
    return [{k.decode(): v.decode() for k, v in f.items()} for _, f in client.xrange(keys.events)]


def test_adopts_the_groups_vms_into_the_ledger_by_their_job_tag(
    fleet: AsgFleet, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    ctl = controller(fleet, redis_client, run_keys, Clock())
    ctl.step()
    ledger = ctl.state.ledger()
    assert sorted(ledger.records) == fleet.in_service()
    rec = next(iter(ledger.records.values()))
    assert rec.status == LedgerStatus.LAUNCHED and rec.offer.instance_type == "p4d.24xlarge"
    assert rec.offer.market.value == "spot" and rec.offer.price_per_hour > 0
    adopted = [e for e in event_types(redis_client, run_keys) if e["type"] == "adopted"]
    assert len(adopted) == 3
    assert ctl.summary().nodes == dict.fromkeys(fleet.in_service(), "launching")


def test_raising_the_jobs_node_count_sets_the_desired_capacity(
    fleet: AsgFleet, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    ctl = controller(fleet, redis_client, run_keys, Clock(), nodes_max=5)
    all_joined(fleet, redis_client, run_keys)
    ctl.state.set_ctl(target_nodes="3")
    ctl.step()
    assert fleet.desired == 3 and not fleet.aws.calls_of("SetDesiredCapacity")
    ctl.state.set_ctl(target_nodes="5")
    ctl.step()
    assert fleet.desired == 5
    assert len(fleet.in_service()) == 5
    # Above nodes.max the job's count is clamped: the group never grows past it.
    ctl.state.set_ctl(target_nodes="9")
    ctl.step()
    assert fleet.desired == 5
    assert not fleet.terminations


def test_scaling_in_removes_exactly_the_drained_instance_and_no_other(
    fleet: AsgFleet, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    clock = Clock()
    ctl = controller(fleet, redis_client, run_keys, clock)
    agents = all_joined(fleet, redis_client, run_keys)
    ctl.step()
    members = fleet.in_service()
    drained = members[1]
    agents[drained].set_state("left", "drained")  # left after a notice of its own
    ctl.state.set_ctl(target_nodes="2")
    clock.now += 5
    ctl.step()
    assert [(t.instance_id, t.decrement) for t in fleet.terminations] == [(drained, True)]
    assert fleet.desired == 2
    # Its agent has left, so nobody else completes the hook: the controller released it.
    assert [c.instance_id for c in fleet.completions] == [drained]
    assert fleet.in_service() == sorted(m for m in members if m != drained)
    assert fleet.ec2_state(drained) == "terminated"
    clock.now += 5
    ctl.step()  # nothing more: the group holds what the job wants
    assert len(fleet.terminations) == 1 and fleet.desired == 2
    rec = ctl.state.ledger().records[drained]
    assert rec.status == LedgerStatus.ENDED and not rec.interrupted and rec.reason == "removed"


def test_scaling_in_drains_the_victim_first_and_removes_it_only_once_it_left(
    fleet: AsgFleet, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    clock = Clock()
    ctl = controller(fleet, redis_client, run_keys, clock)
    agents = all_joined(fleet, redis_client, run_keys)
    ctl.step()
    ctl.state.set_ctl(target_nodes="2")
    clock.now += 5
    ctl.step()
    notices = {m: redis_client.llen(run_keys.notices(m)) for m in agents}
    asked = [m for m, n in notices.items() if n]
    assert len(asked) == 1, notices
    victim = asked[0]
    assert not fleet.terminations and fleet.desired == 3
    agents[victim].set_state("draining")
    clock.now += 5
    ctl.step()
    assert not fleet.terminations, "removed while its checkpoint was still being written"
    agents[victim].set_state("left", "drained")
    clock.now += 5
    ctl.step()
    assert [(t.instance_id, t.decrement) for t in fleet.terminations] == [(victim, True)]
    assert fleet.desired == 2 and victim not in fleet.in_service()


def test_a_restarted_controller_keeps_the_victim_it_chose(
    fleet: AsgFleet, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    clock = Clock()
    ctl = controller(fleet, redis_client, run_keys, clock)
    agents = all_joined(fleet, redis_client, run_keys)
    ctl.step()
    ctl.state.set_ctl(target_nodes="2")
    ctl.step()
    victim = next(m for m in agents if redis_client.llen(run_keys.notices(m)))
    again = controller(fleet, redis_client, run_keys, clock)
    agents[victim].set_state("left")
    clock.now += 5
    again.step()
    assert [t.instance_id for t in fleet.terminations] == [victim]


def test_a_spent_node_the_job_still_wants_is_replaced_keeping_the_size(
    fleet: AsgFleet, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    clock = Clock()
    ctl = controller(fleet, redis_client, run_keys, clock)
    agents = all_joined(fleet, redis_client, run_keys)
    ctl.step()
    broken = fleet.in_service()[0]
    agents[broken].set_state("failed", "health check: 7 of 8 GPUs")
    clock.now += 5
    ctl.step()
    assert [(t.instance_id, t.decrement) for t in fleet.terminations] == [(broken, False)]
    assert [c.instance_id for c in fleet.completions] == [broken]
    assert fleet.desired == 3
    assert len(fleet.in_service()) == 3 and broken not in fleet.in_service()


def test_a_held_vm_whose_agent_still_drains_is_left_for_the_agent_to_release(
    fleet: AsgFleet, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    clock = Clock()
    ctl = controller(fleet, redis_client, run_keys, clock)
    agents = all_joined(fleet, redis_client, run_keys)
    ctl.step()
    # The group itself started removing a VM (a capacity rebalance, an operator).
    member = fleet.in_service()[2]
    fleet.client.terminate_instance_in_auto_scaling_group(
        InstanceId=member, ShouldDecrementDesiredCapacity=False
    )
    agents[member].set_state("draining")
    clock.now += 5
    ctl.step()
    assert fleet.held == [member] and not fleet.completions
    view = ctl.group.describe()
    assert next(m for m in view.members if m.id == member).state is MemberState.LEAVING
    agents[member].set_state("left", "drained")
    clock.now += 5
    ctl.step()
    assert [c.instance_id for c in fleet.completions] == [member]
    assert len(fleet.in_service()) == 3


def test_a_preempted_vm_is_counted_and_its_replacement_adopted(
    fleet: AsgFleet, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    clock = Clock()
    ctl = controller(fleet, redis_client, run_keys, clock)
    all_joined(fleet, redis_client, run_keys)
    ctl.step()
    lost = fleet.in_service()[0]
    fleet.interrupt(lost)  # EC2 takes it back; the group launches another
    clock.now += 5
    ctl.step()
    records = ctl.state.ledger().records
    assert records[lost].status == LedgerStatus.ENDED and records[lost].interrupted
    assert len([r for r in records.values() if r.status == LedgerStatus.LAUNCHED]) == 3
    assert ctl.summary().preemptions == 1
    assert not fleet.terminations


def test_a_finished_run_empties_the_group_by_name_and_is_done(
    fleet: AsgFleet, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    clock = Clock()
    ctl = controller(fleet, redis_client, run_keys, clock)
    agents = all_joined(fleet, redis_client, run_keys)
    ctl.step()
    redis_client.hset(run_keys.progress, mapping={"finished": "1", "final_step": "100"})
    for rec in agents.values():
        rec.set_state("left", "training finished")
    clock.now += 5
    ctl.step()
    assert sorted(t.instance_id for t in fleet.terminations) == sorted(agents)
    assert all(t.decrement for t in fleet.terminations)
    assert fleet.desired == 0 and not fleet.in_service()
    assert ctl.done()


def test_the_budget_stops_the_run_with_a_checkpoint(
    fleet: AsgFleet, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    clock = Clock()
    ctl = controller(fleet, redis_client, run_keys, clock)
    agents = all_joined(fleet, redis_client, run_keys)
    ctl.step()
    clock.now += 3600 * 72  # three p4d VMs for three days cost more than $1000
    ctl.step()
    ctl_state = ctl.state.ctl()
    assert ctl_state["stopping"].startswith("budget") and ctl_state["error"]
    assert all(redis_client.llen(run_keys.notices(m)) == 1 for m in agents)
    assert not fleet.terminations  # drains first: nobody is removed mid-checkpoint


def test_a_group_that_does_not_exist_is_named_in_the_error(
    aws: AwsHarness, run_keys: RunKeys
) -> None:
    f = AsgFleet(aws, run_keys.run_id, size=1)
    try:
        from spottrain.cloud.aws.group import AwsAsgGroup

        g = AwsAsgGroup(
            aws.region,
            "spottrain-typo",
            run_keys.run_id,
            session=f.new_session(),
            endpoint_url=aws.endpoint_url,
        )
        with pytest.raises(BadRequestError, match="no Auto Scaling group 'spottrain-typo'") as e:
            g.describe()
        assert "spottrain_fleet.group" in str(e.value)
    finally:
        f.close()


def test_a_group_of_another_job_is_refused(aws: AwsHarness, run_keys: RunKeys) -> None:
    f = AsgFleet(aws, "other-job-1", size=1)
    try:
        from spottrain.cloud.aws.group import AwsAsgGroup

        g = AwsAsgGroup(
            aws.region,
            f.name,
            run_keys.run_id,
            session=f.new_session(),
            endpoint_url=aws.endpoint_url,
        )
        with pytest.raises(BadRequestError, match="holds VMs of another job"):
            g.describe()
    finally:
        f.close()


def test_growing_past_the_groups_max_size_says_which_variable_to_raise(
    fleet: AsgFleet,
) -> None:
    with pytest.raises(BadRequestError, match="max_size variable"):
        fleet.group().set_target(7)


def test_validate_check_clouds_describes_the_fleets_group(
    fleet: AsgFleet,
    run_keys: RunKeys,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from spottrain.controller.cli import main as cli

    for k, v in fleet.process_env().items():
        monkeypatch.setenv(k, v)
    data = spec_with(FLEET_AWS, "fleet.run_id", run_keys.run_id)
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(spec_with(data, "fleet.group", fleet.name)))
    assert cli.main(["validate", str(spec), "--check-clouds"]) == 0
    out = capsys.readouterr().out
    assert f"fleet: the aws group {fleet.name} in us-east-1" in out
    assert f"aws: group {fleet.name}: size 3 of at most 6, 3 VMs running or starting" in out
    spec.write_text(yaml.safe_dump(spec_with(data, "fleet.group", "spottrain-typo")))
    assert cli.main(["validate", str(spec), "--check-clouds"]) == 1
    assert "no Auto Scaling group 'spottrain-typo'" in capsys.readouterr().err


def test_an_unreachable_auto_scaling_endpoint_is_a_transient_error_naming_it(
    run_keys: RunKeys,
) -> None:
    import boto3

    from spottrain.cloud.aws.group import AwsAsgGroup
    from spottrain.cloud.base import TransientError

    session = boto3.Session(
        aws_access_key_id="x", aws_secret_access_key="y", region_name="us-east-1"
    )
    g = AwsAsgGroup(
        "us-east-1", "g", run_keys.run_id, session=session, endpoint_url="http://127.0.0.1:9"
    )
    with pytest.raises(TransientError, match="could not reach Auto Scaling in us-east-1"):
        g.describe()

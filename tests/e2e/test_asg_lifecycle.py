"""A real agent on a VM of a Terraform-built Auto Scaling group: the group removes the VM, its
termination hook holds it, the instance metadata says ``Terminated``, and the agent drains and
completes the lifecycle action only after its emergency checkpoint has committed.

The agents are real ``spottrain-agent run`` processes training examples/gpt_train.py with
torchrun, each watching its own fake IMDSv2 (tests/fakes/metadata_server.py); the group is
moto's, with the hook behaviour of tests/harnesses/asg.py; the agent reaches it with boto3
through an IAM key of the harness's account, as a VM's instance profile would.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fakes.metadata_server import MetadataServer
from harnesses.asg import AsgFleet
from harnesses.aws import AwsHarness

from spottrain.controller.run.embedded_redis import RedisServer

from .agent_job import (
    RECOVER_TIMEOUT,
    START_TIMEOUT,
    assert_no_progress_lost,
    emergency_commit,
    events,
    make_job,
    wait_drained,
)

pytestmark = pytest.mark.slow


def test_the_agent_completes_the_lifecycle_action_after_its_checkpoint_commits(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    aws = AwsHarness()
    job = make_job(redis_server, tmp_path)
    fleet = AsgFleet(aws, job.run_id, size=2, max_size=2)
    client = redis_server.client()
    members = fleet.in_service()
    fakes = {m: MetadataServer().start() for m in members}
    try:
        fleet.on_hold(lambda iid: fakes[iid].set_lifecycle_state("Terminated"))
        job.extra_env.update(fleet.process_env())
        for m in members:
            job.agent_args = [
                "--cloud=aws",
                f"--metadata-endpoint={fakes[m].url}",
                "--poll-interval=0.5",
                "--zone=us-east-1a",
                f"--asg-name={fleet.name}",
                f"--asg-lifecycle-hook={fleet.hook_name}",
            ]
            job.start_node(m)
        job.wait_for_world(2, START_TIMEOUT, steps=3)
        leaving, staying = members[1], members[0]
        noticed = time.time()
        # The group removes the VM by name (an operator, a rebalance, or the controller).
        fleet.client.terminate_instance_in_auto_scaling_group(
            InstanceId=leaving, ShouldDecrementDesiredCapacity=True
        )
        assert fleet.states()[leaving] == "Terminating:Wait"
        job.wait_for_world(1, RECOVER_TIMEOUT, since=noticed, steps=3)
        wait_drained(job, leaving)
        last = emergency_commit(client, job.run_id)
        assert last["kind"] == "emergency" and last["drain"] == "1", last
        assert_no_progress_lost(job, noticed, int(last["step"]))
        [done] = fleet.completions
        assert done.instance_id == leaving and done.result == "CONTINUE"
        assert done.hook == fleet.hook_name
        assert done.at >= float(last["at"]), "the VM was let go before its checkpoint committed"
        ev = [e for e in events(client, job.run_id, leaving) if e["type"].startswith("lifecycle")]
        assert [e["type"] for e in ev] == ["lifecycle-action-completed"]
        assert int(ev[0]["committed_step"]) == int(last["step"])
        notices = [e for e in events(client, job.run_id, leaving) if e["type"] == "notice"]
        assert notices and notices[0]["source"] == "aws-imds:asg"
        # The group let the VM go and, its size lowered, launched no other.
        assert fleet.ec2_state(leaving) == "terminated"
        assert fleet.in_service() == [staying] and fleet.desired == 1
        assert not fleet.held
    finally:
        job.close(client)
        for fake in fakes.values():
            fake.close()
        fleet.close()
        aws.close()

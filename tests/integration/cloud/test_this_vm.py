""" "This VM" (cloud/this_vm/) against the fakes, one failure mode each: what it asks of its
cloud, and the one-line error naming cause and fix when it cannot. Real boto3 against moto,
plain REST against the Compute Engine fake, the metadata server fake, and a real process
playing a local VM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakes.metadata_server import MetadataServer
from harnesses.asg import AsgFleet
from harnesses.aws import INSTANCE_TYPE, REGION, AwsHarness
from harnesses.gcp import GcpHarness

from spottrain.cloud.base import LaunchRequest, Market, Offer
from spottrain.cloud.this_vm import ThisVmError, this_vm
from spottrain.cloud.this_vm.aws import AwsThisVm
from spottrain.cloud.this_vm.gcp import GcpThisVm
from spottrain.cloud.this_vm.local import LocalThisVm

MD = "/computeMetadata/v1/"


@pytest.fixture(autouse=True)
def _no_calls_leave_this_machine(no_egress: None) -> None:
    """No call reaches a real cloud (see the ``no_egress`` fixture)."""


@pytest.fixture
def md() -> Iterator[MetadataServer]:
    with MetadataServer() as server:
        yield server


@pytest.fixture
def aws() -> Iterator[AwsHarness]:
    harness = AwsHarness()
    yield harness
    harness.close()


def _aws_vm(aws: AwsHarness, md: MetadataServer) -> tuple[str, AwsThisVm]:
    offer = Offer(
        cloud="aws",
        region=REGION,
        zone=f"{REGION}a",
        instance_type=INSTANCE_TYPE,
        gpus=8,
        gpu_type="A100-40GB",
        market=Market.SPOT,
        price_per_hour=8.0,
        interruption_risk=0.1,
    )
    vm = aws.provider.launch(LaunchRequest("r-this-vm-1", "this-vm-run", "n0", offer)).id
    md.set_aws_value("/latest/meta-data/instance-id", vm)
    md.set_aws_value("/latest/meta-data/placement/region", REGION)
    return vm, AwsThisVm(
        metadata_endpoint=md.url, session=aws.new_session(), endpoint_url=aws.endpoint_url
    )


def test_an_aws_vm_reads_its_identity_from_imdsv2_and_terminates_itself(
    aws: AwsHarness, md: MetadataServer
) -> None:
    vm, this = _aws_vm(aws, md)
    assert this.identity() == (vm, REGION)
    assert this.end() == f"ec2:TerminateInstances {vm} in {REGION}"
    (call,) = aws.calls_of("TerminateInstances")
    assert call.params == {"InstanceIds": [vm]}
    state = aws.admin().describe_instances(InstanceIds=[vm])["Reservations"][0]["Instances"][0]
    assert state["State"]["Name"] == "terminated"


def test_an_aws_refusal_names_the_permission_to_grant(aws: AwsHarness, md: MetadataServer) -> None:
    vm, this = _aws_vm(aws, md)
    aws.inject_error(
        "TerminateInstances",
        "UnauthorizedOperation",
        "You are not authorized to perform this operation.",
        403,
    )
    with pytest.raises(ThisVmError) as e:
        this.end()
    assert str(e.value) == (
        f"ec2:TerminateInstances on {vm} refused (UnauthorizedOperation); grant this VM's "
        "instance profile ec2:TerminateInstances on the run's VMs (the README's \"Dead man's "
        'switch" has the policy)'
    )


def test_an_aws_vm_without_imds_says_so(md: MetadataServer) -> None:
    md.set_status("/latest/api/token", 403)
    with pytest.raises(ThisVmError, match=r"IMDSv2 at http://127\.0\.0\.1:\d+ gave no token"):
        AwsThisVm(metadata_endpoint=md.url).identity()


def test_a_vm_held_by_its_groups_hook_completes_the_action_and_goes(
    aws: AwsHarness,
) -> None:
    fleet = AsgFleet(aws, "this-vm-asg", size=2)
    try:
        held, other = fleet.in_service()
        fleet.client.terminate_instance_in_auto_scaling_group(
            InstanceId=held, ShouldDecrementDesiredCapacity=True
        )
        assert fleet.held == [held]
        this = AwsThisVm(session=fleet.new_session(), endpoint_url=aws.endpoint_url)
        assert fleet.hook_name is not None
        hook = {"group": fleet.name, "hook": fleet.hook_name, "region": REGION}
        this.complete_lifecycle_action(instance_id=held, **hook)
        assert [(c.instance_id, c.result) for c in fleet.completions] == [(held, "CONTINUE")]
        assert fleet.ec2_state(held) == "terminated"
        # No action holds the other VM: nothing left to complete is done, not an error.
        this.complete_lifecycle_action(instance_id=other, **hook)
    finally:
        fleet.close()


def _gcp_vm(gcp: GcpHarness, md: MetadataServer, *, account: bool = True) -> GcpThisVm:
    offer = Offer(
        cloud="gcp",
        region="us-central1",
        zone="us-central1-a",
        instance_type="a2-highgpu-8g",
        gpus=8,
        gpu_type="A100-40GB",
        market=Market.SPOT,
        price_per_hour=10.0,
        interruption_risk=0.1,
    )
    name = gcp.provider.launch(LaunchRequest("r-this-vm-2", "this-vm-run", "n0", offer)).id
    md.set_gcp(MD + "project/project-id", gcp.fake.project)
    md.set_gcp(MD + "instance/zone", "projects/123456789/zones/us-central1-a")
    md.set_gcp(MD + "instance/name", name)
    if account:
        token = json.dumps({"access_token": "ya29.fake", "expires_in": 3599})
        md.set_gcp(MD + "instance/service-accounts/default/token", token, json=True)
    return GcpThisVm(metadata_host=md.host, api_endpoint=f"{gcp.fake.url}/compute/v1/")


def test_a_gcp_vm_deletes_itself_by_name_in_its_own_zone_and_project(
    md: MetadataServer,
) -> None:
    gcp = GcpHarness()
    try:
        this = _gcp_vm(gcp, md)
        assert this.identity() == (gcp.fake.project, "us-central1-a", "st-r-this-vm-2")
        assert this.end() == "compute.instances.delete us-central1-a/st-r-this-vm-2"
        assert gcp.fake.instance("st-r-this-vm-2") is None
    finally:
        gcp.close()


def test_a_gcp_vm_without_a_service_account_says_so(md: MetadataServer) -> None:
    gcp = GcpHarness()
    try:
        this = _gcp_vm(gcp, md, account=False)
        with pytest.raises(ThisVmError) as e:
            this.end()
        assert str(e.value) == (
            "the metadata server answered HTTP 404 for instance/service-accounts/default/token:"
            " the VM has no service account"
        )
        assert gcp.fake.count("instances.delete") == 0
    finally:
        gcp.close()


def test_a_garbled_token_is_refused_before_any_call(md: MetadataServer) -> None:
    md.set_gcp(MD + "instance/service-accounts/default/token", "{}", json=True)
    with pytest.raises(ThisVmError, match="token answer holds no access_token"):
        GcpThisVm(metadata_host=md.host).token()


HANDLES_SIGUSR2 = """
import signal, sys, time
signal.signal(signal.SIGUSR2, lambda *_: (open(sys.argv[1], "w").close(), sys.exit(0)))
open(sys.argv[2], "w").close()
while True:
    time.sleep(1)
"""


def test_a_local_vm_is_told_to_shut_down(tmp_path: Path) -> None:
    ended, ready = tmp_path / "ended", tmp_path / "ready"
    vm = subprocess.Popen([sys.executable, "-c", HANDLES_SIGUSR2, str(ended), str(ready)])
    try:
        while not ready.exists():  # its handler is in place
            assert vm.poll() is None
            time.sleep(0.02)
        assert LocalThisVm(str(vm.pid)).end() == f"SIGUSR2 to the local VM's process {vm.pid}"
        assert vm.wait(timeout=60) == 0
        assert ended.exists()
    finally:
        vm.send_signal(signal.SIGKILL)
        vm.wait()


def test_an_unknown_cloud_is_refused() -> None:
    with pytest.raises(ValueError, match="cloud 'azure' is not one of aws, gcp, local"):
        this_vm("azure")

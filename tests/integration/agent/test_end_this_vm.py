"""The dead man's switch ends its VM for good through its cloud's API, with the VM's own
identity as a real VM has it (configured by the environment alone: the metadata server's
address, the API's, the instance profile's keys), before any power-off: an AWS VM is
terminated (from inside a container too, where `shutdown` cannot reach the host) and a GCP
VM deleted rather than stopped with its disks billed. A refused call falls back to the
power-off and says which permission to grant.

Real boto3 against moto (a group built as terraform/aws builds it, an IAM key in its
account), plain REST against the Compute Engine fake, and the metadata server fake; no call
leaves this machine.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakes.metadata_server import MetadataServer
from harnesses.asg import AsgFleet
from harnesses.aws import AwsHarness
from harnesses.gcp import GcpHarness

from spottrain.agent.orphan import end_this_vm
from spottrain.cloud.base import LaunchRequest, Market, Offer

GCP_ZONE = "us-central1-a"
MD = "/computeMetadata/v1/"


@pytest.fixture(autouse=True)
def _no_calls_leave_this_machine(no_egress: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPOTTRAIN_LOCAL_VM_PID", raising=False)


@pytest.fixture
def md() -> Iterator[MetadataServer]:
    with MetadataServer() as server:
        yield server


@pytest.fixture
def fleet() -> Iterator[AsgFleet]:
    aws = AwsHarness()
    f = AsgFleet(aws, "orphan-run", size=1, hook=False)
    yield f
    f.close()
    aws.close()


@pytest.fixture
def gcp() -> Iterator[GcpHarness]:
    h = GcpHarness()
    yield h
    h.close()


def _on_aws_vm(fleet: AsgFleet, md: MetadataServer, monkeypatch: pytest.MonkeyPatch) -> str:
    """Make this process an agent on the group's VM: IMDS names it, its keys reach moto."""
    (vm,) = fleet.in_service()
    md.set_aws_value("/latest/meta-data/instance-id", vm)
    md.set_aws_value("/latest/meta-data/placement/region", fleet.aws.region)
    for key, value in {
        **fleet.process_env(),
        "AWS_EC2_METADATA_SERVICE_ENDPOINT": md.url,
    }.items():
        monkeypatch.setenv(key, value)
    return vm


def _on_gcp_vm(gcp: GcpHarness, md: MetadataServer, monkeypatch: pytest.MonkeyPatch) -> str:
    offer = Offer(
        cloud="gcp",
        region="us-central1",
        zone=GCP_ZONE,
        instance_type="a2-highgpu-8g",
        gpus=8,
        gpu_type="A100-40GB",
        market=Market.SPOT,
        price_per_hour=10.0,
        interruption_risk=0.1,
    )
    name = gcp.provider.launch(LaunchRequest("r-orphan-1", "orphan-run", "n0", offer)).id
    md.set_gcp(MD + "project/project-id", gcp.fake.project)
    md.set_gcp(MD + "instance/zone", f"projects/123456789/zones/{GCP_ZONE}")
    md.set_gcp(MD + "instance/name", name)
    token = {"access_token": "ya29.fake", "expires_in": 3599, "token_type": "Bearer"}
    md.set_gcp(MD + "instance/service-accounts/default/token", json.dumps(token), json=True)
    monkeypatch.setenv("GCE_METADATA_HOST", md.host)
    monkeypatch.setenv("CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE", f"{gcp.fake.url}/compute/v1/")
    return name


def test_an_aws_vm_that_ends_itself_is_terminated_through_the_api(
    fleet: AsgFleet, md: MetadataServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    vm = _on_aws_vm(fleet, md, monkeypatch)
    powered_off = tmp_path / "powered-off"
    ending = end_this_vm("aws", f"touch {powered_off}")
    assert fleet.ec2_state(vm) == "terminated"
    assert not powered_off.exists()  # the power-off is only the fallback
    assert ending.how == f"ec2:TerminateInstances {vm} in {fleet.aws.region}"
    assert ending.problems == ()


def test_a_gcp_vm_that_ends_itself_is_deleted_not_stopped(
    gcp: GcpHarness, md: MetadataServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    name = _on_gcp_vm(gcp, md, monkeypatch)
    powered_off = tmp_path / "powered-off"
    ending = end_this_vm("gcp", f"touch {powered_off}")
    assert gcp.fake.instance(name) is None
    assert gcp.fake.count("instances.delete") == 1
    assert not powered_off.exists()
    assert ending.how == f"compute.instances.delete {GCP_ZONE}/{name}"


def test_a_gcp_vm_whose_account_may_not_delete_it_powers_off_and_says_what_to_grant(
    gcp: GcpHarness, md: MetadataServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    name = _on_gcp_vm(gcp, md, monkeypatch)
    gcp.fake.inject_auth_error(403)
    powered_off = tmp_path / "powered-off"
    ending = end_this_vm("gcp", f"touch {powered_off}")
    assert gcp.fake.count("instances.delete") == 1  # asked first, refused
    assert powered_off.exists()
    assert ending.how == f"power-off: touch {powered_off}"
    (problem,) = ending.problems
    assert problem.startswith(f"instances.delete on {GCP_ZONE}/{name} refused (HTTP 403: ")
    assert "grant this VM's service account compute.instances.delete on itself" in problem
    gcp.fake.clear_faults()
    assert gcp.fake.instance(name) is not None


def test_an_agent_in_a_container_asks_the_host_to_power_off_when_the_api_refuses(
    gcp: GcpHarness, md: MetadataServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An image job's agent runs in docker, where `shutdown` cannot reach the host: once the
    cloud's API refused, it creates the request file the host's path unit watches (the boot
    mounts the host's folder there) rather than running a power-off of its own."""
    _on_gcp_vm(gcp, md, monkeypatch)
    gcp.fake.inject_auth_error(403)
    request = tmp_path / "poweroff" / "request"
    request.parent.mkdir()
    ending = end_this_vm("gcp", request_file=str(request))
    assert request.exists()
    assert ending.how == f"power-off: asked the host ({request})"
    assert "grant this VM's service account" in ending.problems[0]
    gcp.fake.clear_faults()
    # Its folder gone (the boot's mount missing): said, not a power-off of the container.
    request.unlink()
    request.parent.rmdir()
    gcp.fake.inject_auth_error(403)
    failed = end_this_vm("gcp", request_file=str(request))
    assert failed.how == "" and not request.exists()
    assert f"asking the host to power off ({request})" in failed.problems[-1]

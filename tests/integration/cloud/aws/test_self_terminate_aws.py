"""An AWS VM that ends itself (the agent's dead man's switch runs `shutdown -h now`) must
terminate, not stop: a stopped VM keeps its volume billed. Every launch asks for that."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from harnesses.aws import REGION, AwsHarness

from spottrain.cloud.base import LaunchRequest, Market, Offer


@pytest.fixture
def aws() -> Iterator[AwsHarness]:
    harness = AwsHarness()
    yield harness
    harness.close()


@pytest.mark.parametrize("market", [Market.SPOT, Market.ON_DEMAND])
def test_every_launched_vm_terminates_when_its_os_shuts_down(
    aws: AwsHarness, market: Market
) -> None:
    offer = Offer(
        cloud="aws",
        region=REGION,
        zone=f"{REGION}a",
        instance_type="p4d.24xlarge",
        gpus=8,
        gpu_type="A100-40GB",
        market=market,
        price_per_hour=8.0,
        interruption_risk=0.1,
    )
    job = f"j-{uuid.uuid4().hex[:10]}"
    inst = aws.provider.launch(LaunchRequest(f"r-{uuid.uuid4().hex[:8]}", job, "n0", offer))
    reply = aws.admin().describe_instance_attribute(
        InstanceId=inst.id, Attribute="instanceInitiatedShutdownBehavior"
    )
    assert reply["InstanceInitiatedShutdownBehavior"]["Value"] == "terminate"

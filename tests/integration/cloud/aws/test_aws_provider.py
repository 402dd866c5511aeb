"""The AWS provider against moto's EC2 on 127.0.0.1: offers, launch arguments as EC2 recorded
them, idempotency across a restarted controller, list and terminate, each error class, and
the error table itself with literal botocore errors."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml
from botocore.exceptions import (
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    ParamValidationError,
    ReadTimeoutError,
)
from harnesses.aws import AwsHarness, client_error
from spec_samples import VALID, spec_with

from spottrain.catalog import Catalog
from spottrain.cloud.aws import AwsProvider, AwsSettings
from spottrain.cloud.aws.errors import classify_error
from spottrain.cloud.aws.launch import placement_group_name
from spottrain.cloud.base import (
    TAG_JOB,
    TAG_NODE,
    TAG_REQUEST,
    AuthError,
    BadRequestError,
    CapacityError,
    InstanceState,
    LaunchRequest,
    Market,
    Offer,
    OfferQuery,
    Provider,
    ProviderError,
    QuotaError,
    TransientError,
)
from spottrain.controller.run.providers import Endpoints, build_provider
from spottrain.spec import parse_spec

P4D = "p4d.24xlarge"
REGION = "us-east-1"
MOTO_SPOT_PRICE = 0.00001  # moto's price history has this one price for everything
P4D_ON_DEMAND = 21.96
P4D_TABLE_SPOT = round(21.96 * 0.40, 4)


@pytest.fixture(scope="module")
def shared() -> Iterator[AwsHarness]:
    harness = AwsHarness()
    yield harness
    harness.close()


@pytest.fixture
def aws(shared: AwsHarness) -> Iterator[AwsHarness]:
    """The module's harness with no faults, a fresh provider and an empty call record."""
    shared.clear_faults()
    shared.provider = shared.new_provider()
    shared.forget_calls()
    yield shared
    shared.clear_faults()


@pytest.fixture
def job() -> str:
    return f"j-{uuid.uuid4().hex[:10]}"


def offer(
    zone: str = "us-east-1a", market: Market = Market.SPOT, instance_type: str = P4D, **kw: Any
) -> Offer:
    fields: dict[str, Any] = {
        "cloud": "aws",
        "region": REGION,
        "zone": zone,
        "instance_type": instance_type,
        "gpus": 8,
        "gpu_type": "A100-40GB",
        "market": market,
        "price_per_hour": 8.0,
        "interruption_risk": 0.1,
        "network": "efa",
        **kw,
    }
    return Offer(**fields)


def request(job: str, node: str = "n0", rid: str | None = None, **kw: Any) -> LaunchRequest:
    return LaunchRequest(
        request_id=rid or f"r-{uuid.uuid4().hex[:12]}",
        job=job,
        node=node,
        offer=kw.pop("offer", None) or offer(),
        **kw,
    )


def described(aws: AwsHarness, instance_id: str) -> dict[str, Any]:
    reply = aws.admin().describe_instances(InstanceIds=[instance_id])
    raw: dict[str, Any] = reply["Reservations"][0]["Instances"][0]
    return raw


def catalog_with(change: dict[str, Any]) -> Catalog:
    data = json.loads(resources.files("spottrain").joinpath("data/catalog.json").read_text())
    data["aws"]["instance_types"][P4D].update(change)
    return Catalog(data, "test")


# --- offers ---------------------------------------------------------------------------------


def test_the_harness_provider_satisfies_the_provider_interface(aws: AwsHarness) -> None:
    assert isinstance(aws.provider, Provider)
    assert aws.provider.cloud == "aws"


def test_offers_list_every_zone_ec2_offers_the_type_in_both_markets(aws: AwsHarness) -> None:
    offers = aws.provider.offers(aws.query())

    zones = ["us-east-1a", "us-east-1b", "us-east-1c", "us-east-1d"]
    assert sorted({o.zone for o in offers}) == zones
    assert sorted((o.zone, o.market.value) for o in offers) == sorted(
        (z, m) for z in zones for m in ("spot", "on-demand")
    )
    assert all(o.gpus == 8 and o.network == "efa" and o.gpu_type == "A100-40GB" for o in offers)
    assert [o.price_per_hour for o in offers] == sorted(o.price_per_hour for o in offers)
    assert {o.interruption_risk for o in offers if o.market is Market.ON_DEMAND} == {0.0}
    assert {o.interruption_risk for o in offers if o.market is Market.SPOT} == {0.125}


def test_offers_trust_ec2s_gpu_count_and_efa_over_the_catalog(aws: AwsHarness) -> None:
    provider = aws.new_provider(catalog=catalog_with({"gpus": 4, "network": ""}))

    offers = provider.offers(aws.query())

    assert offers and all(o.gpus == 8 and o.network == "efa" for o in offers)


def test_spot_prices_come_from_the_price_history_when_the_source_is_the_api(
    aws: AwsHarness,
) -> None:
    offers = aws.provider.offers(aws.query())

    assert {o.price_per_hour for o in offers if o.market is Market.SPOT} == {MOTO_SPOT_PRICE}
    assert {o.price_per_hour for o in offers if o.market is Market.ON_DEMAND} == {P4D_ON_DEMAND}
    (history,) = aws.calls_of("DescribeSpotPriceHistory")
    assert history.params["ProductDescriptions"] == ["Linux/UNIX"]


def test_spot_prices_come_from_the_catalog_when_the_source_is_the_table(aws: AwsHarness) -> None:
    provider = aws.new_provider(spot_price_source="table")

    offers = provider.offers(aws.query())

    assert {o.price_per_hour for o in offers if o.market is Market.SPOT} == {P4D_TABLE_SPOT}
    assert aws.calls_of("DescribeSpotPriceHistory") == []


def test_offers_ask_only_the_regions_the_query_allows(aws: AwsHarness) -> None:
    image = aws.settings.image_ids[REGION]
    provider = aws.new_provider(
        regions=["us-east-1", "us-west-2"], image_ids={REGION: image, "us-west-2": image}
    )

    offers = provider.offers(OfferQuery(regions=("us-west-2",), instance_types=(P4D,)))

    assert offers and {o.region for o in offers} == {"us-west-2"}
    assert {c.region for c in aws.calls} == {"us-west-2"}


def test_offers_above_the_querys_max_price_are_left_out(aws: AwsHarness) -> None:
    provider = aws.new_provider(spot_price_source="table")

    offers = provider.offers(OfferQuery(instance_types=(P4D,), max_price_per_hour=10.0))

    assert offers and {o.market for o in offers} == {Market.SPOT}


def test_spot_offers_above_the_max_spot_price_setting_are_left_out(aws: AwsHarness) -> None:
    provider = aws.new_provider(spot_price_source="table", max_spot_price=5.0)

    offers = provider.offers(aws.query())

    assert offers and {o.market for o in offers} == {Market.ON_DEMAND}


def test_offers_are_cached_per_region_until_the_ttl_passes(aws: AwsHarness) -> None:
    now = [1000.0]
    provider = aws.new_provider(clock=lambda: now[0], offers_ttl_s=300.0)

    first = provider.offers(aws.query())
    now[0] += 299.0
    again = provider.offers(OfferQuery(instance_types=(P4D,), markets=(Market.SPOT,)))
    assert len(aws.calls_of("DescribeInstanceTypeOfferings")) == 1
    assert again == [o for o in first if o.market is Market.SPOT]

    now[0] += 2.0
    provider.offers(aws.query())
    assert len(aws.calls_of("DescribeInstanceTypeOfferings")) == 2


# --- launch ---------------------------------------------------------------------------------


def test_launch_requires_imdsv2_with_a_hop_limit_of_two(aws: AwsHarness, job: str) -> None:
    instance = aws.provider.launch(request(job))

    options = described(aws, instance.id)["MetadataOptions"]
    assert options["HttpTokens"] == "required"
    assert options["HttpEndpoint"] == "enabled"
    assert options["HttpPutResponseHopLimit"] == 2


def test_launch_buys_spot_once_terminating_on_interruption_with_the_request_as_client_token(
    aws: AwsHarness, job: str
) -> None:
    req = request(job)

    instance = aws.provider.launch(req)

    raw = described(aws, instance.id)
    assert raw["InstanceLifecycle"] == "spot"
    assert raw["ClientToken"] == req.request_id
    assert instance.market is Market.SPOT and instance.request_id == req.request_id
    (call,) = aws.calls_of("RunInstances")
    assert call.params["InstanceMarketOptions"] == {
        "MarketType": "spot",
        "SpotOptions": {
            "SpotInstanceType": "one-time",
            "InstanceInterruptionBehavior": "terminate",
        },
    }


def test_launch_bids_the_max_spot_price_setting_when_one_is_set(aws: AwsHarness, job: str) -> None:
    aws.new_provider(max_spot_price=9.5).launch(request(job))

    (call,) = aws.calls_of("RunInstances")
    assert call.params["InstanceMarketOptions"]["SpotOptions"]["MaxPrice"] == "9.5000"


def test_launch_on_demand_sends_no_market_options(aws: AwsHarness, job: str) -> None:
    instance = aws.provider.launch(request(job, offer=offer(market=Market.ON_DEMAND)))

    assert "InstanceLifecycle" not in described(aws, instance.id)
    assert "InstanceMarketOptions" not in aws.calls_of("RunInstances")[0].params
    assert instance.market is Market.ON_DEMAND


def test_launch_tags_the_instance_and_its_volumes(aws: AwsHarness, job: str) -> None:
    req = request(job, node="node-3", tags={"team": "nlp"})

    instance = aws.provider.launch(req)

    expected = {
        TAG_JOB: job,
        TAG_NODE: "node-3",
        TAG_REQUEST: req.request_id,
        "team": "nlp",
        "Name": f"spottrain-{job}-node-3",
    }
    tags = {t["Key"]: t["Value"] for t in described(aws, instance.id)["Tags"]}
    assert tags == expected
    volumes = aws.admin().describe_volumes(
        Filters=[{"Name": "attachment.instance-id", "Values": [instance.id]}]
    )["Volumes"]
    assert volumes
    for volume in volumes:
        assert {t["Key"]: t["Value"] for t in volume["Tags"]} == expected


def test_launch_sizes_the_root_volume_and_passes_the_user_data(aws: AwsHarness, job: str) -> None:
    script = "#!/bin/bash\necho spottrain\n"
    instance = aws.new_provider(root_volume_gb=321).launch(request(job, user_data=script))

    volumes = aws.admin().describe_volumes(
        Filters=[{"Name": "attachment.instance-id", "Values": [instance.id]}]
    )["Volumes"]
    assert [v["Size"] for v in volumes] == [321]
    attribute = aws.admin().describe_instance_attribute(
        InstanceId=instance.id, Attribute="userData"
    )
    assert base64.b64decode(attribute["UserData"]["Value"]).decode() == script


def test_launch_creates_one_placement_group_per_job_and_zone_and_reuses_it(
    aws: AwsHarness, job: str
) -> None:
    aws.provider.launch(request(job, "n0"))
    aws.provider.launch(request(job, "n1"))
    # A restarted controller finds the group already there and uses it.
    aws.new_provider().launch(request(job, "n2"))
    aws.provider.launch(request(job, "n3", offer=offer(zone="us-east-1b")))

    created = [c.params["GroupName"] for c in aws.calls_of("CreatePlacementGroup")]
    assert created == [
        placement_group_name(job, "us-east-1a"),
        placement_group_name(job, "us-east-1a"),
        placement_group_name(job, "us-east-1b"),
    ]
    assert {c.params["Strategy"] for c in aws.calls_of("CreatePlacementGroup")} == {"cluster"}
    groups = [c.params["Placement"]["GroupName"] for c in aws.calls_of("RunInstances")]
    assert groups == [placement_group_name(job, "us-east-1a")] * 3 + [
        placement_group_name(job, "us-east-1b")
    ]
    assert placement_group_name(job, "us-east-1b") in aws.placement_groups


def test_launch_puts_no_placement_group_when_the_setting_is_off_or_the_type_has_no_efa(
    aws: AwsHarness, job: str
) -> None:
    aws.new_provider(placement_group=False).launch(request(job, "n0"))
    aws.provider.launch(request(job, "n1", offer=offer(network="")))

    assert aws.calls_of("CreatePlacementGroup") == []
    assert ["GroupName" in c.params["Placement"] for c in aws.calls_of("RunInstances")] == [
        False,
        False,
    ]


def test_launch_attaches_an_efa_interface_in_the_zones_subnet_when_the_type_has_efa(
    aws: AwsHarness, job: str
) -> None:
    instance = aws.provider.launch(request(job, offer=offer(zone="us-east-1c")))

    subnet = aws.settings.subnet_ids["us-east-1c"]
    (call,) = aws.calls_of("RunInstances")
    (nic,) = call.params["NetworkInterfaces"]
    assert nic["InterfaceType"] == "efa" and nic["DeviceIndex"] == 0
    assert nic["SubnetId"] == subnet
    assert nic["Groups"] == list(aws.settings.security_group_ids)
    assert "SubnetId" not in call.params and "SecurityGroupIds" not in call.params
    raw = described(aws, instance.id)
    assert raw["SubnetId"] == subnet
    assert [n["SubnetId"] for n in raw["NetworkInterfaces"]] == [subnet]


def test_launch_without_a_subnet_for_the_zone_uses_plain_networking(
    aws: AwsHarness, job: str
) -> None:
    provider = aws.new_provider(subnet_ids={})

    instance = provider.launch(request(job))

    (call,) = aws.calls_of("RunInstances")
    (nic,) = call.params["NetworkInterfaces"]
    assert "InterfaceType" not in nic and "SubnetId" not in nic
    assert "SubnetId" not in call.params and "SecurityGroupIds" not in call.params
    assert nic["Groups"] == list(aws.settings.security_group_ids)
    (recorded,) = described(aws, instance.id)["NetworkInterfaces"]
    assert [g["GroupId"] for g in recorded["Groups"]] == list(aws.settings.security_group_ids)


def root_volumes(aws: AwsHarness, instance_id: str) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = aws.admin().describe_volumes(
        Filters=[{"Name": "attachment.instance-id", "Values": [instance_id]}]
    )["Volumes"]
    return volumes


@pytest.mark.parametrize("subnets", ["the zone's subnet", "no subnet"])
def test_launch_gives_no_public_ip_by_default_even_in_a_public_subnet(
    aws: AwsHarness, job: str, subnets: str
) -> None:
    # The harness's subnets are the default VPC's, which map a public IP on launch.
    provider = aws.provider if subnets == "the zone's subnet" else aws.new_provider(subnet_ids={})
    instance = provider.launch(request(job, offer=offer(network="")))

    raw = described(aws, instance.id)
    assert "PublicIpAddress" not in raw
    assert not any(n.get("Association", {}).get("PublicIp") for n in raw["NetworkInterfaces"])
    if subnets == "the zone's subnet":
        assert raw["SubnetId"] == aws.settings.subnet_ids["us-east-1a"]
    (call,) = aws.calls_of("RunInstances")
    assert call.params["NetworkInterfaces"][0]["AssociatePublicIpAddress"] is False


def test_launch_gives_a_public_ip_when_the_setting_asks_for_one(aws: AwsHarness, job: str) -> None:
    instance = aws.new_provider(public_ip=True).launch(request(job))

    raw = described(aws, instance.id)
    assert raw["PublicIpAddress"]
    (nic,) = aws.calls_of("RunInstances")[0].params["NetworkInterfaces"]
    assert nic["AssociatePublicIpAddress"] is True and nic["InterfaceType"] == "efa"


def test_launch_encrypts_the_root_volume_by_default(aws: AwsHarness, job: str) -> None:
    instance = aws.provider.launch(request(job))

    [volume] = root_volumes(aws, instance.id)
    assert volume["Encrypted"] is True
    (call,) = aws.calls_of("RunInstances")
    [mapping] = call.params["BlockDeviceMappings"]
    assert mapping["Ebs"]["Encrypted"] is True and "KmsKeyId" not in mapping["Ebs"]


def test_launch_encrypts_the_root_volume_with_the_kms_key_given(aws: AwsHarness, job: str) -> None:
    key = "arn:aws:kms:us-east-1:123456789012:key/0b6b5f3e-8c1d-4f2a-9e7b-5d4c3b2a1f00"

    instance = aws.new_provider(root_volume_kms_key=key).launch(request(job))

    [volume] = root_volumes(aws, instance.id)
    assert volume["Encrypted"] is True and volume["KmsKeyId"] == key


def test_launch_leaves_encryption_to_the_account_when_the_setting_is_off(
    aws: AwsHarness, job: str
) -> None:
    aws.new_provider(encrypt_root_volume=False).launch(request(job))

    (call,) = aws.calls_of("RunInstances")
    [mapping] = call.params["BlockDeviceMappings"]
    assert "Encrypted" not in mapping["Ebs"] and "KmsKeyId" not in mapping["Ebs"]


def _spec_provider(aws: AwsHarness, **aws_keys: Any) -> AwsProvider:
    data = spec_with(VALID, "resources.clouds", ["aws"])
    data = spec_with(data, "resources.regions", [REGION])
    data = spec_with(data, "resources.instance_types", [P4D])
    del data["gcp"]
    data["aws"] = {
        "images": {REGION: aws.settings.image_ids[REGION]},
        "subnets": dict(aws.settings.subnet_ids),
        "security_groups": list(aws.settings.security_group_ids),
        **aws_keys,
    }
    spec = parse_spec(yaml.safe_dump(data), "job.yaml").spec
    endpoints = Endpoints(aws_session=aws.session, aws_endpoint_url=aws.endpoint_url)
    provider = build_provider(spec, "aws", endpoints=endpoints)
    assert isinstance(provider, AwsProvider)
    return provider


def test_a_spec_launches_private_vms_with_encrypted_root_volumes(aws: AwsHarness, job: str) -> None:
    instance = _spec_provider(aws).launch(request(job))

    raw = described(aws, instance.id)
    assert "PublicIpAddress" not in raw
    assert raw["SubnetId"] == aws.settings.subnet_ids["us-east-1a"]
    [volume] = root_volumes(aws, instance.id)
    assert volume["Encrypted"] is True


def test_a_spec_can_ask_for_a_public_ip_and_its_own_kms_key(aws: AwsHarness, job: str) -> None:
    key = "alias/spottrain-root"
    provider = _spec_provider(aws, public_ip=True, root_volume_kms_key=key)

    instance = provider.launch(request(job))

    assert described(aws, instance.id)["PublicIpAddress"]
    [volume] = root_volumes(aws, instance.id)
    assert volume["Encrypted"] is True and volume["KmsKeyId"] == key


def test_launch_twice_with_one_request_id_makes_one_instance(aws: AwsHarness, job: str) -> None:
    req = request(job)

    first = aws.provider.launch(req)
    second = aws.provider.launch(req)

    assert second.id == first.id
    assert len(aws.calls_of("RunInstances")) == 1
    assert [i.id for i in aws.provider.list(job)] == [first.id]


def test_launch_after_a_controller_restart_returns_the_instance_launched_before(
    aws: AwsHarness, job: str
) -> None:
    req = request(job)
    first = aws.provider.launch(req)

    again = aws.new_provider().launch(req)

    assert again.id == first.id and again.request_id == req.request_id
    assert len(aws.calls_of("RunInstances")) == 1


def test_launch_returns_the_requests_terminated_instance_instead_of_relaunching(
    aws: AwsHarness, job: str
) -> None:
    req = request(job)
    first = aws.provider.launch(req)
    aws.interrupt(first.id)

    again = aws.provider.launch(req)

    assert again.id == first.id
    assert again.state is InstanceState.TERMINATED and again.interrupted
    assert len(aws.calls_of("RunInstances")) == 1


def test_launch_of_another_clouds_offer_is_a_value_error(aws: AwsHarness, job: str) -> None:
    with pytest.raises(ValueError, match="cannot launch a 'gcp' offer"):
        aws.provider.launch(request(job, offer=offer(cloud="gcp", region="us-central1")))
    with pytest.raises(ValueError, match=r"'eu-west-1' is not in AwsSettings\.regions"):
        aws.provider.launch(request(job, offer=offer(region="eu-west-1", zone="eu-west-1a")))
    assert aws.calls == []


# --- list and terminate ---------------------------------------------------------------------


def test_list_reports_terminated_instances_and_flags_only_interruptions(
    aws: AwsHarness, job: str
) -> None:
    reclaimed = aws.provider.launch(request(job, "n0"))
    ours = aws.provider.launch(request(job, "n1"))
    alive = aws.provider.launch(request(job, "n2"))
    aws.interrupt(reclaimed.id)
    aws.provider.terminate([ours.id])

    by_node = {i.node: i for i in aws.provider.list(job)}

    assert set(by_node) == {"n0", "n1", "n2"}
    assert by_node["n0"].state is InstanceState.TERMINATED and by_node["n0"].interrupted
    assert "Server.SpotInstanceTermination" in by_node["n0"].state_reason
    assert by_node["n1"].state is InstanceState.TERMINATED and not by_node["n1"].interrupted
    assert by_node["n2"].id == alive.id and by_node["n2"].state.alive
    assert not by_node["n2"].interrupted
    n2 = by_node["n2"]
    assert (n2.cloud, n2.region, n2.zone, n2.instance_type) == ("aws", REGION, "us-east-1a", P4D)
    assert n2.address.startswith("172.31.") and n2.launched_at is not None
    assert abs(n2.launched_at - time.time()) < 600


def test_list_reads_the_market_from_the_instance_lifecycle(aws: AwsHarness, job: str) -> None:
    aws.provider.launch(request(job, "spot"))
    aws.provider.launch(request(job, "od", offer=offer(market=Market.ON_DEMAND)))

    markets = {i.node: i.market for i in aws.new_provider().list(job)}

    assert markets == {"spot": Market.SPOT, "od": Market.ON_DEMAND}


def test_list_reports_only_the_jobs_instances(aws: AwsHarness, job: str) -> None:
    mine = aws.provider.launch(request(job))
    aws.provider.launch(request(f"{job}-other"))

    assert [i.id for i in aws.provider.list(job)] == [mine.id]
    assert aws.provider.list(f"{job}-none") == []


def test_terminate_twice_and_of_unknown_ids_is_not_an_error(aws: AwsHarness, job: str) -> None:
    first = aws.provider.launch(request(job, "n0"))
    second = aws.provider.launch(request(job, "n1"))
    unknown = ["i-0123456789abcdef0", "not-an-ec2-id"]

    aws.provider.terminate([first.id, *unknown])
    aws.provider.terminate([first.id, *unknown])
    # A restarted controller does not know the region of any id, and tries each region.
    aws.new_provider().terminate([second.id, *unknown])
    aws.provider.terminate([])

    states = {i.id: i.state for i in aws.provider.list(job)}
    assert states == {first.id: InstanceState.TERMINATED, second.id: InstanceState.TERMINATED}


# --- errors from EC2 ------------------------------------------------------------------------


def test_a_stockout_is_a_capacity_error_for_that_zone_type_and_market(
    aws: AwsHarness, job: str
) -> None:
    aws.inject_capacity_error("us-east-1b", P4D)

    with pytest.raises(CapacityError) as caught:
        aws.provider.launch(request(job, offer=offer(zone="us-east-1b")))
    aws.provider.launch(request(job, offer=offer(zone="us-east-1a")))

    error = caught.value
    assert (error.zone, error.instance_type, error.market) == ("us-east-1b", P4D, Market.SPOT)
    assert error.retryable and "InsufficientInstanceCapacity" in str(error)


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        ("VcpuLimitExceeded", QuotaError),
        ("MaxSpotInstanceCountExceeded", QuotaError),
        ("SpotMaxPriceTooLow", CapacityError),
        ("Unsupported", CapacityError),
        ("UnauthorizedOperation", AuthError),
        ("InvalidParameterCombination", BadRequestError),
        # moto does not check the groups an interface names; EC2 does, with this code.
        ("InvalidGroup.NotFound", BadRequestError),
        ("RequestLimitExceeded", TransientError),
    ],
)
def test_each_ec2_refusal_of_a_launch_raises_its_typed_error(
    aws: AwsHarness, job: str, code: str, kind: type[ProviderError]
) -> None:
    aws.inject_error("RunInstances", code)

    with pytest.raises(kind, match=code):
        aws.provider.launch(request(job))


def test_revoked_credentials_are_an_auth_error_for_every_call(aws: AwsHarness, job: str) -> None:
    aws.inject_auth_error()

    with pytest.raises(AuthError, match="AWS_PROFILE"):
        aws.provider.offers(aws.query())
    with pytest.raises(AuthError):
        aws.provider.launch(request(job))
    with pytest.raises(AuthError):
        aws.provider.list(job)
    with pytest.raises(AuthError):
        aws.provider.terminate(["i-0123456789abcdef0"])


def test_missing_credentials_are_an_auth_error_that_says_how_to_fix_it(
    aws: AwsHarness, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
        "AWS_ROLE_ARN",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    provider = AwsProvider(
        aws.settings, session=boto3.Session(region_name=REGION), endpoint_url=aws.endpoint_url
    )

    with pytest.raises(AuthError) as caught:
        provider.offers(aws.query())

    message = str(caught.value)
    assert "NoCredentialsError" in message
    assert "AWS_PROFILE" in message and "AWS_ACCESS_KEY_ID" in message and "IAM role" in message


def test_a_missing_ami_is_a_bad_request_that_names_the_setting(aws: AwsHarness, job: str) -> None:
    provider = aws.new_provider(image_ids={REGION: "ami-0123456789abcdef0"})

    with pytest.raises(BadRequestError, match=r"AwsSettings.image_ids\['us-east-1'\]"):
        provider.launch(request(job))
    assert aws.calls_of("RunInstances") == []


def test_the_module_imports_without_boto3_and_the_provider_says_how_to_install_it() -> None:
    code = (
        "import sys\n"
        "sys.modules['boto3'] = None\n"
        "sys.modules['botocore'] = None\n"
        "from spottrain.cloud.aws import AwsProvider, AwsSettings\n"
        "settings = AwsSettings(regions=['us-east-1'], image_ids={'us-east-1': 'ami-12345678'})\n"
        "try:\n"
        "    AwsProvider(settings)\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "pip install 'spottrain[aws]'" in out.stdout


# --- the error table, with literal botocore errors ------------------------------------------

CAPACITY = ["InsufficientInstanceCapacity", "InsufficientCapacity", "SpotMaxPriceTooLow"]
QUOTA = ["VcpuLimitExceeded", "InstanceLimitExceeded", "MaxSpotInstanceCountExceeded"]
AUTH = [
    "AuthFailure",
    "UnauthorizedOperation",
    "InvalidClientTokenId",
    "ExpiredToken",
    "SignatureDoesNotMatch",
]
BAD = [
    "InvalidParameterValue",
    "InvalidAMIID.NotFound",
    "InvalidAMIID.Malformed",
    "InvalidParameterCombination",
    "InvalidInstanceType",
    "InvalidGroup.NotFound",
    "MissingParameter",
    "IdempotentParameterMismatch",
]
TRANSIENT = ["RequestLimitExceeded", "Throttling", "InternalError", "ServiceUnavailable"]


@pytest.mark.parametrize(
    ("code", "kind"),
    [(c, CapacityError) for c in [*CAPACITY, "Unsupported"]]
    + [(c, QuotaError) for c in QUOTA]
    + [(c, AuthError) for c in AUTH]
    + [(c, BadRequestError) for c in BAD]
    + [(c, TransientError) for c in TRANSIENT],
)
def test_classify_error_maps_each_ec2_code_to_its_typed_error(
    code: str, kind: type[ProviderError]
) -> None:
    error = classify_error(
        client_error(code, "said EC2", "RunInstances"),
        region="us-east-1",
        zone="us-east-1a",
        instance_type=P4D,
        market=Market.ON_DEMAND,
    )

    assert type(error) is kind
    assert code in str(error) and "said EC2" in str(error)
    if isinstance(error, CapacityError):
        assert (error.zone, error.instance_type, error.market) == (
            "us-east-1a",
            P4D,
            Market.ON_DEMAND,
        )
    if isinstance(error, QuotaError):
        assert error.region == "us-east-1"


def test_classify_error_sends_an_unknown_code_by_its_http_status() -> None:
    server = classify_error(client_error("Brandnew", "x", "RunInstances", 503), region="r")
    client = classify_error(client_error("Brandnew", "x", "RunInstances", 400), region="r")

    assert isinstance(server, TransientError)
    assert isinstance(client, BadRequestError) and "unrecognised EC2 error Brandnew" in str(client)


def test_classify_error_makes_a_capacity_code_without_a_zone_transient() -> None:
    error = classify_error(client_error("Unsupported", "x", "DescribeInstances"), region="r")

    assert isinstance(error, TransientError)


def test_classify_error_says_how_to_fix_credentials_and_permissions() -> None:
    missing = classify_error(NoCredentialsError(), region="us-east-1")
    denied = classify_error(
        client_error("UnauthorizedOperation", "not allowed", "RunInstances"), region="us-east-1"
    )

    assert isinstance(missing, AuthError)
    assert "AWS_PROFILE" in str(missing) and "AWS_ACCESS_KEY_ID" in str(missing)
    assert isinstance(denied, AuthError) and "ec2:RunInstances" in str(denied)


@pytest.mark.parametrize(
    "exc",
    [
        EndpointConnectionError(endpoint_url="https://ec2.us-east-1.amazonaws.com"),
        ConnectTimeoutError(endpoint_url="https://ec2.us-east-1.amazonaws.com"),
        ReadTimeoutError(endpoint_url="https://ec2.us-east-1.amazonaws.com"),
    ],
    ids=["endpoint-connection", "connect-timeout", "read-timeout"],
)
def test_classify_error_makes_network_failures_transient(exc: Exception) -> None:
    assert isinstance(classify_error(exc, region="us-east-1"), TransientError)


def test_classify_error_makes_a_parameter_validation_failure_a_bad_request() -> None:
    error = classify_error(ParamValidationError(report="MinCount is wrong"), region="us-east-1")

    assert isinstance(error, BadRequestError)


# --- settings -------------------------------------------------------------------------------

AMI = "ami-0123456789abcdef0"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"regions": "us-east-1"}, "AwsSettings.regions must be a list of region names"),
        ({"regions": []}, "AwsSettings.regions is empty"),
        ({"regions": [REGION, REGION]}, "AwsSettings.regions names a region twice"),
        ({"image_ids": {}}, "AwsSettings.image_ids has no AMI for region 'us-east-1'"),
        ({"image_ids": {REGION: "img-1"}}, r"AwsSettings.image_ids\['us-east-1'\] is 'img-1'"),
        ({"subnet_ids": {"eu-west-1a": "subnet-0123abcd"}}, "subnet_ids key 'eu-west-1a'"),
        ({"subnet_ids": {"us-east-1a": "sub-1"}}, "not a subnet id"),
        ({"security_group_ids": "sg-0123abcd"}, "security_group_ids must be a list of ids"),
        ({"security_group_ids": ["default"]}, "'default', not a security group id"),
        ({"instance_profile": "arn:aws:iam::1:role/x"}, "neither an instance profile name"),
        ({"root_volume_gb": 4}, "root_volume_gb must be a whole number of GiB from 8"),
        ({"spot_price_source": "live"}, "spot_price_source must be 'api' or 'table'"),
        ({"max_spot_price": 0}, "max_spot_price must be > 0 USD per hour, or None"),
        ({"offers_ttl_s": -1}, "offers_ttl_s must be >= 0"),
        ({"root_volume_kms_key": "my-key"}, "'my-key' is not a KMS key id"),
        (
            {"root_volume_kms_key": "alias/spottrain", "encrypt_root_volume": False},
            "root_volume_kms_key is set but encrypt_root_volume is off",
        ),
    ],
)
def test_aws_settings_refuse_bad_values_with_a_message_naming_the_field(
    changes: dict[str, Any], message: str
) -> None:
    fields: dict[str, Any] = {"regions": [REGION], "image_ids": {REGION: AMI}, **changes}

    with pytest.raises(ValueError, match=message):
        AwsSettings(**fields)


def test_aws_settings_keep_frozen_copies_of_what_they_were_given() -> None:
    regions = [REGION]
    images = {REGION: AMI}
    settings = AwsSettings(
        regions=regions,
        image_ids=images,
        subnet_ids={"us-east-1a": "subnet-0123abcd"},
        security_group_ids=["sg-0123abcd"],
        instance_profile="arn:aws:iam::123456789012:instance-profile/spottrain",
    )
    regions.append("us-west-2")
    images["us-west-2"] = AMI

    assert settings.regions == (REGION,)
    assert dict(settings.image_ids) == {REGION: AMI}
    assert settings.security_group_ids == ("sg-0123abcd",)


def test_a_region_without_catalog_prices_is_refused_when_the_provider_is_built(
    aws: AwsHarness,
) -> None:
    with pytest.raises(ValueError, match="'sa-east-1' has no prices in the catalog"):
        aws.new_provider(regions=["sa-east-1"], image_ids={"sa-east-1": AMI}, subnet_ids={})

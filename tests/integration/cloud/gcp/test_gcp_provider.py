"""The GCP provider with the real ``google-cloud-compute`` REST client against the HTTP fake of
the Compute Engine API, and the provider's error classification with literal exceptions.

Every test runs with HTTP(S)_PROXY pointing at a dead port and only 127.0.0.1 exempt, so a
call that tried to leave for Google's servers would fail at once instead of passing unseen.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import yaml
from fakes.gce import GceFake
from google.api_core import exceptions as api_exc
from google.api_core.client_options import ClientOptions
from google.auth import exceptions as auth_exc
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1
from harnesses.gcp import MACHINE_TYPE, REGION, GcpHarness
from spec_samples import VALID, spec_with

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
    ProviderError,
    QuotaError,
    TransientError,
)
from spottrain.cloud.gcp import GcpProvider, GcpSettings
from spottrain.cloud.gcp.errors import CallTarget, classify_error
from spottrain.cloud.gcp.launch import instance_name
from spottrain.cloud.gcp.settings import AUTH_HINT
from spottrain.controller.run.providers import Endpoints, build_provider
from spottrain.spec import parse_spec

ZONE_A = "us-central1-a"
ZONE_B = "us-central1-b"


@pytest.fixture(autouse=True)
def _no_calls_leave_this_machine(no_egress: None) -> None:
    """No call reaches a real cloud (see the ``no_egress`` fixture)."""


@pytest.fixture
def gcp() -> Iterator[GcpHarness]:
    h = GcpHarness()
    try:
        yield h
    finally:
        h.close()


def _offer(zone: str = ZONE_A, market: Market = Market.SPOT, itype: str = MACHINE_TYPE) -> Offer:
    return Offer(
        cloud="gcp",
        region=zone.rsplit("-", 1)[0],
        zone=zone,
        instance_type=itype,
        gpus=8,
        gpu_type="A100-40GB",
        market=market,
        price_per_hour=10.0,
        interruption_risk=0.1 if market is Market.SPOT else 0.0,
    )


def _request(
    rid: str = "r-1",
    *,
    job: str = "job-a",
    node: str = "node-0",
    offer: Offer | None = None,
    user_data: str = "#!/bin/bash\necho boot\n",
) -> LaunchRequest:
    return LaunchRequest(
        request_id=rid, job=job, node=node, offer=offer or _offer(), user_data=user_data
    )


def _client(fake: GceFake) -> compute_v1.InstancesClient:
    return compute_v1.InstancesClient(
        credentials=AnonymousCredentials(),
        client_options=ClientOptions(api_endpoint=fake.url),
        transport="rest",
    )


def _metadata(body: dict[str, Any]) -> dict[str, str]:
    return {i["key"]: i["value"] for i in body["metadata"]["items"]}


# settings


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"project": "X"}, "gcp project 'X' is not a project id"),
        ({"regions": ("us-central1-a",)}, "gcp region 'us-central1-a' is not a region name"),
        ({"regions": ("us-central1", "us-central1")}, "name a region twice"),
        ({"source_image": "ubuntu"}, "gcp source_image 'ubuntu' is not an image path"),
        ({"network": "Bad Net"}, "gcp network 'Bad Net' is not a network name"),
        (
            {"subnetwork": "regions/us-east4/subnetworks/s", "regions": ("us-central1",)},
            "lies in region us-east4, so regions must be ('us-east4',)",
        ),
        ({"service_account": "nobody"}, "gcp service_account 'nobody' is not an email"),
        ({"scopes": ("cloud-platform",)}, "gcp scope 'cloud-platform' is not an OAuth scope"),
        ({"boot_disk_gb": 5}, "gcp boot_disk_gb must be in [10, 65536], got 5"),
        ({"termination_action": "stop"}, "must be 'STOP' or 'DELETE', got 'stop'"),
        ({"max_run_duration_s": 10}, "gcp max_run_duration_s must be in [30, 10368000]"),
        ({"launch_wait_s": -1.0}, "gcp launch_wait_s must be >= 0, got -1.0"),
        ({"request_timeout_s": 0.0}, "gcp request_timeout_s must be > 0, got 0.0"),
    ],
)
def test_settings_refuse_bad_values_with_a_message_naming_them(
    kwargs: dict[str, Any], message: str
) -> None:
    args: dict[str, Any] = {"project": "my-project", **kwargs}
    with pytest.raises(ValueError, match=re.escape(message)):
        GcpSettings(**args)


def test_settings_default_to_stopping_preempted_spot_vms() -> None:
    settings = GcpSettings(project="my-project")
    assert settings.termination_action == "STOP"
    assert settings.regions == ()


def test_provider_refuses_a_region_the_catalog_does_not_price() -> None:
    with pytest.raises(ValueError, match="'mars-north1' has no prices in the catalog"):
        GcpProvider(GcpSettings(project="my-project", regions=("mars-north1",)))


def test_instance_name_is_the_request_id_when_that_is_a_valid_name() -> None:
    assert instance_name("r-1") == "st-r-1"
    assert instance_name("0abc") == "st-0abc"


@pytest.mark.parametrize("rid", ["a_b", "a-b-", "x" * 63, "a_", "9" * 61])
def test_instance_name_is_a_valid_name_for_awkward_request_ids(rid: str) -> None:
    name = instance_name(rid)
    assert re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", name), name
    assert name == instance_name(rid), "the same id always gives the same name"


def test_request_ids_that_sanitise_alike_get_different_names() -> None:
    assert instance_name("a_b") != instance_name("a-b")
    assert instance_name("x" * 63) != instance_name("x" * 62)


# offers


def test_offers_cover_the_zones_that_have_the_type_with_catalog_prices(gcp: GcpHarness) -> None:
    gcp.fake.remove_machine_type("us-central1-f", MACHINE_TYPE)
    offers = gcp.provider.offers(gcp.query())
    zones = {o.zone for o in offers}
    assert zones == {"us-central1-a", "us-central1-b", "us-central1-c"}
    assert {o.market for o in offers} == {Market.SPOT, Market.ON_DEMAND}
    spot = next(o for o in offers if o.market is Market.SPOT)
    od = next(o for o in offers if o.market is Market.ON_DEMAND)
    assert spot.price_per_hour < od.price_per_hour
    assert spot.interruption_risk > 0 and od.interruption_risk == 0
    assert [o.price_per_hour for o in offers] == sorted(o.price_per_hour for o in offers)


def test_offers_ask_the_api_once_per_machine_type_and_then_use_the_cache(
    gcp: GcpHarness,
) -> None:
    gcp.provider.offers(OfferQuery(regions=(REGION,)))
    asked = gcp.fake.count("machineTypes.aggregatedList")
    assert asked == 4, "one aggregated list per GCP machine type in the catalog"
    gcp.provider.offers(OfferQuery(regions=(REGION,)))
    assert gcp.fake.count("machineTypes.aggregatedList") == asked
    assert gcp.fake.count() == asked


def test_offers_without_zone_verification_make_no_call(gcp: GcpHarness) -> None:
    provider = GcpProvider(
        GcpSettings(project=gcp.fake.project, regions=(REGION,), verify_zones=False),
        credentials=AnonymousCredentials(),
        api_endpoint=gcp.fake.url,
    )
    offers = provider.offers(gcp.query())
    assert len({o.zone for o in offers}) == 4
    assert gcp.fake.count() == 0


def test_offers_stay_in_the_settings_regions(gcp: GcpHarness) -> None:
    offers = gcp.provider.offers(OfferQuery(regions=("us-east4", REGION)))
    assert offers and {o.region for o in offers} == {REGION}


# launch: what is sent


def test_spot_launch_sends_spot_scheduling_labels_and_startup_script(gcp: GcpHarness) -> None:
    inst = gcp.provider.launch(_request())
    body = gcp.fake.inserted[-1]
    assert body["name"] == inst.id == "st-r-1"
    assert body["machineType"] == f"zones/{ZONE_A}/machineTypes/{MACHINE_TYPE}"
    assert body["scheduling"] == {
        "provisioningModel": "SPOT",
        "instanceTerminationAction": "STOP",
        "onHostMaintenance": "TERMINATE",
        "automaticRestart": False,
    }
    assert body["labels"] == {TAG_JOB: "job-a", TAG_NODE: "node-0", TAG_REQUEST: "r-1"}
    assert _metadata(body) == {
        "startup-script": "#!/bin/bash\necho boot\n",
        TAG_JOB: "job-a",
        TAG_NODE: "node-0",
        TAG_REQUEST: "r-1",
    }
    assert "guestAccelerators" not in body, "a2 machine types come with their GPUs"
    (disk,) = body["disks"]
    assert disk["boot"] and disk["autoDelete"]
    assert disk["initializeParams"]["sourceImage"] == GcpSettings(project="p-roject").source_image
    assert disk["initializeParams"]["diskSizeGb"] == "200"
    assert body["networkInterfaces"][0]["network"] == "global/networks/default"
    assert inst.market is Market.SPOT and inst.zone == ZONE_A and inst.state.alive


def test_on_demand_launch_uses_standard_provisioning_that_restarts(gcp: GcpHarness) -> None:
    inst = gcp.provider.launch(_request(offer=_offer(market=Market.ON_DEMAND)))
    scheduling = gcp.fake.inserted[-1]["scheduling"]
    assert scheduling == {
        "provisioningModel": "STANDARD",
        "onHostMaintenance": "TERMINATE",
        "automaticRestart": True,
    }
    assert inst.market is Market.ON_DEMAND
    assert gcp.provider.list("job-a")[0].market is Market.ON_DEMAND


def test_a3_launch_asks_for_gvnic_and_max_run_duration_comes_with_an_action() -> None:
    h = GcpHarness(max_run_duration_s=3600, termination_action="DELETE")
    try:
        h.provider.launch(_request(offer=_offer(itype="a3-highgpu-8g", market=Market.ON_DEMAND)))
        body = h.fake.inserted[-1]
        assert body["networkInterfaces"][0]["nicType"] == "GVNIC"
        assert body["scheduling"]["maxRunDuration"] == {"seconds": "3600"}
        assert body["scheduling"]["instanceTerminationAction"] == "DELETE"
    finally:
        h.close()


def test_launch_gives_no_external_ip_and_no_service_account_unless_asked(gcp: GcpHarness) -> None:
    gcp.provider.launch(_request())

    body = gcp.fake.inserted[-1]
    assert "accessConfigs" not in body["networkInterfaces"][0]
    assert "serviceAccounts" not in body


def _spec_provider(gcp: GcpHarness, **gcp_keys: Any) -> GcpProvider:
    data = spec_with(VALID, "resources.clouds", ["gcp"])
    data = spec_with(data, "resources.regions", [REGION])
    data = spec_with(data, "resources.instance_types", [MACHINE_TYPE])
    data = spec_with(data, "checkpoint.copy_to", "gs://acme/ckpt")
    del data["aws"]
    data["gcp"] = {**data["gcp"], "project": gcp.fake.project, **gcp_keys}
    spec = parse_spec(yaml.safe_dump(data), "job.yaml").spec
    endpoints = Endpoints(gcp_api_endpoint=gcp.fake.url, gcp_credentials=AnonymousCredentials())
    provider = build_provider(spec, "gcp", endpoints=endpoints)
    assert isinstance(provider, GcpProvider)
    return provider


def test_a_spec_launches_private_vms_as_its_named_service_account(gcp: GcpHarness) -> None:
    _spec_provider(gcp, subnetwork="train").launch(_request())

    body = gcp.fake.inserted[-1]
    (nic,) = body["networkInterfaces"]
    assert "accessConfigs" not in nic
    assert nic["subnetwork"] == f"regions/{REGION}/subnetworks/train"
    assert body["serviceAccounts"] == [
        {
            "email": "spottrain-agent@acme-train.iam.gserviceaccount.com",
            "scopes": ["https://www.googleapis.com/auth/cloud-platform"],
        }
    ]


def test_a_spec_can_ask_for_an_external_ip_and_narrower_scopes(gcp: GcpHarness) -> None:
    scopes = ["devstorage.read_write", "https://www.googleapis.com/auth/logging.write"]
    _spec_provider(gcp, external_ip=True, scopes=scopes).launch(_request())

    body = gcp.fake.inserted[-1]
    (config,) = body["networkInterfaces"][0]["accessConfigs"]
    assert config["type"] == "ONE_TO_ONE_NAT"
    assert body["serviceAccounts"][0]["scopes"] == [
        "https://www.googleapis.com/auth/devstorage.read_write",
        "https://www.googleapis.com/auth/logging.write",
    ]


def test_subnetwork_name_is_taken_in_the_region_of_the_launch() -> None:
    h = GcpHarness(subnetwork="train", external_ip=False, service_account="")
    try:
        h.provider.launch(_request())
        body = h.fake.inserted[-1]
        nic = body["networkInterfaces"][0]
        assert nic["subnetwork"] == f"regions/{REGION}/subnetworks/train"
        assert "network" not in nic and "accessConfigs" not in nic
        assert "serviceAccounts" not in body
    finally:
        h.close()


def test_launch_of_another_clouds_offer_is_a_value_error(gcp: GcpHarness) -> None:
    aws = Offer(
        cloud="aws",
        region="us-east-1",
        zone="us-east-1a",
        instance_type="p5.48xlarge",
        gpus=8,
        gpu_type="H100",
        market=Market.SPOT,
        price_per_hour=1.0,
        interruption_risk=0.1,
    )
    with pytest.raises(ValueError, match="'aws'"):
        gcp.provider.launch(_request(offer=aws))
    assert gcp.fake.count("instances.insert") == 0


# the fake validates like the real API


def test_fake_refuses_a_gpu_vm_that_may_live_migrate(gcp: GcpHarness) -> None:
    client = _client(gcp.fake)
    body = compute_v1.Instance(
        name="bad-gpu",
        machine_type=f"zones/{ZONE_A}/machineTypes/{MACHINE_TYPE}",
        scheduling=compute_v1.Scheduling(on_host_maintenance="MIGRATE"),
        disks=[
            compute_v1.AttachedDisk(
                boot=True,
                initialize_params=compute_v1.AttachedDiskInitializeParams(
                    source_image="projects/debian-cloud/global/images/family/debian-12"
                ),
            )
        ],
        network_interfaces=[compute_v1.NetworkInterface(network="global/networks/default")],
    )
    with pytest.raises(api_exc.BadRequest, match="do not support live migration"):
        client.insert_unary(project=gcp.fake.project, zone=ZONE_A, instance_resource=body)
    body.scheduling = compute_v1.Scheduling(
        provisioning_model="SPOT", on_host_maintenance="TERMINATE", automatic_restart=True
    )
    with pytest.raises(api_exc.BadRequest, match="automaticRestart"):
        client.insert_unary(project=gcp.fake.project, zone=ZONE_A, instance_resource=body)
    body.scheduling = compute_v1.Scheduling(on_host_maintenance="TERMINATE")
    body.guest_accelerators = [
        compute_v1.AcceleratorConfig(accelerator_type="nvidia-tesla-a100", accelerator_count=8)
    ]
    with pytest.raises(api_exc.BadRequest, match="comes with its accelerators"):
        client.insert_unary(project=gcp.fake.project, zone=ZONE_A, instance_resource=body)
    body.guest_accelerators = []
    body.name = "Bad_Name"
    with pytest.raises(api_exc.BadRequest, match=r"resource\.name"):
        client.insert_unary(project=gcp.fake.project, zone=ZONE_A, instance_resource=body)
    assert gcp.fake.instances() == []


def test_fake_refuses_a_filter_it_does_not_understand(gcp: GcpHarness) -> None:
    client = _client(gcp.fake)
    request = compute_v1.AggregatedListInstancesRequest(
        project=gcp.fake.project, filter='labels.a = "x" OR labels.b = "y"'
    )
    with pytest.raises(api_exc.BadRequest, match="filter"):
        list(client.aggregated_list(request=request))


# launch: refusals


def test_stockout_reported_by_the_operation_is_a_capacity_error(gcp: GcpHarness) -> None:
    gcp.fake.inject_stockout(ZONE_A, MACHINE_TYPE, via="operation")
    with pytest.raises(CapacityError) as err:
        gcp.provider.launch(_request())
    assert (err.value.zone, err.value.instance_type, err.value.market) == (
        ZONE_A,
        MACHINE_TYPE,
        Market.SPOT,
    )
    assert "does not have enough resources" in str(err.value)
    assert gcp.fake.count("zoneOperations.wait") == 1, "the failure is only in the operation"
    assert gcp.fake.instances() == []
    assert gcp.provider.launch(_request("r-2", offer=_offer(ZONE_B))).zone == ZONE_B


def test_stockout_answered_as_http_503_is_a_capacity_error(gcp: GcpHarness) -> None:
    gcp.fake.inject_stockout(ZONE_A, MACHINE_TYPE, via="http")
    with pytest.raises(CapacityError) as err:
        gcp.provider.launch(_request(offer=_offer(market=Market.ON_DEMAND)))
    assert (err.value.zone, err.value.instance_type, err.value.market) == (
        ZONE_A,
        MACHINE_TYPE,
        Market.ON_DEMAND,
    )
    assert gcp.fake.count("instances.insert") == 1, "no retries of a refused insert"


@pytest.mark.parametrize("via", ["http", "operation"])
def test_quota_refusal_is_a_quota_error_naming_the_region(gcp: GcpHarness, via: str) -> None:
    gcp.fake.inject_quota_error(REGION, "NVIDIA_A100_GPUS", via=via)
    with pytest.raises(QuotaError) as err:
        gcp.provider.launch(_request())
    assert err.value.region == REGION
    assert "NVIDIA_A100_GPUS" in str(err.value)
    assert gcp.fake.instances() == []


def test_unauthenticated_calls_raise_an_auth_error_that_says_how_to_log_in(
    gcp: GcpHarness,
) -> None:
    gcp.fake.inject_auth_error(401)
    with pytest.raises(AuthError, match="gcloud auth application-default login"):
        gcp.provider.launch(_request())
    with pytest.raises(AuthError):
        gcp.provider.list("job-a")
    with pytest.raises(AuthError):
        gcp.provider.terminate(["st-r-1"])
    gcp.fake.inject_auth_error(403)
    with pytest.raises(AuthError, match="permission"):
        gcp.provider.list("job-a")
    gcp.fake.clear_faults()
    assert gcp.provider.list("job-a") == []


def test_missing_credentials_are_an_auth_error_on_first_use(
    gcp: GcpHarness, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    provider = GcpProvider(
        GcpSettings(project=gcp.fake.project, regions=(REGION,), verify_zones=False),
        api_endpoint=gcp.fake.url,
    )
    assert provider.offers(gcp.query()), "offers need no credentials without verification"
    with pytest.raises(AuthError, match="GOOGLE_APPLICATION_CREDENTIALS"):
        provider.list("job-a")


def test_server_errors_are_transient_and_not_retried_for_minutes(gcp: GcpHarness) -> None:
    gcp.fake.fail_next(1, 503, method="instances.aggregatedList")
    started = time.monotonic()
    with pytest.raises(TransientError) as err:
        gcp.provider.list("job-a")
    assert err.value.retryable
    assert time.monotonic() - started < 5
    assert gcp.fake.count("instances.aggregatedList") == 1
    for status in (500, 502, 504, 429):
        gcp.fake.fail_next(1, status, method="instances.insert")
        with pytest.raises(TransientError):
            gcp.provider.launch(_request())
    assert gcp.provider.list("job-a") == []
    assert gcp.provider.launch(_request()).id == "st-r-1"


def test_an_unreachable_api_is_a_transient_error() -> None:
    fake = GceFake().start()
    fake.close()  # its port is now closed
    provider = GcpProvider(
        GcpSettings(project="spottrain-test", regions=(REGION,), request_timeout_s=2.0),
        credentials=AnonymousCredentials(),
        api_endpoint=fake.url,
    )
    with pytest.raises(TransientError):
        provider.list("job-a")


def test_unknown_machine_type_or_image_is_a_bad_request(gcp: GcpHarness) -> None:
    with pytest.raises(BadRequestError, match="machineTypes/no-such-type"):
        gcp.provider.launch(_request(offer=_offer(itype="no-such-type")))
    image = GcpSettings(project="my-project").source_image
    gcp.fake.forget_image(image)
    with pytest.raises(BadRequestError, match="not found"):
        gcp.provider.launch(_request())


def test_launch_returns_a_pending_vm_when_the_operation_outlasts_the_wait() -> None:
    h = GcpHarness(launch_wait_s=0.3)
    try:
        h.fake.op_polls_until_done = 10**6
        started = time.monotonic()
        inst = h.provider.launch(_request())
        assert time.monotonic() - started < 3
        assert inst.state is InstanceState.PENDING and inst.request_id == "r-1"
        assert [i.id for i in h.provider.list("job-a")] == [inst.id]
    finally:
        h.close()


# idempotency


def test_the_same_request_id_twice_creates_one_vm_even_from_a_fresh_provider(
    gcp: GcpHarness,
) -> None:
    first = gcp.provider.launch(_request())
    again = gcp.provider.launch(_request())
    restarted = gcp.new_provider().launch(_request())
    assert first.id == again.id == restarted.id
    assert gcp.fake.count("instances.insert") == 3
    assert [b["name"] for b in gcp.fake.instances()] == ["st-r-1"]
    assert again.request_id == "r-1" and again.node == "node-0"


def test_a_name_taken_by_another_request_is_a_bad_request(gcp: GcpHarness) -> None:
    gcp.provider.launch(_request("r-1", node="node-0"))
    other = gcp.fake.instance("st-r-1")
    assert other is not None
    client = _client(gcp.fake)
    client.delete_unary(project=gcp.fake.project, zone=ZONE_A, instance="st-r-1")
    rogue = compute_v1.Instance(
        name="st-r-1",
        machine_type=f"zones/{ZONE_A}/machineTypes/{MACHINE_TYPE}",
        labels={TAG_REQUEST: "someone-else"},
        scheduling=compute_v1.Scheduling(on_host_maintenance="TERMINATE"),
        disks=[
            compute_v1.AttachedDisk(
                boot=True,
                initialize_params=compute_v1.AttachedDiskInitializeParams(
                    source_image="projects/debian-cloud/global/images/family/debian-12"
                ),
            )
        ],
        network_interfaces=[compute_v1.NetworkInterface()],
    )
    client.insert_unary(project=gcp.fake.project, zone=ZONE_A, instance_resource=rogue)
    with pytest.raises(BadRequestError, match="someone-else"):
        gcp.provider.launch(_request("r-1"))


# list


def test_list_finds_vms_by_job_label_and_excludes_other_jobs(gcp: GcpHarness) -> None:
    mine = {
        gcp.provider.launch(_request("r-1", node="node-0")).id,
        gcp.provider.launch(_request("r-2", node="node-1", offer=_offer(ZONE_B))).id,
    }
    gcp.provider.launch(_request("r-3", job="job-b"))
    listed = gcp.provider.list("job-a")
    assert {i.id for i in listed} == mine
    assert {(i.job, i.zone) for i in listed} == {("job-a", ZONE_A), ("job-a", ZONE_B)}
    assert {i.node for i in listed} == {"node-0", "node-1"}
    assert [i.id for i in gcp.provider.list("job-b")] == ["st-r-3"]
    assert gcp.provider.list("job-c") == []
    assert gcp.provider.list('x" OR name != "y') == [], "not a label value: nothing to find"


def test_list_pages_through_a_long_aggregated_list(gcp: GcpHarness) -> None:
    gcp.fake.page_size = 2
    for n in range(5):
        gcp.provider.launch(_request(f"r-{n}", node=f"node-{n}"))
    assert len(gcp.provider.list("job-a")) == 5
    assert gcp.fake.count("instances.aggregatedList") >= 3


def test_list_reports_a_booting_vm_as_pending_then_running() -> None:
    h = GcpHarness(boot_delay=0.3)
    try:
        before = time.time()
        inst = h.provider.launch(_request())
        assert inst.state is InstanceState.PENDING
        (listed,) = h.provider.list("job-a")
        assert listed.state is InstanceState.PENDING
        assert listed.launched_at is not None and abs(listed.launched_at - before) < 5
        assert listed.address.startswith("10.128.")
        time.sleep(0.35)
        h.provider.list("job-a")
        time.sleep(0.35)
        (listed,) = h.provider.list("job-a")
        assert listed.state is InstanceState.RUNNING and not listed.interrupted
    finally:
        h.close()


def test_a_preempted_vm_is_reported_as_interrupted_until_it_is_deleted(gcp: GcpHarness) -> None:
    inst = gcp.provider.launch(_request())
    gcp.provider.launch(_request("r-2", node="node-1", offer=_offer(ZONE_B)))
    assert gcp.fake.count("zoneOperations.list") == 0
    gcp.fake.preempt(inst.id)
    for provider in (gcp.provider, gcp.new_provider()):
        listed = {i.id: i for i in provider.list("job-a")}
        assert listed[inst.id].interrupted
        assert listed[inst.id].state is InstanceState.TERMINATED
        assert "preempted" in listed[inst.id].state_reason
        assert not listed["st-r-2"].interrupted
    assert gcp.fake.count("zoneOperations.list") == 2, "one zone had a stopped VM, per list"
    gcp.provider.terminate([inst.id])
    assert [i.id for i in gcp.provider.list("job-a")] == ["st-r-2"]


def test_a_vm_stopped_without_preemption_is_not_interrupted(gcp: GcpHarness) -> None:
    inst = gcp.provider.launch(_request())
    gcp.fake.stop(inst.id)
    (listed,) = gcp.provider.list("job-a")
    assert listed.state is InstanceState.TERMINATED and not listed.interrupted


def test_a_relaunched_vm_of_the_same_name_is_not_blamed_for_an_old_preemption(
    gcp: GcpHarness,
) -> None:
    inst = gcp.provider.launch(_request())
    gcp.fake.preempt(inst.id)
    gcp.provider.terminate([inst.id])
    gcp.provider.launch(_request())
    gcp.fake.stop(inst.id)
    (listed,) = gcp.provider.list("job-a")
    assert listed.state is InstanceState.TERMINATED and not listed.interrupted


def test_preemption_with_delete_action_is_reported_by_the_provider_that_saw_the_vm() -> None:
    h = GcpHarness(termination_action="DELETE")
    try:
        inst = h.provider.launch(_request())
        assert h.fake.inserted[-1]["scheduling"]["instanceTerminationAction"] == "DELETE"
        h.fake.preempt(inst.id)
        assert h.fake.instance(inst.id) is None, "the VM is gone"
        (listed,) = h.provider.list("job-a")
        assert listed.id == inst.id and listed.interrupted
        assert listed.state is InstanceState.TERMINATED and listed.node == "node-0"
        # A provider that never saw the VM has nothing to attach the operation to.
        assert h.new_provider().list("job-a") == []
        h.provider.terminate([inst.id])
        assert h.provider.list("job-a") == []
    finally:
        h.close()


# terminate


def test_terminate_is_idempotent_and_ignores_unknown_ids(gcp: GcpHarness) -> None:
    inst = gcp.provider.launch(_request())
    gcp.provider.terminate([inst.id])
    gcp.provider.terminate([inst.id, "st-nobody", "Not A Name"])
    assert gcp.fake.instances() == []
    assert gcp.provider.list("job-a") == []
    assert gcp.fake.count("instances.delete") == 1, "the first delete already removed it"


def test_a_fresh_provider_finds_the_zone_of_a_vm_to_terminate(gcp: GcpHarness) -> None:
    gcp.provider.launch(_request("r-1"))
    gcp.provider.launch(_request("r-2", node="node-1", offer=_offer(ZONE_B)))
    gcp.new_provider().terminate(["st-r-2", "st-r-1"])
    assert gcp.fake.instances() == []


def test_terminate_tries_every_vm_before_raising_the_first_refusal(gcp: GcpHarness) -> None:
    gcp.provider.launch(_request("r-1"))
    gcp.provider.launch(_request("r-2", node="node-1"))
    gcp.fake.fail_next(1, 503, method="instances.delete")
    with pytest.raises(TransientError):
        gcp.provider.terminate(["st-r-1", "st-r-2"])
    assert [b["name"] for b in gcp.fake.instances()] == ["st-r-1"]


# nothing leaves for the real API


def test_every_call_including_operation_polling_reaches_the_fake(gcp: GcpHarness) -> None:
    inst = gcp.provider.launch(_request())
    gcp.provider.offers(gcp.query())
    gcp.fake.preempt(inst.id)
    gcp.provider.list("job-a")
    gcp.provider.terminate([inst.id])
    calls = gcp.fake.calls
    assert calls["zoneOperations.wait"] == 1 and calls["zoneOperations.list"] == 1
    assert calls["instances.delete"] == 1 and calls["machineTypes.aggregatedList"] == 1
    assert set(gcp.fake.hosts) == {f"127.0.0.1:{gcp.fake.port}"}
    assert sum(gcp.fake.hosts.values()) == sum(calls.values())


def test_module_imports_without_the_client_library_and_the_provider_names_the_extra() -> None:
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.startswith("google.cloud.compute"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
from spottrain.cloud import gcp
try:
    gcp.GcpProvider(gcp.GcpSettings(project="my-project"))
except ImportError as e:
    print(e)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "pip install 'spottrain[gcp]'" in out.stdout


# classification, with literal errors


STOCK = (
    "The zone 'projects/p/zones/us-central1-a' does not have enough resources available to "
    "fulfill the request.  Try a different zone, or try again later."
)
TARGET = CallTarget(
    zone=ZONE_A, region=REGION, instance_type="a3-highgpu-8g", market=Market.ON_DEMAND
)


def _op(code: str, message: str, status: int = 0, region: str = "") -> compute_v1.Operation:
    details = []
    if region:
        details = [
            compute_v1.ErrorDetails(
                quota_info=compute_v1.QuotaExceededInfo(dimensions={"region": region})
            )
        ]
    return compute_v1.Operation(
        status="DONE",
        error=compute_v1.Error(
            errors=[compute_v1.Errors(code=code, message=message, error_details=details)]
        ),
        http_error_status_code=status,
    )


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (api_exc.ServiceUnavailable(STOCK), CapacityError),
        (
            api_exc.ServiceUnavailable("x", errors=[{"reason": "ZONE_RESOURCE_POOL_EXHAUSTED"}]),
            CapacityError,
        ),
        (_op("ZONE_RESOURCE_POOL_EXHAUSTED", STOCK, 503), CapacityError),
        (
            _op("ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS", STOCK + " '(resource type:compute)'."),
            CapacityError,
        ),
        (
            _op("UNSUPPORTED_OPERATION", "a3-highgpu-8g is not available in this zone"),
            CapacityError,
        ),
        (_op("UNSUPPORTED_OPERATION", "Disk resize is not supported"), BadRequestError),
        (
            api_exc.Forbidden(
                "Quota 'NVIDIA_H100_GPUS' exceeded.  Limit: 0.0 in region us-east4.",
                errors=[{"reason": "quotaExceeded", "domain": "usageLimits"}],
            ),
            QuotaError,
        ),
        (
            _op("QUOTA_EXCEEDED", "Quota 'CPUS' exceeded.  Limit: 24.0", region="europe-west4"),
            QuotaError,
        ),
        (
            api_exc.Forbidden("Rate Limit Exceeded", errors=[{"reason": "rateLimitExceeded"}]),
            TransientError,
        ),
        (
            api_exc.TooManyRequests("Quota exceeded for quota metric 'Queries' per minute"),
            TransientError,
        ),
        (api_exc.Unauthorized("Request had invalid authentication credentials."), AuthError),
        (
            api_exc.Forbidden(
                "Required 'compute.instances.create' permission", errors=[{"reason": "forbidden"}]
            ),
            AuthError,
        ),
        (api_exc.Forbidden("no", errors=[{"reason": "insufficientPermissions"}]), AuthError),
        (auth_exc.DefaultCredentialsError("Your default credentials were not found."), AuthError),
        (auth_exc.RefreshError("invalid_grant: Token has been expired or revoked."), AuthError),
        (auth_exc.TransportError("connection reset"), TransientError),
        (
            api_exc.BadRequest(
                "Invalid value for field 'resource.name'", errors=[{"reason": "invalid"}]
            ),
            BadRequestError,
        ),
        (
            api_exc.NotFound("The resource 'projects/x/global/images/family/y' was not found"),
            BadRequestError,
        ),
        (api_exc.Conflict("already exists", errors=[{"reason": "alreadyExists"}]), BadRequestError),
        (_op("RESOURCE_NOT_FOUND", "machine type not found", 404), BadRequestError),
        (_op("INVALID_FIELD_VALUE", "bad"), BadRequestError),
        (api_exc.BadRequest("not ready", errors=[{"reason": "resourceNotReady"}]), TransientError),
        (api_exc.InternalServerError("boom"), TransientError),
        (api_exc.BadGateway("bad gateway"), TransientError),
        (api_exc.ServiceUnavailable("Service unavailable"), TransientError),
        (api_exc.GatewayTimeout("timeout"), TransientError),
        (api_exc.DeadlineExceeded("deadline"), TransientError),
        (api_exc.RetryError("gave up", cause=None), TransientError),
        (requests.ConnectionError("refused"), TransientError),
        (requests.ReadTimeout("read timed out"), TransientError),
        (_op("INTERNAL_ERROR", "internal", 500), TransientError),
    ],
)
def test_classify_error_maps_google_errors_to_typed_errors(
    error: object, kind: type[ProviderError]
) -> None:
    classified = classify_error(error, TARGET)
    assert type(classified) is kind
    assert classified.cloud == "gcp"


def test_capacity_error_carries_the_zone_type_and_market_of_the_call() -> None:
    err = classify_error(api_exc.ServiceUnavailable(STOCK), TARGET)
    assert isinstance(err, CapacityError)
    assert (err.zone, err.instance_type, err.market) == (ZONE_A, "a3-highgpu-8g", Market.ON_DEMAND)


def test_quota_error_takes_its_region_from_the_message_or_the_details_or_the_call() -> None:
    said = classify_error(
        api_exc.Forbidden("Quota 'NVIDIA_H100_GPUS' exceeded.  Limit: 0.0 in region us-east4."),
        TARGET,
    )
    detailed = classify_error(
        _op("QUOTA_EXCEEDED", "Quota 'CPUS' exceeded.", region="asia-southeast1"), TARGET
    )
    plain = classify_error(_op("QUOTA_EXCEEDED", "Quota 'CPUS' exceeded."), TARGET)
    assert isinstance(said, QuotaError) and said.region == "us-east4"
    assert isinstance(detailed, QuotaError) and detailed.region == "asia-southeast1"
    assert isinstance(plain, QuotaError) and plain.region == REGION


def test_auth_errors_say_how_to_fix_the_credentials() -> None:
    for error in (
        api_exc.Unauthorized("Request had invalid authentication credentials."),
        auth_exc.DefaultCredentialsError("Your default credentials were not found."),
    ):
        message = str(classify_error(error, TARGET))
        assert "gcloud auth application-default login" in message
        assert "GOOGLE_APPLICATION_CREDENTIALS" in message
    assert "roles/compute.instanceAdmin.v1" in AUTH_HINT

"""A lock of any size launches on both clouds: a run of a 150-package lock (a CUDA torch stack
and a job's own requirements) ships it to its store, and its VMs' user data, which carries
only the files' sha256s, is taken by the real AWS provider through a front that refuses what
EC2 refuses (over 16384 bytes) and by the real GCP provider against the Compute Engine fake
(a metadata value over 256 KiB). What would not fit is refused by ``up`` before any launch."""

from __future__ import annotations

import base64
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml
from box.ec2_front import Ec2Front
from harnesses.aws import FAKE_CREDENTIALS, AwsHarness
from harnesses.gcp import MACHINE_TYPE, GcpHarness
from spec_samples import VALID, spec_with
from wheelhouse import lock_of

from spottrain.cloud.aws import AwsProvider
from spottrain.cloud.base import LaunchRequest, Market, Offer
from spottrain.cloud.base.provider import BadRequestError
from spottrain.controller.run.boot import USER_DATA_LIMITS
from spottrain.controller.run.code import boot_renderer
from spottrain.controller.run.create import create_run
from spottrain.controller.run.records import RunError, RunInfo
from spottrain.controller.run.wheel import self_wheel
from spottrain.envlock import parse_lock
from spottrain.spec import load_spec

AWS_OFFER = Offer(
    cloud="aws", region="us-east-1", zone="us-east-1a", instance_type="p4d.24xlarge", gpus=8,
    gpu_type="A100-40GB", market=Market.SPOT, price_per_hour=8.0, interruption_risk=0.1,
    network="efa",
)  # fmt: skip
GCP_OFFER = Offer(
    cloud="gcp", region="us-central1", zone="us-central1-a", instance_type=MACHINE_TYPE, gpus=8,
    gpu_type="A100-40GB", market=Market.SPOT, price_per_hour=8.0, interruption_risk=0.1,
)  # fmt: skip


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPOTTRAIN_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def ec2() -> Iterator[tuple[AwsHarness, AwsProvider]]:
    """The real AWS provider on moto, through the front that answers as EC2 does."""
    harness = AwsHarness()
    try:
        with Ec2Front(harness.endpoint_url, account_id=harness.account_id) as front:
            provider = AwsProvider(
                # moto has no placement groups; the harness's hooks answer them, not the front
                replace(harness.settings, placement_group=False),
                session=boto3.Session(region_name=harness.region, **FAKE_CREDENTIALS),
                endpoint_url=front.url,
            )
            yield harness, provider
            assert front.internal_errors == []
    finally:
        harness.close()


def _job(tmp_path: Path, redis_url: str, **packages: Any) -> Path:
    (tmp_path / "code").mkdir(exist_ok=True)
    (tmp_path / "store").mkdir(exist_ok=True)
    (tmp_path / "code" / "train.py").write_text("print('hi')\n")
    data = spec_with(
        VALID, "code", {"archive": {"path": "code", "store": f"file://{tmp_path}/store"}}
    )
    data = spec_with(data, "redis", {"url": redis_url})
    if packages:
        data = spec_with(data, "packages", packages)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _locks(tmp_path: Path, home: Path, n: int) -> dict[str, Path]:
    # A lock as `spottrain lock` would make it for this controller: its own wheel's sha256.
    text = lock_of(n, self_wheel(home / "wheels").sha256)
    assert len(parse_lock(text).packages) == n
    path = tmp_path / f"{n}.lock"
    path.write_text(text)
    return {"aws": path, "gcp": path}


def test_a_150_package_lock_launches_on_both_clouds(
    tmp_path: Path, home: Path, redis_server: Any, ec2: tuple[AwsHarness, AwsProvider]
) -> None:
    locks = _locks(tmp_path, home, 150)
    # With the boot around it, far over 16 KB were it carried in the user data.
    assert locks["aws"].stat().st_size > 15_000
    info = create_run(load_spec(_job(tmp_path, redis_server.url)), env_locks=locks)
    run = RunInfo.load(info.run_id)
    assert {c: r["packages"] for c, r in run.env_locks.items()} == {"aws": 150, "gcp": 150}
    render = boot_renderer(info.spec(), info)
    harness, aws = ec2
    script = render("n0", AWS_OFFER)
    assert run.boot_files["aws"]["lock"]["sha256"] in script and "torch==" not in script
    vm = aws.launch(
        LaunchRequest(f"r-{uuid.uuid4().hex[:8]}", info.run_id, "n0", AWS_OFFER, script)
    )
    sent = harness.admin().describe_instance_attribute(InstanceId=vm.id, Attribute="userData")
    assert base64.b64decode(sent["UserData"]["Value"]).decode() == script
    gcp = GcpHarness()
    try:
        script = render("n1", GCP_OFFER)
        request = LaunchRequest(f"r-{uuid.uuid4().hex[:8]}", info.run_id, "n1", GCP_OFFER, script)
        vm = gcp.provider.launch(request)
        body = gcp.fake.instance(vm.id)
        assert body is not None
        items = {i["key"]: i["value"] for i in body["metadata"]["items"]}
        assert items["startup-script"] == script
    finally:
        gcp.close()


def test_what_ec2_refuses_is_refused_by_up_before_any_launch(
    tmp_path: Path, home: Path, redis_server: Any, ec2: tuple[AwsHarness, AwsProvider]
) -> None:
    """The user data does not grow with the lock, but it does with the mirrors the spec
    names: enough of them is refused by ``up`` in one line naming the fix, where EC2 would
    refuse every launch."""
    locks = _locks(tmp_path, home, 60)
    mirrors = [f"https://mirror-{i:03d}.example.com/simple" for i in range(400)]
    job = _job(tmp_path, redis_server.url, extra_index_urls=mirrors)
    with pytest.raises(RunError) as err:
        create_run(load_spec(job), env_locks=locks)
    said = str(err.value)
    assert "\n" not in said and "over the 16384 bytes aws takes as user data" in said
    assert "packages.extra_index_urls" in said
    # EC2 itself (the front) refuses such a text, and the provider says so.
    harness, aws = ec2
    request = LaunchRequest("r-big", "run-1", "n0", AWS_OFFER, "#" * (USER_DATA_LIMITS["aws"] + 1))
    with pytest.raises(BadRequestError, match="User data is limited to 16384 bytes"):
        aws.launch(request)
    assert harness.admin().describe_instances()["Reservations"] == []

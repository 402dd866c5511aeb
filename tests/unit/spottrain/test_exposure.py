"""Unit tests of spottrain.spec.exposure: which specs leave their VMs open, and the words."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from spec_samples import VALID, spec_with

from spottrain.spec import parse_spec
from spottrain.spec.exposure import exposure_warnings

AWS_SUBNETS = {"us-east-1a": "subnet-0a1b2c3d4e5f60718"}
# The VALID spec, locked down: private subnets for its zone, own groups, its own subnetwork.
PRIVATE = spec_with(
    spec_with(
        spec_with(
            spec_with(VALID, "resources.zones", ["us-east-1a", "us-central1-a"]),
            "aws.subnets",
            AWS_SUBNETS,
        ),
        "aws.security_groups",
        ["sg-0123456789abcdef0"],
    ),
    "gcp.subnetwork",
    "train",
)


def warnings_of(data: dict[str, Any]) -> list[str]:
    return exposure_warnings(parse_spec(yaml.safe_dump(data), "job.yaml").spec)


def test_a_locked_down_spec_gives_no_warning() -> None:
    assert warnings_of(PRIVATE) == []


@pytest.mark.parametrize(
    ("path", "value", "starts"),
    [
        ("aws.public_ip", True, "aws.public_ip is true: every VM gets a public IP address"),
        ("aws.security_groups", [], "aws.security_groups is empty: VMs get their VPC's default"),
        ("aws.subnets", {}, "aws.subnets is empty: VMs land in the default VPC"),
        (
            "resources.zones",
            ["us-east-1a", "us-east-1b"],
            "aws.subnets has no subnet for the zones us-east-1b:",
        ),
        ("resources.zones", ..., "aws.subnets has no subnet for any zone of us-east-1 other"),
        ("aws.root_volume_encrypted", False, "aws.root_volume_encrypted is false"),
        ("gcp.external_ip", True, "gcp.external_ip is true: every VM gets an external IP"),
        ("gcp.subnetwork", ..., "gcp.network and gcp.subnetwork are unset: VMs land in the"),
        ("gcp.service_account", "default", "gcp.service_account is 'default'"),
    ],
)
def test_each_opening_gives_one_warning(path: str, value: Any, starts: str) -> None:
    (warning,) = warnings_of(spec_with(PRIVATE, path, value))
    assert warning.startswith(starts)


def test_the_default_account_with_the_cloud_platform_scope_says_so() -> None:
    data = spec_with(PRIVATE, "gcp.service_account", "default")
    (broad,) = warnings_of(data)
    assert "cloud-platform scope" in broad
    (narrow,) = warnings_of(spec_with(data, "gcp.scopes", ["devstorage.read_only"]))
    assert "cloud-platform" not in narrow


def test_private_vms_without_a_network_of_their_own_are_told_what_they_cannot_reach() -> None:
    (aws,) = warnings_of(spec_with(PRIVATE, "aws.subnets", {}))
    assert "cannot reach Redis outside the VPC, the package registry or S3" in aws
    (gcp,) = warnings_of(spec_with(PRIVATE, "gcp.subnetwork", ...))
    assert "Cloud NAT or Private Google Access" in gcp


def test_only_the_clouds_the_job_uses_are_checked() -> None:
    data = spec_with(spec_with(PRIVATE, "resources.clouds", ["gcp"]), "aws.public_ip", True)
    data = spec_with(data, "resources.regions", ["us-central1"])
    data = spec_with(data, "resources.zones", ["us-central1-a"])
    assert warnings_of(spec_with(data, "resources.instance_types", ["a2-highgpu-8g"])) == []


def test_a_terraform_fleet_is_left_to_its_module() -> None:
    data = spec_with(PRIVATE, "resources.clouds", ["aws"])
    data = spec_with(data, "resources.regions", ["us-east-1"])
    data = spec_with(data, "resources.zones", ...)
    data = spec_with(data, "resources.instance_types", ["p4d.24xlarge"])
    data = spec_with(data, "aws.public_ip", True)
    data["fleet"] = {
        "managed_by": "terraform",
        "cloud": "aws",
        "group": "spottrain-fleet",
        "run_id": "r-1",
        "region": "us-east-1",
    }
    assert warnings_of(data) == []

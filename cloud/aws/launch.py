"""The parameters of an EC2 ``run_instances`` call for one launch request."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from spottrain.cloud.aws.settings import AwsSettings
from spottrain.cloud.base import (
    LaunchRequest,
    Market,
    Offer,
)


def placement_group_name(job: str, zone: str) -> str:
    """The cluster placement group of one job in one zone (a group lives in one zone)."""
    return f"spottrain-{job}-{zone}"


def instance_name(request: LaunchRequest) -> str:
    """The ``Name`` tag the console shows."""
    return f"spottrain-{request.job}-{request.node}"


def tag_list(tags: Mapping[str, str]) -> list[dict[str, str]]:
    return [{"Key": k, "Value": v} for k, v in sorted(tags.items())]


def run_instances_params(
    request: LaunchRequest,
    settings: AwsSettings,
    *,
    root_device: str,
    placement_group: str = "",
) -> dict[str, Any]:
    """The ``run_instances`` arguments for one launch (pure: no call is made).

    Args:
        request: the launch; its offer must be an AWS offer in one of ``settings.regions``.
        settings: where and how to launch.
        root_device: the AMI's root device name, to size the root volume.
        placement_group: the cluster placement group to launch into, or ``""``.

    Returns:
        Keyword arguments for ``EC2.Client.run_instances``.
    """
    offer = request.offer
    tags = tag_list({**request.all_tags(), "Name": instance_name(request)})
    placement: dict[str, str] = {"AvailabilityZone": offer.zone}
    if placement_group:
        placement["GroupName"] = placement_group
    params: dict[str, Any] = {
        "ImageId": settings.image_ids[offer.region],
        "InstanceType": offer.instance_type,
        "MinCount": 1,
        "MaxCount": 1,
        "ClientToken": request.request_id,
        "Placement": placement,
        # IMDSv2 only; a hop limit of 2 lets containers on the VM reach the metadata service.
        "MetadataOptions": {
            "HttpTokens": "required",
            "HttpEndpoint": "enabled",
            "HttpPutResponseHopLimit": 2,
        },
        "BlockDeviceMappings": [{"DeviceName": root_device, "Ebs": _root_ebs(settings)}],
        "TagSpecifications": [
            {"ResourceType": "instance", "Tags": tags},
            {"ResourceType": "volume", "Tags": tags},
        ],
        # A VM that powers itself off is done: stopping would keep its volume billed and its
        # slot counted while the controller replaces it anyway.
        "InstanceInitiatedShutdownBehavior": "terminate",
    }
    if request.user_data:
        params["UserData"] = request.user_data
    if offer.market is Market.SPOT:
        spot: dict[str, Any] = {
            "SpotInstanceType": "one-time",
            "InstanceInterruptionBehavior": "terminate",
        }
        if settings.max_spot_price is not None:
            spot["MaxPrice"] = f"{settings.max_spot_price:.4f}"
        params["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": spot}
    params["NetworkInterfaces"] = [_primary_interface(settings, offer)]
    if settings.instance_profile:
        key = "Arn" if settings.instance_profile.startswith("arn:") else "Name"
        params["IamInstanceProfile"] = {key: settings.instance_profile}
    if settings.key_name:
        params["KeyName"] = settings.key_name
    return params


def _root_ebs(settings: AwsSettings) -> dict[str, Any]:
    ebs: dict[str, Any] = {
        "VolumeSize": settings.root_volume_gb,
        "VolumeType": "gp3",
        "DeleteOnTermination": True,
    }
    # Off sends nothing rather than False: EC2 refuses False for an AMI whose snapshot is
    # encrypted, and an account that encrypts by default should still do so.
    if settings.encrypt_root_volume:
        ebs["Encrypted"] = True
        if settings.root_volume_kms_key:
            ebs["KmsKeyId"] = settings.root_volume_kms_key
    return ebs


def _primary_interface(settings: AwsSettings, offer: Offer) -> dict[str, Any]:
    """The VM's one network interface, always given explicitly.

    Only an interface can say "no public IP" (``AssociatePublicIpAddress``); left out, a VM
    in a public subnet, such as any default subnet, gets one. An interface then carries the
    subnet and groups too, since EC2 refuses them at the top level beside it.
    """
    nic: dict[str, Any] = {
        "DeviceIndex": 0,
        "AssociatePublicIpAddress": settings.public_ip,
        "DeleteOnTermination": True,
    }
    subnet = settings.subnet_ids.get(offer.zone, "")
    if subnet:
        nic["SubnetId"] = subnet
        if offer.network == "efa":
            # An EFA interface needs an explicit subnet; without one, plain networking.
            nic["NetworkCardIndex"] = 0
            nic["InterfaceType"] = "efa"
    if settings.security_group_ids:
        nic["Groups"] = list(settings.security_group_ids)
    return nic

"""Where and how spottrain launches on AWS: :class:`AwsSettings`, checked on construction."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

CLOUD = "aws"
SPOT_PRICE_SOURCES = ("api", "table")
DEFAULT_OFFERS_TTL_S = 300.0


_AMI_RE = re.compile(r"^ami-[0-9a-f]{8,17}\Z")
_SUBNET_RE = re.compile(r"^subnet-[0-9a-f]{8,17}\Z")
_SG_RE = re.compile(r"^sg-[0-9a-f]{8,17}\Z")
_PROFILE_ARN_RE = re.compile(r"^arn:aws[a-z-]*:iam::\d{12}:instance-profile/[\w+=,.@/-]+\Z")
_PROFILE_NAME_RE = re.compile(r"^[\w+=,.@-]{1,128}\Z")
_ZONE_RE = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d+(-[a-z]+-\d+)?[a-z]\Z")
# What EC2 takes as a KMS key: a key id, an alias, or the ARN of either.
_KMS_KEY_RE = re.compile(
    r"^(arn:aws[a-z-]*:kms:[a-z0-9-]+:\d{12}:(key/[0-9a-f-]{36}|alias/[\w/-]+)"
    r"|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|alias/[\w/-]+)\Z"
)


@dataclass(frozen=True)
class AwsSettings:
    """Where and how spottrain launches on AWS. Every field is checked on construction.

    Attributes:
        regions: the regions to look for offers and VMs in.
        image_ids: a GPU AMI (``ami-...``) for each region in ``regions``, such as the Deep
            Learning Base AMI; AMI ids differ from region to region.
        subnet_ids: a subnet (``subnet-...``) per availability zone; zones without one use
            the zone's default subnet, and get no EFA interface.
        security_group_ids: security groups (``sg-...``) for every VM; empty means the VPC's
            default group.
        public_ip: give each VM a public IP address. Off by default: a VM with one is
            reachable from the internet wherever its security groups allow; without one it
            reaches the internet through its subnet's NAT gateway (or VPC endpoints).
        instance_profile: the IAM instance profile the VMs run as, by name or ARN; empty for
            none.
        key_name: an EC2 key pair for SSH; empty for none.
        root_volume_gb: the root volume's size in GiB (8 to 16384).
        encrypt_root_volume: encrypt the root volume (on by default; off leaves it to the
            AMI's snapshot and the account's EBS encryption-by-default setting).
        root_volume_kms_key: the KMS key (id, alias or ARN) that encrypts it; empty: the
            account's default EBS key.
        spot_price_source: ``api`` (the spot price history, with the catalog as fallback
            where it has no row) or ``table`` (the bundled catalog only).
        placement_group: put EFA types in a cluster placement group per job and zone.
        max_spot_price: the most USD per VM-hour to bid for spot; None caps at on-demand
            (EC2's default). Spot offers above it are not offered.
        offers_ttl_s: how long offers of a region are reused before EC2 is asked again.
    """

    regions: Sequence[str]
    image_ids: Mapping[str, str]
    subnet_ids: Mapping[str, str] = field(default_factory=dict)
    security_group_ids: Sequence[str] = ()
    instance_profile: str = ""
    key_name: str = ""
    root_volume_gb: int = 200
    public_ip: bool = False
    encrypt_root_volume: bool = True
    root_volume_kms_key: str = ""
    spot_price_source: str = "api"
    placement_group: bool = True
    max_spot_price: float | None = None
    offers_ttl_s: float = DEFAULT_OFFERS_TTL_S

    def __post_init__(self) -> None:
        regions, images = _checked_regions(self)
        subnets = _checked_subnets(self, regions)
        groups = _checked_security_groups(self)
        _check_identity(self)
        _check_root_volume(self)
        _check_market(self)
        # Frozen copies, so settings shared between providers cannot change under them.
        object.__setattr__(self, "regions", regions)
        object.__setattr__(self, "image_ids", MappingProxyType(images))
        object.__setattr__(self, "subnet_ids", MappingProxyType(subnets))
        object.__setattr__(self, "security_group_ids", groups)


def _checked_regions(s: AwsSettings) -> tuple[tuple[str, ...], dict[str, str]]:
    """The regions, and an AMI for each of them."""
    if isinstance(s.regions, str):
        raise ValueError(
            f"AwsSettings.regions must be a list of region names, got the string {s.regions!r}"
        )
    regions = tuple(s.regions)
    if not regions:
        raise ValueError("AwsSettings.regions is empty: name at least one, e.g. ['us-east-1']")
    if len(set(regions)) != len(regions):
        raise ValueError(f"AwsSettings.regions names a region twice: {list(regions)}")
    images = dict(s.image_ids)
    for region in regions:
        if region not in images:
            raise ValueError(
                f"AwsSettings.image_ids has no AMI for region {region!r}: give a GPU AMI "
                "id (ami-...) for every region in regions"
            )
    for region, image in images.items():
        if not _AMI_RE.match(image):
            raise ValueError(
                f"AwsSettings.image_ids[{region!r}] is {image!r}, not an AMI id "
                "(ami- and 8 to 17 hex digits)"
            )
    return regions, images


def _checked_subnets(s: AwsSettings, regions: tuple[str, ...]) -> dict[str, str]:
    """The subnet per availability zone of ``regions``."""
    subnets = dict(s.subnet_ids)
    for zone, subnet in subnets.items():
        if not _ZONE_RE.match(zone) or not any(zone.startswith(r) for r in regions):
            raise ValueError(
                f"AwsSettings.subnet_ids key {zone!r} is not an availability zone of "
                f"{', '.join(regions)} (e.g. {regions[0]}a)"
            )
        if not _SUBNET_RE.match(subnet):
            raise ValueError(
                f"AwsSettings.subnet_ids[{zone!r}] is {subnet!r}, not a subnet id "
                "(subnet- and 8 to 17 hex digits)"
            )
    return subnets


def _checked_security_groups(s: AwsSettings) -> tuple[str, ...]:
    """The security group ids."""
    if isinstance(s.security_group_ids, str):
        raise ValueError(
            "AwsSettings.security_group_ids must be a list of ids, got the string "
            f"{s.security_group_ids!r}"
        )
    groups = tuple(s.security_group_ids)
    for group in groups:
        if not _SG_RE.match(group):
            raise ValueError(
                f"AwsSettings.security_group_ids has {group!r}, not a security group id "
                "(sg- and 8 to 17 hex digits)"
            )
    return groups


def _check_identity(s: AwsSettings) -> None:
    """The instance profile and the key pair."""
    profile = s.instance_profile
    if profile and not (
        _PROFILE_ARN_RE.match(profile)
        if profile.startswith("arn:")
        else _PROFILE_NAME_RE.match(profile)
    ):
        raise ValueError(
            f"AwsSettings.instance_profile {profile!r} is neither an instance profile "
            "name nor an arn:aws:iam::ACCOUNT:instance-profile/NAME ARN"
        )
    if len(s.key_name) > 255:
        raise ValueError("AwsSettings.key_name is longer than 255 characters")


def _check_root_volume(s: AwsSettings) -> None:
    """The root volume's size and encryption."""
    if (
        isinstance(s.root_volume_gb, bool)
        or not isinstance(s.root_volume_gb, int)
        or not 8 <= s.root_volume_gb <= 16384
    ):
        raise ValueError(
            f"AwsSettings.root_volume_gb must be a whole number of GiB from 8 to 16384, "
            f"got {s.root_volume_gb!r}"
        )
    if s.root_volume_kms_key and not s.encrypt_root_volume:
        raise ValueError(
            "AwsSettings.root_volume_kms_key is set but encrypt_root_volume is off: "
            "turn encryption on or drop the key"
        )
    if s.root_volume_kms_key and not _KMS_KEY_RE.match(s.root_volume_kms_key):
        raise ValueError(
            f"AwsSettings.root_volume_kms_key {s.root_volume_kms_key!r} is not a KMS key "
            "id, alias/NAME or key or alias ARN"
        )


def _check_market(s: AwsSettings) -> None:
    """Spot prices and the offer cache."""
    if s.spot_price_source not in SPOT_PRICE_SOURCES:
        raise ValueError(
            f"AwsSettings.spot_price_source must be 'api' or 'table', got {s.spot_price_source!r}"
        )
    if s.max_spot_price is not None and not s.max_spot_price > 0:
        raise ValueError(
            f"AwsSettings.max_spot_price must be > 0 USD per hour, or None to cap at the "
            f"on-demand price, got {s.max_spot_price!r}"
        )
    if not s.offers_ttl_s >= 0:
        raise ValueError(f"AwsSettings.offers_ttl_s must be >= 0, got {s.offers_ttl_s!r}")

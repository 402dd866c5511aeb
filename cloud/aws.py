"""AWS: spot and on-demand GPU VMs on EC2 through boto3.

The module imports without boto3; constructing :class:`AwsProvider` without it raises an
``ImportError`` that says ``pip install 'spottrain[aws]'``.

Choices that hold for every call (the contract itself is in :mod:`spottrain.cloud.base`):

* **Launches are idempotent twice over.** ``launch`` first looks for an instance tagged with
  the request id (in any state: a terminated one means this request already launched and
  lost its VM, and the controller uses a new request id for a replacement), and passes the
  request id as ``ClientToken`` so that EC2 itself returns the first instance when our
  look-up ran before the instance became visible (describe calls lag).
* **Spot is bought one-time, terminate on interruption,** through ``run_instances`` with
  market options. ``max_spot_price=None`` sends no ``MaxPrice``, which EC2 caps at the
  on-demand price. ``create_fleet`` is not used: it needs a launch template per launch
  shape (made, versioned and cleaned up by someone) and reports stockouts inside a
  successful answer; for one VM in one chosen zone it buys nothing ``run_instances`` does
  not, since the planner, not EC2, picks the zone.
* **IMDSv2 is required** with a hop limit of 2, so containers on the VM reach the metadata
  service (the agent's preemption watcher reads it) and nothing can use IMDSv1.
* **EFA types get a cluster placement group** per (job, zone), created on first use, and an
  EFA network interface when a subnet is configured for the zone (an EFA interface needs an
  explicit subnet; without one the VM gets the zone's default subnet and plain networking).
  Types without EFA get neither: a cluster group buys them little bandwidth and narrows
  where spot capacity can be found. Placement groups are left behind when a job ends (an
  empty one costs nothing); ``terraform destroy`` or the console removes them.
* **Private and encrypted by default:** no public IP (set ``public_ip`` to have one) and an
  encrypted root volume (the account's default EBS key unless ``root_volume_kms_key``).
  A private VM reaches Redis, PyPI and S3 only through its subnet's NAT gateway or VPC
  endpoints; the default VPC has neither.
* **Offers are cached per region** for ``offers_ttl_s``: the describe calls behind them are
  slow and rate limited, and prices move on a scale of hours.
* **Errors are classified in one place,** :func:`classify_error`; its table says why each
  code lands where it does.
* ``list`` asks every configured region and fails as a whole if one region cannot be asked:
  a partial view would make the controller relaunch VMs that still exist.
"""

from __future__ import annotations

import builtins
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, cast

from spottrain.catalog import Catalog, bundled

from .base import (
    TAG_JOB,
    TAG_NODE,
    TAG_REQUEST,
    AuthError,
    BadRequestError,
    CapacityError,
    Instance,
    InstanceState,
    LaunchRequest,
    Market,
    Offer,
    OfferQuery,
    ProviderError,
    QuotaError,
    TransientError,
    sort_offers,
)

log = logging.getLogger(__name__)

CLOUD = "aws"
INSTALL_HINT = "pip install 'spottrain[aws]'"
SPOT_PRICE_SOURCES = ("api", "table")
DEFAULT_OFFERS_TTL_S = 300.0
# EC2 accepts up to 1000 ids per TerminateInstances; stay well under it.
_TERMINATE_BATCH = 500

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

_STATES = {
    "pending": InstanceState.PENDING,
    "running": InstanceState.RUNNING,
    "shutting-down": InstanceState.STOPPING,
    "stopping": InstanceState.STOPPING,
    "stopped": InstanceState.STOPPING,
    "terminated": InstanceState.TERMINATED,
}
# The state reasons EC2 gives when it takes a spot VM back (terminate or stop behaviour).
INTERRUPTION_CODES = frozenset({"Server.SpotInstanceTermination", "Server.SpotInstanceShutdown"})


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
        if isinstance(self.regions, str):
            raise ValueError(
                f"AwsSettings.regions must be a list of region names, got the string "
                f"{self.regions!r}"
            )
        regions = tuple(self.regions)
        if not regions:
            raise ValueError("AwsSettings.regions is empty: name at least one, e.g. ['us-east-1']")
        if len(set(regions)) != len(regions):
            raise ValueError(f"AwsSettings.regions names a region twice: {list(regions)}")
        images = dict(self.image_ids)
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
        subnets = dict(self.subnet_ids)
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
        if isinstance(self.security_group_ids, str):
            raise ValueError(
                "AwsSettings.security_group_ids must be a list of ids, got the string "
                f"{self.security_group_ids!r}"
            )
        groups = tuple(self.security_group_ids)
        for group in groups:
            if not _SG_RE.match(group):
                raise ValueError(
                    f"AwsSettings.security_group_ids has {group!r}, not a security group id "
                    "(sg- and 8 to 17 hex digits)"
                )
        profile = self.instance_profile
        if profile and not (
            _PROFILE_ARN_RE.match(profile)
            if profile.startswith("arn:")
            else _PROFILE_NAME_RE.match(profile)
        ):
            raise ValueError(
                f"AwsSettings.instance_profile {profile!r} is neither an instance profile "
                "name nor an arn:aws:iam::ACCOUNT:instance-profile/NAME ARN"
            )
        if len(self.key_name) > 255:
            raise ValueError("AwsSettings.key_name is longer than 255 characters")
        if (
            isinstance(self.root_volume_gb, bool)
            or not isinstance(self.root_volume_gb, int)
            or not 8 <= self.root_volume_gb <= 16384
        ):
            raise ValueError(
                f"AwsSettings.root_volume_gb must be a whole number of GiB from 8 to 16384, "
                f"got {self.root_volume_gb!r}"
            )
        if self.root_volume_kms_key and not self.encrypt_root_volume:
            raise ValueError(
                "AwsSettings.root_volume_kms_key is set but encrypt_root_volume is off: "
                "turn encryption on or drop the key"
            )
        if self.root_volume_kms_key and not _KMS_KEY_RE.match(self.root_volume_kms_key):
            raise ValueError(
                f"AwsSettings.root_volume_kms_key {self.root_volume_kms_key!r} is not a KMS key "
                "id, alias/NAME or key or alias ARN"
            )
        if self.spot_price_source not in SPOT_PRICE_SOURCES:
            raise ValueError(
                f"AwsSettings.spot_price_source must be 'api' or 'table', got "
                f"{self.spot_price_source!r}"
            )
        if self.max_spot_price is not None and not self.max_spot_price > 0:
            raise ValueError(
                f"AwsSettings.max_spot_price must be > 0 USD per hour, or None to cap at the "
                f"on-demand price, got {self.max_spot_price!r}"
            )
        if not self.offers_ttl_s >= 0:
            raise ValueError(f"AwsSettings.offers_ttl_s must be >= 0, got {self.offers_ttl_s!r}")
        # Frozen copies, so settings shared between providers cannot change under them.
        object.__setattr__(self, "regions", regions)
        object.__setattr__(self, "image_ids", MappingProxyType(images))
        object.__setattr__(self, "subnet_ids", MappingProxyType(subnets))
        object.__setattr__(self, "security_group_ids", groups)


# --- error classification -------------------------------------------------------------------

# No capacity here and now: the planner blocks (zone, type, market) for a while and tries
# another offer. "Unsupported" (the type is not offered in that zone, or not with these
# options) is here rather than a bad request: the fix is the same, steer to another zone,
# and a bad request would stop the planner from trying the type anywhere. A spot price
# above the bid is the market saying "not at that price, not here, not now" as well.
_CAPACITY_CODES = frozenset(
    {
        "InsufficientInstanceCapacity",
        "InsufficientCapacity",
        "InsufficientHostCapacity",
        "InsufficientReservedInstanceCapacity",
        "InsufficientFreeAddressesInSubnet",
        "SpotMaxPriceTooLow",
        "Unsupported",
    }
)
# The account's limits for the region: nothing more launches there until a human asks AWS
# for more. MaxSpotInstanceCountExceeded is a quota (the account's spot request count), not
# capacity: another zone of the region would fail the same way.
_QUOTA_CODES = frozenset(
    {
        "VcpuLimitExceeded",
        "InstanceLimitExceeded",
        "MaxSpotInstanceCountExceeded",
        "SpotInstanceRequestLimitExceeded",
        "PlacementGroupLimitExceeded",
        "NetworkInterfaceLimitExceeded",
        "VolumeLimitExceeded",
        "ResourceLimitExceeded",
    }
)
_AUTH_CODES = frozenset(
    {
        "AuthFailure",
        "InvalidClientTokenId",
        "ExpiredToken",
        "ExpiredTokenException",
        "SignatureDoesNotMatch",
        "IncompleteSignature",
        "MissingAuthenticationToken",
        "UnrecognizedClientException",
        "RequestExpired",
        "OptInRequired",
        "Blocked",
        "PendingVerification",
    }
)
_PERMISSION_CODES = frozenset(
    {"UnauthorizedOperation", "AccessDenied", "AccessDeniedException", "NotAuthorized"}
)
_TRANSIENT_CODES = frozenset(
    {
        "RequestLimitExceeded",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "TooManyRequestsException",
        "InternalError",
        "InternalFailure",
        "ServiceUnavailable",
        "Unavailable",
        "RequestTimeout",
        "RequestTimeoutException",
    }
)
# Codes that do not say "Invalid..." or "Malformed..." but still mean the request was wrong.
_BAD_REQUEST_CODES = frozenset(
    {
        "MissingParameter",
        "UnknownParameter",
        "ValidationError",
        "UnsupportedOperation",
        "IdempotentParameterMismatch",
        "NoSuchEntity",
        "DryRunOperation",
    }
)
_BAD_REQUEST_PREFIXES = ("Invalid", "Malformed")
# The id is unknown to this region (or not an EC2 id at all): terminate ignores these.
_NOT_FOUND_CODES = frozenset({"InvalidInstanceID.NotFound", "InvalidInstanceID.Malformed"})

_CREDENTIALS_FIX = (
    "give spottrain AWS credentials: set AWS_PROFILE (after `aws configure` or `aws sso "
    "login`), or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or run it where an IAM role is "
    "attached (instance profile, ECS/EKS task role)"
)

_AUTH_EXCEPTIONS = (
    "NoCredentialsError",
    "PartialCredentialsError",
    "CredentialRetrievalError",
    "ProfileNotFound",
    "SSOError",
    "TokenRetrievalError",
)
_TRANSIENT_EXCEPTIONS = ("ConnectionError", "HTTPClientError", "IncompleteReadError")
_BAD_REQUEST_EXCEPTIONS = ("ParamValidationError",)


def _botocore_kinds() -> tuple[
    type[Exception],
    tuple[type[Exception], ...],
    tuple[type[Exception], ...],
    tuple[type[Exception], ...],
]:
    from botocore import exceptions

    def pick(names: Sequence[str]) -> tuple[type[Exception], ...]:
        found = (getattr(exceptions, n, None) for n in names)
        return tuple(c for c in found if isinstance(c, type) and issubclass(c, Exception))

    client_error: type[Exception] = exceptions.ClientError
    return (
        client_error,
        pick(_AUTH_EXCEPTIONS),
        pick(_TRANSIENT_EXCEPTIONS),
        pick(_BAD_REQUEST_EXCEPTIONS),
    )


def error_code(exc: BaseException) -> str:
    """The EC2 error code of a botocore ``ClientError`` (``""`` for anything else)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return ""
    return str(response.get("Error", {}).get("Code", ""))


def classify_error(
    exc: Exception,
    *,
    region: str,
    zone: str = "",
    instance_type: str = "",
    market: Market = Market.SPOT,
    service: str = "EC2",
) -> ProviderError:
    """Turn a boto3/botocore failure into the typed error the planner acts on.

    The table, by EC2 error code (``ClientError``) or botocore exception:

    - capacity (block this zone/type/market for a while): ``InsufficientInstanceCapacity``,
      ``InsufficientCapacity``, ``InsufficientHostCapacity``, ``SpotMaxPriceTooLow``,
      ``Unsupported`` (the type is not offered in the zone), ``InsufficientFreeAddressesInSubnet``.
      Without a zone and type to block, these are transient instead.
    - quota (the region is done until a human raises a limit): ``VcpuLimitExceeded``,
      ``InstanceLimitExceeded``, ``MaxSpotInstanceCountExceeded``, and the other
      ``...LimitExceeded`` codes of resources a launch makes.
    - auth: ``AuthFailure``, ``UnauthorizedOperation``, ``InvalidClientTokenId``,
      ``ExpiredToken``, ``SignatureDoesNotMatch``, ``RequestExpired`` (clock skew),
      ``OptInRequired``; botocore's ``NoCredentialsError``, ``PartialCredentialsError``,
      ``ProfileNotFound`` and the SSO token errors.
    - bad request: every ``Invalid...`` and ``Malformed...`` code (``InvalidParameterValue``,
      ``InvalidAMIID.NotFound``, ``InvalidParameterCombination``, ``InvalidInstanceType``,
      ``InvalidGroup.NotFound``, ...), ``MissingParameter``, ``IdempotentParameterMismatch``,
      ``NoSuchEntity`` (an unknown instance profile); botocore's ``ParamValidationError``.
    - transient: ``RequestLimitExceeded``, ``Throttling``, ``InternalError``,
      ``ServiceUnavailable``, ``Unavailable``; connection errors and timeouts
      (``EndpointConnectionError``, ``ConnectTimeoutError``, ``ReadTimeoutError``,
      ``ConnectionClosedError``) and unparsable answers.
    - a code not in the table: transient if AWS answered with a 5xx status (its side
      failed), else a bad request (AWS refused this request; repeating it verbatim will not
      help, and the message names the code so the table can grow). Any other exception is
      transient.

    Args:
        exc: what boto3 raised.
        region: the region the call went to.
        zone: the availability zone of a launch, for capacity errors.
        instance_type: the type of a launch, for capacity errors.
        market: the market of a launch, for capacity errors.
        service: the AWS service called, for messages (``Auto Scaling`` for groups).

    Returns:
        The :class:`ProviderError` to raise (the caller raises it ``from exc``).
    """
    try:
        client_error, auth_kinds, transient_kinds, bad_kinds = _botocore_kinds()
    except ImportError:  # pragma: no cover - only reached if boto3 vanished after import
        return TransientError(CLOUD, f"{type(exc).__name__}: {exc}")
    if not isinstance(exc, client_error):
        if isinstance(exc, auth_kinds):
            return AuthError(CLOUD, f"{type(exc).__name__}: {exc}; {_CREDENTIALS_FIX}")
        if isinstance(exc, bad_kinds):
            return BadRequestError(CLOUD, f"{type(exc).__name__}: {exc}")
        what = (
            f"could not reach {service}"
            if isinstance(exc, transient_kinds)
            else f"{service} call failed"
        )
        return TransientError(CLOUD, f"{what} in {region}: {type(exc).__name__}: {exc}")

    code = error_code(exc)
    response = cast(dict[str, Any], getattr(exc, "response", {}))
    message = str(response.get("Error", {}).get("Message", "")) or str(exc)
    operation = str(getattr(exc, "operation_name", "") or "the call")
    said = f"{code}: {message}"
    if code in _CAPACITY_CODES:
        if not zone or not instance_type:
            return TransientError(CLOUD, f"{operation} in {region}: {said}")
        if code == "SpotMaxPriceTooLow":
            said += " (raise AwsSettings.max_spot_price, or leave it unset to bid on-demand)"
        return CapacityError(CLOUD, zone, instance_type, market, said)
    if code in _QUOTA_CODES:
        return QuotaError(
            CLOUD,
            region,
            f"{said}; ask AWS to raise the {market} vCPU quota for this instance family in "
            f"{region} (Service Quotas console), or allow other regions",
        )
    if code in _AUTH_CODES:
        fix = "check this machine's clock" if code == "RequestExpired" else _CREDENTIALS_FIX
        return AuthError(CLOUD, f"{said}; {fix}")
    if code in _PERMISSION_CODES:
        return AuthError(
            CLOUD,
            f"{said}; the credentials lack permission for ec2:{operation} in {region}: grant "
            "it to the IAM user or role spottrain runs as",
        )
    if code in _TRANSIENT_CODES:
        return TransientError(CLOUD, f"{operation} in {region}: {said}")
    if code in _BAD_REQUEST_CODES or code.startswith(_BAD_REQUEST_PREFIXES):
        return BadRequestError(CLOUD, f"{operation} in {region}: {said}")
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if isinstance(status, int) and status >= 500:
        return TransientError(CLOUD, f"{operation} in {region}: {said} (HTTP {status})")
    return BadRequestError(CLOUD, f"{operation} in {region}: unrecognised {service} error {said}")


# --- launch parameters ----------------------------------------------------------------------


def placement_group_name(job: str, zone: str) -> str:
    """The cluster placement group of one job in one zone (a group lives in one zone)."""
    return f"spottrain-{job}-{zone}"


def instance_name(request: LaunchRequest) -> str:
    """The ``Name`` tag the console shows."""
    return f"spottrain-{request.job}-{request.node}"


def _tag_list(tags: Mapping[str, str]) -> list[dict[str, str]]:
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
    tags = _tag_list({**request.all_tags(), "Name": instance_name(request)})
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


# --- the provider ---------------------------------------------------------------------------


class AwsProvider:
    """EC2 behind the :class:`~spottrain.cloud.base.Provider` interface.

    Thread-safe: boto3 clients are, and the caches are guarded by a lock.
    """

    cloud = CLOUD

    def __init__(
        self,
        settings: AwsSettings,
        *,
        session: Any = None,
        catalog: Catalog | None = None,
        endpoint_url: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Build the provider; no call reaches AWS until a method is used.

        Args:
            settings: regions, AMIs, network and pricing choices.
            session: a ``boto3.Session`` (its credentials, profile and event hooks are
                used); None builds one from the environment's credential chain.
            catalog: GPU counts, list prices and interruption bands; the bundled table if
                None.
            endpoint_url: another EC2 endpoint (a VPC endpoint, or moto in tests).
            clock: unix seconds now, for the offer cache.

        Raises:
            ImportError: boto3 is not installed (``pip install 'spottrain[aws]'``).
            ValueError: a region in ``settings`` has no prices in the catalog.
            AuthError: the named AWS profile does not exist.
        """
        try:
            import boto3
            from botocore.config import Config
            from botocore.exceptions import BotoCoreError, ClientError
            from botocore.parsers import ResponseParserError
        except ImportError as e:
            raise ImportError(f"the AWS provider needs boto3: {INSTALL_HINT}") from e
        self.settings = settings
        self._catalog = catalog or bundled()
        for region in settings.regions:
            self._catalog.region_multiplier(CLOUD, region)
        if session is None:
            try:
                session = boto3.Session()
            except BotoCoreError as e:
                raise classify_error(e, region=settings.regions[0]) from e
        self._session = session
        self._endpoint_url = endpoint_url
        self._clock = clock
        self._client_error: type[Exception] = ClientError
        self._sdk_errors: tuple[type[Exception], ...] = (
            ClientError,
            BotoCoreError,
            ResponseParserError,
        )
        # botocore retries throttling and 5xx a few times itself; beyond that the error
        # goes to the controller, whose next pass is the retry.
        self._config = Config(
            retries={"mode": "standard", "max_attempts": 3},
            connect_timeout=10,
            read_timeout=60,
            user_agent_extra="spottrain",
        )
        self._lock = threading.Lock()
        self._clients: dict[str, Any] = {}
        self._offer_cache: dict[str, tuple[float, builtins.list[Offer]]] = {}
        self._images: dict[str, str] = {}  # region -> root device name of its AMI
        self._placement_groups: set[tuple[str, str]] = set()
        self._regions_by_id: dict[str, str] = {}

    # --- Provider -----------------------------------------------------------------------

    def offers(self, query: OfferQuery) -> builtins.list[Offer]:
        """The offers of the configured regions that ``query`` allows, cheapest first.

        Regions the query names but the settings do not are left out (there is no AMI
        for them).

        Each catalog type is offered in every zone where EC2 lists it, in both markets. The
        GPU count and EFA support come from ``describe_instance_types`` (the catalog only
        fills in when EC2 does not describe a type); spot prices from the spot price history
        (``spot_price_source="api"``) or the catalog.

        Raises:
            AuthError, TransientError: EC2 could not be asked.
        """
        regions = [r for r in self.settings.regions if not query.regions or r in query.regions]
        found: builtins.list[Offer] = []
        for region in regions:
            found.extend(o for o in self._region_offers(region) if query.allows(o))
        return sort_offers(found)

    def launch(self, request: LaunchRequest) -> Instance:
        """Launch one VM for ``request``, or return the one this request id launched before.

        Raises:
            ValueError: the offer is not an AWS offer, or its region is not configured.
            CapacityError, QuotaError, AuthError, BadRequestError, TransientError: see
                :func:`classify_error`.
        """
        offer = request.offer
        if offer.cloud != CLOUD:
            raise ValueError(f"AwsProvider cannot launch a {offer.cloud!r} offer")
        region = offer.region
        if region not in self.settings.regions:
            raise ValueError(
                f"region {region!r} is not in AwsSettings.regions "
                f"({', '.join(self.settings.regions)}): add it, with an AMI in image_ids"
            )
        if offer.instance_type not in self._catalog.types(CLOUD):
            # EC2 answers InvalidParameterValue for a type it does not have (moto does not);
            # a type the catalog does not price is refused the same way, before any call.
            raise BadRequestError(
                CLOUD,
                f"instance type {offer.instance_type!r} is not in the catalog (known: "
                f"{', '.join(sorted(self._catalog.types(CLOUD)))}); add it to a copy of the "
                "catalog and point SPOTTRAIN_CATALOG at it",
            )
        existing = self._find_request(region, request.request_id)
        if existing is not None:
            log.info(
                "aws launch already done: request=%s instance=%s state=%s",
                request.request_id,
                existing.id,
                existing.state,
            )
            return existing
        root_device = self._root_device(region)
        group = ""
        if self.settings.placement_group and offer.network == "efa":
            group = self._ensure_placement_group(region, request.job, offer)
        params = run_instances_params(
            request, self.settings, root_device=root_device, placement_group=group
        )
        with self._errors(
            region, zone=offer.zone, instance_type=offer.instance_type, market=offer.market
        ):
            reply = self._client(region).run_instances(**params)
        raw = cast(dict[str, Any], reply["Instances"][0])
        instance = self._to_instance(region, raw, request.all_tags())
        log.info(
            "aws launched: request=%s job=%s node=%s instance=%s %s %s %s",
            request.request_id,
            request.job,
            request.node,
            instance.id,
            offer.zone,
            offer.instance_type,
            offer.market,
        )
        return instance

    def list(self, job: str) -> builtins.list[Instance]:
        """Every VM tagged with ``job`` in the configured regions, terminated ones included.

        Raises:
            AuthError, TransientError: a region could not be asked (no partial answer).
        """
        found: builtins.list[Instance] = []
        for region in self.settings.regions:
            found.extend(self._describe(region, [{"Name": f"tag:{TAG_JOB}", "Values": [job]}]))
        return found

    def terminate(self, instance_ids: Sequence[str]) -> None:
        """Terminate these VMs; ids already gone, or unknown in every region, are ignored.

        An id this provider has seen (in ``launch`` or ``list``) is terminated in its
        region; any other is tried in each configured region in turn.

        Raises:
            AuthError, TransientError: EC2 refused or could not be reached.
        """
        ids = list(dict.fromkeys(instance_ids))
        with self._lock:
            known = {i: self._regions_by_id.get(i) for i in ids}
        by_region: dict[str, builtins.list[str]] = {}
        unplaced: builtins.list[str] = []
        for i, region in known.items():
            if region is None:
                unplaced.append(i)
            else:
                by_region.setdefault(region, []).append(i)
        for region, group in by_region.items():
            self._terminate_in(region, group)
        for region in self.settings.regions:
            if not unplaced:
                break
            unplaced = self._terminate_in(region, unplaced)
        if unplaced:
            log.info("aws terminate: not found in any region, ignored: %s", ", ".join(unplaced))

    # --- offers -------------------------------------------------------------------------

    def _region_offers(self, region: str) -> builtins.list[Offer]:
        now = self._clock()
        with self._lock:
            cached = self._offer_cache.get(region)
        if cached is not None and now - cached[0] < self.settings.offers_ttl_s:
            return cached[1]
        offers = self._fetch_offers(region)
        with self._lock:
            self._offer_cache[region] = (now, offers)
        return offers

    def _fetch_offers(self, region: str) -> builtins.list[Offer]:
        known = self._catalog.types(CLOUD)
        client = self._client(region)
        zones: dict[str, set[str]] = {}
        with self._errors(region):
            pages = client.get_paginator("describe_instance_type_offerings").paginate(
                LocationType="availability-zone",
                Filters=[{"Name": "instance-type", "Values": sorted(known)}],
            )
            for page in pages:
                for row in page.get("InstanceTypeOfferings", []):
                    if row["InstanceType"] in known:
                        zones.setdefault(row["InstanceType"], set()).add(row["Location"])
            if not zones:
                return []
            described = client.describe_instance_types(InstanceTypes=sorted(zones))
            spot = self._spot_prices(client, sorted(zones))
        info = {t["InstanceType"]: t for t in described.get("InstanceTypes", [])}
        offers: builtins.list[Offer] = []
        for name, type_zones in zones.items():
            entry = known[name]
            gpus, network = entry.gpus, entry.network
            api = info.get(name)
            if api is not None:
                gpus = sum(int(g.get("Count", 0)) for g in api.get("GpuInfo", {}).get("Gpus", []))
                network = "efa" if api.get("NetworkInfo", {}).get("EfaSupported") else ""
                if gpus != entry.gpus:
                    log.warning(
                        "aws %s has %d GPUs per EC2, %d per the catalog; using EC2's",
                        name,
                        gpus,
                        entry.gpus,
                    )
            on_demand = self._catalog.price(CLOUD, name, region, Market.ON_DEMAND)
            table_spot = self._catalog.price(CLOUD, name, region, Market.SPOT)
            for zone in sorted(type_zones):
                on_demand_offer = Offer(
                    cloud=CLOUD,
                    region=region,
                    zone=zone,
                    instance_type=name,
                    gpus=gpus,
                    gpu_type=entry.gpu_type,
                    market=Market.ON_DEMAND,
                    price_per_hour=on_demand,
                    interruption_risk=0.0,
                    network=network,
                )
                offers.append(on_demand_offer)
                price = spot.get((name, zone), table_spot)
                cap = self.settings.max_spot_price
                if cap is not None and price > cap:
                    continue  # EC2 would refuse the bid (SpotMaxPriceTooLow)
                offers.append(
                    replace(
                        on_demand_offer,
                        market=Market.SPOT,
                        price_per_hour=price,
                        interruption_risk=entry.interruption_risk,
                    )
                )
        return offers

    def _spot_prices(self, client: Any, types: builtins.list[str]) -> dict[tuple[str, str], float]:
        """The latest spot price per (type, zone); empty when the table is the source."""
        if self.settings.spot_price_source != "api":
            return {}
        latest: dict[tuple[str, str], tuple[datetime, float]] = {}
        # With a start time of now, EC2 returns the price in effect now per zone, not days
        # of history. AWS's now, not the cache's (injectable) clock.
        pages = client.get_paginator("describe_spot_price_history").paginate(
            InstanceTypes=types,
            ProductDescriptions=["Linux/UNIX"],
            StartTime=datetime.now(UTC),
        )
        for page in pages:
            for row in page.get("SpotPriceHistory", []):
                key = (row["InstanceType"], row["AvailabilityZone"])
                stamp = row["Timestamp"]
                if key not in latest or stamp > latest[key][0]:
                    latest[key] = (stamp, float(row["SpotPrice"]))
        return {key: price for key, (_, price) in latest.items()}

    # --- launch helpers -----------------------------------------------------------------

    def _find_request(self, region: str, request_id: str) -> Instance | None:
        found = self._describe(region, [{"Name": f"tag:{TAG_REQUEST}", "Values": [request_id]}])
        if not found:
            return None
        # Two VMs for one request id should not happen (ClientToken dedups); if it did,
        # the oldest live one is the answer and the reconcile loop sees the other by its tags.
        found.sort(key=lambda i: (not i.state.alive, i.launched_at or 0.0, i.id))
        return found[0]

    def _root_device(self, region: str) -> str:
        """The AMI's root device name, checking once per region that the AMI exists."""
        with self._lock:
            cached = self._images.get(region)
        if cached is not None:
            return cached
        image = self.settings.image_ids[region]
        client = self._client(region)
        with self._errors(region):
            try:
                images = client.describe_images(ImageIds=[image]).get("Images", [])
            except self._client_error as e:
                if not error_code(e).startswith("InvalidAMIID"):
                    raise
                images = []
        if not images:
            raise BadRequestError(
                CLOUD,
                f"AMI {image} does not exist in {region} or this account cannot use it: set "
                f"AwsSettings.image_ids[{region!r}] to a GPU AMI of {region} (AMI ids differ "
                "per region; e.g. the Deep Learning Base AMI)",
            )
        root = str(images[0].get("RootDeviceName") or "/dev/xvda")
        with self._lock:
            self._images[region] = root
        return root

    def _ensure_placement_group(self, region: str, job: str, offer: Offer) -> str:
        name = placement_group_name(job, offer.zone)
        with self._lock:
            if (region, name) in self._placement_groups:
                return name
        client = self._client(region)
        with self._errors(
            region, zone=offer.zone, instance_type=offer.instance_type, market=offer.market
        ):
            try:
                client.create_placement_group(
                    GroupName=name,
                    Strategy="cluster",
                    TagSpecifications=[
                        {"ResourceType": "placement-group", "Tags": _tag_list({TAG_JOB: job})}
                    ],
                )
            except self._client_error as e:
                # Made by an earlier launch, or by this controller before a restart.
                if error_code(e) != "InvalidPlacementGroup.Duplicate":
                    raise
        with self._lock:
            self._placement_groups.add((region, name))
        return name

    # --- list and terminate helpers -----------------------------------------------------

    def _describe(
        self, region: str, filters: builtins.list[dict[str, Any]]
    ) -> builtins.list[Instance]:
        found: builtins.list[Instance] = []
        with self._errors(region):
            pages = (
                self._client(region).get_paginator("describe_instances").paginate(Filters=filters)
            )
            for page in pages:
                for reservation in page.get("Reservations", []):
                    for raw in reservation.get("Instances", []):
                        found.append(self._to_instance(region, raw))
        return found

    def _terminate_in(self, region: str, ids: builtins.list[str]) -> builtins.list[str]:
        """Terminate ``ids`` in ``region``; returns those the region does not know."""
        client = self._client(region)
        missing: builtins.list[str] = []
        for start in range(0, len(ids), _TERMINATE_BATCH):
            batch = ids[start : start + _TERMINATE_BATCH]
            if self._terminate_batch(client, region, batch):
                continue
            if len(batch) == 1:
                missing.extend(batch)
                continue
            # One unknown id fails the whole call, so find out which, one by one.
            for i in batch:
                if not self._terminate_batch(client, region, [i]):
                    missing.append(i)
        with self._lock:
            for i in ids:
                if i not in missing:
                    self._regions_by_id[i] = region
        return missing

    def _terminate_batch(self, client: Any, region: str, ids: builtins.list[str]) -> bool:
        """Terminate ``ids``; False if one of them is unknown here (nothing was done)."""
        with self._errors(region):
            try:
                client.terminate_instances(InstanceIds=ids)
            except self._client_error as e:
                if error_code(e) in _NOT_FOUND_CODES:
                    return False
                raise
        log.info("aws terminate: %s in %s", ", ".join(ids), region)
        return True

    # --- plumbing -----------------------------------------------------------------------

    def _client(self, region: str) -> Any:
        with self._lock:
            client = self._clients.get(region)
            if client is None:
                with self._errors(region):
                    client = self._session.client(
                        "ec2",
                        region_name=region,
                        endpoint_url=self._endpoint_url,
                        config=self._config,
                    )
                self._clients[region] = client
            return client

    @contextmanager
    def _errors(
        self,
        region: str,
        *,
        zone: str = "",
        instance_type: str = "",
        market: Market = Market.SPOT,
    ) -> Iterator[None]:
        try:
            yield
        except self._sdk_errors as e:
            raise classify_error(
                e, region=region, zone=zone, instance_type=instance_type, market=market
            ) from e

    def _to_instance(
        self, region: str, raw: Mapping[str, Any], fallback_tags: Mapping[str, str] | None = None
    ) -> Instance:
        tags = dict(fallback_tags or {})
        tags.update({t["Key"]: t["Value"] for t in raw.get("Tags", [])})
        reason = raw.get("StateReason") or {}
        code = str(reason.get("Code", ""))
        launched = raw.get("LaunchTime")
        instance_id = str(raw["InstanceId"])
        with self._lock:
            self._regions_by_id[instance_id] = region
        return Instance(
            id=instance_id,
            cloud=CLOUD,
            region=region,
            zone=str(raw.get("Placement", {}).get("AvailabilityZone", "")),
            instance_type=str(raw.get("InstanceType", "")),
            # EC2 marks spot VMs only; the instance-lifecycle filter is not used (moto lacks
            # it), so the market is read here.
            market=Market.SPOT if raw.get("InstanceLifecycle") == "spot" else Market.ON_DEMAND,
            # A state EC2 adds later counts as not alive: the controller then replaces the VM
            # rather than trusting one it cannot read.
            state=_STATES.get(str(raw.get("State", {}).get("Name", "")), InstanceState.STOPPING),
            job=tags.get(TAG_JOB, ""),
            node=tags.get(TAG_NODE, ""),
            request_id=tags.get(TAG_REQUEST, ""),
            interrupted=code in INTERRUPTION_CODES,
            state_reason=str(reason.get("Message") or code or raw.get("StateTransitionReason", "")),
            launched_at=launched.timestamp() if isinstance(launched, datetime) else None,
            address=str(raw.get("PrivateIpAddress", "")),
        )

"""AWS error classification: boto3/botocore failures turned into the typed
:class:`~spottrain.cloud.base.ProviderError` the planner acts on, in one table."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from spottrain.cloud.aws.settings import CLOUD
from spottrain.cloud.base import (
    AuthError,
    BadRequestError,
    CapacityError,
    Market,
    ProviderError,
    QuotaError,
    TransientError,
)

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
NOT_FOUND_CODES = frozenset({"InvalidInstanceID.NotFound", "InvalidInstanceID.Malformed"})

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
    return _classify_client_error(exc, region, zone, instance_type, market, service)


def _classify_client_error(
    exc: Exception, region: str, zone: str, instance_type: str, market: Market, service: str
) -> ProviderError:
    """:func:`classify_error` for a botocore ``ClientError``, by its error code."""
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


# What Auto Scaling says when a termination lifecycle action is no longer pending (the group
# moved on, or someone else completed it).
_NO_ACTIVE_LIFECYCLE_ACTION = "No active Lifecycle Action"


def lifecycle_action_gone(exc: BaseException) -> bool:
    """Whether a failed ``complete_lifecycle_action`` only says there is no action left to
    complete (the group moved on, or the controller completed it): done, not a failure."""
    return _NO_ACTIVE_LIFECYCLE_ACTION in str(exc)

"""GCP error classification: API exceptions and failed operations turned into the typed
:class:`~spottrain.cloud.base.ProviderError` the planner acts on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from spottrain.cloud.base import (
    AuthError,
    BadRequestError,
    CapacityError,
    Market,
    ProviderError,
    QuotaError,
    TransientError,
)
from spottrain.cloud.gcp.settings import _IN_REGION_RE, _QUOTA_RE, AUTH_HINT, CLOUD

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class CallTarget:
    """What a call was aimed at, so that an error can carry the data a planner needs.

    Attributes:
        zone: the zone of the call, if it had one.
        region: the region of the call, if it had one.
        instance_type: the machine type being launched, if any.
        market: the market being launched in.
    """

    zone: str = ""
    region: str = ""
    instance_type: str = ""
    market: Market = Market.SPOT


@dataclass(frozen=True)
class _Facts:
    status: int | None
    codes: tuple[str, ...]
    message: str
    quota_region: str = ""


_STOCKOUT_CODES = frozenset(
    {
        "ZONE_RESOURCE_POOL_EXHAUSTED",
        "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
        "resourcePoolExhausted",
    }
)
_RATE_CODES = frozenset(
    {
        "rateLimitExceeded",
        "userRateLimitExceeded",
        "RATE_LIMIT_EXCEEDED",
        "RESOURCE_OPERATION_RATE_EXCEEDED",
        "resourceNotReady",
        "RESOURCE_NOT_READY",
    }
)
_QUOTA_CODES = frozenset({"QUOTA_EXCEEDED", "quotaExceeded"})
_AUTH_CODES = frozenset(
    {
        "authError",
        "required",
        "forbidden",
        "insufficientPermissions",
        "accessNotConfigured",
        "SERVICE_DISABLED",
        "PERMISSIONS_ERROR",
        "IAM_PERMISSION_DENIED",
    }
)
_NOT_FOUND_CODES = frozenset({"RESOURCE_NOT_FOUND", "notFound"})
_SERVER_CODES = frozenset({"INTERNAL_ERROR", "backendError", "SERVICE_UNAVAILABLE"})


def classify_error(error: object, target: CallTarget | None = None) -> ProviderError:
    """Turn a refusal from Compute Engine into the typed error the planner understands.

    This is the one place that knows Google's error vocabulary. ``error`` is what a call
    raised (a ``google.api_core`` exception, a ``google.auth`` credentials error, a
    ``requests`` connection error or timeout) or a finished ``compute_v1.Operation`` whose
    ``error.errors`` say why it failed (stockouts and some quota refusals arrive that way).

    Args:
        error: the exception or the failed operation.
        target: what the call was aimed at; a CapacityError takes its zone, machine type and
            market from it, a QuotaError its region unless the message names one.

    Returns:
        A CapacityError (stockout), QuotaError, AuthError (with how to fix the credentials),
        BadRequestError (invalid request, unknown image or machine type) or TransientError
        (throttling, 5xx, timeouts, connection errors, anything not recognised).
    """
    where = target or CallTarget()
    auth = _classify_credentials_error(error)
    if auth is not None:
        return auth
    facts = _facts_of(error)
    if facts is None:
        return TransientError(CLOUD, f"{type(error).__name__}: {error}")
    return _classify_facts(facts, where)


def _classify_credentials_error(error: object) -> ProviderError | None:
    try:
        from google.auth import exceptions as auth_exc
    except ImportError:  # pragma: no cover - google-auth comes with the client library
        return None
    if isinstance(error, auth_exc.DefaultCredentialsError):
        return AuthError(CLOUD, f"no Google credentials found ({error}); {AUTH_HINT}")
    if isinstance(error, auth_exc.RefreshError):
        if getattr(error, "retryable", False):
            return TransientError(CLOUD, f"refreshing the credentials failed for now: {error}")
        return AuthError(CLOUD, f"the Google credentials were rejected ({error}); {AUTH_HINT}")
    if isinstance(error, auth_exc.TransportError):
        return TransientError(CLOUD, f"could not reach Google's auth service: {error}")
    return None


def _facts_of(error: object) -> _Facts | None:
    """Status, error codes and message of an API exception or a failed operation; None for
    errors that never reached the API (timeouts, connection errors)."""
    from google.api_core import exceptions as api_exc

    if isinstance(error, api_exc.GoogleAPICallError):
        codes: list[str] = []
        for item in error.errors:
            if isinstance(item, dict):
                codes.extend(str(item[k]) for k in ("reason", "code") if item.get(k))
        if error.reason:
            codes.append(error.reason)
        status = error.code if isinstance(error.code, int) else None
        return _Facts(status, tuple(codes), str(error.message))
    if _is_operation(error):
        return _operation_facts(error)
    return None


def _is_operation(error: object) -> bool:
    try:
        from google.cloud import compute_v1
    except ImportError:  # pragma: no cover
        return False
    return isinstance(error, compute_v1.Operation)


def _operation_facts(op: Any) -> _Facts:
    codes: list[str] = []
    messages: list[str] = []
    region = ""
    for item in op.error.errors:
        codes.append(item.code)
        messages.append(item.message)
        for detail in item.error_details:
            if "quota_info" in detail:
                region = detail.quota_info.dimensions.get("region", region)
    status = op.http_error_status_code or None
    message = "; ".join(m for m in messages if m) or op.http_error_message or "operation failed"
    return _Facts(status, tuple(codes), message, region)


def _classify_facts(facts: _Facts, where: CallTarget) -> ProviderError:
    codes = set(facts.codes)
    text = facts.message
    lower = text.lower()
    status = facts.status
    shown = f"{status} {text}" if status else text
    if (
        codes & _STOCKOUT_CODES
        or "does not have enough resources available" in lower
        or "resource pool exhausted" in lower
    ):
        return _capacity(where, shown)
    if "UNSUPPORTED_OPERATION" in codes:
        # Compute Engine says this when a zone does not offer the type (or spot for it): an
        # offer to avoid for a while rather than a broken request.
        if where.instance_type and (where.instance_type in text or "zone" in lower):
            return _capacity(where, shown)
        return BadRequestError(CLOUD, shown)
    if codes & _RATE_CODES or status == 429 or "rate limit" in lower:
        return TransientError(CLOUD, f"throttled or not ready, retry later: {shown}")
    quota = _QUOTA_RE.search(text)
    if codes & _QUOTA_CODES or quota:
        found = _IN_REGION_RE.search(text)
        region = facts.quota_region or (found["region"] if found else "") or where.region
        return QuotaError(
            CLOUD,
            region or "the project",
            f"{shown} (ask for more in the console's IAM & Admin > Quotas page)",
        )
    if status in (401, 403) or codes & _AUTH_CODES:
        return AuthError(CLOUD, f"{shown}; {AUTH_HINT}")
    if status == 404 or codes & _NOT_FOUND_CODES:
        return BadRequestError(CLOUD, f"not found: {shown}")
    if (status is not None and status >= 500) or codes & _SERVER_CODES:
        return TransientError(CLOUD, shown)
    if (status is not None and 400 <= status < 500) or any(
        c.startswith(("INVALID", "BAD_REQUEST", "CONDITION_NOT_MET")) for c in codes
    ):
        return BadRequestError(CLOUD, shown)
    return TransientError(CLOUD, shown)


def _capacity(where: CallTarget, message: str) -> CapacityError:
    return CapacityError(
        CLOUD, where.zone or "unknown zone", where.instance_type or "?", where.market, message
    )


def _is_api_error(error: BaseException) -> bool:
    """Whether ``error`` came from talking to the API (so it is classified), as opposed to a
    bug in this module (which propagates)."""
    from google.api_core import exceptions as api_exc
    from google.auth import exceptions as auth_exc

    if isinstance(error, api_exc.GoogleAPIError | auth_exc.GoogleAuthError):
        return True
    try:
        import requests
    except ImportError:  # pragma: no cover - the REST transport needs it
        return isinstance(error, OSError)
    return isinstance(error, requests.RequestException | OSError)


def _http_code(error: BaseException) -> int | None:
    from google.api_core import exceptions as api_exc

    if isinstance(error, api_exc.GoogleAPICallError) and isinstance(error.code, int):
        return error.code
    return None

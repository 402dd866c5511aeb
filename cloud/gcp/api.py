"""Calling the Compute API: REST clients, calls with a timeout and classified errors, paged
lists, and waiting for zone operations."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from spottrain.cloud.base import (
    BadRequestError,
)
from spottrain.cloud.gcp.errors import CallTarget, _http_code, _is_api_error, classify_error

if TYPE_CHECKING:
    from google.auth.credentials import Credentials
    from google.cloud import compute_v1


_Client = TypeVar("_Client")


def rest_client(
    kind: Callable[..., _Client], credentials: Credentials | None, api_endpoint: str | None
) -> _Client:
    """A ``compute_v1`` client of class ``kind`` on the REST transport, pointed at
    ``api_endpoint`` (None: Google's).

    Raises:
        AuthError: no credentials were given and none could be found.
        ProviderError: building it failed otherwise.
    """
    from google.api_core.client_options import ClientOptions

    options = ClientOptions(api_endpoint=api_endpoint) if api_endpoint else None
    try:
        return kind(credentials=credentials, client_options=options, transport="rest")
    except Exception as e:
        if _is_api_error(e):
            raise classify_error(e) from e
        raise


def call_api(target: CallTarget, timeout: float, fn: Callable[..., Any], /, **kwargs: Any) -> Any:
    """One API call, without the library's retries, its errors classified."""
    try:
        return fn(retry=None, timeout=timeout, **kwargs)
    except Exception as e:
        if _is_api_error(e):
            raise classify_error(e, target) from e
        raise


def list_all(target: CallTarget, timeout: float, fn: Callable[..., Any], request: Any) -> list[Any]:
    """Every item of a paged list call (pairs of scope and items for aggregated lists);
    later pages are fetched while iterating, so their errors are classified here too."""
    try:
        return list(fn(request=request, retry=None, timeout=timeout))
    except Exception as e:
        if _is_api_error(e):
            raise classify_error(e, target) from e
        raise


def wait_zone_operation(
    operations: compute_v1.ZoneOperationsClient,
    op: compute_v1.Operation,
    *,
    project: str,
    target: CallTarget,
    budget_s: float,
    request_timeout_s: float,
    clock: Callable[[], float] = time.time,
) -> compute_v1.Operation:
    """Wait for a zonal operation to finish, at most ``budget_s``; the operation as last seen
    (not DONE when the budget ran out).

    Raises:
        ProviderError: a poll was refused (a timeout only ends the wait).
    """
    from google.cloud import compute_v1

    deadline = clock() + budget_s
    while op.status != compute_v1.Operation.Status.DONE:
        left = deadline - clock()
        if left <= 0:
            return op
        started = clock()
        try:
            # The real API holds a wait for up to two minutes; a budget shorter than that
            # ends in a client timeout, which only means "not done yet".
            op = operations.wait(
                project=project,
                zone=target.zone,
                operation=op.name,
                retry=None,
                timeout=min(left, request_timeout_s) + 1.0,
            )
        except Exception as e:
            if _is_timeout(e):
                return op
            if _is_api_error(e):
                raise classify_error(e, target) from e
            raise
        if op.status != compute_v1.Operation.Status.DONE and clock() - started < 0.5:
            # A server that answers a wait at once would make this a busy loop.
            time.sleep(min(0.5, max(0.0, deadline - clock())))
    return op


def _is_not_found(error: BadRequestError) -> bool:
    cause = error.__cause__
    return cause is not None and _http_code(cause) == 404


def _last(link: str) -> str:
    """The last segment of a resource URL or path (``.../zones/us-central1-a`` ->
    ``us-central1-a``)."""
    return link.rstrip("/").rsplit("/", 1)[-1]


def _is_timeout(error: BaseException) -> bool:
    try:
        import requests
    except ImportError:  # pragma: no cover
        return isinstance(error, TimeoutError)
    return isinstance(error, requests.Timeout | TimeoutError)

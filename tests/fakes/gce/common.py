"""What every part of the fake Compute API shares: the API's base URL, its error answers,
timestamps, resource-name checks and request bodies."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any

DEFAULT_PROJECT = "spottrain-test"
API = "https://www.googleapis.com/compute/v1"
PREEMPTED = "compute.instances.preempted"

_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?\Z")
MACHINE_TYPE_RE = re.compile(
    r"^(https://www\.googleapis\.com/compute/v1/)?(projects/[^/]+/)?"
    r"(zones/(?P<zone>[^/]+)/machineTypes/)?(?P<type>[^/]+)\Z"
)


class ApiError(Exception):
    """An answer of the fake API in the real error format."""

    def __init__(
        self, code: int, message: str, reason: str, domain: str = "global", **extra: Any
    ) -> None:
        super().__init__(message)
        self.status = code
        self.body: dict[str, Any] = {
            "error": {
                "code": code,
                "message": message,
                "errors": [{"message": message, "domain": domain, "reason": reason}],
                **extra,
            }
        }


def not_found(what: str) -> ApiError:
    return ApiError(404, f"The resource '{what}' was not found", "notFound")


def invalid(field_name: str, value: Any, why: str) -> ApiError:
    return ApiError(400, f"Invalid value for field '{field_name}': '{value}'. {why}", "invalid")


def timestamp() -> str:
    return datetime.now(UTC).astimezone().isoformat(timespec="milliseconds")


def name_in(raw: bytes) -> str | None:
    try:
        name = json.loads(raw or b"{}").get("name")
    except (ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


def check_name(name: str, field_name: str = "resource.name") -> None:
    if not _NAME_RE.match(name):
        raise invalid(
            field_name,
            name,
            "Must be a match of regex '(?:[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?|[1-9][0-9]{0,19})'",
        )


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw or b"{}")
    except ValueError as e:
        raise ApiError(400, f"Invalid JSON payload received. {e}", "parseError") from None
    if not isinstance(body, dict):
        raise ApiError(400, "Invalid JSON payload received: not an object.", "parseError")
    return body

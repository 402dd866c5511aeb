"""The EC2 instance metadata service (IMDSv2 only), shared by the AWS notice monitors.

The session token is fetched with ``PUT /latest/api/token`` and reused until the last tenth
of its life (at most the last 60 s) begins; then it is fetched again before the next
request, so a poll never sends a token that is about to lapse. A 401 (token expired early or
revoked) fetches a new token once and retries that request. There is no IMDSv1 fallback: an
instance that requires tokens is the common case, and a failed token request is reported,
not papered over.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime
from typing import Any

from .metadata_http import DEFAULT_TIMEOUT_S, HttpResponse, MetadataHttp, request_error

AWS_ENDPOINT_ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
DEFAULT_AWS_ENDPOINT = "http://169.254.169.254"
AWS_TOKEN_PATH = "/latest/api/token"
AWS_SPOT_PATH = "/latest/meta-data/spot/instance-action"
AWS_REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
AWS_LIFECYCLE_PATH = "/latest/meta-data/autoscaling/target-lifecycle-state"
AWS_TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
AWS_TOKEN_HEADER = "X-aws-ec2-metadata-token"
AWS_MAX_TOKEN_TTL = 21600


class ImdsSession:
    """Requests to IMDS with a session token kept fresh.

    Args:
        endpoint: Base URL of IMDS. Default: ``$AWS_EC2_METADATA_SERVICE_ENDPOINT``, else
            ``http://169.254.169.254``. A trailing slash is fine.
        timeout: Seconds each socket operation of each request may take.
        token_ttl: Lifetime requested for session tokens, 1 to 21600 seconds.

    Raises:
        ValueError: On a bad timeout or token_ttl.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        token_ttl: int = AWS_MAX_TOKEN_TTL,
    ) -> None:
        if not 1 <= token_ttl <= AWS_MAX_TOKEN_TTL:
            raise ValueError(
                f"IMDSv2 token_ttl must be 1 to {AWS_MAX_TOKEN_TTL} seconds, got {token_ttl!r}"
            )
        base = endpoint or os.environ.get(AWS_ENDPOINT_ENV) or DEFAULT_AWS_ENDPOINT
        self.endpoint = base.rstrip("/")
        self.token_ttl = token_ttl
        self.http = MetadataHttp(timeout)
        self._token: str | None = None
        self._token_expires = 0.0  # time.monotonic()

    def url(self, path: str) -> str:
        return self.endpoint + path

    def _refresh_margin(self) -> float:
        return min(60.0, self.token_ttl / 10)

    def _fetch_token(self) -> str:
        url = self.url(AWS_TOKEN_PATH)
        # Count the lifetime from before the request: the server's clock starts no earlier.
        started = time.monotonic()
        resp = self.http.request("PUT", url, {AWS_TOKEN_TTL_HEADER: str(self.token_ttl)})
        token = resp.text()
        if resp.status != 200 or not token:
            raise request_error(
                "PUT",
                url,
                f"returned HTTP {resp.status} without an IMDSv2 token "
                "(is IMDS disabled on this instance?)",
            )
        self._token = token
        self._token_expires = started + self.token_ttl
        return token

    def current_token(self) -> str:
        """The token to send now, fetched anew when it is about to lapse.

        Raises:
            WatcherError: When a new token cannot be had.
        """
        if self._token is None or time.monotonic() >= self._token_expires - self._refresh_margin():
            return self._fetch_token()
        return self._token

    def get(self, path: str) -> HttpResponse:
        """GETs one path; the answer is a 200 or a 404.

        Raises:
            WatcherError: On any other answer, or when the request fails.
        """
        url = self.url(path)
        resp = self.http.request("GET", url, {AWS_TOKEN_HEADER: self.current_token()})
        if resp.status == 401:
            self._token = None
            resp = self.http.request("GET", url, {AWS_TOKEN_HEADER: self._fetch_token()})
            if resp.status == 401:
                raise request_error("GET", url, "returned HTTP 401 even with a fresh token")
        if resp.status not in (200, 404):
            raise request_error("GET", url, f"returned unexpected HTTP {resp.status}")
        return resp

    def json_object(self, path: str, resp: HttpResponse) -> dict[str, Any]:
        """The JSON object an answer holds.

        Raises:
            WatcherError: On malformed JSON, or JSON that is not an object.
        """
        try:
            data = json.loads(resp.body)
        except ValueError as exc:
            raise request_error("GET", self.url(path), f"returned malformed JSON: {exc}") from None
        if not isinstance(data, dict):
            raise request_error(
                "GET", self.url(path), f"returned JSON that is not an object: {resp.text()!r}"
            )
        return data


def parse_aws_time(value: Any) -> float:
    """Parses an IMDS timestamp ("2026-11-22T14:40:00Z") into Unix seconds.

    Raises:
        ValueError: If it is not an ISO 8601 date and time with a time zone.
    """
    if not isinstance(value, str) or "T" not in value:
        raise ValueError(f"expected an ISO 8601 time like 2026-11-22T14:40:00Z, got {value!r}")
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(
            f"expected an ISO 8601 time like 2026-11-22T14:40:00Z, got {value!r}"
        ) from None
    if parsed.tzinfo is None:
        raise ValueError(f"time {value!r} has no time zone (IMDS always sends Z)")
    return parsed.timestamp()

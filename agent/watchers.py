"""Cloud preemption-notice watchers: each polls one metadata service and only detects.

A watcher turns what its metadata service says into :class:`~spottrain.agent.notices.Notice`
values and nothing else: it never drains, checkpoints or dedups. :class:`PollLoop` runs one
watcher in a daemon thread and hands every notice and every error to callbacks; the agent's
notice handler decides what to do with them.

Choices that hold for every watcher here:

* A watcher reports a notice on every poll for as long as its source shows it; the handler
  dedups by ``Notice.dedup_key``. ``seen_at`` is when this watcher *first* saw that notice
  (reset once the source clears), so deadlines derived from it (AWS Auto Scaling, GCP) stay
  the same from poll to poll instead of sliding forward.
* One poll checks every path of its service. A path that fails does not hide the others: the
  notices found are returned and the failures of the last poll are kept in ``last_errors``.
  :class:`WatcherError` is raised only when no path could be checked at all.
* Requests never go through an HTTP proxy (``HTTP_PROXY`` and friends are ignored): metadata
  services are link-local and a proxy would answer for the proxy's own VM, or not at all.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from http.client import HTTPException
from typing import Any, Protocol
from urllib.parse import urlencode

from spottrain.agent.notices import Notice, NoticeKind

log = logging.getLogger(__name__)

AWS_ENDPOINT_ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
DEFAULT_AWS_ENDPOINT = "http://169.254.169.254"
AWS_TOKEN_PATH = "/latest/api/token"
AWS_SPOT_PATH = "/latest/meta-data/spot/instance-action"
AWS_REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
AWS_LIFECYCLE_PATH = "/latest/meta-data/autoscaling/target-lifecycle-state"
AWS_TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
AWS_TOKEN_HEADER = "X-aws-ec2-metadata-token"
AWS_MAX_TOKEN_TTL = 21600
# Auto Scaling gives no deadline with "Terminated". Its default lifecycle-hook timeout is
# 3600 s, but an instance without a hook goes at once, so assume little: two minutes, the
# same warning a spot interruption gets.
DEFAULT_ASG_GRACE_S = 120.0
# AWS documents a two-minute warning between the spot interruption notice and the action.
AWS_SPOT_WARNING_S = 120.0

GCP_HOST_ENV = "GCE_METADATA_HOST"
DEFAULT_GCP_HOST = "metadata.google.internal"
GCP_PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
GCP_MAINTENANCE_PATH = "/computeMetadata/v1/instance/maintenance-event"
GCP_FLAVOR_HEADER = "Metadata-Flavor"
GCP_FLAVOR = "Google"
# GCP documents 30 s between the preemption notice and the hard stop (ACPI G2 soft off).
GCP_PREEMPT_GRACE_S = 30.0
# A TERMINATE_ON_HOST_MAINTENANCE event comes 60 s before the VM is stopped.
GCP_MAINTENANCE_GRACE_S = 60.0

DEFAULT_TIMEOUT_S = 2.0
DEFAULT_INTERVAL_S = 2.0
MAX_INTERVAL_S = 5.0
# Metadata answers are a few bytes; cap what we read so a misrouted request cannot flood us.
_MAX_BODY = 64 * 1024
_RETRY = "will retry on the next poll"


class WatcherError(Exception):
    """A metadata request failed or its answer made no sense; the next poll tries again.

    Attributes:
        problem: What was wrong, without the "will retry" tail (for joining several).
        url: The URL that failed, or None when the error sums up several.
    """

    def __init__(self, problem: str, url: str | None = None) -> None:
        super().__init__(f"{problem}; {_RETRY}")
        self.problem = problem
        self.url = url


def _request_error(method: str, url: str, problem: str) -> WatcherError:
    return WatcherError(f"{method} {url} {problem}", url)


def _all_failed(errors: list[WatcherError]) -> WatcherError:
    if len(errors) == 1:
        return errors[0]
    return WatcherError(
        "no metadata path could be checked: " + "; ".join(e.problem for e in errors)
    )


@dataclass(frozen=True)
class HttpResponse:
    """A metadata answer below 500 (5xx, timeouts and refusals are WatcherErrors)."""

    status: int
    body: bytes
    headers: Mapping[str, str]

    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace").strip()

    def header(self, name: str) -> str | None:
        for key, value in self.headers.items():
            if key.lower() == name.lower():
                return value
        return None


class MetadataHttp:
    """A minimal HTTP client for metadata services: no proxy, a timeout on every request.

    Args:
        timeout: Seconds any one socket operation (connect, each read) may take.
    """

    def __init__(self, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        if not timeout > 0:
            raise ValueError(f"metadata request timeout must be > 0 seconds, got {timeout!r}")
        self.timeout = timeout
        # An empty ProxyHandler replaces the default one, which reads HTTP_PROXY & co.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def request(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> HttpResponse:
        """Sends one request and returns the answer, whatever its status below 500.

        Raises:
            WatcherError: On a timeout, a refused or dropped connection, or a 5xx status.
        """
        limit = self.timeout if timeout is None else timeout
        req = urllib.request.Request(url, method=method, headers=dict(headers or {}))
        try:
            try:
                with self._opener.open(req, timeout=limit) as resp:
                    status = int(resp.status)
                    body = resp.read(_MAX_BODY)
                    got = dict(resp.headers.items())
            except urllib.error.HTTPError as exc:
                status = exc.code
                got = dict(exc.headers.items()) if exc.headers is not None else {}
                try:
                    body = exc.read(_MAX_BODY)
                finally:
                    exc.close()
        except TimeoutError:
            raise _request_error(method, url, f"timed out after {limit:g}s") from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                raise _request_error(method, url, f"timed out after {limit:g}s") from None
            raise _request_error(method, url, f"failed: {exc.reason}") from None
        except (OSError, HTTPException) as exc:
            raise _request_error(method, url, f"failed: {type(exc).__name__}: {exc}") from None
        if status >= 500:
            raise _request_error(method, url, f"returned HTTP {status}")
        return HttpResponse(status, body, got)


class _FirstSeen:
    """When each source started showing its current notice, so derived deadlines hold still."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[str, float]] = {}

    def mark(self, source: str, identity: str, now: float) -> float:
        prev = self._seen.get(source)
        if prev is not None and prev[0] == identity:
            return prev[1]
        self._seen[source] = (identity, now)
        return now

    def clear(self, source: str) -> None:
        self._seen.pop(source, None)


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


def _readable_spot_time(resp: HttpResponse) -> float | None:
    """The ``time`` of a spot notice whose other fields are wrong, if that one is fine."""
    try:
        data = json.loads(resp.body)
        return parse_aws_time(data.get("time")) if isinstance(data, dict) else None
    except ValueError:
        return None


_AWS_ACTIONS = {
    "terminate": NoticeKind.TERMINATE,
    "stop": NoticeKind.STOP,
    "hibernate": NoticeKind.HIBERNATE,
}


class AwsImdsWatcher:
    """Watches the EC2 instance metadata service (IMDSv2 only) for the end of this VM.

    One :meth:`poll` checks the spot interruption notice, the rebalance recommendation and
    the Auto Scaling target lifecycle state.

    The session token is fetched with ``PUT /latest/api/token`` and reused until the last
    tenth of its life (at most the last 60 s) begins; then it is fetched again before the
    next request, so a poll never sends a token that is about to lapse. A 401 (token
    expired early or revoked) fetches a new token once and retries that request in the same
    poll. There is no IMDSv1 fallback: an instance that requires tokens is the common case,
    and a failed token request is reported, not papered over.

    A 200 on the spot path whose body is not the documented ``{"action", "time"}`` (bad
    JSON, an unknown action, a bad time) is still a terminate notice, due two minutes after
    it was first seen (or at its ``time``, if that is readable and sooner), with the problem
    in :attr:`last_errors`: IMDS serves that path only
    during an interruption, and ignoring it would lose the emergency checkpoint.

    Args:
        endpoint: Base URL of IMDS. Default: ``$AWS_EC2_METADATA_SERVICE_ENDPOINT``, else
            ``http://169.254.169.254``. A trailing slash is fine.
        timeout: Seconds each socket operation of each request may take.
        token_ttl: Lifetime requested for session tokens, 1 to 21600 seconds.
        asg_grace: Seconds from first seeing the lifecycle state "Terminated" to the assumed
            deadline; Auto Scaling gives none, so this is deliberately short.
        clock: Wall clock for ``seen_at`` and derived deadlines.

    Raises:
        ValueError: On a bad timeout, token_ttl or asg_grace.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        token_ttl: int = AWS_MAX_TOKEN_TTL,
        asg_grace: float = DEFAULT_ASG_GRACE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not 1 <= token_ttl <= AWS_MAX_TOKEN_TTL:
            raise ValueError(
                f"IMDSv2 token_ttl must be 1 to {AWS_MAX_TOKEN_TTL} seconds, got {token_ttl!r}"
            )
        if not asg_grace >= 0:
            raise ValueError(f"asg_grace must be >= 0 seconds, got {asg_grace!r}")
        base = endpoint or os.environ.get(AWS_ENDPOINT_ENV) or DEFAULT_AWS_ENDPOINT
        self.endpoint = base.rstrip("/")
        self.token_ttl = token_ttl
        self.asg_grace = asg_grace
        self.last_errors: list[str] = []
        self._http = MetadataHttp(timeout)
        self._clock = clock
        self._token: str | None = None
        self._token_expires = 0.0  # time.monotonic()
        self._first_seen = _FirstSeen()
        # Problems of a poll that did not stop a path from being checked (an unreadable
        # notice still counts as one); they go to last_errors with the failures.
        self._warnings: list[str] = []

    @property
    def timeout(self) -> float:
        return self._http.timeout

    def _url(self, path: str) -> str:
        return self.endpoint + path

    def _refresh_margin(self) -> float:
        return min(60.0, self.token_ttl / 10)

    def _fetch_token(self) -> str:
        url = self._url(AWS_TOKEN_PATH)
        # Count the lifetime from before the request: the server's clock starts no earlier.
        started = time.monotonic()
        resp = self._http.request("PUT", url, {AWS_TOKEN_TTL_HEADER: str(self.token_ttl)})
        token = resp.text()
        if resp.status != 200 or not token:
            raise _request_error(
                "PUT",
                url,
                f"returned HTTP {resp.status} without an IMDSv2 token "
                "(is IMDS disabled on this instance?)",
            )
        self._token = token
        self._token_expires = started + self.token_ttl
        return token

    def _current_token(self) -> str:
        if self._token is None or time.monotonic() >= self._token_expires - self._refresh_margin():
            return self._fetch_token()
        return self._token

    def _get(self, path: str) -> HttpResponse:
        url = self._url(path)
        resp = self._http.request("GET", url, {AWS_TOKEN_HEADER: self._current_token()})
        if resp.status == 401:
            self._token = None
            resp = self._http.request("GET", url, {AWS_TOKEN_HEADER: self._fetch_token()})
            if resp.status == 401:
                raise _request_error("GET", url, "returned HTTP 401 even with a fresh token")
        if resp.status not in (200, 404):
            raise _request_error("GET", url, f"returned unexpected HTTP {resp.status}")
        return resp

    def _json_object(self, path: str, resp: HttpResponse) -> dict[str, Any]:
        try:
            data = json.loads(resp.body)
        except ValueError as exc:
            raise _request_error(
                "GET", self._url(path), f"returned malformed JSON: {exc}"
            ) from None
        if not isinstance(data, dict):
            raise _request_error(
                "GET", self._url(path), f"returned JSON that is not an object: {resp.text()!r}"
            )
        return data

    def _check_spot(self, now: float) -> Notice | None:
        source = "aws-imds:spot"
        resp = self._get(AWS_SPOT_PATH)
        if resp.status == 404:
            self._first_seen.clear(source)
            return None
        # Only a notice is ever served here (404 otherwise), so a 200 we cannot read is still
        # a notice: dropping it would skip the emergency checkpoint the warning exists for.
        try:
            action, kind, when, deadline = self._parse_spot(resp)
        except WatcherError as exc:
            seen_at = self._first_seen.mark(source, f"unreadable {resp.text()}", now)
            self._warnings.append(
                f"{exc.problem}; treated as a terminate notice due "
                f"{AWS_SPOT_WARNING_S:g}s after it was first seen"
            )
            deadline = seen_at + AWS_SPOT_WARNING_S
            stated = _readable_spot_time(resp)
            if stated is not None:
                # An action we do not know yet still comes with AWS's own deadline.
                deadline = min(deadline, stated)
            return Notice(
                source,
                NoticeKind.TERMINATE,
                deadline,
                seen_at=seen_at,
                detail={"unreadable": True, "body": resp.text()[:200]},
            )
        detail: dict[str, Any] = {"action": action, "time": when}
        seen_at = self._first_seen.mark(source, f"{action} {when}", now)
        if deadline < seen_at:
            detail["late"] = True
        return Notice(source, kind, deadline, seen_at=seen_at, detail=detail)

    def _parse_spot(self, resp: HttpResponse) -> tuple[str, NoticeKind, str, float]:
        """Reads a spot notice's action, kind, raw time and deadline.

        Raises:
            WatcherError: On a body that is not the documented ``{"action", "time"}``.
        """
        data = self._json_object(AWS_SPOT_PATH, resp)
        action = data.get("action")
        kind = _AWS_ACTIONS.get(action) if isinstance(action, str) else None
        if kind is None or not isinstance(action, str):
            raise _request_error(
                "GET",
                self._url(AWS_SPOT_PATH),
                f"returned unknown action {action!r} (expected terminate, stop or hibernate)",
            )
        try:
            deadline = parse_aws_time(data.get("time"))
        except ValueError as exc:
            raise _request_error(
                "GET", self._url(AWS_SPOT_PATH), f"returned a bad time: {exc}"
            ) from None
        return action, kind, str(data["time"]), deadline

    def _check_rebalance(self, now: float) -> Notice | None:
        source = "aws-imds:rebalance"
        resp = self._get(AWS_REBALANCE_PATH)
        if resp.status == 404:
            self._first_seen.clear(source)
            return None
        data = self._json_object(AWS_REBALANCE_PATH, resp)
        notice_time = data.get("noticeTime")
        if not isinstance(notice_time, str):
            raise _request_error(
                "GET",
                self._url(AWS_REBALANCE_PATH),
                f"returned no noticeTime string: {resp.text()!r}",
            )
        seen_at = self._first_seen.mark(source, notice_time, now)
        return Notice(
            source,
            NoticeKind.REBALANCE,
            None,
            seen_at=seen_at,
            detail={"noticeTime": notice_time},
        )

    def _check_lifecycle(self, now: float) -> Notice | None:
        source = "aws-imds:asg"
        resp = self._get(AWS_LIFECYCLE_PATH)
        state = resp.text()
        if resp.status == 404 or state != "Terminated":
            self._first_seen.clear(source)
            return None
        seen_at = self._first_seen.mark(source, state, now)
        return Notice(
            source,
            NoticeKind.SCALE_IN,
            seen_at + self.asg_grace,
            seen_at=seen_at,
            detail={"state": state},
        )

    def poll(self) -> list[Notice]:
        """Checks all three paths once.

        Returns:
            The notices showing now (empty when there are none). Paths that failed, and
            spot notices that could not be read, are in :attr:`last_errors`, one line each.

        Raises:
            WatcherError: When no path could be checked (no token, or every path failed).
        """
        self.last_errors = []
        self._warnings = []
        try:
            self._current_token()
        except WatcherError as exc:
            self.last_errors = [str(exc)]
            raise
        now = self._clock()
        notices: list[Notice] = []
        errors: list[WatcherError] = []
        for check in (self._check_spot, self._check_rebalance, self._check_lifecycle):
            try:
                notice = check(now)
            except WatcherError as exc:
                errors.append(exc)
                continue
            if notice is not None:
                notices.append(notice)
        self.last_errors = [str(e) for e in errors] + self._warnings
        if len(errors) == 3:
            raise _all_failed(errors)
        return notices


class GcpMetadataWatcher:
    """Watches the GCE metadata server for preemption and terminating host maintenance.

    Every answer must carry ``Metadata-Flavor: Google``; one without it came from something
    else (a captive proxy, a misrouted host) and is treated as garbage.

    Args:
        host: ``host[:port]`` of the metadata server. Default: ``$GCE_METADATA_HOST``, else
            ``metadata.google.internal``. An ``http://`` prefix is tolerated.
        timeout: Seconds each socket operation of a request may take; a long-poll gets its
            ``timeout_sec`` on top.
        clock: Wall clock for ``seen_at`` and derived deadlines.

    Raises:
        ValueError: On a bad timeout.
    """

    def __init__(
        self,
        host: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        raw = host or os.environ.get(GCP_HOST_ENV) or DEFAULT_GCP_HOST
        raw = raw.removeprefix("http://").rstrip("/")
        self.host = raw
        self.last_errors: list[str] = []
        self._http = MetadataHttp(timeout)
        self._clock = clock
        self._preempted_etag: str | None = None
        self._first_seen = _FirstSeen()

    @property
    def timeout(self) -> float:
        return self._http.timeout

    def _url(self, path: str) -> str:
        return f"http://{self.host}{path}"

    def _get(self, path: str, query: dict[str, str] | None = None, extra: float = 0) -> str:
        url = self._url(path) + (f"?{urlencode(query)}" if query else "")
        resp = self._http.request(
            "GET", url, {GCP_FLAVOR_HEADER: GCP_FLAVOR}, timeout=self.timeout + extra
        )
        if resp.header(GCP_FLAVOR_HEADER) != GCP_FLAVOR:
            raise _request_error(
                "GET",
                url,
                f"answered without the {GCP_FLAVOR_HEADER}: {GCP_FLAVOR} header "
                "(not the metadata server?)",
            )
        if resp.status != 200:
            raise _request_error("GET", url, f"returned unexpected HTTP {resp.status}")
        if path == GCP_PREEMPTED_PATH:
            self._preempted_etag = resp.header("ETag") or self._preempted_etag
        return resp.text()

    def _read_preempted(self, wait: float) -> str:
        if wait <= 0 or self._preempted_etag is None:
            # Without an ETag, wait_for_change would wait for the *next* change and miss a
            # TRUE that is already there; read the value (and its ETag) first.
            value = self._get(GCP_PREEMPTED_PATH)
            if wait <= 0 or value == "TRUE" or self._preempted_etag is None:
                return value
        timeout_sec = max(1, math.ceil(wait))
        query = {
            "wait_for_change": "true",
            "timeout_sec": str(timeout_sec),
            "last_etag": self._preempted_etag,
        }
        return self._get(GCP_PREEMPTED_PATH, query, extra=timeout_sec)

    def _check_preempted(self, wait: float) -> Notice | None:
        source = "gcp:preempted"
        value = self._read_preempted(wait)
        if value == "FALSE":
            self._first_seen.clear(source)
            return None
        if value != "TRUE":
            raise _request_error(
                "GET",
                self._url(GCP_PREEMPTED_PATH),
                f"returned {value[:80]!r}, expected TRUE or FALSE",
            )
        seen_at = self._first_seen.mark(source, value, self._clock())
        return Notice(
            source,
            NoticeKind.PREEMPTED,
            seen_at + GCP_PREEMPT_GRACE_S,
            seen_at=seen_at,
            detail={"preempted": value},
        )

    def _check_maintenance(self) -> Notice | None:
        source = "gcp:maintenance"
        value = self._get(GCP_MAINTENANCE_PATH)
        if value in ("NONE", "MIGRATE_ON_HOST_MAINTENANCE"):
            # A live migration pauses the VM briefly; it does not end it.
            self._first_seen.clear(source)
            return None
        if value != "TERMINATE_ON_HOST_MAINTENANCE":
            raise _request_error(
                "GET",
                self._url(GCP_MAINTENANCE_PATH),
                f"returned {value[:80]!r}, expected NONE, MIGRATE_ON_HOST_MAINTENANCE "
                "or TERMINATE_ON_HOST_MAINTENANCE",
            )
        seen_at = self._first_seen.mark(source, value, self._clock())
        return Notice(
            source,
            NoticeKind.MAINTENANCE,
            seen_at + GCP_MAINTENANCE_GRACE_S,
            seen_at=seen_at,
            detail={"maintenance_event": value},
        )

    def poll(self, wait: float = 0) -> list[Notice]:
        """Checks ``preempted`` and ``maintenance-event`` once.

        Args:
            wait: When > 0, long-poll ``preempted`` for up to this many seconds (rounded up
                to whole seconds) with ``wait_for_change``, returning as soon as it changes;
                ``maintenance-event`` is then read without waiting.

        Returns:
            The notices showing now. Paths that failed are in :attr:`last_errors`.

        Raises:
            WatcherError: When neither path could be checked.
        """
        self.last_errors = []
        notices: list[Notice] = []
        errors: list[WatcherError] = []
        checks: tuple[Callable[[], Notice | None], ...] = (
            lambda: self._check_preempted(wait),
            self._check_maintenance,
        )
        for check in checks:
            try:
                notice = check()
            except WatcherError as exc:
                errors.append(exc)
                continue
            if notice is not None:
                notices.append(notice)
        self.last_errors = [str(e) for e in errors]
        if len(errors) == len(checks):
            raise _all_failed(errors)
        return notices


class Watcher(Protocol):
    """What :class:`PollLoop` needs: one check per call, and the partial errors it left."""

    last_errors: list[str]

    def poll(self) -> list[Notice]: ...


class PollLoop:
    """Polls one watcher every ``interval`` seconds in a daemon thread.

    The loop only relays: every notice of every poll goes to ``on_notice`` (the handler
    dedups), and errors go to ``on_error`` as one-line messages, each reported once until it
    goes away or changes. No exception ends the loop; only :meth:`stop` does.

    Args:
        watcher: The watcher to poll.
        on_notice: Called in the loop's thread with each notice.
        on_error: Called in the loop's thread with each new error message.
        interval: Seconds from the start of one poll to the start of the next, > 0 and at
            most 5 (a two-minute warning leaves no room for slower polling).
        name: The thread's name.

    Raises:
        ValueError: On a bad interval.
    """

    def __init__(
        self,
        watcher: Watcher,
        on_notice: Callable[[Notice], None],
        on_error: Callable[[str], None],
        *,
        interval: float = DEFAULT_INTERVAL_S,
        name: str = "spottrain-watcher",
    ) -> None:
        if not 0 < interval <= MAX_INTERVAL_S:
            raise ValueError(
                f"poll interval must be > 0 and <= {MAX_INTERVAL_S:g} seconds, got {interval!r}"
            )
        self.watcher = watcher
        self.interval = interval
        self._on_notice = on_notice
        self._on_error = on_error
        self._stop = threading.Event()
        self._reported: set[str] = set()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> PollLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> bool:
        """Asks the loop to stop and waits for it.

        Args:
            timeout: Seconds to wait for an in-flight poll to end (default: the watcher's
                request timeout plus one second). The thread is a daemon, so one stuck past
                this does not keep the process alive.

        Returns:
            Whether the thread has ended.
        """
        self._stop.set()
        if not self._thread.is_alive():
            return True
        if timeout is None:
            timeout = float(getattr(self.watcher, "timeout", DEFAULT_TIMEOUT_S)) + 1.0
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> PollLoop:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def poll_once(self) -> None:
        """Runs one poll and relays its results, as the loop does on each tick."""
        messages: list[str] = []
        notices: list[Notice] = []
        try:
            notices = self.watcher.poll()
            messages = list(self.watcher.last_errors)
        except WatcherError as exc:
            messages = [str(exc)]
        except Exception as exc:
            messages = [f"watcher poll crashed: {type(exc).__name__}: {exc}; {_RETRY}"]
        for notice in notices:
            try:
                self._on_notice(notice)
            except Exception as exc:
                messages.append(
                    f"notice callback failed on {notice.source}: {type(exc).__name__}: {exc}; "
                    "the notice is delivered again on the next poll"
                )
        current = set(messages)
        for message in dict.fromkeys(messages):
            if message not in self._reported:
                try:
                    self._on_error(message)
                except Exception:
                    log.exception("error callback failed on %r", message)
        self._reported = current

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            self.poll_once()
            next_at += self.interval
            now = time.monotonic()
            if next_at < now:
                # A slow poll (a timeout) must not be followed by a burst of catch-up polls.
                next_at = now
            self._stop.wait(next_at - now)

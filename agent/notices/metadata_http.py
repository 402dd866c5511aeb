"""What every metadata-service monitor shares: a proxy-free HTTP client, its errors, and
when a source first showed its current notice.

Choices that hold for every monitor of a metadata service:

* A monitor reports a notice on every poll for as long as its source shows it; the handler
  dedups by the notice's id. ``seen_at`` is when the monitor *first* saw that notice (reset
  once the source clears), so deadlines derived from it (AWS Auto Scaling, GCP) stay the
  same from poll to poll instead of sliding forward.
* One poll of a service checks every source of it. A source that fails does not hide the
  others: the notices found are returned and the failures of the last poll are kept in
  ``last_errors``. :class:`WatcherError` is raised only when no source could be checked.
* Requests never go through an HTTP proxy (``HTTP_PROXY`` and friends are ignored): metadata
  services are link-local and a proxy would answer for the proxy's own VM, or not at all.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.client import HTTPException

from .notice import Notice

DEFAULT_TIMEOUT_S = 2.0
# Metadata answers are a few bytes; cap what we read so a misrouted request cannot flood us.
_MAX_BODY = 64 * 1024
RETRY = "will retry on the next poll"


class WatcherError(Exception):
    """A metadata request failed or its answer made no sense; the next poll tries again.

    Attributes:
        problem: What was wrong, without the "will retry" tail (for joining several).
        url: The URL that failed, or None when the error sums up several.
    """

    def __init__(self, problem: str, url: str | None = None) -> None:
        super().__init__(f"{problem}; {RETRY}")
        self.problem = problem
        self.url = url


def request_error(method: str, url: str, problem: str) -> WatcherError:
    return WatcherError(f"{method} {url} {problem}", url)


def all_failed(errors: list[WatcherError]) -> WatcherError:
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
            raise request_error(method, url, f"timed out after {limit:g}s") from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                raise request_error(method, url, f"timed out after {limit:g}s") from None
            raise request_error(method, url, f"failed: {exc.reason}") from None
        except (OSError, HTTPException) as exc:
            raise request_error(method, url, f"failed: {type(exc).__name__}: {exc}") from None
        if status >= 500:
            raise request_error(method, url, f"returned HTTP {status}")
        return HttpResponse(status, body, got)


class FirstSeen:
    """When one source started showing its current notice, so derived deadlines hold still."""

    def __init__(self) -> None:
        self._seen: tuple[str, float] | None = None

    def mark(self, identity: str, now: float) -> float:
        if self._seen is not None and self._seen[0] == identity:
            return self._seen[1]
        self._seen = (identity, now)
        return now

    def clear(self) -> None:
        self._seen = None


def check_all(
    checks: tuple[Callable[[], Notice | None], ...],
) -> tuple[list[Notice], list[WatcherError]]:
    """Runs every check of one poll; a failed one does not stop the others.

    Returns:
        The notices found and the errors of the checks that failed.
    """
    notices: list[Notice] = []
    errors: list[WatcherError] = []
    for check in checks:
        try:
            notice = check()
        except WatcherError as exc:
            errors.append(exc)
            continue
        if notice is not None:
            notices.append(notice)
    return notices, errors

"""A fake of GCP Secret Manager's REST API (v1) over real HTTP: the one call a VM's boot makes.

::

    GET /v1/projects/{project}/secrets/{secret}/versions/{version}:access
    -> 200 {"name": "projects/{number}/secrets/{secret}/versions/{n}",
            "payload": {"data": "<base64>", "dataCrc32c": "<decimal CRC32C of the bytes>"}}

``version`` is ``latest`` (the newest version) or a number; ``project`` its id or its number.
As the API does, it requires ``Authorization: Bearer TOKEN`` and answers, in Google's error
shape ``{"error": {"code", "message", "status"}}``:

- 401 ``UNAUTHENTICATED`` without a bearer token, or with one ``token_check`` refuses (with
  ``WWW-Authenticate: Bearer``);
- 403 ``PERMISSION_DENIED`` for a secret the test denies, whether or not it exists (IAM is
  asked first): "Permission 'secretmanager.versions.access' denied for resource
  'projects/P/secrets/S/versions/V' (or it may not exist).", naming it as the request did;
- 404 ``NOT_FOUND`` for a secret that does not exist or has no versions ("Secret
  [projects/N/secrets/S] not found or has no versions.") or a version number it does not have
  ("Secret Version [projects/N/secrets/S/versions/V] not found.").

Every request is recorded (:attr:`SecretManagerFake.accesses`: project, secret, version and
status, never the token) and counted; an exception inside the fake is answered 500 and kept
in ``internal_errors``, for the test to assert empty::

    with GoogleOAuthFake() as oauth, SecretManagerFake(token_check=oauth.is_valid) as sm:
        sm.add("gh-deploy", "ghp_...")
        sm.deny("hf-token")
        session = AuthorizedSession(credentials)
        session.get(f"{sm.url}/v1/projects/{sm.project}/secrets/gh-deploy/versions/latest:access")
        sm.count("gh-deploy")
"""

from __future__ import annotations

import base64
import json
import re
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from fakes.http_fake import DispatchingHandler, HTTPFake

DEFAULT_PROJECT = "spottrain-test"
DEFAULT_PROJECT_NUMBER = "271828182845"
_SECRET_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,255}\Z")
_ACCESS_RE = re.compile(
    r"^/v1/projects/(?P<p>[^/]+)/secrets/(?P<s>[^/]+)/versions/(?P<v>[^/:]+):access$"
)
_SEE = "See https://developers.google.com/identity/sign-in/web/devconsole-project."


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC32C = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), the checksum Secret Manager reports as ``dataCrc32c``."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


@dataclass(frozen=True)
class Access:
    """One request to the fake: what it named, and the HTTP status it was answered."""

    project: str
    secret: str
    version: str
    status: int


class _Handler(DispatchingHandler, methods=("GET", "POST")):
    def reply(self, status: int, body: dict[str, Any], headers: dict[str, str]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=UTF-8")
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _Refusal(Exception):
    def __init__(self, code: int, status: str, message: str, **headers: str) -> None:
        super().__init__(message)
        self.code = code
        self.body = {"error": {"code": code, "message": message, "status": status}}
        self.headers = headers


class SecretManagerFake(HTTPFake):
    """The fake; use it as a context manager (or call start() and close()).

    Args:
        project: the default project of :meth:`add` and :meth:`deny`.
        project_number: its number, which the API names resources by.
        token_check: says whether a bearer token is good (``GoogleOAuthFake.is_valid``);
            None takes any.

    Attributes:
        accesses: every request, oldest first.
        internal_errors: exceptions inside the fake, for the test to assert empty.
    """

    def __init__(
        self,
        project: str = DEFAULT_PROJECT,
        *,
        project_number: str = DEFAULT_PROJECT_NUMBER,
        token_check: Callable[[str], bool] | None = None,
    ) -> None:
        super().__init__(_Handler, thread_name="fake-secret-manager")
        self.project = project
        self.token_check = token_check
        self.accesses: list[Access] = []
        self.internal_errors: list[str] = []
        self._lock = threading.Lock()
        self._numbers: dict[str, str] = {project: project_number}
        self._versions: dict[tuple[str, str], list[bytes]] = {}  # (number, secret) -> values
        self._denied: set[tuple[str, str]] = set()

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``, the API's root (``secretmanager`` endpoint)."""
        return f"http://127.0.0.1:{self.port}"

    def project_number(self, project: str | None = None) -> str:
        """The number of ``project`` (made up, and fixed, for a project other than the
        default)."""
        project = project or self.project
        with self._lock:
            return self._number(project)

    # what a test sets

    def add(self, secret: str, value: bytes | str, *, project: str | None = None) -> int:
        """A new version of ``secret`` (created if need be) holding ``value``; its number.

        Raises:
            ValueError: the secret id is not one the API accepts.
        """
        if not _SECRET_ID_RE.match(secret):
            raise ValueError(f"a secret id is 1 to 255 of [A-Za-z0-9_-], got {secret!r}")
        data = value.encode() if isinstance(value, str) else bytes(value)
        with self._lock:
            versions = self._versions.setdefault((self._number(project), secret), [])
            versions.append(data)
            return len(versions)

    def deny(self, secret: str, *, project: str | None = None) -> None:
        """Every access to ``secret`` is refused as IAM refuses a caller without
        ``secretmanager.versions.access`` on it."""
        with self._lock:
            self._denied.add((self._number(project), secret))

    def clear_denials(self) -> None:
        with self._lock:
            self._denied.clear()

    # inspection

    def count(self, secret: str | None = None, *, status: int | None = None) -> int:
        """Requests received for ``secret`` (any if None), answered ``status`` (any if None)."""
        with self._lock:
            return sum(
                1
                for a in self.accesses
                if secret in (None, a.secret) and status in (None, a.status)
            )

    # serving

    def _number(self, project: str | None) -> str:
        project = project or self.project
        if project.isdigit():
            return project
        if project not in self._numbers:
            self._numbers[project] = str(10**11 + zlib.crc32(project.encode()))
        return self._numbers[project]

    def _handle(self, handler: _Handler, method: str) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        if length:
            handler.rfile.read(length)
        path = unquote(urlsplit(handler.path).path)
        m = _ACCESS_RE.match(path) if method == "GET" else None
        project, secret, version = (m["p"], m["s"], m["v"]) if m else ("", "", "")
        headers: dict[str, str] = {}
        try:
            if m is None:
                raise _Refusal(404, "NOT_FOUND", f"The fake has no method for {method} {path}.")
            status, body = self._access(
                handler.headers.get("Authorization"), project, secret, version
            )
        except _Refusal as e:
            status, body, headers = e.code, e.body, e.headers
        except Exception as e:
            with self._lock:
                self.internal_errors.append(f"{method} {path}: {type(e).__name__}: {e}")
            status, body = (
                500,
                {"error": {"code": 500, "message": f"fake bug: {e}", "status": "INTERNAL"}},
            )
        with self._lock:
            self.accesses.append(Access(project, secret, version, status))
        handler.reply(status, body, headers)

    def _access(
        self, authorization: str | None, project: str, secret: str, version: str
    ) -> tuple[int, dict[str, Any]]:
        scheme, _, token = (authorization or "").partition(" ")
        challenge = {"WWW-Authenticate": 'Bearer realm="https://accounts.google.com/"'}
        if scheme.lower() != "bearer" or not token.strip():
            raise _Refusal(
                401,
                "UNAUTHENTICATED",
                "Request is missing required authentication credential. Expected OAuth 2 "
                f"access token, login cookie or other valid authentication credential. {_SEE}",
                **challenge,
            )
        if self.token_check is not None and not self.token_check(token.strip()):
            raise _Refusal(
                401,
                "UNAUTHENTICATED",
                "Request had invalid authentication credentials. Expected OAuth 2 access "
                f"token, login cookie or other valid authentication credential. {_SEE}",
                **challenge,
            )
        with self._lock:
            number = self._number(project)
            denied = (number, secret) in self._denied
            versions = list(self._versions.get((number, secret), []))
        if denied:
            raise _Refusal(
                403,
                "PERMISSION_DENIED",
                "Permission 'secretmanager.versions.access' denied for resource "
                f"'projects/{project}/secrets/{secret}/versions/{version}' (or it may not exist).",
            )
        name = f"projects/{number}/secrets/{secret}"
        if version == "latest":
            if not versions:
                raise _Refusal(404, "NOT_FOUND", f"Secret [{name}] not found or has no versions.")
            n = len(versions)
        elif version.isdigit() and 1 <= int(version) <= len(versions):
            n = int(version)
        else:
            raise _Refusal(
                404, "NOT_FOUND", f"Secret Version [{name}/versions/{version}] not found."
            )
        data = versions[n - 1]
        return 200, {
            "name": f"{name}/versions/{n}",
            "payload": {
                "data": base64.b64encode(data).decode(),
                "dataCrc32c": str(crc32c(data)),
            },
        }

"""An HTTP front for moto's server: what a box VM and the controller talk to as "AWS".

It listens on its own free port of 127.0.0.1 and forwards every request to a moto server
(``ThreadedMotoServer``) unchanged, whatever the service (EC2, S3 path-style or
virtual-host-style, Secrets Manager, STS...): method, target, headers (``Host`` included, so
SigV4 signatures and S3's virtual-host buckets stay valid), body and status. Bodies stream in
pieces of :data:`CHUNK` bytes both ways (``Content-Length`` or chunked; ``Expect:
100-continue`` is answered by the front), so an S3 object of hundreds of MB is never held
whole here (moto keeps it, as its store); :attr:`Ec2Front.peak_buffer` says the most the
front held at once. A request in absolute
form (``GET http://bucket.s3.amazonaws.com/key``, as a client configured with the front as
its HTTP proxy sends) is forwarded in origin form with its ``Host``.

It answers these itself, as AWS does where moto does not:

- EC2 ``RunInstances`` whose ``UserData`` decodes to more than 16384 bytes: HTTP 400 with
  EC2's XML error envelope, ``InvalidParameterValue`` "User data is limited to 16384 bytes",
  and nothing is created (moto launches it).
- EC2 ``GetConsoleOutput``, from :attr:`Ec2Front.console_source` (``fn(instance_id) ->
  bytes | str | None``): the newest 64 KiB it gives, base64, in EC2's
  ``GetConsoleOutputResponse``, whatever ``Latest`` says (EC2 keeps only the newest 64 KiB
  either way); no source, or ``None`` from it, and moto answers.
- Denials standing in for IAM: :meth:`Ec2Front.deny_secret` (Secrets Manager
  ``GetSecretValue`` of that secret, by name or ARN: HTTP 400 ``AccessDeniedException``, the
  role "is not authorized to perform: secretsmanager:GetSecretValue ... because no
  identity-based policy allows" it) and :meth:`Ec2Front.deny_object` (S3 GET or HEAD of a key
  under a prefix: HTTP 403 ``AccessDenied``).

Every request is counted by (service, operation): the service from the SigV4 credential scope
(the ``Authorization`` header, or ``X-Amz-Credential`` of a presigned URL), the operation from
``Action=`` (query APIs: EC2, STS), ``X-Amz-Target`` (JSON APIs: Secrets Manager) or, for S3,
the HTTP method. An exception inside the front is answered 500 (502 when moto cannot be
reached) and kept in ``internal_errors``, for the test to assert empty::

    # Before an AwsHarness's moto (Ec2Front() starts a moto of its own):
    with Ec2Front(harness.endpoint_url, account_id=harness.account_id) as front:
        ec2 = boto3.client("ec2", endpoint_url=front.url, region_name="us-east-1", ...)
        front.console_source = hypervisor_console   # instance id -> bytes | str | None
        front.deny_secret("gh/deploy")
        front.count("ec2", "RunInstances")

``account_id`` puts ``x-moto-account-id`` on the requests that do not carry one (a VM's boot
signs its own requests and knows nothing of moto), so what a VM does lands in the same moto
account as what the test and controller do.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import http.client
import ipaddress
import json
import logging
import re
import secrets
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit
from xml.sax.saxutils import escape

from fakes.http_fake import DispatchingHandler, HTTPFake

CHUNK = 1 << 20
USER_DATA_LIMIT = 16384
CONSOLE_LIMIT = 64 * 1024
MOTO_DEFAULT_ACCOUNT = "123456789012"
# Form and JSON bodies (EC2, STS, Secrets Manager calls) are read whole to be looked at; a
# larger one is streamed without a look.
_INSPECT_LIMIT = 16 << 20
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "expect",
}
_CREDENTIAL_RE = re.compile(r"Credential=[^/,\s]+/\d{8}/[^/]+/([^/]+)/aws4_request")
_QUERY_CREDENTIAL_RE = re.compile(r"^[^/]+/\d{8}/[^/]+/([^/]+)/aws4_request$")
_S3_PATH_HOST_RE = re.compile(r"^s3[.-]((dualstack|fips)[.-])?([^.]*)\.amazonaws\.com$")
_S3_VIRTUAL_HOST_RE = re.compile(r"^(.+)\.s3[.-].*amazonaws\.com$")
_SECRET_ARN_RE = re.compile(r"^arn:aws[a-z-]*:secretsmanager:[^:]*:[^:]*:secret:(.+)$")
# Secrets Manager adds a hyphen and six random characters to the name in a secret's ARN.
_ARN_SUFFIX_RE = re.compile(r"-[A-Za-z0-9]{6}$")
_AMZN_ERROR_TYPE = (
    "AccessDeniedException:http://internal.amazon.com/coral/com.amazon.coral.service/"
)


class _Handler(
    DispatchingHandler,
    methods=("GET", "HEAD", "PUT", "POST", "DELETE", "PATCH", "OPTIONS"),
):
    disable_nagle_algorithm = True


class _Answered(Exception):
    """The front answered the request itself (nothing goes to moto)."""


class _ClientGone(Exception):
    """The client hung up, or sent less than it announced."""


class _UpstreamError(Exception):
    """moto could not be reached, or broke off its answer."""


class Ec2Front(HTTPFake):
    """The front; use it as a context manager (or call start() and close()).

    Args:
        upstream: the moto server to forward to (``http://127.0.0.1:PORT``); None starts a
            ``ThreadedMotoServer`` of the front's own, stopped by close().
        account_id: the moto account for requests that name none (``x-moto-account-id``).
        role: the IAM role a denial names (``arn:aws:sts::ACCOUNT:assumed-role/ROLE/box``).

    Attributes:
        console_source: ``fn(instance_id) -> bytes | str | None`` serving ``GetConsoleOutput``.
        internal_errors: exceptions inside the front, for the test to assert empty.
        peak_buffer: the most bytes of one request or response body held at once.
    """

    def __init__(
        self,
        upstream: str | None = None,
        *,
        account_id: str | None = None,
        role: str = "spottrain-vm",
        upstream_timeout: float = 300.0,
    ) -> None:
        # Werkzeug logs every request of moto's server at INFO; that is noise in test output.
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        self._moto: Any = None
        if upstream is None:
            from moto.server import ThreadedMotoServer

            self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            self._moto.start()
            host, port = self._moto.get_host_and_port()
            upstream = f"http://{host}:{port}"
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"upstream must be http://HOST:PORT, got {upstream!r}")
        self.upstream_url = f"http://{parts.hostname}:{parts.port}"
        self._upstream = (parts.hostname, parts.port)
        self.upstream_timeout = upstream_timeout
        self.account_id = account_id
        self.role = role
        self.console_source: Callable[[str], bytes | str | None] | None = None
        self.internal_errors: list[str] = []
        self.peak_buffer = 0
        self._lock = threading.Lock()
        self._calls: Counter[tuple[str, str]] = Counter()
        self._denied_secrets: set[str] = set()
        self._denied_objects: list[tuple[str, str]] = []
        try:
            super().__init__(_Handler, thread_name="ec2-front")
        except BaseException:
            self._stop_moto()
            raise

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``, the ``endpoint_url`` to give every AWS client."""
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        super().close()
        self._stop_moto()

    def _stop_moto(self) -> None:
        if self._moto is not None:
            self._moto.stop()
            self._moto = None

    # --- what a test sets ---------------------------------------------------------------

    def deny_secret(self, secret_id: str) -> None:
        """``GetSecretValue`` of this secret (asked by name or ARN, given as either) is
        refused as IAM refuses a role without ``secretsmanager:GetSecretValue`` on it."""
        with self._lock:
            self._denied_secrets.add(secret_id)

    def deny_object(self, bucket: str, key_prefix: str = "") -> None:
        """S3 GET and HEAD of keys of ``bucket`` under ``key_prefix`` answer 403
        ``AccessDenied`` (other calls, such as PUT or a listing, pass)."""
        with self._lock:
            self._denied_objects.append((bucket, key_prefix))

    def clear_denials(self) -> None:
        with self._lock:
            self._denied_secrets.clear()
            self._denied_objects.clear()

    # --- inspection ---------------------------------------------------------------------

    def count(self, service: str | None = None, operation: str | None = None) -> int:
        """Requests received for ``service`` (``ec2``, ``s3``, ``secretsmanager``...) and
        ``operation`` (``RunInstances``, ``GetSecretValue``, ``GET``...); None matches any."""
        with self._lock:
            return sum(
                n
                for (s, o), n in self._calls.items()
                if service in (None, s) and operation in (None, o)
            )

    @property
    def calls(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._calls)

    # --- serving ------------------------------------------------------------------------

    def _handle(self, handler: _Handler, method: str) -> None:
        exchange = _Exchange(self, handler, method)
        try:
            exchange.serve()
        except (_ClientGone, BrokenPipeError, ConnectionResetError):
            # The client hung up (it timed out, or was killed with its VM).
            handler.close_connection = True
        except Exception as e:
            handler.close_connection = True
            cause = e.__cause__ if isinstance(e, _UpstreamError) and e.__cause__ else e
            with self._lock:
                self.internal_errors.append(
                    f"{method} {handler.path[:200]}: {type(cause).__name__}: {e}"
                )
            if not exchange.started:
                status = 502 if isinstance(e, _UpstreamError) else 500
                text = f"ec2 front: {type(cause).__name__}: {e}".encode()
                with contextlib.suppress(OSError):
                    exchange.answer(status, text, {})

    def _note_buffer(self, size: int) -> None:
        if size > self.peak_buffer:
            with self._lock:
                self.peak_buffer = max(self.peak_buffer, size)

    def _secret_denied(self, secret_id: str) -> bool:
        with self._lock:
            denied = set(self._denied_secrets)
        if not denied:
            return False
        asked = _secret_names(secret_id)
        return any(asked & _secret_names(d) for d in denied)

    def _object_denied(self, bucket: str, key: str) -> bool:
        with self._lock:
            rules = list(self._denied_objects)
        return bool(key) and any(b == bucket and key.startswith(p) for b, p in rules)


class _Exchange:
    """One request: read, counted, answered by the front or forwarded to moto."""

    def __init__(self, front: Ec2Front, handler: _Handler, method: str) -> None:
        self.front = front
        self.handler = handler
        self.method = method
        self.started = False
        target = handler.path
        if target.startswith(("http://", "https://")):
            parts = urlsplit(target)
            target = parts.path or "/"
            if parts.query:
                target += "?" + parts.query
        self.target = target
        self.path, _, self.query = target.partition("?")
        self.headers = handler.headers
        self.body: bytes | None = None  # read whole, when it is a form or JSON body

    # reading

    def serve(self) -> None:
        length = self.headers.get("Content-Length")
        chunked = "chunked" in (self.headers.get("Transfer-Encoding") or "").lower()
        ctype = (self.headers.get("Content-Type") or "").lower()
        inspect = ctype.startswith(("application/x-www-form-urlencoded", "application/x-amz-json"))
        if inspect and length is not None and not chunked and int(length) <= _INSPECT_LIMIT:
            self.body = self._read_exact(int(length))
        params = _params(self.query, self.body if ctype.startswith("application/x-www") else None)
        service = self._service()
        target = self.headers.get("X-Amz-Target") or ""
        if "Action" in params:
            operation = params["Action"]
        elif target:
            operation = target.rsplit(".", 1)[-1]
        else:
            operation = self.method
        with self.front._lock:
            self.front._calls[(service, operation)] += 1
        try:
            if params.get("Action") == "RunInstances":
                self._check_user_data(params)
            elif params.get("Action") == "GetConsoleOutput":
                self._serve_console(params)
            elif target == "secretsmanager.GetSecretValue" and self.body is not None:
                self._check_secret()
            elif service == "s3" and self.method in ("GET", "HEAD"):
                self._check_object(length, chunked)
        except _Answered:
            return
        self._forward(length, chunked)

    def _read(self, n: int) -> bytes:
        """Up to ``n`` bytes of the body, at least one."""
        try:
            piece = self.handler.rfile.read(n)
        except OSError as e:
            raise _ClientGone(str(e)) from e
        if not piece:
            raise _ClientGone("the client sent less than it announced")
        self.front._note_buffer(len(piece))
        return piece

    def _readline(self) -> bytes:
        try:
            return self.handler.rfile.readline(65537)
        except OSError as e:
            raise _ClientGone(str(e)) from e

    def _read_exact(self, n: int) -> bytes:
        data = self._read(n) if n else b""
        while len(data) < n:
            data += self._read(n - len(data))
        self.front._note_buffer(len(data))
        return data

    def _sized(self, length: str | None) -> Iterator[bytes]:
        left = int(length or 0)
        while left > 0:
            piece = self._read(min(left, CHUNK))
            left -= len(piece)
            yield piece

    def _drain(self, length: str | None, chunked: bool) -> None:
        """Read a body the front answers without (to keep the connection's framing)."""
        for _ in self._dechunked() if chunked else self._sized(length):
            pass

    def _dechunked(self) -> Iterator[bytes]:
        while True:
            line = self._readline()
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise _ClientGone(f"a bad chunk size line: {line[:40]!r}") from None
            if size == 0:
                while self._readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers: dropped
                return
            yield from self._sized(str(size))
            self._readline()

    def _service(self) -> str:
        m = _CREDENTIAL_RE.search(self.headers.get("Authorization") or "")
        if m:
            return m.group(1)
        credential = parse_qs(self.query).get("X-Amz-Credential")
        if credential:
            m = _QUERY_CREDENTIAL_RE.match(credential[-1])
            if m:
                return m.group(1)
        return "unknown"

    def _account(self) -> str:
        return (
            self.headers.get("x-moto-account-id") or self.front.account_id or MOTO_DEFAULT_ACCOUNT
        )

    # what the front answers itself

    def _check_user_data(self, params: dict[str, str]) -> None:
        encoded = params.get("UserData")
        if not encoded:
            return
        try:
            size = len(base64.b64decode(encoded, validate=True))
        except (binascii.Error, ValueError):
            return  # moto refuses what does not decode
        if size > USER_DATA_LIMIT:
            self._ec2_error(
                "InvalidParameterValue", f"User data is limited to {USER_DATA_LIMIT} bytes"
            )

    def _ec2_error(self, code: str, message: str) -> None:
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Response><Errors><Error><Code>{escape(code)}</Code>"
            f"<Message>{escape(message)}</Message></Error></Errors>"
            f"<RequestID>{uuid.uuid4()}</RequestID></Response>"
        ).encode()
        self.answer(400, body, {"Content-Type": "text/xml;charset=UTF-8"})
        raise _Answered

    def _serve_console(self, params: dict[str, str]) -> None:
        source = self.front.console_source
        instance_id = params.get("InstanceId", "")
        if source is None or not instance_id:
            return
        text = source(instance_id)
        if text is None:
            return
        data = text.encode() if isinstance(text, str) else bytes(text)
        data = data[-CONSOLE_LIMIT:]
        version = params.get("Version", "2016-11-15")
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.") + "000Z"
        output = f"<output>{base64.b64encode(data).decode()}</output>" if data else ""
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f'<GetConsoleOutputResponse xmlns="http://ec2.amazonaws.com/doc/{escape(version)}/">'
            f"<requestId>{uuid.uuid4()}</requestId>"
            f"<instanceId>{escape(instance_id)}</instanceId>"
            f"<timestamp>{now}</timestamp>{output}</GetConsoleOutputResponse>"
        ).encode()
        self.answer(200, body, {"Content-Type": "text/xml;charset=UTF-8"})
        raise _Answered

    def _check_secret(self) -> None:
        try:
            secret_id = json.loads(self.body or b"{}").get("SecretId", "")
        except (ValueError, AttributeError):
            return
        if not isinstance(secret_id, str) or not self.front._secret_denied(secret_id):
            return
        action = "secretsmanager:GetSecretValue"
        message = (
            f"User: arn:aws:sts::{self._account()}:assumed-role/{self.front.role}/box "
            f"is not authorized to perform: {action} on resource: {secret_id} "
            f"because no identity-based policy allows the {action} action"
        )
        body = json.dumps({"__type": "AccessDeniedException", "Message": message}).encode()
        self.answer(
            400,
            body,
            {
                "Content-Type": "application/x-amz-json-1.1",
                "x-amzn-RequestId": str(uuid.uuid4()),
                "x-amzn-ErrorType": _AMZN_ERROR_TYPE,
            },
        )
        raise _Answered

    def _check_object(self, length: str | None, chunked: bool) -> None:
        bucket, key = _s3_bucket_key(self.headers.get("Host") or "", self.path)
        if not bucket or not self.front._object_denied(bucket, key):
            return
        self._drain(length, chunked)
        request_id = secrets.token_hex(8).upper()
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            "<Error><Code>AccessDenied</Code><Message>Access Denied</Message>"
            f"<RequestId>{request_id}</RequestId>"
            f"<HostId>{base64.b64encode(secrets.token_bytes(48)).decode()}</HostId></Error>"
        ).encode()
        self.answer(
            403,
            b"" if self.method == "HEAD" else body,
            {"Content-Type": "application/xml", "x-amz-request-id": request_id},
        )
        raise _Answered

    def answer(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        h = self.handler
        self.started = True
        h.send_response(status)
        for key, value in headers.items():
            h.send_header(key, value)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if body and self.method != "HEAD":
            h.wfile.write(body)

    # forwarding

    def _forward(self, length: str | None, chunked: bool) -> None:
        host, port = self.front._upstream
        conn = http.client.HTTPConnection(host, port, timeout=self.front.upstream_timeout)
        try:
            # What reads the client raises _ClientGone, never OSError: an OSError here is
            # moto's.
            try:
                conn.putrequest(self.method, self.target, skip_host=True, skip_accept_encoding=True)
                for key, value in self.headers.items():
                    if key.lower() not in _HOP_BY_HOP:
                        conn.putheader(key, value)
                if self.front.account_id and "x-moto-account-id" not in self.headers:
                    conn.putheader("x-moto-account-id", self.front.account_id)
                conn.putheader("Connection", "close")
                if self.body is not None:
                    conn.endheaders(self.body)
                elif chunked:
                    conn.putheader("Transfer-Encoding", "chunked")
                    conn.endheaders(self._dechunked(), encode_chunked=True)
                else:
                    conn.endheaders()
                    for piece in self._sized(length):
                        conn.send(piece)
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as e:
                raise _UpstreamError(f"moto at {host}:{port}: {e}") from e
            self._relay(resp)
        finally:
            conn.close()

    def _relay(self, resp: http.client.HTTPResponse) -> None:
        h = self.handler
        self.started = True
        h.send_response_only(resp.status, resp.reason)
        for key, value in resp.getheaders():
            if key.lower() not in _HOP_BY_HOP:
                h.send_header(key, value)
        bodiless = self.method == "HEAD" or resp.status in (204, 304) or resp.status < 200
        sized = resp.getheader("Content-Length") is not None
        if not bodiless and not sized:
            h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        if bodiless:
            return
        while True:
            try:
                piece = resp.read(CHUNK)
            except (OSError, http.client.HTTPException) as e:
                raise _UpstreamError(f"moto broke off its answer: {e}") from e
            if not piece:
                break
            self.front._note_buffer(len(piece))
            if sized:
                h.wfile.write(piece)
            else:
                h.wfile.write(b"%x\r\n%b\r\n" % (len(piece), piece))
        if not sized:
            h.wfile.write(b"0\r\n\r\n")


def _params(query: str, form: bytes | None) -> dict[str, str]:
    params = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
    if form:
        text = form.decode("utf-8", "replace")
        params.update({k: v[-1] for k, v in parse_qs(text, keep_blank_values=True).items()})
    return params


def _secret_names(secret_id: str) -> set[str]:
    """What a SecretId may stand for: itself, and for an ARN its name with and without the
    six random characters Secrets Manager appends."""
    names = {secret_id}
    m = _SECRET_ARN_RE.match(secret_id)
    if m:
        names.add(m.group(1))
        names.add(_ARN_SUFFIX_RE.sub("", m.group(1)))
    return names


def _s3_bucket_key(host: str, path: str) -> tuple[str, str]:
    """The bucket and key an S3 request names, by moto's rule for path-style hosts (an IP
    address, ``localhost...``, a name without a dot, ``s3[.-]REGION.amazonaws.com``) and
    virtual-host ones (``BUCKET.s3...amazonaws.com``, else the first label)."""
    name = host
    if name.startswith("["):
        name = name[1 : name.find("]")] if "]" in name else name
    elif name.count(":") == 1:
        name = name.rsplit(":", 1)[0]
    path_style = (
        not name
        or name.startswith("localhost")
        or "." not in name
        or name == "s3.amazonaws.com"
        or _S3_PATH_HOST_RE.match(name) is not None
        or _is_ip(name)
    )
    if path_style:
        bucket, _, key = path.lstrip("/").partition("/")
        return unquote(bucket), unquote(key)
    m = _S3_VIRTUAL_HOST_RE.match(name)
    bucket = m.group(1) if m else name.split(".", 1)[0]
    return bucket, unquote(path.lstrip("/"))


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True

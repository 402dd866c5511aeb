"""A fake cloud metadata service (EC2 IMDSv2 and the GCE metadata server) over real HTTP.

It listens on 127.0.0.1 on a free port, serves each request in a daemon thread, and reads a
scenario that tests change while it runs::

    with MetadataServer() as md:
        watcher = AwsImdsWatcher(md.url)
        md.set_spot_action("terminate", "2026-11-22T14:40:00Z")
        md.set_status(AWS_REBALANCE_PATH, 500)
        md.set_hang(AWS_TOKEN_PATH, 10)   # longer than the client's timeout
        md.expire_tokens()                # the next GET answers 401
        md.count(AWS_TOKEN_PATH, "PUT")

Knobs that apply to any path, checked in this order: a hang (sleep before answering), a
status override (that status, a short body), a raw body override (200 with those bytes).
Hung handlers wake up when the server closes, so teardown never waits for them.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from typing import Any
from urllib.parse import parse_qs, urlsplit

from fakes.http_fake import DispatchingHandler, HTTPFake

AWS_TOKEN_PATH = "/latest/api/token"
AWS_SPOT_PATH = "/latest/meta-data/spot/instance-action"
AWS_REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
AWS_LIFECYCLE_PATH = "/latest/meta-data/autoscaling/target-lifecycle-state"
GCP_PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
GCP_MAINTENANCE_PATH = "/computeMetadata/v1/instance/maintenance-event"

_AWS_DATA_PATHS = (AWS_SPOT_PATH, AWS_REBALANCE_PATH, AWS_LIFECYCLE_PATH)


class _Handler(DispatchingHandler, methods=("GET", "PUT")):
    def reply(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True


class MetadataServer(HTTPFake):
    """The fake; use it as a context manager (or call start() and close())."""

    def __init__(self) -> None:
        super().__init__(_Handler, thread_name="fake-metadata")
        self._cond = threading.Condition()
        self._closing = threading.Event()
        self._requests: Counter[tuple[str, str]] = Counter()
        self._unauthorized = 0
        self._tokens: dict[str, float] = {}  # token -> time.monotonic() it lapses
        self._aws: dict[str, str | None] = dict.fromkeys(_AWS_DATA_PATHS)
        self._gcp: dict[str, str] = {
            GCP_PREEMPTED_PATH: "FALSE",
            GCP_MAINTENANCE_PATH: "NONE",
        }
        self._gcp_version: Counter[str] = Counter()
        self._gcp_json: set[str] = set()
        # Answer GET / with Metadata-Flavor: Google, as google-auth's ping expects on GCE.
        self.gcp_root = False
        self._status: dict[str, int] = {}
        self._body: dict[str, bytes] = {}
        self._hang: dict[str, float] = {}
        self.gcp_flavor_header = True

    # lifecycle

    @property
    def host(self) -> str:
        """``127.0.0.1:PORT``, the form ``GCE_METADATA_HOST`` takes."""
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``, the form ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` takes."""
        return f"http://{self.host}"

    def close(self) -> None:
        # Wake hung handlers and long-polls first, so none outlives the server.
        self._closing.set()
        with self._cond:
            self._cond.notify_all()
        super().close()

    # scenario

    def set_spot_action(self, action: str | None, when: str = "2026-11-22T14:40:00Z") -> None:
        """Serve ``{"action": action, "time": when}`` on the spot path; None: 404."""
        body = None if action is None else f'{{"action": "{action}", "time": "{when}"}}'
        self._set_aws(AWS_SPOT_PATH, body)

    def set_rebalance(self, notice_time: str | None) -> None:
        body = None if notice_time is None else f'{{"noticeTime": "{notice_time}"}}'
        self._set_aws(AWS_REBALANCE_PATH, body)

    def set_lifecycle_state(self, state: str | None) -> None:
        self._set_aws(AWS_LIFECYCLE_PATH, state)

    def _set_aws(self, path: str, body: str | None) -> None:
        with self._cond:
            self._aws[path] = body

    def set_gcp(self, path: str, value: str, *, json: bool = False) -> None:
        """Change a GCP value; a changed value gets a new ETag and wakes long-polls. ``json``:
        served as ``application/json`` (google-auth decodes only those)."""
        with self._cond:
            if json:
                self._gcp_json.add(path)
            if self._gcp.get(path) != value:
                self._gcp[path] = value
                self._gcp_version[path] += 1
                self._cond.notify_all()

    def set_aws_value(self, path: str, value: str | None) -> None:
        """Serve ``value`` on any IMDSv2 path (``/latest/meta-data/...``, ``/latest/user-data``,
        ...); None: 404. Tokens are required as for every AWS path."""
        self._set_aws(path, value)

    def set_status(self, path: str, status: int | None) -> None:
        """Answer every request for path with this status (None: back to normal)."""
        with self._cond:
            self._set_or_drop(self._status, path, status)

    def set_body(self, path: str, body: bytes | None) -> None:
        """Answer every request for path with 200 and these raw bytes (None: normal)."""
        with self._cond:
            self._set_or_drop(self._body, path, body)

    def set_hang(self, path: str, seconds: float | None) -> None:
        """Sleep this long before answering requests for path (None: answer at once)."""
        with self._cond:
            self._set_or_drop(self._hang, path, seconds)

    @staticmethod
    def _set_or_drop(table: dict[str, Any], path: str, value: Any) -> None:
        if value is None:
            table.pop(path, None)
        else:
            table[path] = value

    def expire_tokens(self) -> None:
        """Make every IMDSv2 token issued so far invalid (the next GET with one gets 401)."""
        with self._cond:
            self._tokens.clear()

    def count(self, path: str, method: str | None = None) -> int:
        """Requests received for path (any query string), of one method or all."""
        with self._cond:
            return sum(
                n for (m, p), n in self._requests.items() if p == path and method in (None, m)
            )

    @property
    def total_requests(self) -> int:
        with self._cond:
            return sum(self._requests.values())

    @property
    def unauthorized(self) -> int:
        """How many AWS requests were answered 401."""
        with self._cond:
            return self._unauthorized

    def etag(self, path: str) -> str:
        with self._cond:
            return self._etag(path)

    def _etag(self, path: str) -> str:
        return f'"{path.rsplit("/", 1)[-1]}-{self._gcp_version[path]}"'

    # serving

    def _handle(self, handler: _Handler, method: str) -> None:
        parts = urlsplit(handler.path)
        # A request through a proxy carries the absolute URL; count it under the whole URL.
        path = handler.path if parts.scheme else parts.path
        query = parse_qs(parts.query)
        with self._cond:
            self._requests[(method, path)] += 1
            hang = self._hang.get(path)
        if hang is not None and self._closing.wait(hang):
            return
        gcp = path.startswith("/computeMetadata/")
        extra = {"Metadata-Flavor": "Google"} if gcp and self.gcp_flavor_header else {}
        with self._cond:
            status = self._status.get(path)
            body = self._body.get(path)
        if status is not None:
            handler.reply(status, f"fake status {status}\n".encode(), extra)
        elif body is not None:
            handler.reply(200, body, extra)
        elif gcp:
            self._serve_gcp(handler, path, query, extra)
        elif path == "/" and self.gcp_root:
            handler.reply(200, b"computeMetadata/\n", {"Metadata-Flavor": "Google"})
        else:
            self._serve_aws(handler, method, path)

    def _serve_aws(self, handler: _Handler, method: str, path: str) -> None:
        if path == AWS_TOKEN_PATH:
            if method != "PUT":
                handler.reply(405, b"")
                return
            ttl = handler.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
            if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                handler.reply(400, b"")
                return
            token = uuid.uuid4().hex
            with self._cond:
                self._tokens[token] = time.monotonic() + int(ttl)
            handler.reply(200, token.encode(), {"X-aws-ec2-metadata-token-ttl-seconds": ttl})
            return
        if method != "GET" or path not in self._aws:
            handler.reply(404, b"")
            return
        token = handler.headers.get("X-aws-ec2-metadata-token", "")
        with self._cond:
            lapses = self._tokens.get(token)
            valid = lapses is not None and time.monotonic() < lapses
            if not valid:
                self._unauthorized += 1
            value = self._aws[path]
        if not valid:
            handler.reply(401, b"")
        elif value is None:
            handler.reply(404, b"")
        else:
            handler.reply(200, value.encode())

    def _serve_gcp(
        self, handler: _Handler, path: str, query: dict[str, list[str]], extra: dict[str, str]
    ) -> None:
        if handler.headers.get("Metadata-Flavor") != "Google":
            handler.reply(403, b"Missing Metadata-Flavor:Google header.\n", extra)
            return
        if path not in self._gcp:
            handler.reply(404, b"", extra)
            return
        with self._cond:
            if query.get("wait_for_change") == ["true"]:
                timeout = float(query.get("timeout_sec", ["60"])[0])
                last = query.get("last_etag", [self._etag(path)])[0]
                end = time.monotonic() + timeout
                while (
                    self._etag(path) == last
                    and not self._closing.is_set()
                    and (left := end - time.monotonic()) > 0
                ):
                    self._cond.wait(left)
            value = self._gcp[path]
            etag = self._etag(path)
            kind = "application/json" if path in self._gcp_json else "application/text"
        handler.reply(200, value.encode(), {**extra, "ETag": etag, "Content-Type": kind})

"""A fake Google Cloud Storage JSON API over real HTTP, for the real ``google-cloud-storage``.

It serves the subset of the API that ``GcsStore`` drives through the client library, at the
URLs the library builds from ``client_options={"api_endpoint": fake.url}``:

- ``GET  /storage/v1/b/B``                     bucket metadata (``POST /storage/v1/b`` creates)
- ``GET  /storage/v1/b/B/o``                   list: ``prefix``, ``delimiter``, ``maxResults``,
  ``pageToken``
- ``GET  /storage/v1/b/B/o/NAME``              object metadata, or the bytes with ``alt=media``
- ``GET  /download/storage/v1/b/B/o/NAME``     the bytes (``alt=media``), with ``Range``
- ``DELETE /storage/v1/b/B/o/NAME``
- ``POST /upload/storage/v1/b/B/o?uploadType=media|multipart|resumable``, and the resumable
  session's ``PUT`` chunks with ``Content-Range`` (308 with ``Range`` until the last one)

Objects carry ``md5Hash`` and ``crc32c`` (base64, as GCS does), downloads send them in
``x-goog-hash`` so the client verifies what it receives, and uploads that send a checksum are
checked against it. ``ifGenerationMatch`` is honoured. Errors have GCS's JSON shape::

    {"error": {"code": 404, "message": "No such object: b/k", "errors": [{...}]}}

Usage::

    with GcsServer() as gcs:
        gcs.create_bucket("ckpts")
        client = storage.Client(project="test", credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": gcs.url})
        gcs.fail_all(401)        # every request: 401 Invalid Credentials
        gcs.fail_objects(503, 2) # the next two object requests: 503
        gcs.requests             # every request received, in order

Counted faults skip bucket requests: google-cloud-storage 3.x fetches bucket metadata in a
background thread on a client's first call, and counting it would make a test's faults land
on a random request.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

import google_crc32c

from fakes.http_fake import DispatchingHandler, HTTPFake

_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")
_CONTENT_RANGE_RE = re.compile(r"^bytes (?:(\d+)-(\d+)|\*)/(\d+|\*)$")
_BOUNDARY_RE = re.compile(r'boundary="?([^";]+)"?')

_REASONS = {
    400: "invalid",
    401: "authError",
    403: "forbidden",
    404: "notFound",
    412: "conditionNotMet",
    416: "requestedRangeNotSatisfiable",
    429: "rateLimitExceeded",
    500: "backendError",
    503: "backendError",
}
_MESSAGES = {
    401: "Invalid Credentials",
    403: "The caller does not have permission",
    412: "At least one of the pre-conditions you specified did not hold.",
    429: "The rate of change requests to the object is too high; slow down.",
    500: "We encountered an internal error. Please try again.",
    503: "We encountered an internal error. Please try again.",
}


def crc32c_b64(data: bytes) -> str:
    """The base64 of the big-endian CRC32C, as GCS reports ``crc32c``."""
    return base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode()


def md5_b64(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


@dataclass
class FakeObject:
    data: bytes
    generation: int
    content_type: str
    metadata: dict[str, str]
    crc32c: str
    md5: str
    updated: str


@dataclass
class Request:
    """One request the fake received."""

    method: str
    path: str  # percent-decoded, without the query
    query: dict[str, str]
    headers: dict[str, str]


@dataclass
class _Upload:
    bucket: str
    name: str
    content_type: str
    metadata: dict[str, str]
    total: int | None
    if_generation_match: int | None
    data: bytearray = field(default_factory=bytearray)


class _HttpError(Exception):
    def __init__(self, status: int, message: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message or _MESSAGES.get(status, "error")


class _Handler(DispatchingHandler, methods=("GET", "POST", "PUT", "DELETE")):
    # Headers and body go out in two writes; with Nagle on, the second waits for the
    # client's delayed ACK (40 ms) on every kept-alive request.
    disable_nagle_algorithm = True

    def read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def reply(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body:
            self.wfile.write(body)


class GcsServer(HTTPFake):
    """The fake; use it as a context manager (or call start() and close())."""

    def __init__(self, *, max_page_size: int = 1000) -> None:
        super().__init__(_Handler, thread_name="fake-gcs")
        self.max_page_size = max_page_size
        self._lock = threading.Lock()
        self._buckets: dict[str, dict[str, FakeObject]] = {}
        self._uploads: dict[str, _Upload] = {}
        self._generation = int(time.time() * 1e6)
        self._requests: list[Request] = []
        self._fail_all: int | None = None
        self._fail_objects: list[int] = []

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``: the client's ``api_endpoint``."""
        return f"http://127.0.0.1:{self.port}"

    # state, for tests

    def create_bucket(self, name: str) -> None:
        with self._lock:
            self._buckets.setdefault(name, {})

    def names(self, bucket: str) -> list[str]:
        with self._lock:
            return sorted(self._buckets[bucket])

    def object(self, bucket: str, name: str) -> FakeObject:
        with self._lock:
            return self._buckets[bucket][name]

    def put_object(
        self, bucket: str, name: str, data: bytes, metadata: dict[str, str] | None = None
    ) -> None:
        """Store an object as an API write would (new generation, fresh hashes)."""
        with self._lock:
            self._store(bucket, name, data, "application/octet-stream", metadata or {})

    def tamper(self, bucket: str, name: str, data: bytes, *, keep_hashes: bool = False) -> None:
        """Replace an object's bytes in place, keeping its custom metadata and generation.

        With ``keep_hashes`` the stored CRC32C and MD5 still describe the old bytes (bit rot),
        so the client's own download check fails; without, they describe the new bytes and
        only the sha256 recorded in the metadata can tell.
        """
        with self._lock:
            obj = self._buckets[bucket][name]
            obj.data = data
            if not keep_hashes:
                obj.crc32c = crc32c_b64(data)
                obj.md5 = md5_b64(data)

    def fail_all(self, status: int | None) -> None:
        """Answer every request with this status from now on (None: stop)."""
        with self._lock:
            self._fail_all = status

    def fail_objects(self, status: int, times: int) -> None:
        """Answer the next ``times`` object requests (not bucket ones) with ``status``."""
        with self._lock:
            self._fail_objects.extend([status] * times)

    def clear_faults(self) -> None:
        with self._lock:
            self._fail_all = None
            self._fail_objects.clear()

    @property
    def requests(self) -> list[Request]:
        with self._lock:
            return list(self._requests)

    # the API

    def _handle(self, h: _Handler, method: str) -> None:
        split = urlsplit(h.path)
        raw_path = split.path
        query = {k: v[-1] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
        body = h.read_body()
        with self._lock:
            self._requests.append(
                Request(
                    method, unquote(raw_path), query, {k.lower(): v for k, v in h.headers.items()}
                )
            )
            fault = self._fault_for(raw_path)
        try:
            if fault is not None:
                raise _HttpError(fault)
            self._route(h, method, raw_path, query, body)
        except _HttpError as err:
            h.reply(err.status, _error_body(err.status, err.message), _JSON)

    def _fault_for(self, raw_path: str) -> int | None:
        if self._fail_all is not None:
            return self._fail_all
        if self._fail_objects and "/o" in raw_path:
            return self._fail_objects.pop(0)
        return None

    def _route(
        self, h: _Handler, method: str, raw_path: str, query: dict[str, str], body: bytes
    ) -> None:
        parts = raw_path.split("/")
        # /storage/v1/b[/B[/o[/NAME...]]], /download/storage/v1/b/B/o/NAME,
        # /upload/storage/v1/b/B/o
        if parts[1:4] == ["storage", "v1", "b"]:
            rest = parts[4:]
            if not rest or rest == [""]:
                if method == "POST":
                    return self._insert_bucket(h, body)
                raise _HttpError(400, "listing buckets is not faked")
            bucket = unquote(rest[0])
            if len(rest) == 1 and method == "GET":
                return self._get_bucket(h, bucket)
            if len(rest) == 2 and rest[1] == "o" and method == "GET":
                return self._list(h, bucket, query)
            if len(rest) >= 3 and rest[1] == "o":
                name = unquote("/".join(rest[2:]))
                if method == "GET":
                    if query.get("alt") == "media":
                        return self._media(h, bucket, name, query)
                    return self._get_object(h, bucket, name, query)
                if method == "DELETE":
                    return self._delete(h, bucket, name)
        if parts[1:5] == ["download", "storage", "v1", "b"] and method == "GET":
            rest = parts[5:]
            if len(rest) >= 3 and rest[1] == "o":
                return self._media(h, unquote(rest[0]), unquote("/".join(rest[2:])), query)
        if parts[1:5] == ["upload", "storage", "v1", "b"] and parts[6:] == ["o"]:
            bucket = unquote(parts[5])
            if method == "POST":
                return self._upload(h, bucket, query, body)
            if method == "PUT" and query.get("uploadType") == "resumable":
                return self._resumable_chunk(h, query, body)
        raise _HttpError(404, f"Not Found: {method} {raw_path}")

    # buckets

    def _bucket(self, bucket: str) -> dict[str, FakeObject]:
        with self._lock:
            objects = self._buckets.get(bucket)
        if objects is None:
            raise _HttpError(404, "The specified bucket does not exist.")
        return objects

    def _bucket_json(self, bucket: str) -> dict[str, Any]:
        return {
            "kind": "storage#bucket",
            "id": bucket,
            "name": bucket,
            "selfLink": f"{self.url}/storage/v1/b/{bucket}",
            "projectNumber": "123456789012",
            "location": "US-CENTRAL1",
            "locationType": "region",
            "storageClass": "STANDARD",
            "metageneration": "1",
            "etag": "CAE=",
        }

    def _get_bucket(self, h: _Handler, bucket: str) -> None:
        self._bucket(bucket)
        h.reply(200, json.dumps(self._bucket_json(bucket)).encode(), _JSON)

    def _insert_bucket(self, h: _Handler, body: bytes) -> None:
        name = json.loads(body or b"{}").get("name", "")
        with self._lock:
            if name in self._buckets:
                raise _HttpError(409, "Your previous request to create the named bucket succeeded")
            self._buckets[name] = {}
        h.reply(200, json.dumps(self._bucket_json(name)).encode(), _JSON)

    # objects

    def _object(self, bucket: str, name: str, query: dict[str, str]) -> FakeObject:
        objects = self._bucket(bucket)
        with self._lock:
            obj = objects.get(name)
        if obj is None or ("generation" in query and int(query["generation"]) != obj.generation):
            raise _HttpError(404, f"No such object: {bucket}/{name}")
        match = query.get("ifGenerationMatch")
        if match is not None and int(match) != obj.generation:
            raise _HttpError(412)
        return obj

    def _object_json(self, bucket: str, name: str, obj: FakeObject) -> dict[str, Any]:
        quoted = quote(name, safe="")
        resource: dict[str, Any] = {
            "kind": "storage#object",
            "id": f"{bucket}/{name}/{obj.generation}",
            "selfLink": f"{self.url}/storage/v1/b/{bucket}/o/{quoted}",
            "mediaLink": (
                f"{self.url}/download/storage/v1/b/{bucket}/o/{quoted}"
                f"?generation={obj.generation}&alt=media"
            ),
            "name": name,
            "bucket": bucket,
            "generation": str(obj.generation),
            "metageneration": "1",
            "contentType": obj.content_type,
            "storageClass": "STANDARD",
            "size": str(len(obj.data)),
            "md5Hash": obj.md5,
            "crc32c": obj.crc32c,
            "etag": f"C{obj.generation}=",
            "timeCreated": obj.updated,
            "updated": obj.updated,
        }
        if obj.metadata:
            resource["metadata"] = dict(obj.metadata)
        return resource

    def _get_object(self, h: _Handler, bucket: str, name: str, query: dict[str, str]) -> None:
        obj = self._object(bucket, name, query)
        h.reply(200, json.dumps(self._object_json(bucket, name, obj)).encode(), _JSON)

    def _media(self, h: _Handler, bucket: str, name: str, query: dict[str, str]) -> None:
        obj = self._object(bucket, name, query)
        data, size = obj.data, len(obj.data)
        headers = {
            "Content-Type": obj.content_type,
            "x-goog-hash": f"crc32c={obj.crc32c},md5={obj.md5}",
            "x-goog-generation": str(obj.generation),
            "x-goog-metageneration": "1",
            "x-goog-stored-content-length": str(size),
            "x-goog-stored-content-encoding": "identity",
            "x-goog-storage-class": "STANDARD",
            "ETag": f'"{obj.md5}"',
            "Accept-Ranges": "bytes",
        }
        wanted = h.headers.get("Range")
        if not wanted:
            return h.reply(200, data, headers)
        m = _RANGE_RE.match(wanted.strip())
        if m is None or (not m.group(1) and not m.group(2)):
            raise _HttpError(400, f"bad Range header {wanted!r}")
        if m.group(1):
            start = int(m.group(1))
            end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
        else:
            start, end = max(size - int(m.group(2)), 0), size - 1
        if start >= size or start > end:
            raise _HttpError(416, "The requested range cannot be satisfied.")
        headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        h.reply(206, data[start : end + 1], headers)

    def _list(self, h: _Handler, bucket: str, query: dict[str, str]) -> None:
        objects = self._bucket(bucket)
        prefix = query.get("prefix", "")
        delimiter = query.get("delimiter", "")
        token = query.get("pageToken", "")
        limit = min(int(query.get("maxResults") or self.max_page_size), self.max_page_size)
        with self._lock:
            names = sorted(n for n in objects if n.startswith(prefix))
            snapshot = {n: objects[n] for n in names}
        items: list[dict[str, Any]] = []
        prefixes: list[str] = []
        last = ""
        for name in names:
            if token and name <= token:
                continue
            if delimiter:
                cut = name.find(delimiter, len(prefix))
                if cut >= 0:
                    common = name[: cut + len(delimiter)]
                    if common not in prefixes:
                        if len(items) + len(prefixes) >= limit:
                            break
                        prefixes.append(common)
                    last = name
                    continue
            if len(items) + len(prefixes) >= limit:
                break
            items.append(self._object_json(bucket, name, snapshot[name]))
            last = name
        else:
            last = ""
        body: dict[str, Any] = {"kind": "storage#objects"}
        if items:
            body["items"] = items
        if prefixes:
            body["prefixes"] = prefixes
        if last:
            body["nextPageToken"] = last
        h.reply(200, json.dumps(body).encode(), _JSON)

    def _delete(self, h: _Handler, bucket: str, name: str) -> None:
        objects = self._bucket(bucket)
        with self._lock:
            if objects.pop(name, None) is None:
                raise _HttpError(404, f"No such object: {bucket}/{name}")
        h.reply(204)

    # uploads

    def _store(
        self, bucket: str, name: str, data: bytes, content_type: str, metadata: dict[str, str]
    ) -> FakeObject:
        """Under the lock."""
        self._generation += 1
        obj = FakeObject(
            data=bytes(data),
            generation=self._generation,
            content_type=content_type,
            metadata=dict(metadata),
            crc32c=crc32c_b64(data),
            md5=md5_b64(data),
            updated=time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()),
        )
        self._buckets[bucket][name] = obj
        return obj

    def _commit(
        self,
        h: _Handler,
        bucket: str,
        name: str,
        data: bytes,
        content_type: str,
        metadata: dict[str, str],
        if_generation_match: int | None,
        claimed: dict[str, str],
    ) -> None:
        if not name:
            raise _HttpError(400, "Required object name is missing.")
        if "crc32c" in claimed and claimed["crc32c"] != crc32c_b64(data):
            raise _HttpError(400, "Provided CRC32C does not match the object's data.")
        if "md5Hash" in claimed and claimed["md5Hash"] != md5_b64(data):
            raise _HttpError(400, "Provided MD5 hash does not match the object's data.")
        objects = self._bucket(bucket)
        with self._lock:
            if if_generation_match is not None:
                current = objects.get(name)
                have = current.generation if current is not None else 0
                if have != if_generation_match:
                    raise _HttpError(412)
            obj = self._store(bucket, name, data, content_type, metadata)
        h.reply(200, json.dumps(self._object_json(bucket, name, obj)).encode(), _JSON)

    def _upload(self, h: _Handler, bucket: str, query: dict[str, str], body: bytes) -> None:
        self._bucket(bucket)
        kind = query.get("uploadType")
        match = query.get("ifGenerationMatch")
        if_match = int(match) if match is not None else None
        if kind == "media":
            content_type = h.headers.get("Content-Type") or "application/octet-stream"
            return self._commit(
                h, bucket, query.get("name", ""), body, content_type, {}, if_match, {}
            )
        if kind == "multipart":
            meta, data, content_type = _parse_multipart(h.headers.get("Content-Type", ""), body)
            claimed: dict[str, str] = {k: str(meta[k]) for k in ("crc32c", "md5Hash") if k in meta}
            return self._commit(
                h,
                bucket,
                str(meta.get("name") or query.get("name", "")),
                data,
                str(meta.get("contentType") or content_type),
                dict(meta.get("metadata") or {}),
                if_match,
                claimed,
            )
        if kind == "resumable":
            meta = json.loads(body or b"{}")
            total = h.headers.get("x-upload-content-length")
            upload_id = uuid.uuid4().hex
            with self._lock:
                self._uploads[upload_id] = _Upload(
                    bucket=bucket,
                    name=str(meta.get("name") or query.get("name", "")),
                    content_type=str(
                        meta.get("contentType")
                        or h.headers.get("x-upload-content-type")
                        or "application/octet-stream"
                    ),
                    metadata=dict(meta.get("metadata") or {}),
                    total=int(total) if total else None,
                    if_generation_match=if_match,
                )
            location = (
                f"{self.url}/upload/storage/v1/b/{quote(bucket, safe='')}/o"
                f"?uploadType=resumable&upload_id={upload_id}"
            )
            return h.reply(200, b"", {"Location": location})
        raise _HttpError(400, f"unsupported uploadType {kind!r}")

    def _resumable_chunk(self, h: _Handler, query: dict[str, str], body: bytes) -> None:
        upload_id = query.get("upload_id", "")
        with self._lock:
            upload = self._uploads.get(upload_id)
        if upload is None:
            raise _HttpError(404, "No such upload session.")
        content_range = h.headers.get("Content-Range", "")
        m = _CONTENT_RANGE_RE.match(content_range.strip())
        if m is None:
            raise _HttpError(400, f"bad Content-Range {content_range!r}")
        if m.group(1) is not None:
            start, end = int(m.group(1)), int(m.group(2))
            if start != len(upload.data):
                # Out of order: say what we have, as GCS does, and let the client resend.
                return self._resumable_status(h, upload)
            if end - start + 1 != len(body):
                raise _HttpError(400, "Content-Range does not match the body's length.")
            upload.data.extend(body)
        if m.group(3) != "*":
            upload.total = int(m.group(3))
        if upload.total is not None and len(upload.data) >= upload.total:
            with self._lock:
                self._uploads.pop(upload_id, None)
            claimed = _parse_goog_hash(h.headers.get("x-goog-hash", ""))
            return self._commit(
                h,
                upload.bucket,
                upload.name,
                bytes(upload.data),
                upload.content_type,
                upload.metadata,
                upload.if_generation_match,
                claimed,
            )
        self._resumable_status(h, upload)

    @staticmethod
    def _resumable_status(h: _Handler, upload: _Upload) -> None:
        headers = {"Range": f"bytes=0-{len(upload.data) - 1}"} if upload.data else {}
        h.reply(308, b"", headers)


_JSON = {"Content-Type": "application/json; charset=UTF-8"}


def _error_body(status: int, message: str) -> bytes:
    reason = _REASONS.get(status, "error")
    error = {"message": message, "domain": "global", "reason": reason}
    if status == 401:
        error.update(locationType="header", location="Authorization")
    return json.dumps({"error": {"code": status, "message": message, "errors": [error]}}).encode()


def _parse_multipart(content_type: str, body: bytes) -> tuple[dict[str, Any], bytes, str]:
    """The JSON metadata part, the media part and its content type of a multipart upload."""
    m = _BOUNDARY_RE.search(content_type)
    if m is None:
        raise _HttpError(400, "multipart upload without a boundary")
    sep = b"--" + m.group(1).encode()
    pieces = body.split(sep)
    # ["", part1, part2, "--..."]: each part is CRLF, headers, CRLF CRLF, body, CRLF.
    if len(pieces) < 4 or not pieces[-1].startswith(b"--"):
        raise _HttpError(400, "malformed multipart body")
    parsed: list[tuple[dict[str, str], bytes]] = []
    for piece in pieces[1:3]:
        head, _, content = piece.removeprefix(b"\r\n").partition(b"\r\n\r\n")
        headers = {}
        for line in head.decode("latin-1").split("\r\n"):
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
        parsed.append((headers, content.removesuffix(b"\r\n")))
    meta = json.loads(parsed[0][1] or b"{}")
    return meta, parsed[1][1], parsed[1][0].get("content-type", "application/octet-stream")


def _parse_goog_hash(header: str) -> dict[str, str]:
    claimed: dict[str, str] = {}
    for item in header.split(","):
        name, _, value = item.strip().partition("=")
        if name == "crc32c":
            claimed["crc32c"] = value
        elif name == "md5":
            claimed["md5Hash"] = value
    return claimed

"""One contract suite for every ObjectStore: a local directory, S3 (moto's server over HTTP)
and GCS (the HTTP fake in ``tests/fakes/gcs_server.py``, driven by the real client library).

Each backend comes with the levers only a test has: writing an object behind the store's
back (to tamper with it), and a store whose every call fails as with bad credentials or an
unavailable service.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlsplit

import boto3
import pytest
import redis
import requests
from botocore.awsrequest import AWSResponse
from fakes.gcs_server import GcsServer
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage as gcs
from moto.server import ThreadedMotoServer

from spottrain.agent.checkpoint.copy import CheckpointCopier
from spottrain.agent.checkpoint.directory import CheckpointDir
from spottrain.agent.checkpoint.manifest import FileSum, Manifest
from spottrain.agent.node_record import NodeInfo, NodeRecord
from spottrain.cloud.aws.s3 import S3Store
from spottrain.cloud.gcp.gcs import GcsStore
from spottrain.cloud.storage import (
    SHA256_METADATA,
    BucketNotFound,
    CorruptObject,
    IncompleteCopy,
    LocalStore,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    SourceChanged,
    StorageAuthError,
    StorageError,
    StorageUnavailable,
    download_dir,
    list_dirs,
    parse_store_url,
    upload_dir,
)
from spottrain.protocol.keys import RunKeys

MIB = 1 << 20
BUCKET = "spottrain-test"


# --- the fakes ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    _aws_session().client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    yield endpoint
    server.stop()


@pytest.fixture(scope="module")
def aws_session() -> Any:
    """One session for the module: each new one loads the S3 service model again (~0.3 s)."""
    return _aws_session()


@pytest.fixture(scope="module")
def gcs_server() -> Iterator[GcsServer]:
    with GcsServer() as server:
        server.create_bucket(BUCKET)
        yield server


def _aws_session() -> Any:
    return boto3.Session(
        aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
    )


class _RawBody:
    def __init__(self, body: bytes) -> None:
        self._body = body

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self._body


def _s3_fault(status: int, code: str, times: int | None = None) -> Callable[..., Any]:
    """A before-send hook that answers S3 requests with an error instead of sending them."""
    left = [times]

    def hook(request: Any, **_: Any) -> AWSResponse | None:
        if left[0] is not None:
            if left[0] <= 0:
                return None
            left[0] -= 1
        body = f"<Error><Code>{code}</Code><Message>injected by the test</Message></Error>"
        headers = {"Content-Type": "application/xml"}
        return AWSResponse(request.url, status, headers, _RawBody(body.encode()))

    return hook


class _LocalOnlySession(requests.Session):
    """The GCS client's HTTP session: records each host and refuses any but 127.0.0.1."""

    def __init__(self) -> None:
        super().__init__()
        self.hosts: list[str] = []

    def request(self, method: str | bytes, url: str | bytes, *args: Any, **kwargs: Any) -> Any:
        host = urlsplit(str(url)).hostname or ""
        self.hosts.append(host)
        if host != "127.0.0.1":
            raise AssertionError(f"a request left 127.0.0.1: {method!r} {url!r}")
        return super().request(method, url, *args, **kwargs)  # type: ignore[arg-type]


# --- backends -------------------------------------------------------------------------------


class Backend:
    """A store under test, with a fresh prefix, and the levers of its fake."""

    name: str
    store: ObjectStore

    def put_raw(self, key: str, data: bytes, sha256: str | None) -> None:
        """Write an object behind the store's back, recording ``sha256`` (or none)."""
        raise NotImplementedError

    def failing_store(self, kind: str) -> ObjectStore:
        """A store of the same objects whose calls fail: "auth", "unavailable", or
        "transient" (the first call fails, retries succeed)."""
        raise NotImplementedError

    def missing_bucket_store(self) -> ObjectStore:
        raise NotImplementedError


class LocalBackend(Backend):
    name = "local"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.store = LocalStore(root, create=True)

    def put_raw(self, key: str, data: bytes, sha256: str | None) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        meta = self.root / ".spottrain-meta" / f"{key}.json"
        if sha256 is None:
            meta.unlink(missing_ok=True)
        else:
            meta.parent.mkdir(parents=True, exist_ok=True)
            meta.write_text(f'{{"sha256": "{sha256}", "size": {len(data)}}}')

    def failing_store(self, kind: str) -> ObjectStore:
        pytest.skip("a local directory has no credentials or transient service errors")

    def missing_bucket_store(self) -> ObjectStore:
        return LocalStore(self.root / "not-mounted")


class S3Backend(Backend):
    name = "s3"

    def __init__(self, endpoint: str, session: Any) -> None:
        self.endpoint = endpoint
        self.session = session
        self.raw = session.client("s3", endpoint_url=endpoint)
        self.prefix = f"t-{uuid.uuid4().hex[:10]}"
        self.store = self._store(session)

    def _store(self, session: Any, bucket: str = BUCKET, max_attempts: int = 1) -> S3Store:
        return S3Store(
            bucket,
            self.prefix,
            session=session,
            endpoint_url=self.endpoint,
            multipart_threshold=5 * MIB,
            multipart_chunksize=5 * MIB,
            max_attempts=max_attempts,
        )

    def put_raw(self, key: str, data: bytes, sha256: str | None) -> None:
        metadata = {SHA256_METADATA: sha256} if sha256 else {}
        self.raw.put_object(Bucket=BUCKET, Key=f"{self.prefix}/{key}", Body=data, Metadata=metadata)

    def failing_store(self, kind: str) -> ObjectStore:
        session = _aws_session()
        # Hooks go on the session before the store makes its client, which copies them.
        if kind == "auth":
            session.events.register("before-send.s3", _s3_fault(403, "InvalidAccessKeyId"))
            return self._store(session)
        if kind == "unavailable":
            session.events.register("before-send.s3", _s3_fault(503, "SlowDown"))
            return self._store(session, max_attempts=2)
        session.events.register("before-send.s3", _s3_fault(503, "SlowDown", times=1))
        return self._store(session, max_attempts=3)

    def missing_bucket_store(self) -> ObjectStore:
        return self._store(self.session, bucket="no-such-bucket")


class GcsBackend(Backend):
    name = "gcs"

    def __init__(self, server: GcsServer) -> None:
        self.server = server
        self.prefix = f"t-{uuid.uuid4().hex[:10]}"
        self.http = _LocalOnlySession()
        self.store = self._store()

    def _store(self, bucket: str = BUCKET, retry_timeout_s: float = 0.0) -> GcsStore:
        client = gcs.Client(
            project="test",
            credentials=AnonymousCredentials(),
            client_options={"api_endpoint": self.server.url},
            _http=self.http,
        )
        return GcsStore(
            bucket,
            self.prefix,
            client=client,
            chunk_size=2 * MIB,
            retry_timeout_s=retry_timeout_s,
        )

    def put_raw(self, key: str, data: bytes, sha256: str | None) -> None:
        metadata = {SHA256_METADATA: sha256} if sha256 else None
        self.server.put_object(BUCKET, f"{self.prefix}/{key}", data, metadata)

    def failing_store(self, kind: str) -> ObjectStore:
        if kind == "auth":
            self.server.fail_all(401)
        elif kind == "unavailable":
            self.server.fail_all(503)
        else:
            self.server.fail_objects(503, 1)
            return self._store(retry_timeout_s=10.0)
        return self.store

    def missing_bucket_store(self) -> ObjectStore:
        return self._store(bucket="no-such-bucket")


@pytest.fixture(params=["local", "s3", "gcs"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "local":
        yield LocalBackend(tmp_path / "store")
    elif request.param == "s3":
        yield S3Backend(
            request.getfixturevalue("moto_endpoint"), request.getfixturevalue("aws_session")
        )
    else:
        server: GcsServer = request.getfixturevalue("gcs_server")
        gcs_backend = GcsBackend(server)
        yield gcs_backend
        server.clear_faults()
        assert set(gcs_backend.http.hosts) <= {"127.0.0.1"}


# --- a store wrapper that records and fails on demand ----------------------------------------


class RecordingStore:
    """Delegates to a store, records every write and read, and can fail the n-th get_file."""

    def __init__(self, inner: ObjectStore, *, fail_get_file_at: int | None = None) -> None:
        self.inner = inner
        self.calls: list[tuple[str, str]] = []
        self._fail_at = fail_get_file_at

    def put_file(
        self, key: str, path: str | os.PathLike[str], *, sha256: str | None = None
    ) -> None:
        self.calls.append(("put", key))
        self.inner.put_file(key, path, sha256=sha256)

    def put_fileobj(self, key: str, f: BinaryIO, *, sha256: str | None = None) -> None:
        self.calls.append(("put", key))
        self.inner.put_fileobj(key, f, sha256=sha256)

    def get_file(self, key: str, path: str | os.PathLike[str]) -> ObjectInfo:
        self.calls.append(("get", key))
        if self._fail_at is not None and sum(c[0] == "get" for c in self.calls) == self._fail_at:
            raise StorageUnavailable("injected: the connection dropped")
        return self.inner.get_file(key, path)

    def put_bytes(self, key: str, data: bytes) -> None:
        self.calls.append(("put", key))
        self.inner.put_bytes(key, data)

    def get_bytes(self, key: str) -> bytes:
        return self.inner.get_bytes(key)

    def stat(self, key: str) -> ObjectInfo:
        return self.inner.stat(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str = "") -> list[str]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.calls.append(("delete", key))
        self.inner.delete(key)

    def url(self, key: str = "") -> str:
        return self.inner.url(key)


def _make_tree(root: Path) -> dict[str, bytes]:
    files = {
        "MANIFEST.json": b'{"step": 120}\n',
        ".metadata": b"dcp metadata",
        "__0_0.distcp": os.urandom(3000),
        "__1_0.distcp": os.urandom(5000),
        "extra/nested/deep.bin": os.urandom(100),
        "extra/empty.txt": b"",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def _read_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


# --- single objects ---------------------------------------------------------------------------


def test_put_bytes_then_get_bytes_returns_the_same_bytes(backend: Backend) -> None:
    backend.store.put_bytes("a/b.txt", b"hello")
    backend.store.put_bytes("empty", b"")
    assert backend.store.get_bytes("a/b.txt") == b"hello"
    assert backend.store.get_bytes("empty") == b""
    info = backend.store.stat("a/b.txt")
    assert (info.key, info.size) == ("a/b.txt", 5)
    assert info.sha256 == "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"


def test_a_large_file_round_trips_through_multipart_or_resumable_transfers(
    backend: Backend, tmp_path: Path
) -> None:
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(17 * MIB + 123))
    backend.store.put_file("ckpt/big.bin", src)
    dest = tmp_path / "out" / "deeper" / "big.bin"
    info = backend.store.get_file("ckpt/big.bin", dest)
    assert dest.read_bytes() == src.read_bytes()
    assert info.size == src.stat().st_size
    assert [p.name for p in dest.parent.iterdir()] == ["big.bin"]  # no temporary left behind


def test_exists_is_true_only_for_stored_objects(backend: Backend) -> None:
    backend.store.put_bytes("dir/obj", b"x")
    assert backend.store.exists("dir/obj")
    assert not backend.store.exists("dir/other")
    assert not backend.store.exists("dir")  # a "directory" is not an object


def test_list_returns_the_keys_under_a_prefix_sorted(backend: Backend) -> None:
    for key in ["b/2", "a/1", "b/1", "b10/x", "c"]:
        backend.store.put_bytes(key, key.encode())
    assert backend.store.list() == ["a/1", "b/1", "b/2", "b10/x", "c"]
    assert backend.store.list("b/") == ["b/1", "b/2"]
    assert backend.store.list("b") == ["b/1", "b/2", "b10/x"]
    assert backend.store.list("zzz/") == []


def test_delete_removes_an_object_and_deleting_again_is_not_an_error(backend: Backend) -> None:
    backend.store.put_bytes("x/y", b"1")
    backend.store.delete("x/y")
    backend.store.delete("x/y")
    backend.store.delete("never/was")
    assert not backend.store.exists("x/y")
    assert backend.store.list() == []


def test_a_missing_key_raises_object_not_found(backend: Backend, tmp_path: Path) -> None:
    with pytest.raises(ObjectNotFound) as excinfo:
        backend.store.get_bytes("nope/missing")
    assert excinfo.value.key == "nope/missing"
    assert "nope/missing" in str(excinfo.value)
    with pytest.raises(ObjectNotFound):
        backend.store.stat("nope/missing")
    with pytest.raises(ObjectNotFound):
        backend.store.get_file("nope/missing", tmp_path / "dl" / "f")
    assert list((tmp_path / "dl").iterdir()) == []


@pytest.mark.parametrize(
    "key",
    ["", "/abs", "a//b", "a/", "../up", "a/../b", "a/./b", ".spottrain-meta/x", "f.spottrain-part"],
)
def test_bad_keys_are_refused_before_any_request(backend: Backend, key: str) -> None:
    with pytest.raises(ValueError, match="key"):
        backend.store.put_bytes(key, b"x")
    with pytest.raises(ValueError, match="key"):
        backend.store.get_bytes(key)
    with pytest.raises(ValueError, match="key"):
        backend.store.delete(key)
    with pytest.raises(ValueError, match="key"):
        backend.store.exists(key)


def test_url_names_the_object_in_a_form_open_store_reads(backend: Backend) -> None:
    url = backend.store.url("ckpt/step-000000120/MANIFEST.json")
    assert url.endswith("/ckpt/step-000000120/MANIFEST.json")
    parsed = parse_store_url(url)
    assert parsed.scheme == {"local": "file", "s3": "s3", "gcs": "gs"}[backend.name]
    if parsed.scheme != "file":
        assert parsed.bucket == BUCKET
    root = parse_store_url(backend.store.url())
    assert parsed.path == f"{root.path}/ckpt/step-000000120/MANIFEST.json"


def test_a_put_overwrites_the_previous_object(backend: Backend, tmp_path: Path) -> None:
    backend.store.put_bytes("k", b"old bytes")
    first = backend.store.stat("k")
    src = tmp_path / "new"
    src.write_bytes(b"new")
    backend.store.put_file("k", src)
    assert backend.store.get_bytes("k") == b"new"
    assert backend.store.stat("k").version != first.version


def test_get_bytes_detects_an_object_tampered_with_behind_the_store(backend: Backend) -> None:
    backend.store.put_bytes("t/obj", b"original")
    recorded = backend.store.stat("t/obj").sha256
    backend.put_raw("t/obj", b"tampered", recorded)
    with pytest.raises(CorruptObject, match="sha256"):
        backend.store.get_bytes("t/obj")


def test_a_missing_bucket_raises_bucket_not_found(backend: Backend) -> None:
    store = backend.missing_bucket_store()
    with pytest.raises(BucketNotFound):
        store.get_bytes("k")
    with pytest.raises(BucketNotFound):
        store.exists("k")
    with pytest.raises(BucketNotFound):
        store.list()


def test_bad_credentials_raise_storage_auth_error_saying_how_to_fix_them(
    backend: Backend,
) -> None:
    store = backend.failing_store("auth")
    with pytest.raises(StorageAuthError, match="credentials") as excinfo:
        store.put_bytes("k", b"x")
    assert any(word in str(excinfo.value) for word in ("AWS_PROFILE", "gcloud auth"))
    with pytest.raises(StorageAuthError):
        store.get_bytes("k")
    with pytest.raises(StorageAuthError):
        store.list()


def test_an_unavailable_service_raises_storage_unavailable(backend: Backend) -> None:
    store = backend.failing_store("unavailable")
    with pytest.raises(StorageUnavailable):
        store.put_bytes("k", b"x")
    with pytest.raises(StorageUnavailable):
        store.get_bytes("k")
    with pytest.raises(StorageUnavailable):
        store.exists("k")


def test_a_transient_error_is_retried_and_the_call_succeeds(backend: Backend) -> None:
    store = backend.failing_store("transient")
    store.put_bytes("k", b"survives a 503")
    assert store.get_bytes("k") == b"survives a 503"


# --- directory copies -----------------------------------------------------------------------


def test_upload_dir_then_download_dir_round_trips_nested_files(
    backend: Backend, tmp_path: Path
) -> None:
    src = tmp_path / "step-000000120"
    files = _make_tree(src)
    report = upload_dir(backend.store, src, "ckpt/step-000000120")
    assert sorted(report.uploaded) == sorted(files)
    assert report.skipped == () and report.deleted == ()
    assert report.url == backend.store.url("ckpt/step-000000120")
    dest = tmp_path / "restored" / "step-000000120"
    assert download_dir(backend.store, "ckpt/step-000000120", dest) == dest
    assert _read_tree(dest) == files
    assert [p.name for p in dest.parent.iterdir()] == ["step-000000120"]


def test_upload_dir_puts_the_commit_marker_last(backend: Backend, tmp_path: Path) -> None:
    src = tmp_path / "step-000000120"
    files = _make_tree(src)
    recorder = RecordingStore(backend.store)
    upload_dir(recorder, src, "ckpt/step-000000120")
    puts = [key for op, key in recorder.calls if op == "put"]
    assert len(puts) == len(files)
    assert puts[-1] == "ckpt/step-000000120/MANIFEST.json"


def test_download_dir_refuses_a_copy_without_its_marker(backend: Backend, tmp_path: Path) -> None:
    src = tmp_path / "step-000000140"
    _make_tree(src)
    upload_dir(backend.store, src, "ckpt/step-000000140")
    backend.store.delete("ckpt/step-000000140/MANIFEST.json")  # as if the upload died before it
    dest = tmp_path / "restored"
    with pytest.raises(IncompleteCopy, match=r"MANIFEST\.json"):
        download_dir(backend.store, "ckpt/step-000000140", dest)
    assert not dest.exists()


def test_download_dir_detects_a_corrupted_object_and_leaves_nothing(
    backend: Backend, tmp_path: Path
) -> None:
    src = tmp_path / "step-000000120"
    _make_tree(src)
    upload_dir(backend.store, src, "ckpt/step-000000120")
    key = "ckpt/step-000000120/__1_0.distcp"
    recorded = backend.store.stat(key).sha256
    backend.put_raw(key, b"bit rot" * 100, recorded)
    dest = tmp_path / "restored" / "step-000000120"
    with pytest.raises(CorruptObject, match=r"__1_0\.distcp"):
        download_dir(backend.store, "ckpt/step-000000120", dest)
    assert list(dest.parent.iterdir()) == []


def test_download_dir_refuses_an_object_without_a_recorded_sha256(
    backend: Backend, tmp_path: Path
) -> None:
    src = tmp_path / "step-000000120"
    _make_tree(src)
    upload_dir(backend.store, src, "ckpt/step-000000120")
    backend.put_raw("ckpt/step-000000120/stranger.bin", b"written by another tool", None)
    with pytest.raises(CorruptObject, match="no recorded sha256"):
        download_dir(backend.store, "ckpt/step-000000120", tmp_path / "restored")
    assert not (tmp_path / "restored").exists()


def test_a_download_that_fails_midway_leaves_no_partial_directory(
    backend: Backend, tmp_path: Path
) -> None:
    src = tmp_path / "step-000000120"
    _make_tree(src)
    upload_dir(backend.store, src, "ckpt/step-000000120")
    flaky = RecordingStore(backend.store, fail_get_file_at=3)
    parent = tmp_path / "restored"
    with pytest.raises(StorageUnavailable, match="injected"):
        download_dir(flaky, "ckpt/step-000000120", parent / "step-000000120")
    assert list(parent.iterdir()) == []


def test_download_dir_will_not_overwrite_an_existing_directory(
    backend: Backend, tmp_path: Path
) -> None:
    src = tmp_path / "step-000000120"
    _make_tree(src)
    upload_dir(backend.store, src, "ckpt/step-000000120")
    with pytest.raises(FileExistsError):
        download_dir(backend.store, "ckpt/step-000000120", src)


def test_a_repeated_upload_skips_unchanged_files(backend: Backend, tmp_path: Path) -> None:
    src = tmp_path / "step-000000120"
    files = _make_tree(src)
    upload_dir(backend.store, src, "ckpt/step-000000120")
    recorder = RecordingStore(backend.store)
    again = upload_dir(recorder, src, "ckpt/step-000000120")
    assert again.uploaded == () and again.bytes_uploaded == 0
    assert sorted(again.skipped) == sorted(files)
    assert recorder.calls == []


def test_a_changed_copy_is_uncommitted_first_and_mirrors_the_directory(
    backend: Backend, tmp_path: Path
) -> None:
    src = tmp_path / "step-000000120"
    files = _make_tree(src)
    upload_dir(backend.store, src, "ckpt/step-000000120")
    (src / "__0_0.distcp").write_bytes(b"changed")
    (src / "extra" / "empty.txt").unlink()
    recorder = RecordingStore(backend.store)
    report = upload_dir(recorder, src, "ckpt/step-000000120")
    marker = "ckpt/step-000000120/MANIFEST.json"
    assert recorder.calls[0] == ("delete", marker)
    assert recorder.calls[-1] == ("put", marker)
    assert report.uploaded == ("__0_0.distcp", "MANIFEST.json")
    assert report.deleted == ("extra/empty.txt",)
    assert "MANIFEST.json" not in report.skipped
    dest = tmp_path / "restored"
    download_dir(backend.store, "ckpt/step-000000120", dest)
    expected = {k: v for k, v in files.items() if k != "extra/empty.txt"}
    expected["__0_0.distcp"] = b"changed"
    assert _read_tree(dest) == expected


def test_an_interrupted_upload_resumes_without_resending_finished_files(
    backend: Backend, tmp_path: Path
) -> None:
    src = tmp_path / "step-000000120"
    _make_tree(src)
    # The first attempt sent two files and died before the marker.
    backend.store.put_file("ckpt/step-000000120/__0_0.distcp", src / "__0_0.distcp")
    backend.store.put_file("ckpt/step-000000120/.metadata", src / ".metadata")
    report = upload_dir(backend.store, src, "ckpt/step-000000120")
    assert set(report.skipped) == {"__0_0.distcp", ".metadata"}
    assert report.uploaded[-1] == "MANIFEST.json"


def test_list_dirs_lists_only_complete_copies(backend: Backend, tmp_path: Path) -> None:
    for step in ("step-000000100", "step-000000120", "step-000000140"):
        _make_tree(tmp_path / step)
        upload_dir(backend.store, tmp_path / step, f"ckpt/{step}")
    backend.store.delete("ckpt/step-000000140/MANIFEST.json")
    backend.store.put_bytes("ckpt/latest", b"step-000000120")
    assert list_dirs(backend.store, "ckpt") == ["step-000000100", "step-000000120"]
    assert list_dirs(backend.store, "elsewhere") == []


def test_list_dirs_nested_lists_complete_copies_at_any_depth_by_their_path(
    backend: Backend, tmp_path: Path
) -> None:
    _make_tree(tmp_path / "a")
    _make_tree(tmp_path / "a" / "sub")  # a directory of a copy's files with its own marker
    for name in ("step-000000100", "hf/checkpoint-40", "hf/checkpoint-60", "x/y/checkpoint-7"):
        upload_dir(backend.store, tmp_path / "a", f"ckpt/{name}")
    backend.store.delete("ckpt/hf/checkpoint-60/MANIFEST.json")
    # Inside a copy without its marker, nothing says "a copy's files": its sub/ is listed,
    # and a reader that knows its names (the copier: <prefix>N) passes it over.
    assert list_dirs(backend.store, "ckpt", nested=True) == [
        "hf/checkpoint-40",
        "hf/checkpoint-60/sub",
        "step-000000100",
        "x/y/checkpoint-7",
    ]
    assert list_dirs(backend.store, "ckpt") == ["step-000000100"]


def test_upload_dir_refuses_a_directory_without_its_marker(
    backend: Backend, tmp_path: Path
) -> None:
    src = tmp_path / "step-000000120"
    _make_tree(src)
    (src / "MANIFEST.json").unlink()
    with pytest.raises(ValueError, match=r"no MANIFEST\.json"):
        upload_dir(backend.store, src, "ckpt/step-000000120")
    with pytest.raises(ValueError, match="non-empty prefix"):
        upload_dir(backend.store, src, "", commit_marker=".metadata")
    assert backend.store.list() == []


# --- a file or checkpoint that changes while it is uploaded ------------------------------------


def test_put_file_refuses_a_file_changed_since_the_caller_hashed_it(
    backend: Backend, tmp_path: Path
) -> None:
    src = tmp_path / "f"
    src.write_bytes(b"what was hashed")
    stale = hashlib.sha256(src.read_bytes()).hexdigest()
    src.write_bytes(b"what is there now")
    with pytest.raises(SourceChanged, match="changed since it was hashed"):
        backend.store.put_file("k", src, sha256=stale)
    assert not backend.store.exists("k")
    backend.store.put_file("k", src)
    assert backend.store.get_bytes("k") == b"what is there now"


def _commit_checkpoint(ckdir: CheckpointDir, step: int, *, flip: bool = False) -> Path:
    """Commit checkpoint ``step`` through the real commit path, with random shard bytes;
    ``flip``: a byte of one shard is damaged on the volume afterwards."""
    tmp = ckdir.tmp_path(step, 0)
    tmp.mkdir()
    sums = {}
    for name, data in {
        ".metadata": b"dcp metadata",
        "__0_0.distcp": os.urandom(3000),
        "__1_0.distcp": os.urandom(6000),
    }.items():
        (tmp / name).write_bytes(data)
        sums[name] = FileSum(len(data), zlib.crc32(data))
    path = ckdir.commit(tmp, Manifest(step, 2, 0, "periodic", time.time(), sums))
    if flip:
        shard = path / "__1_0.distcp"
        raw = bytearray(shard.read_bytes())
        raw[100] ^= 0x01
        shard.write_bytes(bytes(raw))
    return path


class _RecommitBeforeFirstPut:
    """Delegates to a store; just before the first file goes up, the checkpoint being
    uploaded is committed again by a newer round (set aside, replaced, deleted)."""

    def __init__(self, inner: ObjectStore, recommit: Callable[[], Path]) -> None:
        self.inner = inner
        self._recommit: Callable[[], Path] | None = recommit

    def _maybe_recommit(self) -> None:
        if self._recommit is not None:
            self._recommit, recommit = None, self._recommit
            recommit()

    def put_file(self, key: str, path: str | os.PathLike[str], **kw: Any) -> None:
        self._maybe_recommit()
        self.inner.put_file(key, path, **kw)

    def put_fileobj(self, key: str, f: BinaryIO, **kw: Any) -> None:
        self._maybe_recommit()
        self.inner.put_fileobj(key, f, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_step_committed_again_during_its_upload_never_leaves_a_corrupt_copy(
    backend: Backend, tmp_path: Path
) -> None:
    volume = CheckpointDir(_mkdir(tmp_path / "volume"))
    path = _commit_checkpoint(volume, 7)
    prefix = "run/step-000000007"
    store = _RecommitBeforeFirstPut(backend.store, lambda: _commit_checkpoint(volume, 7))
    try:
        upload_dir(store, path, prefix)  # type: ignore[arg-type]
    except StorageUnavailable as exc:
        assert "upload it again" in str(exc)
        assert list_dirs(backend.store, "run") == []  # no marker: never taken for a copy
        upload_dir(backend.store, path, prefix)  # the retry copies the new commit
    pulled = tmp_path / "pulled"
    dest = download_dir(backend.store, prefix, pulled / "step-000000007")
    assert CheckpointDir(pulled).check(7, dest) is None
    assert _read_tree(dest) == _read_tree(volume.step_path(7))


# --- bringing a checkpoint copy in ------------------------------------------------------------


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


def _copier(
    backend: Backend, volume: Path, client: redis.Redis, keys: RunKeys, node: str = "n-new"
) -> CheckpointCopier:
    record = NodeRecord(client, keys, NodeInfo(node, "local"))
    return CheckpointCopier(
        backend.store.url(), str(volume), client, keys, node, record, store=backend.store
    )


def _copy_out(backend: Backend, keys: RunKeys, path: Path, name: str | None = None) -> None:
    upload_dir(backend.store, path, f"{keys.run_id}/{name or path.name}")


def _commit_in_place(volume: CheckpointDir, rel: str, step: int, *, torn: bool = False) -> Path:
    """A framework's checkpoint at ``rel`` in the volume (``hf/checkpoint-5``), committed in
    place through the real commit path, as the Trainer's callback does; ``torn``: its files
    only, as a save that died before its manifest leaves it."""
    path = volume.root / rel
    path.mkdir(parents=True)
    sums = {}
    for name, data in {
        "model.safetensors": os.urandom(4000),
        "trainer_state.json": b'{"global_step": %d}' % step,
    }.items():
        (path / name).write_bytes(data)
        sums[name] = FileSum(len(data), zlib.crc32(data))
    if torn:
        return path
    return volume.commit_in_place(path, Manifest(step, 2, 0, "periodic", time.time(), sums))


def _report_commit(client: redis.Redis, keys: RunKeys, path: Path, step: int) -> None:
    """Node n-old committed ``path``, as the SDK reports a commit to the run's Redis."""
    client.hset(keys.ckpt_last, mapping={"node": "n-old", "step": str(step), "path": str(path)})


def _events(client: redis.Redis, keys: RunKeys, kind: str) -> list[dict[str, str]]:
    rows = [{k.decode(): v.decode() for k, v in f.items()} for _, f in client.xrange(keys.events)]
    return [row for row in rows if row["type"] == kind]


def test_a_new_node_falls_back_to_the_newest_usable_copy_and_says_what_it_skipped(
    backend: Backend, tmp_path: Path, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    old = CheckpointDir(_mkdir(tmp_path / "zone-a"))
    for step in (10, 20, 30, 40, 50):
        _copy_out(backend, run_keys, _commit_checkpoint(old, step, flip=step == 20))
    run = run_keys.run_id
    # 50: its upload died before the marker; 40: an object rotted in the store; 30: an
    # object lost; 20: damaged on the volume before it was copied (its objects are whole).
    backend.store.delete(f"{run}/step-000000050/MANIFEST.json")
    rotted = f"{run}/step-000000040/__0_0.distcp"
    backend.put_raw(rotted, b"rot" * 1000, backend.store.stat(rotted).sha256)
    backend.store.delete(f"{run}/step-000000030/__1_0.distcp")

    volume = tmp_path / "zone-b"
    result = _copier(backend, volume, redis_client, run_keys).pull_newest()
    assert result.step == 10
    assert [name for name, _ in result.skipped] == [
        "step-000000040",
        "step-000000030",
        "step-000000020",
    ]
    reasons = [why for _, why in result.skipped]
    assert "is corrupt" in reasons[0]
    assert "__1_0.distcp is missing" in reasons[1]
    assert "does not verify once downloaded" in reasons[2] and "CRC32" in reasons[2]
    found = CheckpointDir(volume).find_restorable()
    assert found is not None and found.manifest.step == 10 and found.skipped == []
    assert [p.name for p in volume.iterdir() if p.name.startswith(".tmp")] == []
    assert (volume / "latest").read_text() == "step-000000010"

    events = [
        {k.decode(): v.decode() for k, v in f.items()}
        for _, f in redis_client.xrange(run_keys.events)
    ]
    skipped = [e for e in events if e["type"] == "checkpoint-copy-skipped"]
    assert [(e["step"], e["node"]) for e in skipped] == [
        ("40", "n-new"),
        ("30", "n-new"),
        ("20", "n-new"),
    ]
    assert [e["reason"] for e in skipped] == reasons
    pulled = [e for e in events if e["type"] == "checkpoint-pulled"]
    assert len(pulled) == 1 and pulled[0]["step"] == "10"


def test_with_no_usable_copy_a_node_with_an_empty_volume_refuses_to_start_from_nothing(
    backend: Backend, tmp_path: Path, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    old = CheckpointDir(_mkdir(tmp_path / "zone-a"))
    _copy_out(backend, run_keys, _commit_checkpoint(old, 10, flip=True))
    with pytest.raises(StorageError, match=r"no usable checkpoint copy .*step-000000010: .*CRC32"):
        _copier(backend, tmp_path / "zone-b", redis_client, run_keys).pull_newest()
    # A volume with a checkpoint of its own starts from it, having said what it skipped.
    own = CheckpointDir(_mkdir(tmp_path / "zone-c"))
    _commit_checkpoint(own, 5)
    result = _copier(backend, own.root, redis_client, run_keys).pull_newest()
    assert result.step is None and [n for n, _ in result.skipped] == ["step-000000010"]
    assert [s for s, _ in own.committed()] == [5]


def test_a_frameworks_copy_already_brought_in_by_a_node_of_the_zone_is_used_by_the_next(
    backend: Backend, tmp_path: Path, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    """A framework's checkpoint-N (the Trainer's, committed in place) is not a step-N of the
    volume's own: the second node to boot on the zone's shared volume finds the copy the
    first brought in as the volume's own newest, and brings in nothing."""
    old = CheckpointDir(_mkdir(tmp_path / "zone-a"))
    _copy_out(backend, run_keys, _commit_in_place(old, "checkpoint-5", 5))
    volume = tmp_path / "zone-b"
    first = _copier(backend, volume, redis_client, run_keys).pull_newest()
    second = _copier(backend, volume, redis_client, run_keys).pull_newest()
    assert (first.step, second.step) == (5, None)
    assert CheckpointDir(volume).check(5, volume / "checkpoint-5") is None
    assert [p.name for p in volume.iterdir() if p.name.startswith(".tmp")] == []
    assert len(_events(redis_client, run_keys, "checkpoint-pulled")) == 1


def test_a_trainers_checkpoint_below_the_volume_comes_back_to_its_place_in_another_zone(
    backend: Backend, tmp_path: Path, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    """output_dir=$SPOTTRAIN_CKPT_DIR/hf: the copy keeps hf/, and the pull puts it back
    there, where the Trainer (and last_checkpoint(output_dir)) looks."""
    zone_a = CheckpointDir(_mkdir(tmp_path / "zone-a"))
    path = _commit_in_place(zone_a, "hf/checkpoint-5", 5)
    _report_commit(redis_client, run_keys, path, 5)
    assert _copier(backend, zone_a.root, redis_client, run_keys, node="n-old").copy_newest()
    run = run_keys.run_id
    assert backend.store.exists(f"{run}/hf/checkpoint-5/MANIFEST.json")
    assert not backend.store.exists(f"{run}/checkpoint-5/MANIFEST.json")
    assert redis_client.hget(run_keys.ckpt_copied, "step") == b"5"

    zone_b = tmp_path / "zone-b"
    result = _copier(backend, zone_b, redis_client, run_keys).pull_newest()
    assert result.step == 5
    assert CheckpointDir(zone_b).check(5, zone_b / "hf" / "checkpoint-5") is None
    assert not (zone_b / "checkpoint-5").exists()
    assert [p.name for p in (zone_b / "hf").iterdir()] == ["checkpoint-5"]  # no temporary left
    (pulled,) = _events(redis_client, run_keys, "checkpoint-pulled")
    assert pulled["source"].endswith(f"{run}/hf/checkpoint-5")


def test_a_checkpoint_outside_the_volume_is_never_copied_and_the_event_names_the_fix(
    backend: Backend, tmp_path: Path, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    zone_a = CheckpointDir(_mkdir(tmp_path / "zone-a"))
    elsewhere = CheckpointDir(_mkdir(tmp_path / "elsewhere"))
    _report_commit(redis_client, run_keys, _commit_in_place(elsewhere, "checkpoint-5", 5), 5)
    copier = _copier(backend, zone_a.root, redis_client, run_keys, node="n-old")
    assert not copier.copy_newest()
    assert not copier.copy_newest()
    assert backend.store.list(f"{run_keys.run_id}/") == []
    assert redis_client.hget(run_keys.ckpt_copied, "step") is None
    (failed,) = _events(redis_client, run_keys, "checkpoint-copy-failed")  # said once
    assert failed["step"] == "5"
    assert "outside the checkpoint volume" in failed["error"]
    assert "$SPOTTRAIN_CKPT_DIR" in failed["error"] and "output_dir" in failed["error"]


@pytest.mark.parametrize("where", ["", "hf/"])
def test_a_volume_whose_newest_is_a_trainers_checkpoint_brings_in_no_older_copy(
    backend: Backend,
    tmp_path: Path,
    redis_client: redis.Redis,
    run_keys: RunKeys,
    where: str,
) -> None:
    """A complete checkpoint-N committed in place counts as the volume's, wherever the copies
    would put theirs: an older copy is not brought in over it at every boot."""
    zone_a = CheckpointDir(_mkdir(tmp_path / "zone-a"))
    _copy_out(
        backend,
        run_keys,
        _commit_in_place(zone_a, f"{where}checkpoint-5", 5),
        f"{where}checkpoint-5",
    )
    zone_b = CheckpointDir(_mkdir(tmp_path / "zone-b"))
    _commit_in_place(zone_b, f"{where}checkpoint-8", 8)
    result = _copier(backend, zone_b.root, redis_client, run_keys).pull_newest()
    assert result.step is None and result.skipped == ()
    assert not (zone_b.root / f"{where}checkpoint-5").exists()
    assert not (zone_b.root / "latest").exists()
    assert _events(redis_client, run_keys, "checkpoint-pulled") == []


def test_a_torn_trainers_checkpoint_on_the_volume_does_not_stop_a_newer_copy_coming_in(
    backend: Backend, tmp_path: Path, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    zone_a = CheckpointDir(_mkdir(tmp_path / "zone-a"))
    _copy_out(backend, run_keys, _commit_in_place(zone_a, "hf/checkpoint-5", 5), "hf/checkpoint-5")
    zone_b = CheckpointDir(_mkdir(tmp_path / "zone-b"))
    _commit_in_place(zone_b, "hf/checkpoint-3", 3)
    _commit_in_place(zone_b, "hf/checkpoint-5", 5, torn=True)  # saves that died
    _commit_in_place(zone_b, "hf/checkpoint-9", 9, torn=True)
    result = _copier(backend, zone_b.root, redis_client, run_keys).pull_newest()
    assert result.step == 5
    hf = zone_b.root / "hf"
    assert zone_b.check(5, hf / "checkpoint-5") is None
    # The torn one in the copy's place is kept aside, as resume does; the newer one is left
    # for resume (last_checkpoint) to set aside.
    assert len(list(hf.glob(".torn-checkpoint-5-*"))) == 1
    assert (hf / "checkpoint-9").is_dir()


def test_a_copy_named_to_land_outside_the_volume_is_skipped_with_why(
    backend: Backend, tmp_path: Path, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    """A name read back from the store is untrusted: '..' or an absolute path never leads a
    download out of the volume; the copy is skipped like a corrupt one."""
    if backend.name == "local":
        pytest.skip("a directory of files holds no key with a '..' or an empty part")
    zone_a = CheckpointDir(_mkdir(tmp_path / "zone-a"))
    _copy_out(backend, run_keys, _commit_in_place(zone_a, "checkpoint-4", 4))
    run = run_keys.run_id
    for name in ("../../escape/checkpoint-9", "/abs/checkpoint-8"):
        for rel, data in _read_tree(zone_a.root / "checkpoint-4").items():
            backend.put_raw(f"{run}/{name}/{rel}", data, hashlib.sha256(data).hexdigest())
    volume = tmp_path / "deep" / "zone-b"
    result = _copier(backend, volume, redis_client, run_keys).pull_newest()
    assert result.step == 4
    assert [name for name, _ in result.skipped] == [
        "../../escape/checkpoint-9",
        "/abs/checkpoint-8",
    ]
    assert "'..' part" in result.skipped[0][1] and "absolute path" in result.skipped[1][1]
    assert not (tmp_path / "escape").exists() and not Path("/abs").exists()
    skipped = _events(redis_client, run_keys, "checkpoint-copy-skipped")
    assert [e["step"] for e in skipped] == ["9", "8"]


def test_a_copy_whose_place_in_the_volume_is_a_symbolic_link_is_skipped_with_why(
    backend: Backend, tmp_path: Path, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    zone_a = CheckpointDir(_mkdir(tmp_path / "zone-a"))
    _copy_out(backend, run_keys, _commit_in_place(zone_a, "checkpoint-4", 4))
    _copy_out(backend, run_keys, _commit_in_place(zone_a, "hf/checkpoint-9", 9), "hf/checkpoint-9")
    volume = _mkdir(tmp_path / "zone-b")
    outside = _mkdir(tmp_path / "outside")
    (volume / "hf").symlink_to(outside)
    result = _copier(backend, volume, redis_client, run_keys).pull_newest()
    assert result.step == 4
    assert [name for name, _ in result.skipped] == ["hf/checkpoint-9"]
    assert "is a symbolic link" in result.skipped[0][1]
    assert list(outside.iterdir()) == []


# --- backend-specific -----------------------------------------------------------------------


def test_gcs_store_sends_every_request_to_the_fake(gcs_server: GcsServer, tmp_path: Path) -> None:
    gcs_backend = GcsBackend(gcs_server)
    seen_before = len(gcs_server.requests)
    src = tmp_path / "f"
    src.write_bytes(os.urandom(9 * MIB))  # above the client's 8 MiB multipart limit
    gcs_backend.store.put_file("big", src)
    gcs_backend.store.put_bytes("small", b"x")
    gcs_backend.store.get_file("big", tmp_path / "back")
    gcs_backend.store.list()
    gcs_backend.store.delete("small")
    requests_seen = gcs_server.requests[seen_before:]
    kinds = {
        (r.method, r.path.split("/b/")[0], r.query.get("uploadType", "")) for r in requests_seen
    }
    assert ("POST", "/upload/storage/v1", "resumable") in kinds
    assert ("PUT", "/upload/storage/v1", "resumable") in kinds
    assert ("POST", "/upload/storage/v1", "multipart") in kinds
    assert ("GET", "/download/storage/v1", "") in kinds
    assert ("DELETE", "/storage/v1", "") in kinds
    chunks = [r for r in requests_seen if r.method == "PUT"]
    assert len(chunks) == 5  # 9 MiB in 2 MiB chunks
    assert all("content-range" in r.headers for r in chunks)
    assert gcs_backend.http.hosts and set(gcs_backend.http.hosts) == {"127.0.0.1"}


def test_gcs_download_with_a_stale_crc32c_is_reported_corrupt(gcs_server: GcsServer) -> None:
    gcs_backend = GcsBackend(gcs_server)
    gcs_backend.store.put_bytes("obj", b"original bytes")
    gcs_server.tamper(BUCKET, f"{gcs_backend.prefix}/obj", b"flipped bytes!", keep_hashes=True)
    with pytest.raises(CorruptObject, match="CRC32C"):
        gcs_backend.store.get_bytes("obj")


def test_gcs_listing_follows_page_tokens(gcs_server: GcsServer) -> None:
    gcs_backend = GcsBackend(gcs_server)
    keys = [f"k{i:02d}" for i in range(7)]
    for key in keys:
        gcs_backend.store.put_bytes(key, b"")
    gcs_server.max_page_size = 2
    try:
        seen_before = len(gcs_server.requests)
        assert gcs_backend.store.list() == keys
        pages = [r for r in gcs_server.requests[seen_before:] if r.path.endswith("/o")]
        assert len(pages) == 4
    finally:
        gcs_server.max_page_size = 1000


def test_s3_large_file_is_uploaded_in_multipart_parts(
    moto_endpoint: str, aws_session: Any, tmp_path: Path
) -> None:
    s3_backend = S3Backend(moto_endpoint, aws_session)
    src = tmp_path / "big"
    src.write_bytes(os.urandom(11 * MIB))
    s3_backend.store.put_file("big", src)
    head = s3_backend.raw.head_object(Bucket=BUCKET, Key=f"{s3_backend.prefix}/big")
    assert head["ETag"].strip('"').endswith("-3")  # 5 + 5 + 1 MiB
    assert head["Metadata"][SHA256_METADATA] == s3_backend.store.stat("big").sha256

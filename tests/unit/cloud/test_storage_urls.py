"""Storage URLs and keys: what is accepted, and the exact refusals; stores without their SDK."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from spottrain.cloud.storage import (
    BucketNotFound,
    LocalStore,
    StoreUrl,
    parse_store_url,
    validate_key,
)
from spottrain.cloud.stores import open_store

FORMS = (
    "s3://BUCKET[/PREFIX], gs://BUCKET[/PREFIX], file:///ABSOLUTE/DIR, or a plain directory path"
)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("s3://my-bucket", StoreUrl("s3", "my-bucket", "")),
        ("s3://my-bucket/", StoreUrl("s3", "my-bucket", "")),
        ("s3://my-bucket/runs/llama/", StoreUrl("s3", "my-bucket", "runs/llama")),
        ("gs://ckpt.example.com/a", StoreUrl("gs", "ckpt.example.com", "a")),
        ("gs://under_score/x/y", StoreUrl("gs", "under_score", "x/y")),
        ("file:///srv/ckpt", StoreUrl("file", "", "/srv/ckpt")),
        ("file://localhost/srv/ckpt", StoreUrl("file", "", "/srv/ckpt")),
        ("file:///srv/with%20space", StoreUrl("file", "", "/srv/with space")),
        ("/srv/ckpt/", StoreUrl("file", "", "/srv/ckpt")),
    ],
)
def test_parse_store_url_accepts_the_documented_forms(url: str, expected: StoreUrl) -> None:
    assert parse_store_url(url) == expected


def test_a_relative_path_is_made_absolute_against_the_current_directory() -> None:
    assert parse_store_url("some/dir") == StoreUrl("file", "", str(Path.cwd() / "some/dir"))


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://example.com/x", "unknown scheme 'http'"),
        ("s3:/my-bucket/x", "a URL needs '://' after its scheme"),
        ("s3://", "the bucket is missing"),
        ("gs:///prefix", "the bucket is missing"),
        ("s3://My_Bucket", "is not a valid bucket name"),
        ("s3://ab", "is not a valid bucket name"),
        ("s3://bucket/a//b", "empty part"),
        ("s3://bucket/a/../b", "'.' or '..' part"),
        ("s3://bucket/p?versionId=3", "no '?' query"),
        ("file://relative/dir", "three slashes, file:///relative/dir"),
    ],
)
def test_a_bad_url_is_refused_with_the_forms_that_are_allowed(url: str, why: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        parse_store_url(url)
    message = str(excinfo.value)
    assert message.startswith(f"storage URL {url!r} is not one of the forms spottrain accepts")
    assert FORMS in message
    assert why in message


def test_an_empty_url_is_refused_with_the_forms_that_are_allowed() -> None:
    with pytest.raises(ValueError, match="storage URL is empty; use one of s3://"):
        parse_store_url("")


@pytest.mark.parametrize("key", ["a", "a/b/c", "step-000000120/.metadata", "x..y", ".hidden"])
def test_valid_keys_are_returned_unchanged(key: str) -> None:
    assert validate_key(key) == key


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ("", "is empty"),
        ("/a", "starts with '/'"),
        ("a//b", "empty part"),
        ("a/", "empty part"),
        ("..", "'.' or '..' part"),
        ("a/./b", "'.' or '..' part"),
        ("a\nb", "line break"),
        (".spottrain-meta/a", "reserved"),
        ("a/b.spottrain-part", "reserved"),
    ],
)
def test_a_bad_key_is_refused_with_what_a_key_looks_like(key: str, why: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        validate_key(key)
    assert why in str(excinfo.value)
    assert "keys are '/'-separated relative paths" in str(excinfo.value)


def test_open_store_opens_a_local_store_for_a_path(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    assert isinstance(store, LocalStore)
    assert store.url("a/b") == f"{tmp_path.as_uri()}/a/b"
    assert parse_store_url(store.url()).path == str(tmp_path)


def test_a_local_store_on_a_missing_directory_says_it_may_not_be_mounted(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "mnt" / "ckpt")
    with pytest.raises(BucketNotFound, match="is its volume mounted"):
        store.put_bytes("k", b"x")
    assert not (tmp_path / "mnt").exists()


def _run_without(modules: list[str], code: str) -> subprocess.CompletedProcess[str]:
    # Run in a child so blocking the import touches nothing in this process.
    blocker = "; ".join(f"sys.modules[{m!r}] = None" for m in modules)
    return subprocess.run(
        [sys.executable, "-c", f"import sys; {blocker}\n{code}"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_module_imports_without_any_cloud_sdk() -> None:
    result = _run_without(
        ["boto3", "botocore", "google.cloud.storage", "google.cloud"],
        "import spottrain.cloud.storage, spottrain.cloud.code_archive; print('ok')",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize(
    ("blocked", "make", "extra"),
    [
        (["boto3"], "S3Store('my-bucket')", "pip install 'spottrain[aws]'"),
        (["google.cloud.storage"], "GcsStore('my-bucket')", "pip install 'spottrain[gcp]'"),
        (["boto3"], "open_store('s3://my-bucket/x')", "pip install 'spottrain[aws]'"),
    ],
)
def test_a_store_without_its_sdk_says_which_extra_to_install(
    blocked: list[str], make: str, extra: str
) -> None:
    code = (
        "from spottrain.cloud.storage import *\n"
        "from spottrain.cloud.stores import open_store\n"
        "from spottrain.cloud.aws.s3 import S3Store\n"
        "from spottrain.cloud.gcp.gcs import GcsStore\n"
        "try:\n"
        f"    {make}\n"
        "except MissingSdkError as exc:\n"
        "    print(exc)\n"
    )
    result = _run_without(blocked, code)
    assert result.returncode == 0, result.stderr
    assert extra in result.stdout

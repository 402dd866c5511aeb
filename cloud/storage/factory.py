"""Opening a store from its URL (``s3://``, ``gs://``, ``file://`` or a path).

The S3 and GCS stores live with their clouds (:mod:`spottrain.cloud.aws.s3`,
:mod:`spottrain.cloud.gcp.gcs`) and are imported only when a URL names them, so this module
imports without either SDK."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from spottrain.cloud.storage.interface import _BUCKET_RE, ObjectStore, _normalise_store_prefix
from spottrain.cloud.storage.local import LocalStore

_URL_FORMS = (
    "s3://BUCKET[/PREFIX], gs://BUCKET[/PREFIX], file:///ABSOLUTE/DIR, or a plain directory path"
)
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


@dataclass(frozen=True)
class StoreUrl:
    """A parsed storage URL.

    Attributes:
        scheme: ``"s3"``, ``"gs"`` or ``"file"``.
        bucket: the bucket (empty for ``file``).
        path: the prefix inside the bucket (no leading or trailing '/'), or for ``file`` the
            absolute directory.
    """

    scheme: str
    bucket: str
    path: str


def parse_store_url(url: str) -> StoreUrl:
    """Parse ``s3://BUCKET[/PREFIX]``, ``gs://BUCKET[/PREFIX]``, ``file:///DIR`` or a path.

    A plain path may be relative; it is made absolute against the current directory.

    Raises:
        ValueError: the URL is none of those forms; the message lists them.
    """
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"storage URL is empty; use one of {_URL_FORMS}")
    scheme_match = _SCHEME_RE.match(url)
    if scheme_match is None:
        return StoreUrl("file", "", str(Path(url).expanduser().absolute()))
    scheme = scheme_match.group(1).lower()
    bad = f"storage URL {url!r} is not one of the forms spottrain accepts: {_URL_FORMS}"
    if not url[scheme_match.end() :].startswith("//"):
        raise ValueError(f"{bad} (a URL needs '://' after its scheme)")
    parts = urlsplit(url)
    if parts.query or parts.fragment:
        raise ValueError(f"{bad} (no '?' query or '#' fragment)")
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(
                f"{bad} (a file URL names an absolute directory with three slashes, "
                f"file:///{parts.netloc}{parts.path})"
            )
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise ValueError(f"{bad} (a file URL needs an absolute directory)")
        return StoreUrl("file", "", str(Path(path)))
    if scheme not in ("s3", "gs"):
        raise ValueError(f"{bad} (unknown scheme {scheme!r})")
    bucket = parts.netloc
    if not bucket:
        raise ValueError(f"{bad} (the bucket is missing)")
    if not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise ValueError(
            f"{bad} (bucket {bucket!r} is not a valid bucket name: 3 to 222 lowercase "
            "letters, digits, '.', '-' or '_', starting and ending with a letter or digit)"
        )
    try:
        prefix = _normalise_store_prefix(parts.path)
    except ValueError as exc:
        raise ValueError(f"{bad} ({exc})") from None
    return StoreUrl(scheme, bucket, prefix)


def open_store(url: str) -> ObjectStore:
    """Open the store a URL names, with the SDK's default credentials.

    ``s3://`` uses boto3's default session (``AWS_PROFILE``, ``AWS_ENDPOINT_URL_S3`` and the
    rest of its environment apply); ``gs://`` uses Application Default Credentials (and
    ``STORAGE_EMULATOR_HOST`` when set); a ``file://`` URL or a path opens a
    :class:`LocalStore` on a directory that must exist.

    Raises:
        ValueError: a malformed URL; the message lists the accepted forms.
        MissingSdkError: the SDK for that scheme is not installed.
        StorageAuthError: no credentials could be found (GCS checks at construction).
    """
    parsed = parse_store_url(url)
    if parsed.scheme == "s3":
        from spottrain.cloud.aws.s3 import S3Store  # imports boto3 only when used

        return S3Store(parsed.bucket, parsed.path)
    if parsed.scheme == "gs":
        from spottrain.cloud.gcp.gcs import GcsStore  # imports google-cloud-storage when used

        return GcsStore(parsed.bucket, parsed.path)
    return LocalStore(parsed.path)

"""Storage URLs (``s3://``, ``gs://``, ``file://`` or a path), parsed and checked.
:mod:`spottrain.cloud.stores` opens the store a URL names."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from spottrain.cloud.storage.interface import _BUCKET_RE, _normalise_store_prefix

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

"""The object store interface: what a store knows about an object, the :class:`ObjectStore`
protocol every store implements, and the rules for keys."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import BinaryIO, Protocol, runtime_checkable

# The object metadata field that holds the sha256 of an object's bytes, recorded by every put.
SHA256_METADATA = "sha256"
DEFAULT_COMMIT_MARKER = "MANIFEST.json"

# Temporary files carry this suffix until their rename; listings skip them, keys may not use it.
_PART_SUFFIX = ".spottrain-part"
# A LocalStore keeps each object's recorded sha256 in a sidecar under this directory.
_LOCAL_META_DIR = ".spottrain-meta"
_READ_CHUNK = 8 << 20
_MIB = 1 << 20

# Both clouds allow lowercase letters, digits, '.', '-' (and GCS '_'), starting and ending
# with a letter or digit; GCS names with dots may reach 222 characters.
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]\Z")
_KEY_FORM = (
    "keys are '/'-separated relative paths such as 'ckpt/step-000000120/MANIFEST.json' "
    "(no leading '/', no empty, '.' or '..' parts)"
)


# --- the interface --------------------------------------------------------------------------


@dataclass(frozen=True)
class ObjectInfo:
    """What a store knows about one object.

    Attributes:
        key: the key, relative to the store's prefix.
        size: bytes.
        sha256: hex digest recorded when the object was written through an ``ObjectStore``;
            ``None`` for an object written by another tool.
        version: changes whenever the object is replaced (S3 ETag, GCS generation, a local
            file's inode and mtime); only compared for equality.
    """

    key: str
    size: int
    sha256: str | None
    version: str


@runtime_checkable
class ObjectStore(Protocol):
    """A flat namespace of immutable-until-overwritten objects under one prefix.

    The contract, which ``tests/integration/cloud/storage/test_object_store_contract.py``
    checks for every implementation:

    - **Keys** are '/'-separated paths relative to the store's prefix: no leading '/', no
      empty, '.' or '..' parts, nothing ending in ``.spottrain-part`` and no first part
      ``.spottrain-meta``. A bad key raises ``ValueError`` before any request is sent.
    - **Whole objects.** A put replaces the object at once (readers see the old bytes or the
      new, never a mix); ``get_file`` writes a temporary file beside its destination and
      renames it into place, so a crash never leaves a torn destination file.
    - **Checksummed.** Every put records the sha256 of the bytes with the object (S3 user
      metadata, GCS custom metadata, a sidecar file locally); every get checks the bytes it
      received against it and raises :class:`CorruptObject` on a mismatch. A file is hashed
      and sent through one open descriptor, and checked unchanged after sending, so the
      recorded sha256 is that of the bytes sent; a file that changed in between is
      withdrawn with :class:`SourceChanged`, never stored under another file's hash.
    - **Consistency** is the backend's: S3 and GCS are strongly consistent for reads after
      writes and for listings; no operation is atomic across keys.
    - **Errors** are one of the :class:`StorageError` subclasses: :class:`ObjectNotFound`,
      :class:`BucketNotFound`, :class:`StorageAuthError`, :class:`StorageUnavailable`
      (transient; the SDK has already retried), :class:`CorruptObject`. ``delete`` of a
      missing object is not an error.
    """

    def put_file(
        self, key: str, path: str | os.PathLike[str], *, sha256: str | None = None
    ) -> None:
        """Upload a local file, in parts when it is large (see :meth:`put_fileobj`).

        Args:
            key: where to put it.
            path: the file.
            sha256: its hex sha256 as the caller computed it: if the file's bytes no longer
                hash to it, :class:`SourceChanged` is raised and nothing is sent.

        Raises:
            ValueError: a bad key.
            FileNotFoundError: ``path`` does not exist.
            SourceChanged: the file changed since the caller hashed it, or while it was
                sent (then the object is deleted again).
            StorageError: another subclass, as in the class docstring.
        """
        ...

    def put_fileobj(self, key: str, f: BinaryIO, *, sha256: str | None = None) -> None:
        """Upload an open regular file, from its start: hashed through ``f``, then sent from
        ``f``, then checked unchanged (size, mtime, ctime). Whoever renames or replaces the
        file's path meanwhile does not change what ``f`` reads.

        Raises:
            ValueError: a bad key, or ``f`` is not a regular file.
            SourceChanged: as for :meth:`put_file`.
            StorageError: another subclass, as in the class docstring.
        """
        ...

    def get_file(self, key: str, path: str | os.PathLike[str]) -> ObjectInfo:
        """Download an object to ``path`` atomically, creating its parent directories.

        Returns:
            The object's info, whose sha256 the downloaded bytes matched (when recorded).

        Raises:
            ValueError: a bad key.
            ObjectNotFound: no such object.
            CorruptObject: the bytes do not match the recorded sha256.
            StorageError: another subclass, as in the class docstring.
        """
        ...

    def put_bytes(self, key: str, data: bytes) -> None:
        """Store ``data`` as one object.

        Raises:
            ValueError: a bad key.
            StorageError: one of its subclasses, as in the class docstring.
        """
        ...

    def get_bytes(self, key: str) -> bytes:
        """Read a whole object into memory.

        Raises:
            ValueError: a bad key.
            ObjectNotFound: no such object.
            CorruptObject: the bytes do not match the recorded sha256.
            StorageError: another subclass, as in the class docstring.
        """
        ...

    def stat(self, key: str) -> ObjectInfo:
        """The object's size, recorded sha256 and version.

        Raises:
            ValueError: a bad key.
            ObjectNotFound: no such object.
            StorageError: another subclass, as in the class docstring.
        """
        ...

    def exists(self, key: str) -> bool:
        """Whether an object is stored at ``key``.

        Raises:
            ValueError: a bad key.
            StorageError: a subclass other than ObjectNotFound.
        """
        ...

    def list(self, prefix: str = "") -> list[str]:
        """Every key that starts with ``prefix`` (a plain string prefix), sorted.

        Raises:
            ValueError: a prefix with a leading '/' or an empty, '.' or '..' part.
            StorageError: one of its subclasses, as in the class docstring.
        """
        ...

    def delete(self, key: str) -> None:
        """Delete an object; deleting a missing one is not an error.

        Raises:
            ValueError: a bad key.
            StorageError: one of its subclasses, as in the class docstring.
        """
        ...

    def url(self, key: str = "") -> str:
        """The full URL of ``key`` (or of the store itself), which
        :func:`spottrain.cloud.stores.open_store` reads.

        Raises:
            ValueError: a bad key.
        """
        ...


# --- keys and URLs --------------------------------------------------------------------------


def validate_key(key: str) -> str:
    """Return ``key`` if it is a valid object key.

    Raises:
        ValueError: why it is not, and what a key looks like.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"object key {key!r} is empty; {_KEY_FORM}")
    why = _key_problem(key)
    if why:
        raise ValueError(f"bad object key {key!r}: {why}; {_KEY_FORM}")
    return key


def _key_problem(key: str) -> str:
    if key.startswith("/"):
        return "it starts with '/'"
    if any(c in key for c in "\x00\r\n"):
        return "it contains a NUL or line break"
    parts = key.split("/")
    if any(p == "" for p in parts):
        return "it has an empty part ('//' or a trailing '/')"
    if any(p in (".", "..") for p in parts):
        return "it has a '.' or '..' part"
    if parts[0] == _LOCAL_META_DIR:
        return f"{_LOCAL_META_DIR!r} is reserved for the local store's checksums"
    if parts[-1].endswith(_PART_SUFFIX):
        return f"names ending in {_PART_SUFFIX!r} are reserved for partial downloads"
    return ""


def _validate_prefix(prefix: str) -> str:
    if prefix == "":
        return prefix
    if prefix.startswith("/"):
        raise ValueError(f"bad key prefix {prefix!r}: it starts with '/'; {_KEY_FORM}")
    parts = prefix.split("/")
    # The last part is a plain string prefix ("step-00" matches "step-000000120").
    if any(p in ("", ".", "..") for p in parts[:-1]) or parts[-1] == "..":
        raise ValueError(f"bad key prefix {prefix!r}: an empty, '.' or '..' part; {_KEY_FORM}")
    return prefix


def _normalise_store_prefix(prefix: str) -> str:
    prefix = prefix.strip("/")
    if prefix and _key_problem(prefix):
        raise ValueError(f"bad store prefix {prefix!r}: {_key_problem(prefix)}; {_KEY_FORM}")
    return prefix

"""Object storage for checkpoint copies and code archives: S3, GCS, or a local directory.

A job that moves to another zone or cloud takes its newest checkpoint with it through object
storage: :func:`upload_dir` copies a committed checkpoint directory to a store, and
:func:`download_dir` fetches it back on the new fleet. ``spottrain up`` also uploads the job's
code there (see :mod:`spottrain.cloud.code_archive`).

Stores are opened from a URL::

    store = open_store("s3://my-bucket/runs/llama")      # or gs://..., file:///..., a path
    report = upload_dir(store, Path("/ckpt/step-000000120"), "ckpt/step-000000120")
    download_dir(store, "ckpt/step-000000120", Path("/ckpt/step-000000120"))

The cloud SDKs (boto3, google-cloud-storage) are imported only when a store of that kind is
built, so this module imports without them.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib
import json
import logging
import os
import re
import shutil
import stat as stat_mod
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO, NoReturn, Protocol, runtime_checkable
from urllib.parse import unquote, urlsplit

log = logging.getLogger(__name__)

# The object metadata field that holds the sha256 of an object's bytes, recorded by every put.
SHA256_METADATA = "sha256"
DEFAULT_COMMIT_MARKER = "MANIFEST.json"

# Temporary files carry this suffix until their rename; listings skip them, keys may not use it.
_PART_SUFFIX = ".spottrain-part"
# A LocalStore keeps each object's recorded sha256 in a sidecar under this directory.
_LOCAL_META_DIR = ".spottrain-meta"
_READ_CHUNK = 8 << 20
_MIB = 1 << 20

_KEY_FORM = (
    "keys are '/'-separated relative paths such as 'ckpt/step-000000120/MANIFEST.json' "
    "(no leading '/', no empty, '.' or '..' parts)"
)
_URL_FORMS = (
    "s3://BUCKET[/PREFIX], gs://BUCKET[/PREFIX], file:///ABSOLUTE/DIR, or a plain directory path"
)
# Both clouds allow lowercase letters, digits, '.', '-' (and GCS '_'), starting and ending
# with a letter or digit; GCS names with dots may reach 222 characters.
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]\Z")
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


# --- errors -------------------------------------------------------------------------------


class StorageError(Exception):
    """An object store refused or failed a request; the message says what and why."""


class ObjectNotFound(StorageError):
    """The object does not exist (the bucket does)."""

    def __init__(self, key: str, url: str | None = None) -> None:
        self.key = key
        self.url = url or key
        super().__init__(f"no object at {self.url}")


class BucketNotFound(StorageError):
    """The bucket (or a local store's directory) does not exist."""

    def __init__(self, bucket: str, detail: str = "") -> None:
        self.bucket = bucket
        super().__init__(detail or f"bucket {bucket!r} does not exist; create it or fix the URL")


class StorageAuthError(StorageError):
    """Credentials are missing, expired or lack permission; the message says how to fix it."""


class StorageUnavailable(StorageError):
    """A transient failure (timeout, 5xx, throttling, an object replaced mid-read): retry."""


class SourceChanged(StorageUnavailable):
    """A local file or directory changed while it was uploaded (a newer commit of the same
    checkpoint replaced it): what was sent is withdrawn; upload it again."""


class CorruptObject(StorageError):
    """An object's bytes do not match the sha256 recorded when it was written."""

    def __init__(self, key: str, detail: str) -> None:
        self.key = key
        super().__init__(detail)


class IncompleteCopy(StorageError):
    """A directory copy has no commit marker: its upload died, or is still running."""

    def __init__(self, prefix: str, detail: str) -> None:
        self.prefix = prefix
        super().__init__(detail)


class MissingSdkError(StorageError, ImportError):
    """The cloud SDK a store needs is not installed; the message names the extra to install."""


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

    The contract, which ``tests/integration/test_object_store_contract.py`` checks for every
    implementation:

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
        """The full URL of ``key`` (or of the store itself), which :func:`open_store` reads.

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
        return S3Store(parsed.bucket, parsed.path)
    if parsed.scheme == "gs":
        return GcsStore(parsed.bucket, parsed.path)
    return LocalStore(parsed.path)


# --- shared helpers -------------------------------------------------------------------------


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The hex sha256 of a file's bytes, read in large chunks."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_READ_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def _stream_sha256(f: BinaryIO) -> tuple[str, int]:
    """The hex sha256 of what ``f`` reads from here to its end, and how many bytes."""
    digest = hashlib.sha256()
    size = 0
    while chunk := f.read(_READ_CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What changes when a file's content is written (for the same open file)."""
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _part_path(dest: Path) -> Path:
    return dest.parent / f".{dest.name}.{uuid.uuid4().hex[:12]}{_PART_SUFFIX}"


class _StoreBase:
    """What every store shares: key checks, atomic ``get_file`` and sha256 verification.

    Subclasses implement the ``_``-prefixed primitives, on keys already validated (relative
    to the store's prefix).
    """

    def _describe(self, key: str) -> str:
        raise NotImplementedError

    def _stat(self, key: str) -> ObjectInfo:
        raise NotImplementedError

    def _put_fileobj(self, key: str, f: BinaryIO, size: int, sha256: str) -> None:
        """Send ``size`` bytes of ``f`` from its current position (its start)."""
        raise NotImplementedError

    def _put_bytes(self, key: str, data: bytes, sha256: str) -> None:
        raise NotImplementedError

    def _download_to(self, key: str, tmp: Path) -> ObjectInfo:
        """Write the object's bytes to ``tmp``; return the info they should match."""
        raise NotImplementedError

    def _get_bytes(self, key: str) -> tuple[ObjectInfo, bytes]:
        raise NotImplementedError

    def _list(self, prefix: str) -> list[str]:
        raise NotImplementedError

    def _delete(self, key: str) -> None:
        raise NotImplementedError

    # The public methods, the same for every store.

    def put_file(
        self, key: str, path: str | os.PathLike[str], *, sha256: str | None = None
    ) -> None:
        validate_key(key)
        src = Path(path)
        if not src.is_file():
            raise FileNotFoundError(errno.ENOENT, "no such file to upload", str(src))
        with open(src, "rb") as f:
            self.put_fileobj(key, f, sha256=sha256)

    def put_fileobj(self, key: str, f: BinaryIO, *, sha256: str | None = None) -> None:
        validate_key(key)
        name = getattr(f, "name", None)
        name = name if isinstance(name, str) else "the file"
        before = os.fstat(f.fileno())
        if not stat_mod.S_ISREG(before.st_mode):
            raise ValueError(f"{name} is not a regular file; only regular files are uploaded")
        f.seek(0)
        digest, size = _stream_sha256(f)
        if sha256 is not None and sha256 != digest:
            raise SourceChanged(
                f"{name} changed since it was hashed (its bytes hash to {digest}, not "
                f"{sha256}); nothing was sent for {self._describe(key)}: upload it again"
            )
        if size != before.st_size:
            raise SourceChanged(f"{name} changed while it was hashed; upload it again")
        f.seek(0)
        self._put_fileobj(key, f, size, digest)
        if _identity(os.fstat(f.fileno())) != _identity(before):
            # What went up may not be what was hashed: withdraw it rather than leave an
            # object that a reader would later refuse as corrupt.
            with contextlib.suppress(StorageError):
                self._delete(key)
            raise SourceChanged(
                f"{name} changed while it was uploaded to {self._describe(key)}, which was "
                "deleted again; upload it again"
            )

    def put_bytes(self, key: str, data: bytes) -> None:
        validate_key(key)
        self._put_bytes(key, bytes(data), hashlib.sha256(data).hexdigest())

    def get_file(self, key: str, path: str | os.PathLike[str]) -> ObjectInfo:
        validate_key(key)
        dest = Path(path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = _part_path(dest)
        try:
            info = self._download_to(key, tmp)
            _fsync_file(tmp)
            self._verify(key, info, file_sha256(tmp))
            os.replace(tmp, dest)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        _fsync_dir(dest.parent)
        return info

    def get_bytes(self, key: str) -> bytes:
        validate_key(key)
        info, data = self._get_bytes(key)
        self._verify(key, info, hashlib.sha256(data).hexdigest())
        return data

    def stat(self, key: str) -> ObjectInfo:
        validate_key(key)
        return self._stat(key)

    def exists(self, key: str) -> bool:
        validate_key(key)
        try:
            self._stat(key)
        except ObjectNotFound:
            return False
        return True

    def list(self, prefix: str = "") -> list[str]:
        return sorted(self._list(_validate_prefix(prefix)))

    def delete(self, key: str) -> None:
        validate_key(key)
        self._delete(key)

    def _verify(self, key: str, info: ObjectInfo, actual: str) -> None:
        if info.sha256 is None or info.sha256 == actual:
            return
        # A writer may have replaced the object between our stat and our read; that is a
        # race to retry, not corruption.
        try:
            now = self._stat(key)
        except ObjectNotFound:
            now = None
        if now is None or now.version != info.version:
            raise StorageUnavailable(
                f"{self._describe(key)} was replaced or deleted while it was read; try again"
            )
        raise CorruptObject(
            key,
            f"{self._describe(key)} is corrupt: its bytes hash to sha256 {actual}, but "
            f"{info.sha256} was recorded when it was written",
        )


# --- local directory ------------------------------------------------------------------------


class LocalStore(_StoreBase):
    """Objects as files under a directory (a shared mount, or tests).

    Object ``a/b`` is the file ``ROOT/a/b``; its recorded sha256 lives in
    ``ROOT/.spottrain-meta/a/b.json``. Every write goes to a temporary file, is fsynced and
    renamed into place, so a crash leaves the old object or the new one.

    Args:
        root_dir: the store's directory.
        create: create it if it does not exist. Off by default: a missing directory usually
            means its volume is not mounted, and writing to the boot disk instead would hide
            that.
    """

    def __init__(self, root_dir: str | os.PathLike[str], *, create: bool = False) -> None:
        self.root = Path(root_dir).expanduser().absolute()
        if create:
            self.root.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def url(self, key: str = "") -> str:
        if key:
            validate_key(key)
        return (self.root / key).as_uri() if key else self.root.as_uri()

    def _describe(self, key: str) -> str:
        return str(self.root / key)

    def _meta_path(self, key: str) -> Path:
        return self.root / _LOCAL_META_DIR / f"{key}.json"

    @contextlib.contextmanager
    def _errors(self, key: str, doing: str) -> Iterator[None]:
        if not self.root.is_dir():
            raise BucketNotFound(
                str(self.root),
                f"local store directory {self.root} does not exist (is its volume mounted?); "
                "create it, or pass create=True",
            )
        try:
            yield
        except StorageError:
            raise
        except FileNotFoundError as exc:
            raise ObjectNotFound(key, self._describe(key)) from exc
        except PermissionError as exc:
            raise StorageAuthError(
                f"{doing} {self._describe(key)}: permission denied; fix the owner or mode of "
                f"{self.root} or point the store elsewhere"
            ) from exc
        except (IsADirectoryError, NotADirectoryError) as exc:
            raise StorageError(
                f"{doing} {self._describe(key)}: key {key!r} clashes with a directory of the "
                "same name (a local store cannot hold both 'a' and 'a/b')"
            ) from exc
        except OSError as exc:
            raise StorageError(
                f"{doing} {self._describe(key)} failed: {exc.strerror or exc}"
            ) from exc

    def _write_atomically(self, dest: Path, write: Any) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = _part_path(dest)
        try:
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dest)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        _fsync_dir(dest.parent)

    def _put(self, key: str, write: Any, sha256: str, size: int) -> None:
        meta = self._meta_path(key)
        # The sidecar goes first and comes back last, so an object never sits beside a
        # sidecar that vouches for other bytes.
        with contextlib.suppress(FileNotFoundError):
            meta.unlink()
        self._write_atomically(self.root / key, write)
        record = json.dumps({SHA256_METADATA: sha256, "size": size}).encode()
        self._write_atomically(meta, lambda f: f.write(record))

    def _put_fileobj(self, key: str, f: BinaryIO, size: int, sha256: str) -> None:
        with self._errors(key, "writing"):

            def write(out: IO[bytes]) -> None:
                shutil.copyfileobj(f, out, _READ_CHUNK)

            self._put(key, write, sha256, size)

    def _put_bytes(self, key: str, data: bytes, sha256: str) -> None:
        with self._errors(key, "writing"):
            self._put(key, lambda f: f.write(data), sha256, len(data))

    def _stat(self, key: str) -> ObjectInfo:
        with self._errors(key, "reading"):
            st = os.stat(self.root / key)
            if not stat_mod.S_ISREG(st.st_mode):
                raise ObjectNotFound(key, self._describe(key))
            sha256: str | None = None
            try:
                record = json.loads(self._meta_path(key).read_bytes())
                if isinstance(record, dict) and record.get("size") == st.st_size:
                    value = record.get(SHA256_METADATA)
                    sha256 = value if isinstance(value, str) else None
            except (FileNotFoundError, NotADirectoryError, ValueError):
                pass
            return ObjectInfo(key, st.st_size, sha256, f"{st.st_ino}-{st.st_mtime_ns}")

    def _download_to(self, key: str, tmp: Path) -> ObjectInfo:
        info = self._stat(key)
        with self._errors(key, "reading"):
            shutil.copyfile(self.root / key, tmp)
        return info

    def _get_bytes(self, key: str) -> tuple[ObjectInfo, bytes]:
        info = self._stat(key)
        with self._errors(key, "reading"):
            return info, (self.root / key).read_bytes()

    def _list(self, prefix: str) -> list[str]:
        with self._errors(prefix, "listing"):
            keys: list[str] = []
            for dirpath, dirnames, filenames in os.walk(self.root):
                rel_dir = os.path.relpath(dirpath, self.root)
                if rel_dir == ".":
                    dirnames[:] = [d for d in dirnames if d != _LOCAL_META_DIR]
                    rel_dir = ""
                for name in filenames:
                    if name.endswith(_PART_SUFFIX):
                        continue
                    key = f"{rel_dir}/{name}" if rel_dir else name
                    if key.startswith(prefix):
                        keys.append(key)
            return keys

    def _delete(self, key: str) -> None:
        with self._errors(key, "deleting"):
            path = self.root / key
            if path.is_dir():
                return
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                self._meta_path(key).unlink()
            self._prune(path.parent, self.root)
            self._prune(self._meta_path(key).parent, self.root / _LOCAL_META_DIR)

    @staticmethod
    def _prune(directory: Path, stop: Path) -> None:
        # Empty directories are leftovers of deleted keys; object stores have none.
        while directory != stop and stop in directory.parents:
            try:
                directory.rmdir()
            except OSError:
                return
            directory = directory.parent


# --- Amazon S3 ------------------------------------------------------------------------------

_S3_AUTH_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "InvalidAccessKeyId",
        "InvalidToken",
        "ExpiredToken",
        "TokenRefreshRequired",
        "SignatureDoesNotMatch",
        "AuthorizationHeaderMalformed",
        "AccountProblem",
        "403",
        "401",
    }
)
_S3_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "OperationAborted",
        "PreconditionFailed",
    }
)


def _import_boto3() -> Any:
    try:
        import boto3
    except ImportError as exc:
        raise MissingSdkError(
            "S3 storage needs boto3, which is not installed: pip install 'spottrain[aws]'"
        ) from exc
    return boto3


class _BucketStore(_StoreBase):
    """A bucket of an object store (S3, GCS) with keys under a prefix."""

    scheme = ""
    bucket: str
    prefix: str

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url()!r})"

    def _full(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def url(self, key: str = "") -> str:
        if key:
            validate_key(key)
        path = self._full(key) if key else self.prefix
        base = f"{self.scheme}://{self.bucket}"
        return f"{base}/{path}" if path else base

    def _describe(self, key: str) -> str:
        return self.url(key)


class S3Store(_BucketStore):
    """Objects in an S3 bucket (or an S3-compatible endpoint) under a prefix.

    The sha256 of each object is its user metadata ``x-amz-meta-sha256``. Files at or above
    ``multipart_threshold`` go up and come down in ``multipart_chunksize`` parts, in parallel.

    Args:
        bucket: the bucket.
        prefix: the key prefix every key is relative to.
        session: a ``boto3.Session``; the default session when omitted.
        endpoint_url: an S3-compatible endpoint (MinIO, moto); path-style addressing is used.
        multipart_threshold: bytes from which transfers use multipart.
        multipart_chunksize: bytes per part (S3 requires at least 5 MiB).
        max_attempts: attempts per request, the first included (botocore's standard retry
            mode, with backoff, for throttling, 5xx and connection errors).

    Raises:
        MissingSdkError: boto3 is not installed.
        ValueError: a bad bucket, prefix or size.
    """

    scheme = "s3"

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        session: Any = None,
        endpoint_url: str | None = None,
        multipart_threshold: int = 64 * _MIB,
        multipart_chunksize: int = 16 * _MIB,
        max_attempts: int = 5,
    ) -> None:
        if not _BUCKET_RE.match(bucket):
            raise ValueError(f"bad S3 bucket name {bucket!r}")
        if multipart_chunksize < 5 * _MIB:
            raise ValueError(
                f"multipart_chunksize {multipart_chunksize} is below 5 MiB, S3's smallest part"
            )
        if multipart_threshold < 5 * _MIB:
            raise ValueError(f"multipart_threshold {multipart_threshold} is below 5 MiB")
        if max_attempts < 1:
            raise ValueError(f"max_attempts {max_attempts} must be at least 1")
        boto3 = _import_boto3()
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = _normalise_store_prefix(prefix)
        session = session if session is not None else boto3.Session()
        config = Config(
            retries={"total_max_attempts": max_attempts, "mode": "standard"},
            connect_timeout=10,
            read_timeout=60,
            s3={"addressing_style": "path"} if endpoint_url else None,
        )
        self._client = session.client("s3", endpoint_url=endpoint_url, config=config)
        self._transfer = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=8,
        )
        self._bucket_seen = False

    def _auth_error(self, detail: str) -> StorageAuthError:
        return StorageAuthError(
            f"S3 refused the credentials for {self.url()} ({detail}); check AWS_PROFILE or "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or the VM's instance profile), that they "
            f"have not expired, and that they may read and write s3://{self.bucket}"
        )

    def _classify(self, exc: BaseException, key: str) -> StorageError:
        from boto3.exceptions import RetriesExceededError, S3UploadFailedError
        from botocore import exceptions as bexc

        if isinstance(exc, S3UploadFailedError | RetriesExceededError):
            # boto3 re-raises a ClientError from a transfer as S3UploadFailedError without
            # `from`, and s3transfer's exhausted retries carry the last error as an attribute.
            inner = getattr(exc, "last_exception", None) or exc.__cause__ or exc.__context__
            if inner is not None and inner is not exc:
                return self._classify(inner, key)
            return StorageUnavailable(f"transfer of {self.url(key)} failed: {exc}")
        if isinstance(exc, bexc.ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            message = str(err.get("Message", "") or code)
            if code == "NoSuchBucket":
                return BucketNotFound(self.bucket, f"S3 bucket {self.bucket!r} does not exist")
            if code in ("NoSuchKey", "404", "NotFound") or status == 404:
                return ObjectNotFound(key, self.url(key))
            if code in _S3_AUTH_CODES or status in (401, 403):
                return self._auth_error(f"{code}: {message}")
            if code in _S3_TRANSIENT_CODES or status >= 500 or status in (408, 412, 429):
                return StorageUnavailable(f"S3 {code} for {self.url(key)}: {message}; retry")
            return StorageError(f"S3 refused a request for {self.url(key)}: {code}: {message}")
        if isinstance(exc, bexc.NoCredentialsError | bexc.PartialCredentialsError):
            return self._auth_error(str(exc))
        if isinstance(exc, bexc.CredentialRetrievalError | bexc.TokenRetrievalError):
            return self._auth_error(str(exc))
        if isinstance(exc, bexc.ConnectionError | bexc.HTTPClientError):
            return StorageUnavailable(f"cannot reach S3 for {self.url(key)}: {exc}")
        if isinstance(exc, bexc.BotoCoreError):
            return StorageError(f"S3 request for {self.url(key)} failed: {exc}")
        raise exc

    @contextlib.contextmanager
    def _errors(self, key: str) -> Iterator[None]:
        try:
            yield
        except StorageError:
            raise
        except Exception as exc:
            raise self._classify(exc, key) from exc

    def _raise_not_found(self, key: str) -> NoReturn:
        # HEAD answers a bare 404 for a missing bucket and a missing key alike.
        if not self._bucket_seen:
            try:
                with self._errors(""):
                    self._client.head_bucket(Bucket=self.bucket)
            except ObjectNotFound as exc:
                raise BucketNotFound(
                    self.bucket, f"S3 bucket {self.bucket!r} does not exist"
                ) from exc.__cause__
            self._bucket_seen = True
        raise ObjectNotFound(key, self.url(key))

    def _stat(self, key: str) -> ObjectInfo:
        from botocore.exceptions import ClientError

        try:
            with self._errors(key):
                head = self._client.head_object(Bucket=self.bucket, Key=self._full(key))
        except ObjectNotFound as exc:
            if isinstance(exc.__cause__, ClientError):
                self._raise_not_found(key)
            raise
        self._bucket_seen = True
        return ObjectInfo(
            key,
            int(head["ContentLength"]),
            head.get("Metadata", {}).get(SHA256_METADATA),
            str(head.get("ETag", "")),
        )

    def _put_fileobj(self, key: str, f: BinaryIO, size: int, sha256: str) -> None:
        # s3transfer closes the file it is given; the caller still needs its own.
        with self._errors(key), os.fdopen(os.dup(f.fileno()), "rb") as body:
            self._client.upload_fileobj(
                body,
                self.bucket,
                self._full(key),
                ExtraArgs={"Metadata": {SHA256_METADATA: sha256}},
                Config=self._transfer,
            )

    def _put_bytes(self, key: str, data: bytes, sha256: str) -> None:
        with self._errors(key):
            self._client.put_object(
                Bucket=self.bucket,
                Key=self._full(key),
                Body=data,
                Metadata={SHA256_METADATA: sha256},
            )

    def _download_to(self, key: str, tmp: Path) -> ObjectInfo:
        info = self._stat(key)
        with self._errors(key):
            self._client.download_file(
                self.bucket, self._full(key), str(tmp), Config=self._transfer
            )
        return info

    def _get_bytes(self, key: str) -> tuple[ObjectInfo, bytes]:
        with self._errors(key):
            resp = self._client.get_object(Bucket=self.bucket, Key=self._full(key))
            data = resp["Body"].read()
        info = ObjectInfo(
            key,
            int(resp["ContentLength"]),
            resp.get("Metadata", {}).get(SHA256_METADATA),
            str(resp.get("ETag", "")),
        )
        return info, data

    def _list(self, prefix: str) -> list[str]:
        base = f"{self.prefix}/" if self.prefix else ""
        keys: list[str] = []
        with self._errors(prefix):
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base + prefix
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    keys.append(obj["Key"][len(base) :])
        return keys

    def _delete(self, key: str) -> None:
        with self._errors(key):
            self._client.delete_object(Bucket=self.bucket, Key=self._full(key))


# --- Google Cloud Storage -------------------------------------------------------------------

_GCS_CHUNK_QUANTUM = 256 * 1024


def _import_gcs() -> Any:
    try:
        storage = importlib.import_module("google.cloud.storage")
    except ImportError as exc:
        raise MissingSdkError(
            "GCS storage needs google-cloud-storage, which is not installed: "
            "pip install 'spottrain[gcp]'"
        ) from exc
    return storage


class GcsStore(_BucketStore):
    """Objects in a Google Cloud Storage bucket under a prefix.

    The sha256 of each object is its custom metadata ``sha256``. Objects above 8 MiB go up
    in a resumable upload of ``chunk_size`` chunks (the client's fixed threshold); downloads
    are single streams, which the client checks against the object's CRC32C.

    Args:
        bucket: the bucket.
        prefix: the key prefix every key is relative to.
        client: a ``google.cloud.storage.Client``; built from the other arguments if omitted.
        credentials: ``google.auth`` credentials; Application Default Credentials if omitted.
        project: the billing project, if the bucket needs one (requester pays).
        api_endpoint: another endpoint (an emulator), e.g. ``http://127.0.0.1:4443``.
        chunk_size: bytes per resumable-upload request, a multiple of 256 KiB.
        retry_timeout_s: how long the client retries transient errors (429, 5xx, connection
            errors) with backoff before giving up; 0 disables retries.

    Raises:
        MissingSdkError: google-cloud-storage is not installed.
        StorageAuthError: no credentials were given and none could be found.
        ValueError: a bad bucket, prefix or chunk size.
    """

    scheme = "gs"

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        client: Any = None,
        credentials: Any = None,
        project: str | None = None,
        api_endpoint: str | None = None,
        chunk_size: int = 32 * _MIB,
        retry_timeout_s: float = 120.0,
    ) -> None:
        if not _BUCKET_RE.match(bucket):
            raise ValueError(f"bad GCS bucket name {bucket!r}")
        if chunk_size <= 0 or chunk_size % _GCS_CHUNK_QUANTUM:
            raise ValueError(f"chunk_size {chunk_size} is not a positive multiple of 256 KiB")
        if retry_timeout_s < 0:
            raise ValueError(f"retry_timeout_s {retry_timeout_s} is negative")
        storage = _import_gcs()
        from google.cloud.storage.retry import DEFAULT_RETRY

        self.bucket = bucket
        self.prefix = _normalise_store_prefix(prefix)
        if client is None:
            try:
                # project=None says "no project needed" (objects live in a bucket that exists);
                # leaving it out makes the client insist on finding a default project.
                client = storage.Client(
                    project=project,
                    credentials=credentials,
                    client_options={"api_endpoint": api_endpoint} if api_endpoint else None,
                )
            except Exception as exc:
                raise self._classify(exc, "") from exc
        self._client = client
        self._bucket = client.bucket(bucket)
        self._chunk_size = chunk_size
        self._retry = DEFAULT_RETRY.with_timeout(retry_timeout_s) if retry_timeout_s else None

    def _auth_error(self, detail: str) -> StorageAuthError:
        return StorageAuthError(
            f"GCS refused the credentials for {self.url()} ({detail}); run `gcloud auth "
            "application-default login`, set GOOGLE_APPLICATION_CREDENTIALS to a service "
            "account key, or give the VM's service account roles/storage.objectAdmin on "
            f"gs://{self.bucket}"
        )

    def _classify(self, exc: BaseException, key: str) -> StorageError:
        import requests
        from google.api_core import exceptions as gexc
        from google.auth import exceptions as auth_exc
        from google.cloud.storage.exceptions import DataCorruption, InvalidResponse

        if isinstance(exc, gexc.RetryError) and exc.cause is not None:
            return self._classify(exc.cause, key)
        if isinstance(exc, DataCorruption):
            return CorruptObject(
                key, f"{self.url(key)} failed the download's CRC32C/MD5 check: {exc}"
            )
        if isinstance(exc, gexc.NotFound):
            if "bucket does not exist" in str(exc).lower():
                return BucketNotFound(self.bucket, f"GCS bucket {self.bucket!r} does not exist")
            return ObjectNotFound(key, self.url(key))
        if isinstance(exc, gexc.Unauthorized | gexc.Forbidden):
            return self._auth_error(str(exc))
        if isinstance(exc, auth_exc.DefaultCredentialsError | auth_exc.RefreshError):
            return self._auth_error(str(exc))
        if isinstance(exc, gexc.PreconditionFailed):
            return StorageUnavailable(f"{self.url(key)} was replaced while it was read; retry")
        if isinstance(exc, gexc.GoogleAPICallError) and (
            exc.code in (408, 429) or (exc.code or 0) >= 500
        ):
            return StorageUnavailable(f"GCS is unavailable for {self.url(key)}: {exc}; retry")
        if isinstance(exc, requests.ConnectionError | requests.Timeout | auth_exc.TransportError):
            return StorageUnavailable(f"cannot reach GCS for {self.url(key)}: {exc}")
        if isinstance(exc, ConnectionError | TimeoutError):
            return StorageUnavailable(f"connection to GCS failed for {self.url(key)}: {exc}")
        if isinstance(exc, InvalidResponse):
            status = getattr(exc.response, "status_code", 0)
            if status in (408, 429) or status >= 500:
                return StorageUnavailable(f"GCS answered {status} for {self.url(key)}; retry")
            return StorageError(f"GCS answered {status} for {self.url(key)}: {exc}")
        if isinstance(exc, gexc.GoogleAPICallError):
            return StorageError(f"GCS refused a request for {self.url(key)}: {exc}")
        raise exc

    @contextlib.contextmanager
    def _errors(self, key: str) -> Iterator[None]:
        try:
            yield
        except StorageError:
            raise
        except Exception as exc:
            raise self._classify(exc, key) from exc

    def _info(self, key: str, blob: Any) -> ObjectInfo:
        sha256 = (blob.metadata or {}).get(SHA256_METADATA)
        return ObjectInfo(key, int(blob.size or 0), sha256, str(blob.generation))

    def _reloaded(self, key: str) -> Any:
        blob = self._bucket.blob(self._full(key))
        with self._errors(key):
            blob.reload(retry=self._retry)
        return blob

    def _stat(self, key: str) -> ObjectInfo:
        return self._info(key, self._reloaded(key))

    def _put_fileobj(self, key: str, f: BinaryIO, size: int, sha256: str) -> None:
        blob = self._bucket.blob(self._full(key), chunk_size=self._chunk_size)
        blob.metadata = {SHA256_METADATA: sha256}
        with self._errors(key):
            blob.upload_from_file(
                f, size=size, content_type="application/octet-stream", retry=self._retry
            )

    def _put_bytes(self, key: str, data: bytes, sha256: str) -> None:
        blob = self._bucket.blob(self._full(key))
        blob.metadata = {SHA256_METADATA: sha256}
        with self._errors(key):
            blob.upload_from_string(
                data, content_type="application/octet-stream", retry=self._retry
            )

    def _download_to(self, key: str, tmp: Path) -> ObjectInfo:
        # A blob without chunk_size downloads in one stream, which the client verifies
        # against the CRC32C; a chunked (ranged) download would skip that check.
        blob = self._reloaded(key)
        with self._errors(key), open(tmp, "wb") as f:
            blob.download_to_file(f, if_generation_match=blob.generation, retry=self._retry)
        return self._info(key, blob)

    def _get_bytes(self, key: str) -> tuple[ObjectInfo, bytes]:
        blob = self._reloaded(key)
        with self._errors(key):
            data = blob.download_as_bytes(if_generation_match=blob.generation, retry=self._retry)
        return self._info(key, blob), data

    def _list(self, prefix: str) -> list[str]:
        base = f"{self.prefix}/" if self.prefix else ""
        with self._errors(prefix):
            blobs = self._client.list_blobs(self.bucket, prefix=base + prefix, retry=self._retry)
            return [blob.name[len(base) :] for blob in blobs]

    def _delete(self, key: str) -> None:
        try:
            with self._errors(key):
                self._bucket.blob(self._full(key)).delete(retry=self._retry)
        except ObjectNotFound:
            pass


# --- directory copies -----------------------------------------------------------------------


@dataclass(frozen=True)
class UploadReport:
    """What :func:`upload_dir` did, by path relative to the directory.

    Attributes:
        url: the copy's URL.
        uploaded: files sent (the marker last).
        skipped: files already stored with the same size and sha256.
        deleted: stale objects under the prefix that the directory no longer has.
        bytes_uploaded: the bytes sent.
    """

    url: str
    uploaded: tuple[str, ...]
    skipped: tuple[str, ...]
    deleted: tuple[str, ...]
    bytes_uploaded: int


def _dir_prefix(prefix: str) -> str:
    prefix = prefix.strip("/")
    if not prefix:
        raise ValueError(
            "a directory copy needs a non-empty prefix (a copy at the store's root would "
            "mirror over everything else in it)"
        )
    validate_key(prefix)
    return prefix


def _local_files(local_dir: Path, dir_fd: int) -> list[str]:
    """The regular files under the directory open as ``dir_fd``, as relative paths."""
    rels: list[str] = []
    for dirpath, dirnames, filenames, fd in os.fwalk(".", dir_fd=dir_fd):
        dirnames.sort()
        for name in [*dirnames, *filenames]:
            if stat_mod.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                raise ValueError(
                    f"{local_dir / dirpath / name} is a symbolic link; upload_dir copies "
                    "regular files only (replace the link with the file it points to)"
                )
        for name in filenames:
            rel = (Path(dirpath) / name).as_posix()
            problem = _key_problem(rel)
            if problem:
                raise ValueError(f"{local_dir / rel} cannot be stored as an object: {problem}")
            rels.append(rel)
    return rels


def upload_dir(
    store: ObjectStore,
    local_dir: str | os.PathLike[str],
    prefix: str,
    *,
    commit_marker: str = DEFAULT_COMMIT_MARKER,
) -> UploadReport:
    """Copy a directory to ``prefix/`` so that readers see all of it or none of it.

    A copy is complete if and only if its commit marker (a file of the directory, such as a
    checkpoint's ``MANIFEST.json``) exists in the store, so the marker goes up last. Before
    anything of an existing complete copy changes, its marker is deleted first. Files
    already stored with the same size and sha256 are skipped, which makes a repeated or
    interrupted upload cheap to resume. The prefix ends up mirroring the directory: objects
    under it that the directory does not have are deleted.

    Every file is read through one descriptor of the directory, opened at the start, and
    each is hashed and sent through one descriptor of its own (see
    :meth:`ObjectStore.put_fileobj`). A directory renamed away and replaced meanwhile (a
    checkpoint step committed again by a newer round) is therefore still copied whole, from
    the directory as it was at the start, or, if it was deleted before all its files were
    opened, the upload stops with :class:`SourceChanged`, leaving no marker: upload again.

    Args:
        store: where to copy to.
        local_dir: the directory; regular files only, no symbolic links.
        prefix: the copy's key prefix, e.g. ``"ckpt/step-000000120"``.
        commit_marker: the path of the marker file, relative to ``local_dir``.

    Returns:
        What was uploaded, skipped and deleted.

    Raises:
        ValueError: an empty prefix, a directory without the marker, a symbolic link, or a
            file name that cannot be a key.
        FileNotFoundError: ``local_dir`` does not exist.
        SourceChanged: the directory changed or vanished while it was uploaded.
        StorageError: another subclass, from the store.
    """
    root = Path(local_dir)
    if not root.is_dir():
        raise FileNotFoundError(errno.ENOENT, "no directory to upload", str(root))
    prefix = _dir_prefix(prefix)
    validate_key(commit_marker)
    dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return _upload_dir_at(store, root, dir_fd, prefix, commit_marker)
    except FileNotFoundError as exc:
        raise SourceChanged(
            f"{root} was replaced or removed while it was uploaded ({exc.filename or exc} is "
            "gone; a newer commit of the same checkpoint?); the copy has no "
            f"{commit_marker}, so it is not taken for a complete one: upload it again"
        ) from exc
    finally:
        os.close(dir_fd)


def _upload_dir_at(
    store: ObjectStore, root: Path, dir_fd: int, prefix: str, commit_marker: str
) -> UploadReport:
    rels = _local_files(root, dir_fd)
    if commit_marker not in rels:
        raise ValueError(
            f"{root} has no {commit_marker}: upload_dir needs the directory's commit marker "
            "(a copy counts as complete only once its marker is stored); pass "
            "commit_marker= naming a file the directory has"
        )

    def open_rel(rel: str) -> BinaryIO:
        def opener(_: str, flags: int) -> int:
            return os.open(rel, flags | os.O_NOFOLLOW, dir_fd=dir_fd)

        return open(root / rel, "rb", opener=opener)

    remote = {key[len(prefix) + 1 :] for key in store.list(prefix + "/")}
    to_upload: list[str] = []
    skipped: list[str] = []
    for rel in sorted(rels):
        if rel in remote:
            try:
                info = store.stat(f"{prefix}/{rel}")
            except ObjectNotFound:
                info = None
            if info is not None and info.sha256 is not None:
                with open_rel(rel) as f:
                    size = os.fstat(f.fileno()).st_size
                    if info.size == size and _stream_sha256(f)[0] == info.sha256:
                        skipped.append(rel)
                        continue
        to_upload.append(rel)
    stale = sorted(remote - set(rels))

    marker_key = f"{prefix}/{commit_marker}"
    if (to_upload or stale) and commit_marker in remote:
        # Un-commit first: from here until the marker is back, readers see no copy at all.
        store.delete(marker_key)
        if commit_marker in skipped:
            skipped.remove(commit_marker)
            to_upload.append(commit_marker)
    sent = 0

    def send(rel: str) -> int:
        with open_rel(rel) as f:
            store.put_fileobj(f"{prefix}/{rel}", f)
            return os.fstat(f.fileno()).st_size

    ordered = [rel for rel in to_upload if rel != commit_marker]
    for rel in ordered:
        sent += send(rel)
    for rel in stale:
        store.delete(f"{prefix}/{rel}")
    if commit_marker in to_upload:
        sent += send(commit_marker)
        ordered.append(commit_marker)
    report = UploadReport(
        url=store.url(prefix),
        uploaded=tuple(ordered),
        skipped=tuple(skipped),
        deleted=tuple(stale),
        bytes_uploaded=sent,
    )
    log.info(
        "event=storage.upload_dir url=%s uploaded=%d skipped=%d deleted=%d bytes=%d",
        report.url,
        len(report.uploaded),
        len(report.skipped),
        len(report.deleted),
        report.bytes_uploaded,
    )
    return report


def download_dir(
    store: ObjectStore,
    prefix: str,
    local_dir: str | os.PathLike[str],
    *,
    commit_marker: str = DEFAULT_COMMIT_MARKER,
) -> Path:
    """Fetch a complete copy made by :func:`upload_dir` into a new directory, atomically.

    Every object under ``prefix/`` is downloaded into a temporary directory beside
    ``local_dir``, checked against the sha256 recorded at upload, and the directory is
    renamed to ``local_dir`` only when all are good: on any failure nothing is left at
    ``local_dir``. If the copy's marker is replaced or deleted while downloading (another
    upload began), the download is refused rather than mixing two copies.

    Args:
        store: where the copy is.
        prefix: the copy's key prefix.
        local_dir: the directory to create; it must not exist yet.
        commit_marker: the marker's path relative to the copy.

    Returns:
        ``local_dir``.

    Raises:
        IncompleteCopy: the copy has no marker, or lost it while downloading.
        CorruptObject: an object does not match its recorded sha256, or has none.
        FileExistsError: ``local_dir`` already exists.
        ValueError: an empty prefix, or an object whose key cannot be a local path.
        StorageError: another subclass, from the store.
    """
    dest = Path(local_dir)
    prefix = _dir_prefix(prefix)
    validate_key(commit_marker)
    if dest.exists() or dest.is_symlink():
        raise FileExistsError(
            errno.EEXIST, "download_dir will not overwrite an existing directory", str(dest)
        )
    marker_key = f"{prefix}/{commit_marker}"
    try:
        marker = store.stat(marker_key)
    except ObjectNotFound:
        raise IncompleteCopy(
            prefix,
            f"{store.url(prefix)} is not a complete copy: it has no {commit_marker} (its "
            "upload died or is still running); use an older copy",
        ) from None
    keys = store.list(prefix + "/")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.download-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        for key in keys:
            rel = key[len(prefix) + 1 :]
            problem = _key_problem(rel)
            if problem:
                raise ValueError(f"refusing object {store.url(key)}: {problem}")
            info = store.get_file(key, tmp / rel)
            if info.sha256 is None:
                raise CorruptObject(
                    key,
                    f"{store.url(key)} has no recorded sha256, so it cannot be verified; "
                    "it was not written by upload_dir",
                )
        try:
            now = store.stat(marker_key)
        except ObjectNotFound:
            now = None
        if now is None or now.version != marker.version:
            raise IncompleteCopy(
                prefix,
                f"{store.url(prefix)} changed while it was downloaded (a new upload began); "
                "try again",
            )
        _fsync_dir(tmp)
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(dest.parent)
    log.info(
        "event=storage.download_dir url=%s dest=%s files=%d", store.url(prefix), dest, len(keys)
    )
    return dest


def list_dirs(
    store: ObjectStore, prefix: str = "", *, commit_marker: str = DEFAULT_COMMIT_MARKER
) -> list[str]:
    """The complete copies directly under ``prefix/``: names whose marker exists, sorted.

    ``list_dirs(store, "ckpt")`` gives ``["step-000000120", "step-000000140"]`` when those
    two copies are complete; ``store`` then holds them at ``"ckpt/step-000000120/..."``.

    Raises:
        ValueError: a bad prefix or marker.
        StorageError: a subclass, from the store.
    """
    prefix = prefix.strip("/")
    if prefix:
        validate_key(prefix)
    validate_key(commit_marker)
    base = f"{prefix}/" if prefix else ""
    names = set()
    for key in store.list(base):
        rest = key[len(base) :]
        name, sep, tail = rest.partition("/")
        if sep and tail == commit_marker:
            names.add(name)
    return sorted(names)

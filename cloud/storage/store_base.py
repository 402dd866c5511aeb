"""What every store shares: key checks, atomic downloads, sha256 verification, and the base of
the bucket stores (S3, GCS)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat as stat_mod
import uuid
from pathlib import Path
from typing import BinaryIO

from spottrain.cloud.storage.errors import (
    CorruptObject,
    ObjectNotFound,
    SourceChanged,
    StorageError,
    StorageUnavailable,
)
from spottrain.cloud.storage.interface import (
    _PART_SUFFIX,
    _READ_CHUNK,
    ObjectInfo,
    _validate_prefix,
    validate_key,
)
from spottrain.fileio import fsync_dir, fsync_file

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
            fsync_file(tmp)
            self._verify(key, info, file_sha256(tmp))
            os.replace(tmp, dest)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        fsync_dir(dest.parent)
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

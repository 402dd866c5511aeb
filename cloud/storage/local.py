"""A store on a local directory (tests, a single machine, or a shared filesystem)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat as stat_mod
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, BinaryIO

from spottrain.cloud.storage.errors import (
    BucketNotFound,
    ObjectNotFound,
    StorageAuthError,
    StorageError,
)
from spottrain.cloud.storage.interface import (
    _LOCAL_META_DIR,
    _PART_SUFFIX,
    _READ_CHUNK,
    SHA256_METADATA,
    ObjectInfo,
    validate_key,
)
from spottrain.cloud.storage.store_base import _part_path, _StoreBase
from spottrain.fileio import fsync_dir


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
        fsync_dir(dest.parent)

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

"""The manifest that makes a checkpoint directory a checkpoint.

Written last, inside the temporary directory, before the rename that commits it (or, for a
checkpoint a framework wrote under its own name, in place: the manifest is then the commit
point). It names every file (by path relative to the directory) with its size and CRC32
(computed while the file was written, never by reading it back; a framework's files are read
back once, see :func:`sum_files`), the step, the world size, the rendezvous round and the
fencing epoch of the generation that wrote it (-1: none; see :mod:`.directory`). It carries
its own checksum, so a torn or edited manifest is caught rather than trusted.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

try:
    # zlib-ng's CRC32 (carry-less multiply): the very numbers zlib gives, about 3x faster
    # here (12 against 3.6 GB/s), which is most of what an emergency save's checksums cost
    # beyond torch's own save. It releases the GIL on large buffers, as zlib does.
    from zlib_ng.zlib_ng import crc32 as _fast_crc32
except ImportError:  # a platform without its wheel: zlib's, the same checksums, slower
    _fast_crc32 = zlib.crc32

crc32: Callable[[bytes | bytearray | memoryview, int], int] = _fast_crc32
"""CRC32 of a buffer, continued from a previous value: every checksum of a checkpoint's files
and of its manifest (zlib's algorithm whichever library computes it)."""

MANIFEST_NAME = "MANIFEST.json"
FORMAT = 1
_READ_CHUNK = 8 << 20


class ManifestError(ValueError):
    """A manifest that cannot be trusted: missing, torn, or its own checksum fails."""


@dataclass(frozen=True)
class FileSum:
    size: int
    crc32: int


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    round: int
    kind: str  # "periodic", "emergency", "final", "requested"
    created_at: float
    files: dict[str, FileSum]
    request_id: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    epoch: int = -1

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def _body(self) -> dict[str, Any]:
        d = asdict(self)
        d["files"] = {k: asdict(v) for k, v in sorted(self.files.items())}
        d["format"] = FORMAT
        return d

    def to_bytes(self) -> bytes:
        body = self._body()
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        body["manifest_crc32"] = crc32(canonical, 0)
        return (json.dumps(body, sort_keys=True, indent=1) + "\n").encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Manifest:
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(f"manifest is not JSON (torn write?): {exc}") from exc
        if not isinstance(body, dict):
            raise ManifestError("manifest is not a JSON object")
        claimed = body.pop("manifest_crc32", None)
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        if claimed != crc32(canonical, 0):
            raise ManifestError("manifest checksum does not match its content")
        if body.get("format") != FORMAT:
            raise ManifestError(f"manifest format {body.get('format')!r} is not {FORMAT}")
        try:
            return cls(
                step=int(body["step"]),
                world_size=int(body["world_size"]),
                round=int(body["round"]),
                kind=str(body["kind"]),
                created_at=float(body["created_at"]),
                files={
                    str(k): FileSum(int(v["size"]), int(v["crc32"]))
                    for k, v in body["files"].items()
                },
                request_id=int(body.get("request_id", 0)),
                extra=dict(body.get("extra") or {}),
                epoch=int(body.get("epoch", -1)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ManifestError(f"manifest lacks or mangles a field: {exc!r}") from exc

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        path = directory / MANIFEST_NAME
        try:
            raw = path.read_bytes()
        except FileNotFoundError as exc:
            raise ManifestError(f"no {MANIFEST_NAME}") from exc
        except OSError as exc:
            raise ManifestError(f"cannot read {MANIFEST_NAME}: {exc.strerror}") from exc
        return cls.from_bytes(raw)


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_READ_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            crc = crc32(view[:n], crc)
    return crc


def list_files(directory: Path) -> list[str]:
    """The files of a checkpoint directory, by path relative to it ("/"-separated, sorted),
    in its subdirectories too (a framework's checkpoint may have them), without the
    manifest."""
    out = []
    for dirpath, _, names in os.walk(directory):
        rel = Path(dirpath).relative_to(directory)
        out += [(rel / n).as_posix() for n in names]
    return sorted(n for n in out if n != MANIFEST_NAME)


def sum_files(directory: Path, names: list[str]) -> dict[str, FileSum]:
    """The size and CRC32 of each of ``names`` (relative to ``directory``), each file synced
    to its disk first: for checkpoints a framework wrote, whose bytes spottrain never saw go
    out, so they are read back (from the page cache, just written).

    Raises:
        OSError: a file is missing or unreadable.
    """
    out = {}
    for name in names:
        path = directory / name
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        out[name] = FileSum(size, file_crc32(path))
    return out


def verify_files(directory: Path, manifest: Manifest, *, checksums: bool = True) -> list[str]:
    """What is wrong with the files of a checkpoint against its manifest (empty: all good)."""
    problems: list[str] = []
    present = set(list_files(directory))
    for name in sorted(present - set(manifest.files)):
        problems.append(f"{name} is not in the manifest")
    for name, want in sorted(manifest.files.items()):
        path = directory / name
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        if size != want.size:
            problems.append(f"{name} has {size} bytes, the manifest says {want.size}")
        elif checksums and file_crc32(path) != want.crc32:
            problems.append(f"{name} fails its CRC32 (the manifest says {want.crc32:#010x})")
    return problems

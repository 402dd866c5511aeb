"""The token cache's formats and names: the key's format version, the files of a cache,
the tokenizer protocol, the opened cache, and the errors it raises."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt

log = logging.getLogger("spottrain.token_cache")

# Part of the key: a change to the file layout or to how sources are read makes old caches
# misses instead of misreads. 2: a source enters the key by its own sha256, not its bytes.
FORMAT_VERSION = 2
DEFAULT_CHUNK_BYTES = 8 << 20
# Below this a build runs serially: spawning tokenizer processes (each imports the
# tokenizer's module afresh) costs seconds.
DEFAULT_PARALLEL_MIN_BYTES = 64 << 20
DIGESTS_DIR = "digests"
READ_BYTES = 1 << 20
DTYPES = ("<u2", "<u4")

Verify = Literal["size", "full"]
PathLike = str | os.PathLike[str]


class TokenCacheError(RuntimeError):
    """The cache cannot be opened or built; the message says why and what to do."""


class SourceChanged(TokenCacheError):
    """A source's bytes are not those its digest says (it changed, or a digest is stale)."""


class Tokenizer(Protocol):
    """What the cache needs of a tokenizer.

    ``fingerprint`` must change whenever the ids ``encode`` returns could change (a new
    version, vocabulary or merge list): it is part of the key, and a stale one silently
    reuses tokens of the old tokenizer.
    """

    @property
    def name(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    def fingerprint(self) -> str: ...

    def encode(self, text: str) -> Sequence[int]: ...


# A tokenizer may set ``parallel = False`` (a class or instance attribute) when ``encode``
# must run in the calling process: one that holds a GPU, a lock or a connection.


class ByteTokenizer:
    """The UTF-8 bytes of the text, one token each (vocabulary of 256): needs no files and no
    packages, and never changes, so its fingerprint is its name and version."""

    name = "byte"
    version = 1
    vocab_size = 256

    def fingerprint(self) -> str:
        return f"spottrain.ByteTokenizer/{self.version}/utf-8"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


@dataclass(frozen=True)
class TokenCache:
    """An opened cache. ``tokens`` is read-only (a ``np.memmap`` unless it is empty);
    ``hit`` is False only in the process that built it."""

    tokens: npt.NDArray[Any]
    key: str
    hit: bool
    path: Path
    manifest_path: Path
    manifest: dict[str, Any]
    # Bytes of the sources this open read to compute the key: 0 when every source kept the
    # identity its digest was recorded under.
    hashed_bytes: int = 0

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True)
class Source:
    path: Path
    name: str
    size: int
    # Changes whenever the file's bytes can have changed (see the module docstring).
    identity: str


@dataclass(frozen=True)
class Paths:
    root: Path
    key: str

    @property
    def tokens(self) -> Path:
        return self.root / f"{self.key}.tokens"

    @property
    def manifest(self) -> Path:
        return self.root / f"{self.key}.json"

    @property
    def lock(self) -> Path:
        return self.root / f"{self.key}.lock"

    def tmp(self, final: Path) -> Path:
        return final.with_name(f"{final.name}.tmp-{socket.gethostname()}-{os.getpid()}")

    def stale_tmps(self) -> list[Path]:
        return sorted(
            [
                *self.root.glob(f"{self.key}.tokens.tmp-*"),
                *self.root.glob(f"{self.key}.json.tmp-*"),
            ]
        )


def token_dtype(vocab_size: int) -> np.dtype[Any]:
    """Little-endian, so a cache written on one machine reads the same on any other."""
    if vocab_size <= 0:
        raise TokenCacheError(f"tokenizer vocab_size must be positive, got {vocab_size}")
    return np.dtype("<u2") if vocab_size <= 65535 else np.dtype("<u4")


# -- file system helpers ----------------------------------------------------------------------
def unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def dir_error(root: Path, exc: OSError, doing: str) -> TokenCacheError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        why, fix = "it is full", "free space or point the cache at a larger volume"
    elif exc.errno == errno.EROFS:
        why, fix = "it is on a read-only file system", "point the cache at a writable volume"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        why, fix = "this user may not write there", "fix its owner or mode, or choose another"
    else:
        why, fix = exc.strerror or str(exc), "check the volume or choose another directory"
    return TokenCacheError(f"token cache directory {root}: {doing} failed because {why}; {fix}")

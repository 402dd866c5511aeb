"""The sources of a cache and its key: each source's sha256, recalled from the digests kept
in ``cache_dir/digests`` while the file keeps its identity (see the package docstring)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from spottrain.fileio import atomic_write

from .format import (
    DIGESTS_DIR,
    FORMAT_VERSION,
    READ_BYTES,
    PathLike,
    Source,
    TokenCacheError,
    Tokenizer,
    log,
)


def resolve_sources(sources: PathLike | Sequence[PathLike]) -> list[Source]:
    items = [sources] if isinstance(sources, str | os.PathLike) else list(sources)
    if not items:
        raise TokenCacheError("no sources given: pass at least one text file or directory")
    out: list[Source] = []
    for item in items:
        path = Path(item)
        if path.is_dir():
            members = sorted(
                (Path(d) / f for d, _, files in os.walk(path, onerror=_walk_error) for f in files),
                key=lambda p: p.relative_to(path).as_posix(),
            )
            for member in members:
                name = f"{path.name}/{member.relative_to(path).as_posix()}"
                out.append(_stat_source(member, name))
        else:
            out.append(_stat_source(path, path.name))
    return out


def _walk_error(exc: OSError) -> None:
    # Skipping an unreadable subdirectory would silently leave its files out of the key.
    raise _unreadable(Path(exc.filename or "?"), exc)


def _unreadable(path: Path, exc: OSError) -> TokenCacheError:
    return TokenCacheError(
        f"cannot read source {path}: {exc.strerror or exc}; pass an existing, readable "
        "text file or directory"
    )


def _stat_source(path: Path, name: str) -> Source:
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):  # before opening: a FIFO would block the open
            raise TokenCacheError(f"source {path} is not a regular file or a directory")
        # Opening, not just stat: an unreadable file should fail here, named, not mid-build.
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise _unreadable(path, exc) from exc
    return Source(path, name, st.st_size, identity_of(st))


def identity_of(st: os.stat_result) -> str:
    # No st_dev: the same file on a shared volume has one inode but a different device
    # number on each host, and should be hashed once for all of them.
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"


def _field(h: hashlib._Hash, value: str) -> None:
    # Length-prefixed, so no two different field sequences hash the same bytes.
    data = value.encode("utf-8")
    h.update(len(data).to_bytes(8, "big"))
    h.update(data)


def _key_hasher(tokenizer: Tokenizer, count: int) -> hashlib._Hash:
    h = hashlib.sha256()
    _field(h, "spottrain-token-cache")
    _field(h, str(FORMAT_VERSION))
    _field(h, tokenizer.name)
    _field(h, tokenizer.fingerprint())
    _field(h, str(tokenizer.vocab_size))
    _field(h, str(count))
    return h


def read_error(src: Source, exc: OSError) -> TokenCacheError:
    return TokenCacheError(f"reading source {src.path} failed: {exc.strerror or exc}")


def changed(src: Source) -> TokenCacheError:
    return TokenCacheError(
        f"source {src.path} changed while it was being read (expected {src.size} bytes); "
        "the token cache needs sources that stay the same: finish writing them, then run again"
    )


def _file_sha256(src: Source) -> str:
    h = hashlib.sha256()
    read = 0
    try:
        with open(src.path, "rb") as f:
            while block := f.read(READ_BYTES):
                h.update(block)
                read += len(block)
            after = os.fstat(f.fileno())
    except OSError as exc:
        raise read_error(src, exc) from exc
    if read != src.size or identity_of(after) != src.identity:
        raise changed(src)
    return h.hexdigest()


@dataclass(frozen=True)
class Digests:
    """The sources' digests kept in ``cache_dir/digests`` (None: hash every open)."""

    root: Path | None

    def _entry(self, src: Source) -> Path | None:
        if self.root is None:
            return None
        ident = hashlib.sha256(f"{src.path.resolve()}\0{src.identity}".encode()).hexdigest()
        return self.root / f"{ident[:40]}.json"

    def recall(self, src: Source) -> str | None:
        entry = self._entry(src)
        if entry is None:
            return None
        try:
            found = json.loads(entry.read_bytes())
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, ValueError) as exc:
            log.warning("ignoring the unreadable source digest %s (%s)", entry, exc)
            return None
        ok = (
            isinstance(found, dict)
            and found.get("identity") == src.identity
            and isinstance(found.get("sha256"), str)
            and len(found["sha256"]) == 64
        )
        return str(found["sha256"]) if ok else None

    def forget(self, src: Source) -> None:
        entry = self._entry(src)
        if entry is not None:
            with contextlib.suppress(OSError):
                entry.unlink()

    def remember(self, src: Source, digest: str) -> None:
        entry = self._entry(src)
        if entry is None:
            return
        record = {"path": str(src.path.resolve()), "identity": src.identity, "sha256": digest}
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            # A cache of digests: losing it to a crash only costs hashing again.
            atomic_write(entry, json.dumps(record), durable=False)
        except OSError as exc:
            # A read-only cache directory: the key is still right, the next open hashes again.
            log.debug("cannot record the digest of %s in %s: %s", src.path, entry.parent, exc)


@dataclass(frozen=True)
class Keyed:
    key: str
    digests: list[str]  # each source's sha256, in order
    hashed_bytes: int  # read to compute them (0: all recalled)


def compute_key(srcs: list[Source], tokenizer: Tokenizer, digests: Digests) -> Keyed:
    h = _key_hasher(tokenizer, len(srcs))
    hashed = 0
    found: list[str] = []
    for src in srcs:
        _field(h, src.name)
        _field(h, str(src.size))
        digest = digests.recall(src)
        if digest is None:
            digest = _file_sha256(src)
            hashed += src.size
            digests.remember(src, digest)
        _field(h, digest)
        found.append(digest)
    return Keyed(h.hexdigest(), found, hashed)


def cache_key(
    sources: PathLike | Sequence[PathLike],
    tokenizer: Tokenizer,
    cache_dir: PathLike | None = None,
) -> str:
    """The key ``open_tokens`` would use for these sources and this tokenizer (reading the
    digests recorded in ``cache_dir``, when given)."""
    digests = Digests(Path(cache_dir) / DIGESTS_DIR if cache_dir is not None else None)
    return compute_key(resolve_sources(sources), tokenizer, digests).key

"""Tokenized data cached once on the shared volume, reused by later runs and restarted nodes.

A corpus (text files) is tokenized once into a flat file of token ids that every rank maps
read-only with ``np.memmap``, so a node that is backfilled after a preemption starts training
in seconds instead of tokenizing again::

    from spottrain.token_cache import ByteTokenizer, open_tokens

    cache = open_tokens(["data/train.txt"], ByteTokenizer(), "/mnt/ckpt/run/token-cache")
    window = cache.tokens[start : start + context + 1]  # np.memmap, read-only

**Key.** ``sha256`` over a format version, the tokenizer's identity (``name``,
``fingerprint()``, ``vocab_size``) and each source file in order: its name (the basename of
a file given directly, ``<dir>/<relative path>`` for the files of a directory, sorted), its
size and the sha256 of its bytes. A different corpus or tokenizer gets a different cache; the
same one found under another mount point gets the same.

**Hashing once.** Each file's sha256 is kept in ``cache_dir/digests/``, one small JSON file
named by the file's path and identity: its size, ``st_mtime_ns``, ``st_ctime_ns`` and inode.
An open whose sources keep their identity stats them and reads nothing (a backfilled node
starts without reading the corpus); a file that changed in any way the kernel records (an
edit, ``cp`` over it, a restored mtime: ``ctime`` still moves) is hashed again. A node that
has its own copy of the corpus hashes it once. The digests are only a shortcut to the key:
a build hashes each source again as it tokenizes it and refuses to commit tokens whose
sources no longer match. ``TokenCache.hashed_bytes`` says how much an open read to hash.

**Parallel tokenizing.** A build cuts the sources into chunks that end at a newline and,
with ``workers`` above 1, tokenizes them in that many processes (``spawn``), writing the
results in order: the token file is byte for byte the one a serial build writes. A
tokenizer that cannot be pickled, or declares ``parallel = False``, is run serially, and so
is a corpus below ``parallel_min_bytes`` (starting the processes costs more than it saves).
The default is one worker per core, up to 8.

**Files**, in ``cache_dir``: ``<key>.tokens`` (the ids, little-endian ``uint16`` when the
vocabulary has at most 65535 entries, else ``uint32``), ``<key>.json`` (the manifest: key,
dtype, count, sha256 of the token bytes, tokenizer, sources, created_at, builder) and
``<key>.lock``. The manifest is the commit marker, written last and atomically (temporary
name, fsync, rename, fsync of the directory); nothing without one is ever read. A committed
token file is never written in place, so a reader that mapped it keeps valid data even if
another process later replaces it.

**One builder.** A process that finds no committed cache takes an exclusive ``flock`` on
``<key>.lock`` and builds into ``<key>.tokens.tmp-<host>-<pid>``; the others block on the
lock and, once they hold it, find the manifest and open the cache. The kernel (or the file
server) drops the lock of a process that dies, so the next process takes it, removes the
dead builder's temporary files and builds again. ``flock`` excludes processes across hosts
on Lustre, on EFS and on NFSv4 (Linux emulates it with NFS byte-range locks); on NFS mounted
with ``nolock``, or NFSv3 without a lock daemon, it only excludes processes on the same
host. There two hosts may both build; the result is still one valid cache (the same bytes,
committed by rename), though a builder can fail, clearly, when the other one removes its
temporary file.

**Verification.** ``verify="size"`` (default) checks the manifest against the token file's
size; ``verify="full"`` also recomputes the sha256 of the token bytes. A cache that fails is
logged, removed under the lock, and rebuilt.

**Tokenizers** implement :class:`Tokenizer`. ``encode`` is called on whole lines (chunks of
about ``chunk_bytes`` that end at a newline), so a tokenizer that merges across newlines sees
slightly different text boundaries than one call per file would give. The tokens of the
sources are concatenated in order with nothing between them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import multiprocessing
import os
import pickle
import socket
import stat
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt

__all__ = [
    "FORMAT_VERSION",
    "ByteTokenizer",
    "TokenCache",
    "TokenCacheError",
    "Tokenizer",
    "cache_key",
    "open_tokens",
    "token_dtype",
]

log = logging.getLogger("spottrain.token_cache")

# Part of the key: a change to the file layout or to how sources are read makes old caches
# misses instead of misreads. 2: a source enters the key by its own sha256, not its bytes.
FORMAT_VERSION = 2
DEFAULT_CHUNK_BYTES = 8 << 20
# Below this a build runs serially: spawning tokenizer processes (each imports the
# tokenizer's module afresh) costs seconds.
DEFAULT_PARALLEL_MIN_BYTES = 64 << 20
DIGESTS_DIR = "digests"
_READ_BYTES = 1 << 20
_DTYPES = ("<u2", "<u4")

Verify = Literal["size", "full"]
PathLike = str | os.PathLike[str]


class TokenCacheError(RuntimeError):
    """The cache cannot be opened or built; the message says why and what to do."""


class _SourceChanged(TokenCacheError):
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
class _Source:
    path: Path
    name: str
    size: int
    # Changes whenever the file's bytes can have changed (see the module docstring).
    identity: str


@dataclass(frozen=True)
class _Paths:
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


# -- sources and key --------------------------------------------------------------------------
def _resolve_sources(sources: PathLike | Sequence[PathLike]) -> list[_Source]:
    items = [sources] if isinstance(sources, str | os.PathLike) else list(sources)
    if not items:
        raise TokenCacheError("no sources given: pass at least one text file or directory")
    out: list[_Source] = []
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


def _stat_source(path: Path, name: str) -> _Source:
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):  # before opening: a FIFO would block the open
            raise TokenCacheError(f"source {path} is not a regular file or a directory")
        # Opening, not just stat: an unreadable file should fail here, named, not mid-build.
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise _unreadable(path, exc) from exc
    return _Source(path, name, st.st_size, _identity(st))


def _identity(st: os.stat_result) -> str:
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


def _read_error(src: _Source, exc: OSError) -> TokenCacheError:
    return TokenCacheError(f"reading source {src.path} failed: {exc.strerror or exc}")


def _changed(src: _Source) -> TokenCacheError:
    return TokenCacheError(
        f"source {src.path} changed while it was being read (expected {src.size} bytes); "
        "the token cache needs sources that stay the same: finish writing them, then run again"
    )


def _file_sha256(src: _Source) -> str:
    h = hashlib.sha256()
    read = 0
    try:
        with open(src.path, "rb") as f:
            while block := f.read(_READ_BYTES):
                h.update(block)
                read += len(block)
            after = os.fstat(f.fileno())
    except OSError as exc:
        raise _read_error(src, exc) from exc
    if read != src.size or _identity(after) != src.identity:
        raise _changed(src)
    return h.hexdigest()


@dataclass(frozen=True)
class _Digests:
    """The sources' digests kept in ``cache_dir/digests`` (None: hash every open)."""

    root: Path | None

    def _entry(self, src: _Source) -> Path | None:
        if self.root is None:
            return None
        ident = hashlib.sha256(f"{src.path.resolve()}\0{src.identity}".encode()).hexdigest()
        return self.root / f"{ident[:40]}.json"

    def recall(self, src: _Source) -> str | None:
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

    def forget(self, src: _Source) -> None:
        entry = self._entry(src)
        if entry is not None:
            with contextlib.suppress(OSError):
                entry.unlink()

    def remember(self, src: _Source, digest: str) -> None:
        entry = self._entry(src)
        if entry is None:
            return
        record = {"path": str(src.path.resolve()), "identity": src.identity, "sha256": digest}
        tmp = entry.with_name(f"{entry.name}.tmp-{socket.gethostname()}-{os.getpid()}")
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(record))
            os.replace(tmp, entry)
        except OSError as exc:
            # A read-only cache directory: the key is still right, the next open hashes again.
            with contextlib.suppress(OSError):
                tmp.unlink()
            log.debug("cannot record the digest of %s in %s: %s", src.path, entry.parent, exc)


@dataclass(frozen=True)
class _Keyed:
    key: str
    digests: list[str]  # each source's sha256, in order
    hashed_bytes: int  # read to compute them (0: all recalled)


def _key(srcs: list[_Source], tokenizer: Tokenizer, digests: _Digests) -> _Keyed:
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
    return _Keyed(h.hexdigest(), found, hashed)


def cache_key(
    sources: PathLike | Sequence[PathLike],
    tokenizer: Tokenizer,
    cache_dir: PathLike | None = None,
) -> str:
    """The key ``open_tokens`` would use for these sources and this tokenizer (reading the
    digests recorded in ``cache_dir``, when given)."""
    digests = _Digests(Path(cache_dir) / DIGESTS_DIR if cache_dir is not None else None)
    return _key(_resolve_sources(sources), tokenizer, digests).key


# -- file system helpers ----------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _dir_error(root: Path, exc: OSError, doing: str) -> TokenCacheError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        why, fix = "it is full", "free space or point the cache at a larger volume"
    elif exc.errno == errno.EROFS:
        why, fix = "it is on a read-only file system", "point the cache at a writable volume"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        why, fix = "this user may not write there", "fix its owner or mode, or choose another"
    else:
        why, fix = exc.strerror or str(exc), "check the volume or choose another directory"
    return TokenCacheError(f"token cache directory {root}: {doing} failed because {why}; {fix}")


# -- verification -----------------------------------------------------------------------------
class _Corrupt(Exception):
    pass


def _read_manifest(paths: _Paths) -> dict[str, Any] | None:
    """The committed manifest, None when there is none; _Corrupt when it is unusable."""
    try:
        raw = paths.manifest.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _Corrupt(f"manifest unreadable: {exc.strerror or exc}") from exc
    try:
        manifest = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _Corrupt(f"manifest is not valid JSON: {exc}") from exc
    if not isinstance(manifest, dict):
        raise _Corrupt("manifest is not a JSON object")
    problems = []
    if manifest.get("format") != FORMAT_VERSION:
        problems.append(f"format {manifest.get('format')!r} != {FORMAT_VERSION}")
    if manifest.get("key") != paths.key:
        problems.append(f"key {manifest.get('key')!r} != {paths.key}")
    if manifest.get("dtype") not in _DTYPES:
        problems.append(f"dtype {manifest.get('dtype')!r} not one of {_DTYPES}")
    count = manifest.get("count")
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        problems.append(f"count {count!r} is not a non-negative integer")
    if not isinstance(manifest.get("sha256"), str):
        problems.append("sha256 missing")
    if problems:
        raise _Corrupt("manifest fields are wrong: " + "; ".join(problems))
    return manifest


def _open_committed(
    paths: _Paths, verify: Verify
) -> tuple[dict[str, Any], npt.NDArray[Any]] | None:
    """The committed cache, checked; None when nothing is committed; _Corrupt when it fails."""
    manifest = _read_manifest(paths)
    if manifest is None:
        return None
    dtype = np.dtype(manifest["dtype"])
    count: int = manifest["count"]
    try:
        # One descriptor for the checks and the mapping: they see the same file even if a
        # rebuild renames another one over the name in between.
        f = open(paths.tokens, "rb")  # noqa: SIM115 - closed below; the mapping outlives it
    except OSError as exc:
        raise _Corrupt(f"token file unreadable: {exc.strerror or exc}") from exc
    with f:
        size = os.fstat(f.fileno()).st_size
        want = count * dtype.itemsize
        if size != want:
            raise _Corrupt(f"token file has {size} bytes, the manifest says {want}")
        if verify == "full":
            h = hashlib.sha256()
            try:
                while block := f.read(_READ_BYTES):
                    h.update(block)
            except OSError as exc:
                raise _Corrupt(f"token file unreadable: {exc.strerror or exc}") from exc
            if h.hexdigest() != manifest["sha256"]:
                raise _Corrupt(
                    f"sha256 of the token bytes is {h.hexdigest()}, "
                    f"the manifest says {manifest['sha256']}"
                )
        if count == 0:
            empty = np.empty(0, dtype=dtype)
            empty.flags.writeable = False
            return manifest, empty
        tokens: npt.NDArray[Any] = np.memmap(f, dtype=dtype, mode="r", shape=(count,))
    return manifest, tokens


def _remove_corrupt(paths: _Paths, reason: str) -> None:
    log.warning(
        "token cache %s in %s is corrupt (%s); rebuilding it", paths.key, paths.root, reason
    )
    # The manifest goes first: from then on no reader takes the token file for committed.
    _unlink(paths.manifest)
    _unlink(paths.tokens)
    _fsync_dir(paths.root)


# -- lock -------------------------------------------------------------------------------------
@contextlib.contextmanager
def _exclusive(paths: _Paths, timeout_s: float) -> Iterator[None]:
    try:
        fd = os.open(paths.lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise _dir_error(paths.root, exc, f"creating the lock file {paths.lock.name}") from exc
    try:
        deadline = time.monotonic() + timeout_s
        delay = 0.01
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                # Polling rather than a blocking flock: a blocking one cannot time out.
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TokenCacheError(_timeout_message(paths, timeout_s)) from None
                time.sleep(min(delay, left))
                delay = min(delay * 2, 0.5)
        # Who holds it, for the timeout message of those who wait; the lock file itself is
        # never removed, since a waiter may hold a descriptor to it.
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the flock


def _timeout_message(paths: _Paths, timeout_s: float) -> str:
    try:
        holder = json.loads(paths.lock.read_text())
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder["since"])))
        who = f"held by pid {holder['pid']} on host {holder['host']} since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        who = "its holder unknown"
    return (
        f"timed out after {timeout_s:g} s waiting for the token cache lock {paths.lock} "
        f"({who}). Another process is building this cache: if it is still working, raise "
        "lock_timeout_s above the time a build takes; if it is gone and the lock stays taken "
        "(a file system that does not release the locks of dead processes, as some NFS "
        "setups), make sure no process builds this key and delete the lock file"
    )


# -- build ------------------------------------------------------------------------------------
def _encode_piece(
    tokenizer: Tokenizer, dtype: str, path: str, piece: bytes, offset: int
) -> tuple[bytes, int]:
    """One newline-ended piece of a source as token bytes, and how many tokens they are."""
    try:
        text = piece.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TokenCacheError(
            f"source {path} is not UTF-8 text (byte {offset + exc.start}); the token "
            "cache tokenizes text files: convert it to UTF-8 or leave it out"
        ) from exc
    ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    if ids.ndim != 1:
        raise TokenCacheError(f"tokenizer {tokenizer.name} returned a {ids.ndim}-d array")
    vocab = tokenizer.vocab_size
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise TokenCacheError(
            f"tokenizer {tokenizer.name} returned ids outside [0, {vocab}) for {path}: "
            f"min {int(ids.min())}, max {int(ids.max())}; fix its vocab_size"
        )
    return ids.astype(dtype).tobytes(), int(ids.size)


# The tokenizer of a tokenizing process, sent once when the process starts.
_worker_tokenizer: Tokenizer | None = None


def _start_worker(pickled: bytes) -> None:
    global _worker_tokenizer
    _worker_tokenizer = pickle.loads(pickled)


def _encode_in_worker(dtype: str, path: str, piece: bytes, offset: int) -> tuple[bytes, int]:
    assert _worker_tokenizer is not None, "tokenizing process started without its tokenizer"
    return _encode_piece(_worker_tokenizer, dtype, path, piece, offset)


def _pieces(
    srcs: list[_Source], digests: list[str], chunk_bytes: int
) -> Iterator[tuple[_Source, bytes, int]]:
    """Each source in newline-ended pieces of about ``chunk_bytes``, in order, with each
    piece's offset; raises once a source turns out not to be what its digest says."""
    for src, want in zip(srcs, digests, strict=True):
        h = hashlib.sha256()
        read = 0
        pending = bytearray()  # bytes after the last newline, waiting for more
        try:
            f = open(src.path, "rb")  # noqa: SIM115 - closed by the with below
        except OSError as exc:
            raise _read_error(src, exc) from exc
        with f:
            while True:
                try:
                    block = f.read(chunk_bytes)
                except OSError as exc:
                    raise _read_error(src, exc) from exc
                if not block:
                    break
                h.update(block)
                read += len(block)
                # Search the new block only, so a long line is not scanned again on every
                # read.
                cut = block.rfind(b"\n")
                if cut < 0:
                    pending += block
                    continue
                piece = bytes(pending) + block[: cut + 1]
                yield src, piece, read - len(block) - len(pending)
                pending = bytearray(block[cut + 1 :])
            if pending:
                yield src, bytes(pending), read - len(pending)
        if read != src.size:
            raise _changed(src)
        # Tokens from a file that changed since the key was computed must not be committed
        # under that key.
        if h.hexdigest() != want:
            raise _SourceChanged(
                f"source {src.path} changed between hashing and tokenizing; the token cache "
                "needs sources that stay the same: finish writing them, then run again"
            )


def _parallelism(tokenizer: Tokenizer, workers: int | None, total: int, min_bytes: int) -> int:
    if workers is None:
        workers = min(8, os.cpu_count() or 1)
    if workers <= 1 or total < min_bytes:
        return 1
    if getattr(tokenizer, "parallel", True) is False:
        return 1
    try:
        pickle.dumps(tokenizer)
    except Exception as exc:  # any pickling failure means "not in processes"
        log.info("tokenizer %s cannot be pickled (%s): tokenizing serially", tokenizer.name, exc)
        return 1
    return workers


def _tokenized(
    tokenizer: Tokenizer,
    dtype: str,
    pieces: Iterator[tuple[_Source, bytes, int]],
    workers: int,
) -> Iterator[tuple[bytes, int]]:
    """The token bytes of each piece, in the order of the pieces."""
    if workers <= 1:
        for src, piece, offset in pieces:
            yield _encode_piece(tokenizer, dtype, str(src.path), piece, offset)
        return
    # spawn, not fork: the caller is often a training process with threads (torch, NCCL)
    # that a forked child would inherit in whatever state they were.
    pool = ProcessPoolExecutor(
        max_workers=workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_start_worker,
        initargs=(pickle.dumps(tokenizer),),
    )
    inflight: deque[Future[tuple[bytes, int]]] = deque()
    try:
        for src, piece, offset in pieces:
            inflight.append(pool.submit(_encode_in_worker, dtype, str(src.path), piece, offset))
            # Two pieces a process keeps them busy and bounds memory to a few chunks.
            if len(inflight) >= 2 * workers:
                yield inflight.popleft().result()
        while inflight:
            yield inflight.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _build(
    paths: _Paths,
    srcs: list[_Source],
    digests: list[str],
    tokenizer: Tokenizer,
    chunk_bytes: int,
    workers: int,
) -> dict[str, Any]:
    started = time.time()
    dtype = token_dtype(tokenizer.vocab_size)
    vocab = tokenizer.vocab_size
    total = sum(s.size for s in srcs)
    log.info(
        "building token cache %s in %s: %d source(s), %d bytes, tokenizer %s, %d process(es)",
        paths.key,
        paths.root,
        len(srcs),
        total,
        tokenizer.name,
        workers,
    )
    tmp = paths.tmp(paths.tokens)
    digest = hashlib.sha256()
    count = 0
    try:
        with open(tmp, "wb") as out:
            pieces = _pieces(srcs, digests, chunk_bytes)
            for data, n in _tokenized(tokenizer, dtype.str, pieces, workers):
                out.write(data)
                digest.update(data)
                count += n
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, paths.tokens)
    except OSError as exc:
        _unlink(tmp)
        raise _dir_error(paths.root, exc, f"writing {tmp.name}") from exc
    except BaseException:
        _unlink(tmp)
        raise

    manifest: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "key": paths.key,
        "dtype": dtype.str,
        "count": count,
        "sha256": digest.hexdigest(),
        "tokenizer": {
            "name": tokenizer.name,
            "fingerprint": tokenizer.fingerprint(),
            "vocab_size": vocab,
        },
        "sources": [
            {"name": s.name, "size": s.size, "sha256": d}
            for s, d in zip(srcs, digests, strict=True)
        ],
        "created_at": time.time(),
        "builder": {"host": socket.gethostname(), "pid": os.getpid(), "processes": workers},
        "build_seconds": round(time.time() - started, 3),
    }
    tmp_manifest = paths.tmp(paths.manifest)
    try:
        with open(tmp_manifest, "w") as mf:
            json.dump(manifest, mf, indent=1)
            mf.flush()
            os.fsync(mf.fileno())
        # Both renames reach the disk in this order: a token file may be committed without
        # a manifest (and is then rebuilt), never a manifest without its token file.
        _fsync_dir(paths.root)
        os.replace(tmp_manifest, paths.manifest)
        _fsync_dir(paths.root)
    except OSError as exc:
        _unlink(tmp_manifest)
        raise _dir_error(paths.root, exc, "committing the manifest") from exc
    log.info(
        "built token cache %s: %d tokens in %.1f s", paths.key, count, manifest["build_seconds"]
    )
    return manifest


# -- entry point ------------------------------------------------------------------------------
def open_tokens(
    sources: PathLike | Sequence[PathLike],
    tokenizer: Tokenizer,
    cache_dir: PathLike,
    *,
    verify: Verify = "size",
    lock_timeout_s: float = 600.0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    workers: int | None = None,
    parallel_min_bytes: int = DEFAULT_PARALLEL_MIN_BYTES,
) -> TokenCache:
    """The tokens of ``sources`` (files, or directories read recursively in name order), from
    the cache in ``cache_dir`` if it holds them, else tokenized once and committed there.

    Any number of processes, on any number of hosts sharing ``cache_dir``, may call this at
    once: one builds, the others wait up to ``lock_timeout_s`` for it and then reuse its
    result. A committed cache is opened without the lock (a read-only ``cache_dir`` is fine
    then); building needs a writable one. ``workers`` processes tokenize a build of at least
    ``parallel_min_bytes`` (None: one per core, up to 8; see the module docstring).

    Raises TokenCacheError, naming the cause and the fix, when a source cannot be read, the
    directory cannot be written, or the lock is not had in time.
    """
    if verify not in ("size", "full"):
        raise ValueError(f"verify must be 'size' or 'full', got {verify!r}")
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    srcs = _resolve_sources(sources)
    token_dtype(tokenizer.vocab_size)
    root = Path(cache_dir)
    digests = _Digests(root / DIGESTS_DIR)
    keyed = _key(srcs, tokenizer, digests)
    paths = _Paths(root, keyed.key)
    hashed = keyed.hashed_bytes

    try:
        found = _open_committed(paths, verify)
    except _Corrupt:
        found = None  # judged again under the lock, where it may be removed
    if found is not None:
        return _result(paths, *found, hit=True, hashed=hashed)

    try:
        paths.root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _dir_error(paths.root, exc, "creating it") from exc
    with _exclusive(paths, lock_timeout_s):
        try:
            found = _open_committed(paths, verify)
        except _Corrupt as exc:
            _remove_corrupt(paths, str(exc))
            found = None
        if found is not None:
            return _result(paths, *found, hit=True, hashed=hashed)
        for stale in paths.stale_tmps():
            # Holding the lock, no live builder of this key can own these.
            log.info("removing %s, left by a build that did not finish", stale)
            _unlink(stale)
        total = sum(s.size for s in srcs)
        workers = _parallelism(tokenizer, workers, total, parallel_min_bytes)
        try:
            _build(paths, srcs, keyed.digests, tokenizer, chunk_bytes, workers)
        except _SourceChanged:
            # Whether a file changed or a recorded digest was wrong, the next open reads
            # every source again rather than failing once per stale digest.
            for src in srcs:
                digests.forget(src)
            raise
        # Mapped from the file as committed, so the builder reads what everyone else reads.
        try:
            found = _open_committed(paths, "size")
        except _Corrupt as exc:
            raise TokenCacheError(
                f"token cache {paths.key} in {paths.root} failed its check right after it "
                f"was built ({exc}); the volume may be faulty"
            ) from exc
        if found is None:
            raise TokenCacheError(
                f"the manifest {paths.manifest} vanished right after it was committed: "
                "another process is removing files in the token cache directory"
            )
        return _result(paths, *found, hit=False, hashed=hashed)


def _result(
    paths: _Paths, manifest: dict[str, Any], tokens: npt.NDArray[Any], *, hit: bool, hashed: int
) -> TokenCache:
    return TokenCache(
        hashed_bytes=hashed,
        tokens=tokens,
        key=paths.key,
        hit=hit,
        path=paths.tokens,
        manifest_path=paths.manifest,
        manifest=manifest,
    )

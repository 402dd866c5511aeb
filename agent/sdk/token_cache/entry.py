"""``open_tokens``: open the committed cache, or build it under the lock."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy.typing as npt

from .build import build, parallelism
from .digests import Digests, compute_key, resolve_sources
from .format import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_PARALLEL_MIN_BYTES,
    DIGESTS_DIR,
    PathLike,
    Paths,
    Source,
    SourceChanged,
    TokenCache,
    TokenCacheError,
    Tokenizer,
    Verify,
    dir_error,
    log,
    token_dtype,
    unlink,
)
from .lock import exclusive
from .verify import Corrupt, open_committed, remove_corrupt


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
    srcs = resolve_sources(sources)
    token_dtype(tokenizer.vocab_size)
    root = Path(cache_dir)
    digests = Digests(root / DIGESTS_DIR)
    keyed = compute_key(srcs, tokenizer, digests)
    paths = Paths(root, keyed.key)
    hashed = keyed.hashed_bytes

    try:
        found = open_committed(paths, verify)
    except Corrupt:
        found = None  # judged again under the lock, where it may be removed
    if found is not None:
        return _result(paths, *found, hit=True, hashed=hashed)

    try:
        paths.root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise dir_error(paths.root, exc, "creating it") from exc
    with exclusive(paths, lock_timeout_s):
        try:
            found = open_committed(paths, verify)
        except Corrupt as exc:
            remove_corrupt(paths, str(exc))
            found = None
        if found is not None:
            return _result(paths, *found, hit=True, hashed=hashed)
        for stale in paths.stale_tmps():
            # Holding the lock, no live builder of this key can own these.
            log.info("removing %s, left by a build that did not finish", stale)
            unlink(stale)
        total = sum(s.size for s in srcs)
        workers = parallelism(tokenizer, workers, total, parallel_min_bytes)
        found = _build_and_open(
            paths, srcs, keyed.digests, digests, tokenizer, chunk_bytes, workers
        )
        return _result(paths, *found, hit=False, hashed=hashed)


def _build_and_open(
    paths: Paths,
    srcs: list[Source],
    source_digests: list[str],
    digests: Digests,
    tokenizer: Tokenizer,
    chunk_bytes: int,
    workers: int,
) -> tuple[dict[str, Any], npt.NDArray[Any]]:
    """Build the cache (holding its lock) and open it as committed."""
    try:
        build(paths, srcs, source_digests, tokenizer, chunk_bytes, workers)
    except SourceChanged:
        # Whether a file changed or a recorded digest was wrong, the next open reads
        # every source again rather than failing once per stale digest.
        for src in srcs:
            digests.forget(src)
        raise
    # Mapped from the file as committed, so the builder reads what everyone else reads.
    try:
        found = open_committed(paths, "size")
    except Corrupt as exc:
        raise TokenCacheError(
            f"token cache {paths.key} in {paths.root} failed its check right after it "
            f"was built ({exc}); the volume may be faulty"
        ) from exc
    if found is None:
        raise TokenCacheError(
            f"the manifest {paths.manifest} vanished right after it was committed: "
            "another process is removing files in the token cache directory"
        )
    return found


def _result(
    paths: Paths, manifest: dict[str, Any], tokens: npt.NDArray[Any], *, hit: bool, hashed: int
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

"""Building a cache: the sources in newline-ended pieces, tokenized serially or in spawned
processes, written in order, then committed by the manifest."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import pickle
import socket
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

import numpy as np

from spottrain.fileio import fsync_dir

from .digests import changed, read_error
from .format import (
    FORMAT_VERSION,
    Paths,
    Source,
    SourceChanged,
    TokenCacheError,
    Tokenizer,
    dir_error,
    log,
    token_dtype,
    unlink,
)


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
    srcs: list[Source], digests: list[str], chunk_bytes: int
) -> Iterator[tuple[Source, bytes, int]]:
    """Each source in newline-ended pieces of about ``chunk_bytes``, in order, with each
    piece's offset; raises once a source turns out not to be what its digest says."""
    for src, want in zip(srcs, digests, strict=True):
        h = hashlib.sha256()
        read = 0
        pending = bytearray()  # bytes after the last newline, waiting for more
        try:
            f = open(src.path, "rb")  # noqa: SIM115 - closed by the with below
        except OSError as exc:
            raise read_error(src, exc) from exc
        with f:
            while True:
                try:
                    block = f.read(chunk_bytes)
                except OSError as exc:
                    raise read_error(src, exc) from exc
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
            raise changed(src)
        # Tokens from a file that changed since the key was computed must not be committed
        # under that key.
        if h.hexdigest() != want:
            raise SourceChanged(
                f"source {src.path} changed between hashing and tokenizing; the token cache "
                "needs sources that stay the same: finish writing them, then run again"
            )


def parallelism(tokenizer: Tokenizer, workers: int | None, total: int, min_bytes: int) -> int:
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
    pieces: Iterator[tuple[Source, bytes, int]],
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


def build(
    paths: Paths,
    srcs: list[Source],
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
        unlink(tmp)
        raise dir_error(paths.root, exc, f"writing {tmp.name}") from exc
    except BaseException:
        unlink(tmp)
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
    _commit_manifest(paths, manifest)
    log.info(
        "built token cache %s: %d tokens in %.1f s", paths.key, count, manifest["build_seconds"]
    )
    return manifest


def _commit_manifest(paths: Paths, manifest: dict[str, Any]) -> None:
    """Write the manifest atomically after the token file: the commit marker."""
    tmp_manifest = paths.tmp(paths.manifest)
    try:
        with open(tmp_manifest, "w") as mf:
            json.dump(manifest, mf, indent=1)
            mf.flush()
            os.fsync(mf.fileno())
        # Both renames reach the disk in this order: a token file may be committed without
        # a manifest (and is then rebuilt), never a manifest without its token file.
        fsync_dir(paths.root)
        os.replace(tmp_manifest, paths.manifest)
        fsync_dir(paths.root)
    except OSError as exc:
        unlink(tmp_manifest)
        raise dir_error(paths.root, exc, "committing the manifest") from exc

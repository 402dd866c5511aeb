"""One process opening a token cache, for tests/integration/agent/test_token_cache.py.

Prints one JSON line: the cache's key, hit, count, the sha256 of the tokens as this process
reads them through its mapping, the manifest's builder and created_at, and the token file's
inode; or ``{"error": ...}`` and exit status 3 on a TokenCacheError. Logs go to stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time

import numpy as np

from spottrain.agent.sdk.token_cache import ByteTokenizer, TokenCacheError, open_tokens


class VersionedBytes(ByteTokenizer):
    """The byte tokenizer under another version: the same ids, another identity."""

    version = 2


class SlowBytes(ByteTokenizer):
    """The byte tokenizer (same identity, same cache key) that sleeps on each chunk, so a
    test can catch the build in progress."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def encode(self, text: str) -> list[int]:
        time.sleep(self.delay)
        return super().encode(text)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--source", action="append", required=True)
    p.add_argument("--tokenizer", choices=["byte", "byte-v2"], default="byte")
    p.add_argument("--verify", choices=["size", "full"], default="full")
    p.add_argument("--lock-timeout", type=float, default=60.0)
    p.add_argument("--chunk-bytes", type=int, default=1 << 20)
    p.add_argument("--slow", type=float, default=0.0, help="seconds each encode call sleeps")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    p.add_argument("--go-file", help="wait until this file exists, so workers start together")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")

    tokenizer: ByteTokenizer
    if args.slow:
        tokenizer = SlowBytes(args.slow)
    elif args.tokenizer == "byte-v2":
        tokenizer = VersionedBytes()
    else:
        tokenizer = ByteTokenizer()
    if args.go_file:
        while not os.path.exists(args.go_file):
            time.sleep(0.005)
    try:
        cache = open_tokens(
            args.source,
            tokenizer,
            args.cache_dir,
            verify=args.verify,
            lock_timeout_s=args.lock_timeout,
            chunk_bytes=args.chunk_bytes,
            workers=args.workers,
            parallel_min_bytes=0,
        )
    except TokenCacheError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 3
    read = hashlib.sha256(np.ascontiguousarray(cache.tokens).tobytes()).hexdigest()
    print(
        json.dumps(
            {
                "pid": os.getpid(),
                "hit": cache.hit,
                "key": cache.key,
                "count": len(cache),
                "dtype": cache.tokens.dtype.str,
                "read_sha256": read,
                "builder_pid": cache.manifest["builder"]["pid"],
                "created_at": cache.manifest["created_at"],
                "inode": os.stat(cache.path).st_ino,
                "writeable": bool(cache.tokens.flags.writeable),
                "hashed_bytes": cache.hashed_bytes,
                "processes": cache.manifest["builder"]["processes"],
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

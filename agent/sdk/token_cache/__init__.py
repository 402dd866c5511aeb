"""Tokenized data cached once on the shared volume, reused by later runs and restarted nodes.

A corpus (text files) is tokenized once into a flat file of token ids that every rank maps
read-only with ``np.memmap``, so a node that is backfilled after a preemption starts training
in seconds instead of tokenizing again::

    from spottrain.agent.sdk.token_cache import ByteTokenizer, open_tokens

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

from .digests import cache_key
from .entry import open_tokens
from .format import (
    FORMAT_VERSION,
    ByteTokenizer,
    TokenCache,
    TokenCacheError,
    Tokenizer,
    token_dtype,
)

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

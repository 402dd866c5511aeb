"""The token cache across real processes (tests/token_cache_worker.py): a miss then a hit,
keys that follow the corpus and the tokenizer, many processes on a cold cache (one builds),
a builder killed mid-build, a lock held too long, and corrupt caches found and rebuilt."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spottrain.agent.sdk.token_cache import (
    ByteTokenizer,
    TokenCacheError,
    cache_key,
    open_tokens,
)

WORKER = str(Path(__file__).resolve().parents[2] / "token_cache_worker.py")


def write_corpus(root: Path) -> list[Path]:
    """Two sources: a file, and a directory of two files, with multi-byte UTF-8 on lines
    that straddle the workers' small read chunks."""
    root.mkdir(parents=True, exist_ok=True)
    first = root / "a.txt"
    first.write_text("".join(f"line {i}: spot train node gpu é 日本\n" for i in range(800)))
    shards = root / "shards"
    shards.mkdir()
    (shards / "2.txt").write_text("".join(f"second {i} redis round\n" for i in range(300)))
    (shards / "1.txt").write_text("first shard, no final newline")
    return [first, shards]


def expected_sha(sources: list[Path]) -> str:
    """What the byte tokenizer must give: each file's bytes in order (a directory's by name),
    as little-endian uint16."""
    files: list[Path] = []
    for s in sources:
        files += sorted(s.rglob("*")) if s.is_dir() else [s]
    data = b"".join(f.read_bytes() for f in files)
    return hashlib.sha256(np.frombuffer(data, np.uint8).astype("<u2").tobytes()).hexdigest()


def cmd(cache: Path, sources: list[Path], *extra: str) -> list[str]:
    args = [sys.executable, WORKER, "--cache-dir", str(cache)]
    for s in sources:
        args += ["--source", str(s)]
    return args + list(extra)


def run(cache: Path, sources: list[Path], *extra: str, rc: int = 0) -> dict[str, Any]:
    proc = subprocess.run(cmd(cache, sources, *extra), capture_output=True, text=True, timeout=60)
    assert proc.returncode == rc, proc.stdout + proc.stderr
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    out["stderr"] = proc.stderr
    return out


def leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.glob("*.tmp-*"))


def wait_for_tmp(cache: Path, proc: subprocess.Popen[str]) -> Path:
    """The builder's temporary file: proof that it holds the lock and is writing."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        tmps = list(cache.glob("*.tokens.tmp-*"))
        if tmps and tmps[0].stat().st_size > 0:
            return tmps[0]
        assert proc.poll() is None, "the slow builder exited early"
        time.sleep(0.01)
    raise AssertionError("no build in progress after 20 s")


@pytest.fixture
def corpus(tmp_path: Path) -> list[Path]:
    return write_corpus(tmp_path / "corpus")


def test_miss_then_hit_reuses_the_file(tmp_path: Path, corpus: list[Path]) -> None:
    cache = tmp_path / "cache"
    first = run(cache, corpus, "--chunk-bytes", "1000")
    assert first["hit"] is False
    assert first["read_sha256"] == expected_sha(corpus)
    assert first["dtype"] == "<u2" and first["writeable"] is False
    manifest_path = cache / f"{first['key']}.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest["count"] == first["count"] and manifest["sha256"] == first["read_sha256"]
    assert [s["name"] for s in manifest["sources"]] == ["a.txt", "shards/1.txt", "shards/2.txt"]
    stamp = manifest_path.stat().st_mtime_ns

    second = run(cache, corpus)
    assert second["hit"] is True
    assert second["key"] == first["key"]
    assert second["read_sha256"] == first["read_sha256"]
    # Not rebuilt: the same token file and manifest, written by the first process.
    assert second["inode"] == first["inode"]
    assert second["created_at"] == first["created_at"]
    assert second["builder_pid"] == first["pid"]
    assert manifest_path.stat().st_mtime_ns == stamp
    assert leftovers(cache) == []
    # The key needs no absolute paths: the same corpus elsewhere is the same cache.
    assert cache_key(corpus, ByteTokenizer()) == first["key"]


def test_key_follows_corpus_and_tokenizer(tmp_path: Path, corpus: list[Path]) -> None:
    cache = tmp_path / "cache"
    base = run(cache, corpus)
    other_tokenizer = run(cache, corpus, "--tokenizer", "byte-v2")
    assert other_tokenizer["hit"] is False and other_tokenizer["key"] != base["key"]

    original = corpus[0].read_bytes()
    corpus[0].write_bytes(original.replace(b"line 7:", b"line 8:", 1))  # same size
    edited = run(cache, corpus)
    assert edited["hit"] is False and edited["key"] not in (base["key"], other_tokenizer["key"])
    assert edited["read_sha256"] == expected_sha(corpus)

    corpus[0].write_bytes(original)
    again = run(cache, corpus)
    assert again["hit"] is True and again["key"] == base["key"]


def test_concurrent_first_use_builds_once(tmp_path: Path, corpus: list[Path]) -> None:
    cache = tmp_path / "cache"
    go = tmp_path / "go"
    # Slow enough that the others find the build in progress, not finished.
    extra = ("--go-file", str(go), "--slow", "0.02", "--chunk-bytes", "4096")
    procs = [
        subprocess.Popen(cmd(cache, corpus, *extra), stdout=subprocess.PIPE, text=True)
        for _ in range(5)
    ]
    time.sleep(0.5)  # past the imports, all polling for the go file
    go.touch()
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        results.append(json.loads(out.strip().splitlines()[-1]))
    builders = [r for r in results if not r["hit"]]
    assert len(builders) == 1, results
    assert {r["builder_pid"] for r in results} == {builders[0]["pid"]}
    assert {r["read_sha256"] for r in results} == {expected_sha(corpus)}
    assert len({r["inode"] for r in results}) == 1
    assert leftovers(cache) == []


def test_writer_killed_mid_build_is_rebuilt(tmp_path: Path, corpus: list[Path]) -> None:
    cache = tmp_path / "cache"
    slow = subprocess.Popen(
        cmd(cache, corpus, "--slow", "0.3", "--chunk-bytes", "1024"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        wait_for_tmp(cache, slow)
    finally:
        slow.send_signal(signal.SIGKILL)
        slow.wait(10)
    assert leftovers(cache), "the killed builder's temporary file should still be there"
    assert list(cache.glob("*.json")) == []  # nothing committed

    after = run(cache, corpus)
    assert after["hit"] is False
    assert after["read_sha256"] == expected_sha(corpus)
    assert "left by a build that did not finish" in after["stderr"]
    assert leftovers(cache) == []


def test_lock_timeout_names_the_lock_and_its_holder(tmp_path: Path, corpus: list[Path]) -> None:
    cache = tmp_path / "cache"
    slow = subprocess.Popen(
        cmd(cache, corpus, "--slow", "0.3", "--chunk-bytes", "1024"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        wait_for_tmp(cache, slow)
        started = time.monotonic()
        waiter = run(cache, corpus, "--lock-timeout", "0.5", rc=3)
        assert time.monotonic() - started < 10
    finally:
        slow.send_signal(signal.SIGKILL)
        slow.wait(10)
    message = waiter["error"]
    key = cache_key(corpus, ByteTokenizer())
    assert str(cache / f"{key}.lock") in message
    assert f"held by pid {slow.pid}" in message
    assert "lock_timeout_s" in message


def test_flipped_bytes_found_by_the_full_check(tmp_path: Path, corpus: list[Path]) -> None:
    cache = tmp_path / "cache"
    built = run(cache, corpus)
    tokens = cache / f"{built['key']}.tokens"
    raw = bytearray(tokens.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    tokens.write_bytes(bytes(raw))

    # The default size check cannot see a flipped byte: that is what verify="full" is for.
    quick = run(cache, corpus, "--verify", "size")
    assert quick["hit"] is True and quick["read_sha256"] != expected_sha(corpus)

    full = run(cache, corpus, "--verify", "full")
    assert full["hit"] is False
    assert full["read_sha256"] == expected_sha(corpus)
    assert "corrupt" in full["stderr"] and "sha256" in full["stderr"]
    assert run(cache, corpus, "--verify", "full")["hit"] is True


def test_truncated_file_found_by_the_size_check(tmp_path: Path, corpus: list[Path]) -> None:
    cache = tmp_path / "cache"
    built = run(cache, corpus)
    tokens = cache / f"{built['key']}.tokens"
    os.truncate(tokens, tokens.stat().st_size - 10)

    rebuilt = run(cache, corpus, "--verify", "size")
    assert rebuilt["hit"] is False
    assert rebuilt["read_sha256"] == expected_sha(corpus)
    assert "corrupt" in rebuilt["stderr"] and "bytes" in rebuilt["stderr"]


def test_garbled_manifest_is_rebuilt(tmp_path: Path, corpus: list[Path]) -> None:
    cache = tmp_path / "cache"
    built = run(cache, corpus)
    (cache / f"{built['key']}.json").write_text('{"format": 1, "key": ')
    rebuilt = run(cache, corpus, "--verify", "size")
    assert rebuilt["hit"] is False and rebuilt["read_sha256"] == expected_sha(corpus)
    assert "not valid JSON" in rebuilt["stderr"]


# -- bad input, in this process ------------------------------------------------------------------
def test_missing_source_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(TokenCacheError, match=rf"cannot read source {missing}"):
        open_tokens([missing], ByteTokenizer(), tmp_path / "cache")
    with pytest.raises(TokenCacheError, match="no sources"):
        open_tokens([], ByteTokenizer(), tmp_path / "cache")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(TokenCacheError, match="not a regular file"):
        open_tokens([fifo], ByteTokenizer(), tmp_path / "cache")


def test_unwritable_cache_dir_is_named(tmp_path: Path, corpus: list[Path]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    # A path under a regular file: unwritable even for root, who writes through chmod.
    with pytest.raises(TokenCacheError, match=r"token cache directory .*file/cache.*failed"):
        open_tokens(corpus, ByteTokenizer(), blocker / "cache")


def test_committed_cache_opens_from_a_read_only_dir(tmp_path: Path, corpus: list[Path]) -> None:
    cache = tmp_path / "cache"
    built = open_tokens(corpus, ByteTokenizer(), cache)
    (cache / f"{built.key}.lock").unlink()  # a copy of the cache shipped without its lock
    os.chmod(cache, 0o555)
    try:
        again = open_tokens(corpus, ByteTokenizer(), cache, verify="full")
    finally:
        os.chmod(cache, 0o755)
    assert again.hit and np.array_equal(again.tokens, built.tokens)
    assert not (cache / f"{built.key}.lock").exists()


def test_empty_source_and_wide_vocabulary(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    cache = open_tokens([empty], ByteTokenizer(), tmp_path / "cache")
    assert len(cache) == 0 and not cache.hit
    assert open_tokens([empty], ByteTokenizer(), tmp_path / "cache").hit

    class Wide(ByteTokenizer):
        name = "wide"
        vocab_size = 70_000

        def encode(self, text: str) -> list[int]:
            return [b + 65_536 for b in text.encode()]

    src = tmp_path / "s.txt"
    src.write_text("abc\n")
    wide = open_tokens([src], Wide(), tmp_path / "cache")
    assert wide.tokens.dtype == np.dtype("<u4")
    assert wide.tokens.tolist() == [65_536 + b for b in b"abc\n"]


def test_ids_outside_the_vocabulary_are_refused(tmp_path: Path) -> None:
    class Liar(ByteTokenizer):
        name = "liar"
        vocab_size = 100

    src = tmp_path / "s.txt"
    src.write_text("zzz\n")  # 'z' is 122
    with pytest.raises(TokenCacheError, match=r"outside \[0, 100\)"):
        open_tokens([src], Liar(), tmp_path / "cache")
    assert leftovers(tmp_path / "cache") == []


def corpus_bytes(sources: list[Path]) -> int:
    return sum(f.stat().st_size for s in sources for f in (s.rglob("*") if s.is_dir() else [s]))


def test_a_restart_reads_no_source_to_find_its_cache(tmp_path: Path, corpus: list[Path]) -> None:
    """The corpus is hashed once per file identity: a later process (a restarted rank, a
    backfilled node on the same volume) stats the sources and opens the cache."""
    cache = tmp_path / "cache"
    first = run(cache, corpus)
    assert first["hit"] is False
    assert first["hashed_bytes"] == corpus_bytes(corpus)
    again = run(cache, corpus)
    assert again["hit"] is True
    assert again["hashed_bytes"] == 0
    assert again["key"] == first["key"] == cache_key(corpus, ByteTokenizer(), cache)
    assert again["read_sha256"] == expected_sha(corpus)


def test_an_edit_behind_a_restored_mtime_is_still_seen(tmp_path: Path, corpus: list[Path]) -> None:
    """Same size, mtime put back: the inode's ctime moved, so the file is hashed again and a
    new cache holds the new bytes."""
    cache = tmp_path / "cache"
    first = run(cache, corpus)
    victim = corpus[0]
    st = victim.stat()
    data = bytearray(victim.read_bytes())
    data[0:4] = b"LINE"
    victim.write_bytes(bytes(data))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert victim.stat().st_mtime_ns == st.st_mtime_ns and victim.stat().st_size == st.st_size
    second = run(cache, corpus)
    assert second["hit"] is False
    assert second["key"] != first["key"]
    assert second["hashed_bytes"] == victim.stat().st_size  # only the edited file
    assert second["read_sha256"] == expected_sha(corpus)


def test_unreadable_or_wrong_digests_never_give_wrong_tokens(
    tmp_path: Path, corpus: list[Path]
) -> None:
    cache = tmp_path / "cache"
    run(cache, corpus)
    entries = sorted((cache / "digests").glob("*.json"))
    assert len(entries) == 3  # one per source file
    # Garbage: ignored, the file is hashed again.
    entries[0].write_text("{not json")
    assert run(cache, corpus)["hit"] is True
    # A well-formed entry with another file's digest: the key it gives has no cache, and the
    # build, which hashes each source as it reads it, refuses to commit under it.
    for entry in entries:
        record = json.loads(entry.read_text())
        record["sha256"] = "0" * 64
        entry.write_text(json.dumps(record))
    out = run(cache, corpus, rc=3)
    assert "changed between hashing and tokenizing" in out["error"]
    # ... and drops the stale digest, so the next open hashes that file and succeeds.
    healed = run(cache, corpus)
    assert healed["read_sha256"] == expected_sha(corpus)


def test_a_read_only_cache_dir_still_opens_without_recording_digests(
    tmp_path: Path, corpus: list[Path]
) -> None:
    cache = tmp_path / "cache"
    run(cache, corpus)
    for entry in (cache / "digests").glob("*.json"):
        entry.unlink()
    cache.chmod(0o555)
    (cache / "digests").chmod(0o555)
    try:
        out = run(cache, corpus)
    finally:
        (cache / "digests").chmod(0o755)
        cache.chmod(0o755)
    assert out["hit"] is True
    assert out["read_sha256"] == expected_sha(corpus)


def test_a_parallel_build_writes_the_serial_bytes(tmp_path: Path, corpus: list[Path]) -> None:
    """Two tokenizing processes on small chunks: the same key, the same token bytes, in
    order, as a serial build."""
    serial = run(tmp_path / "serial", corpus, "--chunk-bytes", "512")
    parallel = run(tmp_path / "parallel", corpus, "--chunk-bytes", "512", "--workers", "2")
    assert serial["processes"] == 1
    assert parallel["processes"] == 2
    assert parallel["key"] == serial["key"]
    assert parallel["read_sha256"] == serial["read_sha256"] == expected_sha(corpus)


def test_a_parallel_build_names_a_bad_source(tmp_path: Path) -> None:
    src = tmp_path / "bad.txt"
    src.write_bytes(b"fine line\n" * 200 + b"\xff\xfe broken\n" + b"more\n" * 50)
    out = run(tmp_path / "cache", [src], "--chunk-bytes", "256", "--workers", "2", rc=3)
    assert "bad.txt is not UTF-8 text (byte 2000)" in out["error"]
    assert leftovers(tmp_path / "cache") == []


class _Unpicklable(ByteTokenizer):
    def __init__(self) -> None:
        self.hook = lambda text: text  # a lambda cannot be pickled


def test_a_tokenizer_that_cannot_be_pickled_runs_serially(
    tmp_path: Path, corpus: list[Path]
) -> None:
    cache = open_tokens(corpus, _Unpicklable(), tmp_path / "cache", workers=4, parallel_min_bytes=0)
    assert cache.manifest["builder"]["processes"] == 1
    data = np.ascontiguousarray(cache.tokens).tobytes()
    assert hashlib.sha256(data).hexdigest() == expected_sha(corpus)

"""The log chunker and the file tail: whole lines, cut by size, time and at the end; the
oldest dropped (and said so) when shipping falls behind; truncation, rotation, the bound."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from spottrain.agent.logship.chunker import DROP_MARKER, Chunker
from spottrain.agent.logship.tail import FileTail


def _all(c: Chunker) -> list[bytes]:
    out = []
    while (chunk := c.take()) is not None:
        out.append(chunk)
    return out


def test_chunks_hold_whole_lines_cut_by_size_by_time_and_at_flush() -> None:
    c = Chunker(chunk_s=10, chunk_bytes=100, backlog_bytes=10_000)
    line = b"x" * 39 + b"\n"  # 40 bytes
    # Split anywhere: lines are put back together before they count.
    data = line * 3
    c.feed(data[:7], now=0.0)
    c.feed(data[7:95], now=1.0)
    assert c.take() is None and c.due_in(1.5) == 9.5  # its first line was whole at 1.0
    c.feed(data[95:], now=2.0)
    # The third line would pass 100 bytes: two lines are cut, the third opens the next.
    assert _all(c) == [line * 2]
    c.tick(11.9)
    assert c.take() is None
    c.tick(12.0)  # ten seconds after its first line, read at 2.0
    assert _all(c) == [line]
    assert c.due_in(12.0) is None
    # A line longer than a chunk is cut in pieces, each ending in a newline.
    c.feed(b"y" * 250, now=20.0)
    assert _all(c) == [b"y" * 99 + b"\n", b"y" * 99 + b"\n"]
    # At the end, the last partial line goes too, with a newline.
    c.feed(b"end", now=21.0)
    c.flush()
    assert _all(c) == [b"y" * 52 + b"end\n"]
    assert not c.pending and c.dropped_total == 0


def test_a_full_backlog_drops_the_oldest_whole_chunks_and_the_next_says_how_many() -> None:
    c = Chunker(chunk_s=10, chunk_bytes=100, backlog_bytes=250)
    lines = [f"{i:09d}\n".encode() * 10 for i in range(6)]  # 100 bytes: one chunk each
    for i, chunk in enumerate(lines):
        c.feed(chunk, now=float(i))
    assert c.held <= 250
    assert c.dropped_total == 400  # four oldest chunks gone, the newest two kept
    first, second = _all(c)
    marker = DROP_MARKER.format(n=400).encode()
    assert first == marker + lines[4]
    assert marker == (
        b"[spottrain] 400 bytes of this node's output were dropped: shipping fell behind\n"
    )
    assert second == lines[5]  # said once
    # A chunk put back (its upload abandoned) is shipped first next time, unmarked again.
    c.put_back(second)
    assert c.take() == second


def test_the_tail_follows_truncation_rotation_and_keeps_the_file_bounded(
    tmp_path: Path,
) -> None:
    path = tmp_path / "node.log"
    tail = FileTail(str(path))
    assert tail.read() == b""  # not there yet
    path.write_bytes(b"one\n")
    assert tail.read() == b"one\n"
    with path.open("ab") as f:
        f.write(b"two\n")
    assert tail.read() == b"two\n" and tail.read() == b""
    path.write_bytes(b"3\n")  # truncated and rewritten by someone else
    assert tail.read() == b"3\n"
    # Rotated: the old file's last lines first, then the new file from its start.
    with path.open("ab") as f:
        f.write(b"last of old\n")
    os.rename(path, tmp_path / "node.log.1")
    path.write_bytes(b"new\n")
    assert tail.read() == b"last of old\n"
    assert tail.read() == b"new\n"  # the old file is done: on to the new one
    tail.close()

    bounded = FileTail(str(path), max_bytes=10)
    writer = os.open(path, os.O_WRONLY | os.O_APPEND)  # as systemd's append: holds it
    os.write(writer, b"0123456789\n")
    assert bounded.read() == b"new\n0123456789\n"
    assert bounded.read() == b"" and path.stat().st_size == 0 and bounded.truncations == 1
    os.write(writer, b"after\n")  # the writer's next line lands at the new start
    os.close(writer)
    assert bounded.read() == b"after\n"
    bounded.close()


@pytest.mark.parametrize("chunk_bytes", [1, 2])
def test_the_smallest_chunks_still_cut_an_endless_line_and_end(chunk_bytes: int) -> None:
    """A one-byte chunk once cut nothing off an endless line, forever, holding the lock."""
    c = Chunker(chunk_s=10, chunk_bytes=chunk_bytes, backlog_bytes=10_000)
    fed = threading.Thread(target=c.feed, args=(b"abc", 0.0), daemon=True)
    fed.start()
    fed.join(timeout=30)
    assert not fed.is_alive(), "feed never returned"
    c.flush()
    assert b"".join(_all(c)).replace(b"\n", b"") == b"abc"


def test_a_chunk_of_no_bytes_is_refused() -> None:
    with pytest.raises(ValueError, match="holds nothing"):
        Chunker(chunk_s=10, chunk_bytes=0, backlog_bytes=10)

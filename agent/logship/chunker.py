"""Bytes of a node's output in, chunks of whole lines out: cut by size, by time and at the
end, held in a bounded backlog that drops its oldest chunks when shipping falls behind.

Pure and thread-safe: the tail thread feeds it, the upload thread takes from it, and the
tests drive both with a clock of their own."""

from __future__ import annotations

import threading
from collections import deque

DROP_MARKER = "[spottrain] {n} bytes of this node's output were dropped: shipping fell behind\n"


class Chunker:
    """Cuts a stream of bytes into chunks of whole lines.

    A chunk is cut when the next line would take it past ``chunk_bytes``, when
    ``chunk_s`` have passed since its first line (:meth:`tick`), and at :meth:`flush`.
    A line longer than ``chunk_bytes`` is cut at ``chunk_bytes`` (its pieces each end in a
    newline), so neither a chunk nor the memory held grows without bound. Cut chunks wait
    in a backlog of at most ``backlog_bytes`` (with the chunk being filled): past it the
    oldest are dropped, and the next chunk taken starts with :data:`DROP_MARKER`.
    """

    def __init__(self, chunk_s: float, chunk_bytes: int, backlog_bytes: int) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"a chunk of {chunk_bytes} bytes holds nothing: give at least 1")
        self.chunk_s = chunk_s
        self.chunk_bytes = chunk_bytes
        self.backlog_bytes = backlog_bytes
        self._lock = threading.Lock()
        self._open = bytearray()
        self._partial = bytearray()
        self._first_at: float | None = None
        self._ready: deque[bytes] = deque()
        self._ready_bytes = 0
        self._dropped = 0  # bytes dropped since the last chunk taken
        self.dropped_total = 0

    # -- the tail's side --------------------------------------------------------------------
    def feed(self, data: bytes, now: float) -> None:
        """Add bytes read from the node's output (any split: lines are put back together)."""
        if not data:
            return
        with self._lock:
            self._partial += data
            while True:
                nl = self._partial.find(b"\n")
                if nl >= 0:
                    line = bytes(self._partial[: nl + 1])
                    del self._partial[: nl + 1]
                elif len(self._partial) >= self.chunk_bytes:
                    # An endless line: cut a chunk's worth, marked by a newline; at least a
                    # byte of it, or a one-byte chunk would cut nothing, forever.
                    piece = max(1, self.chunk_bytes - 1)
                    line = bytes(self._partial[:piece]) + b"\n"
                    del self._partial[:piece]
                else:
                    break
                self._add_line(line, now)
            self._cut_if_due(now)
            self._trim()

    def tick(self, now: float) -> None:
        """Cut the chunk being filled if its first line is ``chunk_s`` old."""
        with self._lock:
            self._cut_if_due(now)
            self._trim()

    def due_in(self, now: float) -> float | None:
        """Seconds until the chunk being filled must be cut; ``None``: it holds no line."""
        with self._lock:
            if self._first_at is None:
                return None
            return max(0.0, self._first_at + self.chunk_s - now)

    def flush(self) -> None:
        """Cut everything held, a last line without its newline included (with one)."""
        with self._lock:
            if self._partial:
                self._open += bytes(self._partial) + b"\n"
                self._partial.clear()
            self._cut()
            self._trim()

    # -- the uploader's side ----------------------------------------------------------------
    def take(self) -> bytes | None:
        """The oldest cut chunk (with the drop marker first when chunks were dropped), or
        ``None`` when none is ready."""
        with self._lock:
            if not self._ready:
                return None
            data = self._ready.popleft()
            self._ready_bytes -= len(data)
            if self._dropped:
                data = DROP_MARKER.format(n=self._dropped).encode() + data
                self._dropped = 0
            return data

    def put_back(self, data: bytes) -> None:
        """Return a taken chunk to the front (its upload is abandoned for now)."""
        with self._lock:
            self._ready.appendleft(data)
            self._ready_bytes += len(data)
            self._trim()

    @property
    def held(self) -> int:
        """Unshipped bytes held: cut chunks, the chunk being filled and a partial line."""
        with self._lock:
            return self._ready_bytes + len(self._open) + len(self._partial)

    @property
    def pending(self) -> bool:
        """Whether any output is held (cut or not)."""
        return self.held > 0

    # -- inside the lock --------------------------------------------------------------------
    def _add_line(self, line: bytes, now: float) -> None:
        if self._open and len(self._open) + len(line) > self.chunk_bytes:
            self._cut()
        if not self._open:
            self._first_at = now
        self._open += line
        if len(self._open) >= self.chunk_bytes:
            self._cut()

    def _cut_if_due(self, now: float) -> None:
        if self._first_at is not None and now - self._first_at >= self.chunk_s:
            self._cut()

    def _cut(self) -> None:
        if self._open:
            self._ready.append(bytes(self._open))
            self._ready_bytes += len(self._open)
            self._open.clear()
        self._first_at = None

    def _trim(self) -> None:
        # Drop whole chunks, oldest first: what reaches the store stays whole lines, and
        # the newest output (closest to whatever went wrong) is what is kept.
        while self._ready and self._ready_bytes + len(self._open) > self.backlog_bytes:
            gone = self._ready.popleft()
            self._ready_bytes -= len(gone)
            self._dropped += len(gone)
            self.dropped_total += len(gone)

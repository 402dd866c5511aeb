"""Following the file a node's output is appended to: from its start (a new VM's file
holds only this VM's output), through truncation and rotation, and keeping it bounded."""

from __future__ import annotations

import contextlib
import json
import os
from typing import BinaryIO

READ_BYTES = 1 << 20


class FileTail:
    """New bytes of ``path``, read in order.

    - A file that does not exist yet is waited for (the first :meth:`read` returns ``b""``).
    - Truncated under us (shorter than what was read): read again from its start.
    - Rotated (``path`` is another file now): the old file is read to its end first.
    - ``max_bytes`` > 0: once everything written has been read and the file is past it, it
      is truncated to nothing, so a week of output cannot fill the VM's disk. Its writer
      appends (systemd's ``append:``, the local VM's ``O_APPEND``), so its next line lands at
      the new start; a line written between our last read and the truncation (one system
      call apart) is lost, which is the price of bounding a file another process appends to.
    """

    def __init__(self, path: str, max_bytes: int = 0) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._f: BinaryIO | None = None
        self._ino: int | None = None
        self.pos = 0
        self.truncations = 0
        # Where an agent before this one (on this VM) stopped, having shipped everything.
        self._resume = _load_mark(self.mark_path)

    @property
    def mark_path(self) -> str:
        return self.path + ".shipped"

    def mark_shipped(self) -> None:
        """Record that everything read so far is shipped: an agent restarted on this VM
        (systemd's Restart=) goes on from here instead of shipping the file again."""
        if self._ino is None:
            return
        with contextlib.suppress(OSError):
            tmp = self.mark_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"ino": self._ino, "pos": self.pos}, f)
            os.replace(tmp, self.mark_path)

    def read(self, limit: int = READ_BYTES) -> bytes:
        """Up to ``limit`` new bytes (``b""``: none yet)."""
        if self._f is None and not self._open():
            return b""
        assert self._f is not None
        try:
            size = os.fstat(self._f.fileno()).st_size
        except OSError:
            self.close()
            return b""
        if size < self.pos:
            self.pos = 0  # truncated by someone else: it starts again
        if size == self.pos:
            if self._rotated():
                self.close()
                return self.read(limit)
            self._bound(size)
            return b""
        self._f.seek(self.pos)
        data = self._f.read(min(limit, size - self.pos))
        self.pos += len(data)
        return data

    def close(self) -> None:
        if self._f is not None:
            with contextlib.suppress(OSError):
                self._f.close()
        self._f = None
        self._ino = None
        self.pos = 0

    def _open(self) -> bool:
        try:
            # Writable only when this tail bounds the file (ftruncate needs it).
            self._f = open(self.path, "r+b" if self.max_bytes else "rb")  # noqa: SIM115
        except OSError:
            return False
        st = os.fstat(self._f.fileno())
        self._ino = st.st_ino
        mark, self._resume = self._resume, None
        # The same file, not shorter than when it was marked: skip what was shipped.
        self.pos = mark[1] if mark and mark[0] == st.st_ino and mark[1] <= st.st_size else 0
        return True

    def _rotated(self) -> bool:
        try:
            return os.stat(self.path).st_ino != self._ino
        except OSError:
            return False  # gone for now: keep the file we hold until another appears

    def _bound(self, size: int) -> None:
        if not self.max_bytes or size < self.max_bytes or self._f is None:
            return
        try:
            os.ftruncate(self._f.fileno(), 0)
        except OSError:
            return
        self.pos = 0
        self.truncations += 1


def _load_mark(path: str) -> tuple[int, int] | None:
    try:
        with open(path) as f:
            mark = json.load(f)
        return int(mark["ino"]), int(mark["pos"])
    except (OSError, ValueError, KeyError, TypeError):
        return None

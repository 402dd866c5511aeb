"""Durable file writes, once for the whole house: fsync a file or a directory, and replace a
file atomically (a reader sees the old content or the new, never a torn one)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import IO


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the directory's entries (a rename, a new file) reach the disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_beside(path: Path) -> Path:
    """A temporary name in the same directory (a rename across file systems is not atomic),
    unique per host and process: VMs sharing a volume never write the same one."""
    return path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")


def atomic_write(
    path: str | os.PathLike[str],
    data: bytes | str | Callable[[IO[bytes]], object],
    *,
    durable: bool = True,
) -> None:
    """Replace ``path`` with ``data`` (bytes, text, or a function writing to a binary file).

    With ``durable`` the content is fsynced before the rename and the directory after it, so
    a crash leaves the old file or the new one; without it, readers still never see a torn
    file but a crash may lose the update.
    """
    dest = Path(path)
    tmp = temp_beside(dest)
    try:
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    if durable:
        fsync_dir(dest.parent)

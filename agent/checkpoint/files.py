"""Durable writes and names on the checkpoint directory, and its errors."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from .failpoints import failpoint


class CheckpointDirError(OSError):
    """The checkpoint directory cannot be used; the message says why and what to do."""


class StaleCommitError(RuntimeError):
    """A commit from an older generation than the one now training was refused: a newer
    fencing epoch was claimed in the directory, or Redis says a newer round trains."""


def describe_os_error(exc: OSError, root: Path, doing: str) -> str:
    """One plain sentence for an I/O failure on the checkpoint directory."""
    if exc.errno == errno.ENOSPC or exc.errno == errno.EDQUOT:
        why = "it is full (no space left on the device)"
        fix = "free space or point the checkpoint directory at a larger volume"
    elif exc.errno == errno.EROFS:
        why = "it is on a read-only file system"
        fix = "remount it read-write or point the checkpoint directory elsewhere"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        why = "this user may not write there (permission denied)"
        fix = "fix its owner or mode, or point the checkpoint directory elsewhere"
    elif exc.errno == errno.ENOENT:
        why = "it does not exist"
        fix = "mount the checkpoint volume there or create the directory"
    else:
        why = exc.strerror or str(exc)
        fix = "check the volume"
    return f"checkpoint directory {root}: {doing} failed because {why}; {fix}"


def write_file_durably(path: Path, data: bytes, *, failpoint_name: str | None = None) -> None:
    """Write ``data`` to ``path`` and fsync it (the directory entry is the caller's job)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        half = len(view) // 2
        if failpoint_name is not None:
            # Half of it on disk, then the failpoint: a torn write, as a crash leaves it.
            _write_all(fd, view[:half])
            os.fsync(fd)
            failpoint(failpoint_name)
            view = view[half:]
        _write_all(fd, view)
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        n = os.write(fd, view)
        view = view[n:]


def step_name(step: int) -> str:
    return f"step-{step:09d}"


def writer_tag(round_: int, epoch: int) -> str:
    """How a writer's temporary names say who wrote them: its epoch, or its round if none."""
    return f"e{epoch}" if epoch >= 0 else f"r{round_}"

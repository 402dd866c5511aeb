"""The one-builder lock: an exclusive ``flock`` on ``<key>.lock``."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator

from .format import Paths, TokenCacheError, dir_error


@contextlib.contextmanager
def exclusive(paths: Paths, timeout_s: float) -> Iterator[None]:
    try:
        fd = os.open(paths.lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise dir_error(paths.root, exc, f"creating the lock file {paths.lock.name}") from exc
    try:
        deadline = time.monotonic() + timeout_s
        delay = 0.01
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                # Polling rather than a blocking flock: a blocking one cannot time out.
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TokenCacheError(_timeout_message(paths, timeout_s)) from None
                time.sleep(min(delay, left))
                delay = min(delay * 2, 0.5)
        # Who holds it, for the timeout message of those who wait; the lock file itself is
        # never removed, since a waiter may hold a descriptor to it.
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the flock


def _timeout_message(paths: Paths, timeout_s: float) -> str:
    try:
        holder = json.loads(paths.lock.read_text())
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder["since"])))
        who = f"held by pid {holder['pid']} on host {holder['host']} since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        who = "its holder unknown"
    return (
        f"timed out after {timeout_s:g} s waiting for the token cache lock {paths.lock} "
        f"({who}). Another process is building this cache: if it is still working, raise "
        "lock_timeout_s above the time a build takes; if it is gone and the lock stays taken "
        "(a file system that does not release the locks of dead processes, as some NFS "
        "setups), make sure no process builds this key and delete the lock file"
    )

"""Knowing a run's own processes for certain before signalling one.

A pid alone names nothing for long: a process that ended leaves its pid free for the next
one, and a command line that says "spottrain" may be an editor on ``spottrain-ideas.md``.
A run's process (its embedded Redis, its controller) is recorded when it starts as a
:class:`ProcessMark`: its pid, its start time in clock ticks since boot (field 22 of
``/proc/PID/stat``), the boot it started in, and the run's marker it carries where it can
carry one (the run id as an element of its argv, or the run's folder as its working
directory). Only a
process that matches every part of its mark is signalled, and through a pidfd opened
before the check where the kernel has them, so the pid cannot change hands between the
check and the signal.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from spottrain.fileio import atomic_write


@dataclass(frozen=True)
class ProcessMark:
    """Who a run's process is: pid, start time (ticks since boot), boot id, the run's
    marker, and the host it runs on (said in messages; a mark is checked on its own host
    only)."""

    pid: int
    start: int
    boot: str
    marker: str
    host: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Any) -> ProcessMark | None:
        """A mark read back from a record; None for anything that is not a whole one."""
        if not isinstance(raw, dict):
            return None
        try:
            mark = cls(
                pid=int(raw["pid"]),
                start=int(raw["start"]),
                boot=str(raw["boot"]),
                marker=str(raw["marker"]),
                host=str(raw.get("host", "")),
            )
        except (KeyError, TypeError, ValueError):
            return None
        return mark if mark.pid > 0 and mark.start > 0 else None

    def describe(self) -> str:
        return f"pid {self.pid}" + (f" on {self.host}" if self.host else "")


def boot_id() -> str:
    """This boot's id (a reboot starts the tick count again, and may reuse every pid)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot); None when it is gone or a zombie."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    # The command name (field 2) may hold spaces and parentheses: fields follow the last ')'.
    fields = raw[raw.rfind(")") + 2 :].split()
    if len(fields) < 20 or fields[0] == "Z":
        return None
    return int(fields[19])


def carries_marker(pid: int, marker: str) -> bool:
    """Whether ``pid`` carries ``marker``: as a whole argv element (a background controller's
    run id), or as its working directory (a redis-server works in the run's ``redis/``
    folder and overwrites its argv and environment with its title). An empty marker: a
    process that could carry none (a foreground ``spottrain up``, whose run id was made
    after it started); its start time alone names it."""
    if not marker:
        return True
    try:
        if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
            return True
        return os.readlink(f"/proc/{pid}/cwd") == marker
    except OSError:
        return False


def mark_process(pid: int, marker: str) -> ProcessMark | None:
    """The mark of the running ``pid`` (None: gone, or it does not carry ``marker``)."""
    start = start_ticks(pid)
    if start is None or not carries_marker(pid, marker):
        return None
    return ProcessMark(pid, start, boot_id(), marker, socket.gethostname())


def is_running(mark: ProcessMark) -> bool:
    """Whether the very process ``mark`` names still runs on this machine."""
    if mark.host and mark.host != socket.gethostname():
        return False
    if mark.boot != boot_id() or start_ticks(mark.pid) != mark.start:
        return False
    return carries_marker(mark.pid, mark.marker)


def write_mark(path: Path, mark: ProcessMark) -> None:
    atomic_write(path, json.dumps(mark.as_dict()), durable=False)


def read_mark(path: Path) -> ProcessMark | None:
    try:
        return ProcessMark.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def end_process(mark: ProcessMark, *, grace_s: float = 5.0, kill: bool = True) -> bool:
    """SIGTERM the process ``mark`` names, wait up to ``grace_s`` for it to end, then (with
    ``kill``) SIGKILL it. A process that does not match the mark is never signalled.

    Returns:
        True when the marked process is gone (or was not there), False when it still runs.
    """
    pidfd = _open_pidfd(mark.pid)
    try:
        # Checked after the pidfd is open: the pidfd names the process that was checked.
        if not is_running(mark):
            return True
        _signal(mark.pid, pidfd, signal.SIGTERM)
        if _wait_gone(mark, pidfd, grace_s):
            return True
        if not kill:
            return False
        if pidfd is None and not is_running(mark):
            return True
        _signal(mark.pid, pidfd, signal.SIGKILL)
        return _wait_gone(mark, pidfd, grace_s)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _open_pidfd(pid: int) -> int | None:
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return int(opener(pid))
    except OSError:
        return None  # gone already (checked again by the caller), or no pidfd here


def _signal(pid: int, pidfd: int | None, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        sender = getattr(signal, "pidfd_send_signal", None)
        if pidfd is not None and sender is not None:
            sender(pidfd, sig)
        else:
            os.kill(pid, sig)


def _wait_gone(mark: ProcessMark, pidfd: int | None, timeout_s: float) -> bool:
    """Wait until the process ends: a pidfd turns readable when it does; without one, its
    mark is looked at again every 50 ms."""
    if pidfd is not None:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        return bool(poller.poll(int(timeout_s * 1000)))
    deadline = time.monotonic() + timeout_s
    while is_running(mark):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True

"""One VM of the local cloud: a process that boots, runs its boot command, and dies the way a
cloud VM does.

``python -m spottrain.cloud.local.vm RECORD`` is started by
:class:`spottrain.cloud.local.compute.LocalProvider` in a session of its own, so it outlives the
controller that launched it (as a real VM outlives a laptop going to sleep). It:

1. stays ``pending`` for the launch latency, then is ``running``;
2. runs the boot command (the agent, for a job), its output appended to the VM's log;
3. after the boot command exits, idles like a VM whose service stopped, until deleted;
4. on SIGTERM (a delete), SIGUSR1 (a preemption with notice) or SIGUSR2 (a shutdown from
   inside: its agent ending its own VM, ``$SPOTTRAIN_LOCAL_VM_PID`` names this process) does
   what systemd does at shutdown: SIGTERM to the boot command only, then SIGKILL to
   everything left after the grace period (the notice window), and records the end.

A preemption without notice never reaches this process: the provider SIGKILLs the VM and
everything under it at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from spottrain.cloud.local.records import RecordStore
from spottrain.process_group import child_pids, descendants
from spottrain.protocol.env import ENV_LOCAL_VM_PID, ENV_LOGS_FILE, ENV_VM_ID


class _Stop:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.interrupted = False
        self.reason = ""

    def request(self, interrupted: bool, reason: str) -> None:
        if self.event.is_set():
            # A preemption may overtake a delete in flight: record it, keep the first deadline.
            self.interrupted = self.interrupted or interrupted
            return
        self.interrupted = interrupted
        self.reason = reason
        self.event.set()


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every descendant, as a VM's death does (torchrun's workers live in
    sessions of their own, so a process group does not reach them).

    Every process is frozen first, again and again until no new one appears, so nothing
    forks a survivor between the look and the kill.
    """
    frozen: set[int] = set()
    while True:
        found = {pid, *descendants(pid)} - frozen
        if not found:
            break
        for p in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGSTOP)
        frozen |= found
    for p in frozen:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


_PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> None:
    """Adopt our orphans, as a VM's init does: a worker whose parent exited (torchrun's
    workers live in sessions of their own) stays ours to kill when the VM dies."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _reap_orphans(keep: int | None) -> None:
    """Collect adopted orphans that exited (never the boot command: Popen reaps that one)."""
    for pid in child_pids().get(os.getpid(), []):
        if pid != keep:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)


def run_vm(record_path: Path) -> int:
    _become_subreaper()
    store = RecordStore(record_path.parent.parent)
    vm_id = record_path.stem
    rec = store.read(vm_id)
    stop = _Stop()
    signal.signal(signal.SIGTERM, lambda *_: stop.request(False, "deleted"))
    signal.signal(signal.SIGUSR1, lambda *_: stop.request(True, "preempted"))
    # A shutdown from inside the VM (its agent's dead man's switch): it ends like a delete.
    signal.signal(signal.SIGUSR2, lambda *_: stop.request(False, "shut down by its agent"))

    boot: dict[str, Any] = json.loads(rec["user_data"] or "{}")
    grace = float(rec["grace_s"])
    if stop.event.wait(float(rec["launch_latency_s"])):
        store.update(vm_id, state="terminated", reason=stop.reason, interrupted=stop.interrupted)
        return 0
    store.update(vm_id, state="running", running_at=time.time())

    child: subprocess.Popen[bytes] | None = None
    argv = boot.get("argv") or []
    if argv:
        log_path = store.log_path(vm_id)
        env = {**os.environ, **{str(k): str(v) for k, v in (boot.get("env") or {}).items()}}
        env[ENV_LOCAL_VM_PID] = str(os.getpid())  # how the VM's agent ends it
        # The console file is what its agent ships (as a cloud VM's unit file), named by
        # this VM's id, as the controller records it.
        env.setdefault(ENV_LOGS_FILE, str(log_path))
        env.setdefault(ENV_VM_ID, vm_id)
        with open(log_path, "ab") as log:
            child = subprocess.Popen(
                [str(a) for a in argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=boot.get("cwd") or None,
            )
        store.update(vm_id, boot_pid=child.pid)

    # Wait for a stop, noting when the boot command exits (the VM itself keeps running).
    while not stop.event.wait(0.2):
        _reap_orphans(child.pid if child is not None else None)
        if child is not None and child.poll() is not None:
            store.update(vm_id, boot_exit=child.returncode)
            child = None

    store.update(vm_id, state="stopping", reason=stop.reason, interrupted=stop.interrupted)
    deadline = time.monotonic() + grace
    if child is not None and child.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGTERM)
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if child.poll() is not None:
            store.update(vm_id, boot_exit=child.returncode)
    # Whatever outlived the grace period (or the boot command's children) dies with the VM.
    for p in descendants(os.getpid()):
        kill_tree(p)
    _reap_orphans(None)
    store.update(
        vm_id,
        state="terminated",
        reason=stop.reason,
        interrupted=stop.interrupted,
        ended_at=time.time(),
    )
    return 0


def spawn(record_path: Path, log_path: Path) -> int:
    """Fork the VM into a session of its own and print its pid.

    The launcher exits at once and the VM is adopted by init, which reaps it when it ends:
    a controller that launched hundreds of VMs collects no zombies, and its own children's
    exit statuses stay its own.
    """
    pid = os.fork()
    if pid:
        print(pid, flush=True)
        return 0
    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.close(null)
    try:
        code = run_vm(record_path)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 3 and args[0] == "--spawn":
        return spawn(Path(args[1]), Path(args[2]))
    if len(args) != 1:
        print(
            "usage: python -m spottrain.cloud.local.vm [--spawn RECORD.json LOG] RECORD.json",
            file=sys.stderr,
        )
        return 2
    return run_vm(Path(args[0]))


if __name__ == "__main__":
    raise SystemExit(main())

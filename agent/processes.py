"""Processes on this machine: torchrun's command line, checking which of a process tree
still run (the tree itself: :mod:`spottrain.process_group`), and the unprivileged user the
workers run as on a VM."""

from __future__ import annotations

import os
import pwd
import stat
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


def torchrun_command(
    *,
    script: str,
    script_args: Sequence[str],
    rdzv_endpoint: str,
    run_id: str,
    nnodes: str,
    backend: str = "redis",
    nproc_per_node: int = 1,
    max_restarts: int = 100,
    rdzv_conf: Mapping[str, object] | None = None,
    local_addr: str = "127.0.0.1",
    monitor_interval: float = 0.1,
) -> list[str]:
    """The torchrun command line of one node (using this interpreter's torchrun)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        f"--rdzv-backend={backend}",
        f"--rdzv-endpoint={rdzv_endpoint}",
        f"--rdzv-id={run_id}",
        f"--max-restarts={max_restarts}",
        f"--monitor-interval={monitor_interval}",
        f"--local-addr={local_addr}",
    ]
    if rdzv_conf:
        cmd.append("--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in rdzv_conf.items()))
    return [*cmd, script, *script_args]


def running(pids: Iterable[int]) -> list[int]:
    """The processes of ``pids`` that still run (zombies, which only wait to be reaped, and
    vanished ones excluded), sorted."""
    alive = []
    for pid in sorted(set(pids)):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        # The command name is in parentheses and may itself contain spaces or parentheses.
        if stat[stat.rfind(")") + 2 :].split()[0] != "Z":
            alive.append(pid)
    return alive


@dataclass(frozen=True)
class WorkerUser:
    """The unprivileged account torchrun and the training processes run as, when the agent
    runs as root (on a VM, under systemd): the job's code, the largest and least trusted part
    of a node, then cannot read the node's secrets, change the agent's venv or the system.

    Build it with :func:`resolve_worker_user`.
    """

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str

    def popen_kwargs(self) -> dict[str, Any]:
        """``subprocess.Popen`` arguments that start the child as this user, with its primary
        and supplementary groups (``video``/``render`` where a distribution gates GPUs by
        group) and none of root's."""
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups)}

    def env(self, env: Mapping[str, str]) -> dict[str, str]:
        """``env`` with the login variables of this user: caches that default to ``~``
        (torch hub, Triton, Hugging Face, pip) must not point at root's home."""
        return {**env, "HOME": self.home, "USER": self.name, "LOGNAME": self.name}


def resolve_worker_user(name: str) -> WorkerUser | None:
    """The user named by ``SPOTTRAIN_WORKER_USER``, or None when the workers stay as the agent.

    Dropping privileges needs root; an agent that already runs as ``name`` has nothing to
    drop (the local cloud, or a unit with ``User=``).

    Raises:
        ValueError: The user does not exist, is root, or the agent is neither root nor that
            user (the message says what to change).
    """
    if not name:
        return None
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise ValueError(
            f"SPOTTRAIN_WORKER_USER={name}: no such user on this machine; create it "
            f"(`useradd --system --user-group {name}`, as the boot script does) or set "
            "SPOTTRAIN_WORKER_USER= (empty) to run the workers as the agent's own user"
        ) from None
    if entry.pw_uid == 0:
        raise ValueError(
            f"SPOTTRAIN_WORKER_USER={name} is root: name an unprivileged user, or set it "
            "empty to keep the workers as the agent's own user"
        )
    if os.geteuid() == entry.pw_uid:
        return None
    if os.geteuid() != 0:
        raise ValueError(
            f"SPOTTRAIN_WORKER_USER={name}: only an agent running as root can start the "
            f"workers as another user (this one runs as uid {os.geteuid()}); run the agent "
            "as root, or set SPOTTRAIN_WORKER_USER= (empty)"
        )
    groups = tuple(g for g in os.getgrouplist(name, entry.pw_gid) if g != entry.pw_gid)
    return WorkerUser(name, entry.pw_uid, entry.pw_gid, groups, entry.pw_dir)


def hand_over(root: str, user: WorkerUser) -> None:
    """Make ``root`` and what the agent (as root) made in it the worker user's, so that the
    workers can save checkpoints there and prune old ones (a checkpoint the agent brought in
    from object storage, a directory made by the unit's ``ExecStartPre``).

    A subdirectory the worker user already owns is not walked: only the agent writes as
    root, and it writes whole new entries, so this stays cheap on a volume of large
    checkpoints. Symbolic links are neither followed nor changed, and the walk goes by
    directory descriptors (``os.fwalk``): workers of other nodes share the volume, and a
    directory swapped for a link to ``/etc`` mid-walk must not hand ``/etc`` over.

    Raises:
        OSError: An owner could not be changed (e.g. a network file system that squashes
            root) or ``root`` is not a directory; ``filename`` names the path.
    """
    owner = (user.uid, user.gid)
    for _, dirnames, filenames, dirfd in os.fwalk(root, follow_symlinks=False):
        st = os.fstat(dirfd)
        if (st.st_uid, st.st_gid) != owner:
            os.fchown(dirfd, *owner)
        for name in filenames:
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            if not stat.S_ISLNK(st.st_mode) and (st.st_uid, st.st_gid) != owner:
                os.chown(name, *owner, dir_fd=dirfd, follow_symlinks=False)
        dirnames[:] = [
            name
            for name in dirnames
            if os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_uid != user.uid
        ]

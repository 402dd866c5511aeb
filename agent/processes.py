"""Processes on this machine: torchrun's command line, and finding and checking a process
tree (torchrun puts each worker in a session of its own, so process groups do not reach
them)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, Sequence


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


def child_pids() -> dict[int, list[int]]:
    """Map each process id on this machine to its children (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue  # exited meanwhile
        # The command name is in parentheses and may itself contain spaces or parentheses.
        fields = stat[stat.rfind(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, nearest first."""
    tree = child_pids()
    out: list[int] = []
    todo = list(tree.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(tree.get(p, []))
    return out


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

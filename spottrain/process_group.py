"""Process trees on this machine, read from /proc: each process's children, and every
descendant of a process (torchrun puts each worker in a session of its own, so process groups
do not reach them; walking the tree does)."""

from __future__ import annotations

import os


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

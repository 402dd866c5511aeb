"""Reading the consoles of VMs that have said nothing of their boot: which to read (pure,
:meth:`ConsoleWatch.due`), and what the reads found, kept between passes.

A VM whose boot fails before it can reach Redis (no python3, no route to Redis, a wrong
password file) says why only on its console (``spottrain.protocol.boot``'s lines). The
controller reads the console of a VM launched at least :data:`CONSOLE_AFTER_S` ago whose agent
has not registered and whose boot has not reported, at most every :data:`CONSOLE_EVERY_S` per
VM and at most :data:`CONSOLE_READS_PER_PASS` VMs a pass (a fleet of thousands booting at once
must not cost thousands of API calls a pass), and once more when a VM reaches the boot
timeout, for its last line. A failure line found there is written as the node's boot hash
(``source=console``) by the executor, and the planner decides on it like on any report.

What was read lives in this controller's memory only: a restarted controller reads again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from spottrain.protocol.boot import BootReport
from spottrain.protocol.states import NodeState

from .types import NodeObs

CONSOLE_AFTER_S = 60.0
CONSOLE_EVERY_S = 30.0
CONSOLE_READS_PER_PASS = 16


@dataclass(frozen=True)
class ConsoleRead:
    """One read of a VM's console.

    Attributes:
        at: when it was read (or tried).
        last_line: its last non-empty line ("" for none, or when the read failed).
        report: the node's last boot line on it, if any (``source=console``).
        error: why the read failed ("" when it did not).
    """

    at: float
    last_line: str = ""
    report: BootReport | None = None
    error: str = ""


def _unheard(n: NodeObs) -> bool:
    """A VM that runs and whose agent has not registered, or still boots."""
    return (
        n.instance is not None
        and n.instance.state.alive
        and n.agent_state in (None, NodeState.BOOTING)
        and not (n.boot is not None and n.boot.failed)
    )


@dataclass
class ConsoleWatch:
    """Which consoles to read this pass, and what was read before.

    Args:
        after_s: a VM is read once it has been launched this long with no word of its boot.
        every_s: the same VM is read again at most this often.
        per_pass: the most VMs read in one pass.
    """

    after_s: float = CONSOLE_AFTER_S
    every_s: float = CONSOLE_EVERY_S
    per_pass: int = CONSOLE_READS_PER_PASS
    reads: dict[str, ConsoleRead] = field(default_factory=dict)

    def due(self, nodes: Iterable[NodeObs], now: float, boot_timeout_s: float) -> list[NodeObs]:
        """The nodes whose console to read now, most urgent first, at most ``per_pass``:
        those past the boot timeout and not read since it (their last line goes into the
        reason they are ended with), then those launched ``after_s`` ago with no agent
        record and no boot report, never read before read again, each at most every
        ``every_s``."""
        final: list[NodeObs] = []
        periodic: list[tuple[float, NodeObs]] = []
        for n in nodes:
            if not _unheard(n):
                continue
            last = self.reads.get(n.name)
            timeout_at = n.launched_at + boot_timeout_s
            if now > timeout_at:
                if last is None or last.at < timeout_at:
                    final.append(n)
            elif (
                n.agent_state is None
                and n.boot is None
                and now - n.launched_at >= self.after_s
                and (last is None or now - last.at >= self.every_s)
            ):
                periodic.append((last.at if last is not None else float("-inf"), n))
        final.sort(key=lambda n: (n.launched_at, n.name))
        periodic.sort(key=lambda x: (x[0], x[1].launched_at, x[1].name))
        return [*final, *(n for _, n in periodic)][: self.per_pass]

    def record(self, reads: Mapping[str, ConsoleRead]) -> None:
        """Keep what this pass's reads found."""
        self.reads.update(reads)

    def annotate(self, nodes: Sequence[NodeObs]) -> list[NodeObs]:
        """``nodes`` with what their consoles said (their last line, and their boot as the
        console showed it when the VM reported none, or a failure the VM could not report);
        forgets the nodes that no longer boot."""
        out: list[NodeObs] = []
        keep: dict[str, ConsoleRead] = {}
        for n in nodes:
            read = self.reads.get(n.name)
            if read is None or not _unheard(n):
                out.append(n)
                continue
            keep[n.name] = read
            boot = n.boot
            seen = read.report
            if seen is not None and (boot is None or (seen.failed and not boot.failed)):
                boot = seen
            out.append(replace(n, console=read.last_line or n.console, boot=boot))
        self.reads = keep
        return out

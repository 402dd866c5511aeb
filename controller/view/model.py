"""The live view's input: plain data, read from the run by :mod:`.collect` and drawn by
:mod:`.render` (which does no I/O, so tests build these by hand)."""

from __future__ import annotations

from dataclasses import dataclass, field

from spottrain.controller.reconcile.summary import Summary


@dataclass(frozen=True)
class NodeRow:
    """One live node of the fleet: where its VM is and what its agent says."""

    node: str
    cloud: str
    zone: str
    instance_type: str
    market: str
    state: str


@dataclass(frozen=True)
class EventRow:
    """One entry of the run's event stream, for the view's last few lines."""

    at: float
    node: str
    kind: str
    detail: str


@dataclass(frozen=True)
class ViewData:
    """Everything one frame of the live view shows.

    Attributes:
        step_rate: steps per second over the last half minute (None until two steps were
            seen apart).
        short: how long the fleet has been short of nodes and of what ("" when it is not).
        replica: a replica run's quorum and replica lines (head first, then one per
            replica); empty for an elastic run.
        notes: other lines that must not pass unseen (a refused checkpoint commit).
        boot_failed: the failed-launch streak and each node whose boot reported a failure
            (``n3: boot failed in 'install the environment': pip: ...``), escaped.
        booting: the stage of each node still booting (``n3: booting: fetch the code``).
    """

    run_id: str
    summary: Summary
    nodes: list[NodeRow] = field(default_factory=list)
    step_rate: float | None = None
    elapsed_s: float | None = None
    short: str = ""
    replica: list[str] = field(default_factory=list)
    events: list[EventRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    boot_failed: list[str] = field(default_factory=list)
    booting: list[str] = field(default_factory=list)

"""Replica-level fault tolerance (``train.fault_tolerance: replica``) on torchft.

Each replica (one VM, or a group of ``nodes_per_replica`` VMs with its own torchrun) trains
a full copy of the model; replicas average gradients through a fault-tolerant all-reduce
coordinated by torchft's lighthouse. A replica lost costs its peers about a heartbeat, not a
restart; a joiner fetches the state from a live peer.

This package is the only place that imports torchft (pinned to 0.2.0, whose internals it
drives), so the lighthouse can be replaced without touching the trainer. Modules:
:mod:`.engine` (the manager and the step protocol), :mod:`.plan` (pure: who computes which
samples), :mod:`.quorum` (a quorum is its id and its members), :mod:`.groups` (the
cross-replica process group), :mod:`.watchdog` (aborts a collective whose peer stopped
heartbeating), :mod:`.holders` (who holds the state, the leave decision),
:mod:`.disk` (fenced checkpoints from one replica) and :mod:`.session` (all of it for a
training loop).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import EngineConfig, ReplicaEngine
    from .plan import StepPlan
    from .session import ReplicaSession

__all__ = ["EngineConfig", "ReplicaEngine", "ReplicaSession", "StepPlan"]

_WHERE = {
    "EngineConfig": ".engine",
    "ReplicaEngine": ".engine",
    "StepPlan": ".plan",
    "ReplicaSession": ".session",
}


def __getattr__(name: str) -> Any:
    # Lazily: importing the package must not import torch or torchft.
    if name not in _WHERE:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(_WHERE[name], __name__), name)

"""A replica run's lighthouse tied to its record and its Redis: kept up while the controller
drives the run, its address published for the agents, stopped when the run ends. Only a run
with ``train.replica.quorum: lighthouse`` has one (``RunInfo.lighthouse`` set at its
creation); the Redis quorum, the default, runs no process of its own."""

from __future__ import annotations

from spottrain.controller.reconcile.state import RunState
from spottrain.controller.run.lighthouse import (
    LighthouseSupervisor,
    min_replicas,
    stop_lighthouse,
)
from spottrain.controller.run.records import RunInfo


def supervise_lighthouse(info: RunInfo, state: RunState) -> LighthouseSupervisor | None:
    """Start keeping the run's lighthouse up (None for a run without one: elastic, or the
    Redis quorum). Each (re)start writes
    its address to ``replica_lighthouse``, where the agents read it at each launch; each
    restart is an event (``lighthouse-restart``, with how long it was down).

    Raises:
        RunError: it cannot be started (the replica extra missing, its port taken).
    """
    if not info.lighthouse:
        return None
    supervisor: LighthouseSupervisor

    def on_start(restarted: bool, down_s: float | None) -> None:
        state.client.set(state.keys.replica_lighthouse, info.lighthouse)
        if restarted:
            state.event(
                "lighthouse-restart",
                address=info.lighthouse,
                down_s=round(down_s or 0.0, 3),
                restarts=supervisor.restarts,
            )

    supervisor = LighthouseSupervisor(
        info.dir, info.lighthouse_bind, min_replicas(info.spec()), on_start
    )
    return supervisor.start()


def end_lighthouse(info: RunInfo) -> None:
    """Stop the run's lighthouse, whichever process started it; nothing for a run without
    one."""
    if info.lighthouse_bind:
        stop_lighthouse(info.dir, info.lighthouse_bind)

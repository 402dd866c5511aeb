"""The states the parts of a run write to Redis, as enums: one spelling of each value.

- :class:`NodeState`: where one node (one VM's agent) is in its life, with the moves allowed
  between states (:data:`TRANSITIONS`). The agent writes it (the node's hash, its heartbeat,
  ``state`` events); the controller, the report and ``spottrain status`` read it.
- :class:`RunPhase`: the run as a whole, the ``phase`` field of the controller's hash.
- :class:`LedgerStatus`: one launch in the controller's launch ledger.

Each is a ``StrEnum``: a member *is* its value (``NodeState.JOINED == "joined"``), so it
goes to Redis, JSON and f-strings as the bare string it replaced. The values are a format
(a fleet's agents and its controller may come from different releases): never rename one.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType


class NodeState(StrEnum):
    """Where one node (one VM's agent) is in its life (a ``str``: its value is its name
    in Redis and in the event stream)."""

    BOOTING = "booting"  # the agent started; the health check has not passed yet
    HEALTHY = "healthy"  # the health check passed; torchrun may be starting
    JOINED = "joined"  # torchrun's workers joined a rendezvous round and train
    CHECKPOINTING = "checkpointing"  # an early checkpoint (rebalance recommendation), no drain
    DRAINING = "draining"  # leaving: emergency checkpoint, leave the rendezvous, stop torchrun
    LEFT = "left"  # gone on purpose: drained, training finished, or removed
    FAILED = "failed"  # the node or the agent itself broke


_S = NodeState

# The whole state machine. Two moves need a word:
# - BOOTING -> LEFT (added to the first sketch of the flow): a stop (systemd, a notice seen
#   as SIGTERM) can come during the health check, which takes up to a minute. The node never
#   joined, so there is nothing to drain, and it did not fail either: recording FAILED would
#   count a preemption as a broken VM.
# - DRAINING -> LEFT even when the emergency checkpoint could not commit: the node went away
#   as planned and its peers re-form from the last committed checkpoint. FAILED after
#   DRAINING means the agent itself broke (the event stream shows which).
# No state moves to itself: a repeated notice or a second "joined" round is not a transition,
# and callers that see one have a dedup bug worth surfacing.
TRANSITIONS: Mapping[NodeState, frozenset[NodeState]] = MappingProxyType(
    {
        _S.BOOTING: frozenset({_S.HEALTHY, _S.LEFT, _S.FAILED}),
        _S.HEALTHY: frozenset({_S.JOINED, _S.DRAINING, _S.LEFT, _S.FAILED}),
        _S.JOINED: frozenset({_S.CHECKPOINTING, _S.DRAINING, _S.LEFT, _S.FAILED}),
        _S.CHECKPOINTING: frozenset({_S.JOINED, _S.DRAINING, _S.LEFT, _S.FAILED}),
        _S.DRAINING: frozenset({_S.LEFT, _S.FAILED}),
        _S.LEFT: frozenset(),
        _S.FAILED: frozenset(),
    }
)

# LEFT and FAILED: nothing moves on from them (a node the controller counts as spent).
TERMINAL: frozenset[NodeState] = frozenset(s for s, nxt in TRANSITIONS.items() if not nxt)
# The node's workers are in a round and train (the world size counts these).
TRAINING: frozenset[NodeState] = frozenset({_S.JOINED, _S.CHECKPOINTING})
# The node is on its way out, or out.
LEAVING: frozenset[NodeState] = frozenset({_S.DRAINING, *TERMINAL})


def allowed(frm: NodeState, to: NodeState) -> bool:
    """Whether the state machine allows the move ``frm -> to``."""
    return to in TRANSITIONS[frm]


def _names(states: frozenset[NodeState]) -> str:
    # Sorted in declaration order so messages read like the flow and are stable for tests.
    return ", ".join(s.value for s in NodeState if s in states)


class IllegalTransition(ValueError):
    """A move the state machine does not allow.

    Attributes:
        frm: The state the node was in.
        to: The state asked for.
        allowed: The states it could have moved to.
    """

    def __init__(self, frm: NodeState, to: NodeState, reason: str = "") -> None:
        self.frm = frm
        self.to = to
        self.allowed = TRANSITIONS[frm]
        why = f" (asked for because: {reason})" if reason else ""
        if not self.allowed:
            nxt = f"{frm.value} is terminal and allows no next state; a new agent run starts over"
        else:
            nxt = f"from {frm.value} the allowed next states are: {_names(self.allowed)}"
        super().__init__(
            f"illegal node state transition {frm.value} -> {to.value}{why}: {nxt}. "
            "If another thread moved the node first, catch this error; otherwise the caller's "
            "flow is missing from spottrain.protocol.states.TRANSITIONS"
        )


class RunPhase(StrEnum):
    """The run as a whole: the ``phase`` field of the controller's hash (``RunKeys.ctl``).

    ``RUNNING`` is written when the run starts; the controller's summary reads
    ``STOPPING`` when no phase is written and a stop was asked; a run ends ``DONE``,
    ``FAILED`` (the controller recorded an error) or ``DOWN`` (``spottrain down``).
    """

    RUNNING = "running"
    STOPPING = "stopping"
    DONE = "done"
    FAILED = "failed"
    DOWN = "down"


# The phases a run does not leave.
ENDED_PHASES: frozenset[RunPhase] = frozenset({RunPhase.DONE, RunPhase.FAILED, RunPhase.DOWN})


class LedgerStatus(StrEnum):
    """One launch in the controller's launch ledger (``RunKeys.ctl_launches``).

    ``INTENT`` is written before the provider is asked (so a crash between asking and
    recording leaves a trace to adopt), ``LAUNCHED`` once the provider named the VM,
    ``FAILED`` when the launch was refused or never confirmed, ``ENDED`` once the VM is gone.
    """

    INTENT = "intent"
    LAUNCHED = "launched"
    FAILED = "failed"
    ENDED = "ended"


# The launches that hold (or may hold) a VM.
LIVE_LAUNCHES: frozenset[LedgerStatus] = frozenset({LedgerStatus.INTENT, LedgerStatus.LAUNCHED})

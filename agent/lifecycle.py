"""The states an agent's node goes through, and which moves between them are allowed.

Pure: no I/O. The agent records each move in Redis; this module only decides whether a move
is legal and keeps the history. The notice handler and the main loop both advance the same
:class:`Lifecycle`, so every read and write of it holds one lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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

TERMINAL: frozenset[NodeState] = frozenset(s for s, nxt in TRANSITIONS.items() if not nxt)


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
            "flow is missing from lifecycle.TRANSITIONS"
        )


@dataclass(frozen=True)
class Transition:
    """One recorded move.

    Attributes:
        frm: The state before.
        to: The state after.
        at: When, in seconds from the lifecycle's clock (Unix seconds by default).
        reason: Why, in one line, for the event stream.
    """

    frm: NodeState
    to: NodeState
    at: float
    reason: str = ""


class Lifecycle:
    """The current state of one node and how it got there. Thread-safe.

    :meth:`can` followed by :meth:`advance` is not atomic: another thread may move the
    node in between, and :meth:`advance` then raises. Code that races (the notice handler
    against the main loop) calls :meth:`try_advance`, which checks and moves under one lock.

    Args:
        clock: Returns the time recorded in each :class:`Transition` (``time.time`` unless a
            test passes its own).
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._state = NodeState.BOOTING
        self._history: list[Transition] = []

    @property
    def state(self) -> NodeState:
        with self._lock:
            return self._state

    @property
    def terminal(self) -> bool:
        """Whether the node is LEFT or FAILED, from which nothing moves on."""
        with self._lock:
            return self._state in TERMINAL

    @property
    def history(self) -> list[Transition]:
        """Every move so far, oldest first (a copy)."""
        with self._lock:
            return list(self._history)

    def can(self, to: NodeState) -> bool:
        """Whether moving to ``to`` is allowed from the current state."""
        with self._lock:
            return to in TRANSITIONS[self._state]

    def advance(self, to: NodeState, reason: str = "") -> Transition:
        """Move to ``to`` and record it.

        Args:
            to: The next state.
            reason: Why, in one line, for the event stream.

        Returns:
            The recorded transition.

        Raises:
            IllegalTransition: ``to`` is not an allowed next state of the current one (the
                state is left unchanged).
        """
        with self._lock:
            frm = self._state
            if to not in TRANSITIONS[frm]:
                raise IllegalTransition(frm, to, reason)
            t = Transition(frm=frm, to=to, at=self._clock(), reason=reason)
            self._state = to
            self._history.append(t)
            return t

    def try_advance(self, to: NodeState, reason: str = "") -> Transition | None:
        """Move to ``to`` if that is allowed now; otherwise do nothing.

        For moves that another thread may have made moot ("drained" after a crash already
        recorded FAILED): the check and the move are one step, so nothing can come between.

        Returns:
            The recorded transition, or None when ``to`` was not allowed.
        """
        try:
            return self.advance(to, reason)
        except IllegalTransition:
            return None

    def __repr__(self) -> str:
        return f"Lifecycle(state={self.state.value}, transitions={len(self.history)})"

"""One node's walk through the states of :mod:`spottrain.protocol.states` (the enum and its
allowed moves live there, on the floor, where the controller reads the same values).

Pure: no I/O. The agent records each move in Redis; this module only checks each move against
the state machine and keeps the history. The notice handler and the main loop both advance the
same :class:`Lifecycle`, so every read and write of it holds one lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from spottrain.protocol.states import TERMINAL, IllegalTransition, NodeState, allowed


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
            return allowed(self._state, to)

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
            if not allowed(frm, to):
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

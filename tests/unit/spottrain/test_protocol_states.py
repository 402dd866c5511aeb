"""The floor's state enums (spottrain.protocol.states): their values are a format (Redis, the
event stream, the golden fixtures), the sets the controller reads, and the move check.
The node state machine's moves themselves are tested in test_lifecycle.py."""

from __future__ import annotations

import itertools
import json

import pytest

from spottrain.protocol.states import (
    ENDED_PHASES,
    LEAVING,
    LIVE_LAUNCHES,
    TERMINAL,
    TRAINING,
    TRANSITIONS,
    LedgerStatus,
    NodeState,
    RunPhase,
    allowed,
)


def test_the_values_are_the_strings_redis_holds() -> None:
    # Written out on purpose: renaming a value breaks running fleets and the golden fixtures.
    assert [s.value for s in NodeState] == [
        "booting",
        "healthy",
        "joined",
        "checkpointing",
        "draining",
        "left",
        "failed",
    ]
    assert {p.value for p in RunPhase} == {"running", "stopping", "done", "failed", "down"}
    assert {s.value for s in LedgerStatus} == {"intent", "launched", "failed", "ended"}


@pytest.mark.parametrize("member", [*NodeState, *RunPhase, *LedgerStatus])
def test_a_member_is_its_bare_string_everywhere(member: str) -> None:
    bare = str.__str__(member)
    assert member == bare
    assert f"{member}" == bare
    assert json.dumps(member) == json.dumps(bare)
    assert type(member)(bare) is member


def test_the_sets_the_controller_reads() -> None:
    S = NodeState
    assert {S.LEFT, S.FAILED} == TERMINAL
    assert {S.JOINED, S.CHECKPOINTING} == TRAINING
    assert {S.DRAINING, S.LEFT, S.FAILED} == LEAVING
    assert {"done", "failed", "down"} == ENDED_PHASES
    assert {"intent", "launched"} == LIVE_LAUNCHES
    # Bare strings read from Redis find their members in the sets.
    assert "joined" in TRAINING and "left" in TERMINAL and "launched" in LIVE_LAUNCHES


def test_allowed_is_the_table() -> None:
    for frm, to in itertools.product(NodeState, NodeState):
        assert allowed(frm, to) is (to in TRANSITIONS[frm])
    # Nothing moves out of a terminal state; every state but BOOTING is reachable.
    assert not any(allowed(t, s) for t in TERMINAL for s in NodeState)
    reachable = set().union(*TRANSITIONS.values())
    assert reachable == set(NodeState) - {NodeState.BOOTING}

"""The node lifecycle state machine (the table in spottrain.protocol.states, walked by
spottrain.agent.lifecycle): the table as written down, every allowed and every refused move,
the history and its clock, and concurrent advances. Pure: no I/O."""

from __future__ import annotations

import itertools
import sys
import threading
from collections.abc import Iterator

import pytest

from spottrain.agent.lifecycle import Lifecycle, Transition
from spottrain.protocol.states import TERMINAL, TRANSITIONS, IllegalTransition, NodeState

S = NodeState

# The table again, written out independently: a change to the state machine has to change
# this too, on purpose.
EXPECTED = {
    S.BOOTING: {S.HEALTHY, S.LEFT, S.FAILED},
    S.HEALTHY: {S.JOINED, S.DRAINING, S.LEFT, S.FAILED},
    S.JOINED: {S.CHECKPOINTING, S.DRAINING, S.LEFT, S.FAILED},
    S.CHECKPOINTING: {S.JOINED, S.DRAINING, S.LEFT, S.FAILED},
    S.DRAINING: {S.LEFT, S.FAILED},
    S.LEFT: set(),
    S.FAILED: set(),
}

# A legal way from BOOTING to each state.
PATHS = {
    S.BOOTING: [],
    S.HEALTHY: [S.HEALTHY],
    S.JOINED: [S.HEALTHY, S.JOINED],
    S.CHECKPOINTING: [S.HEALTHY, S.JOINED, S.CHECKPOINTING],
    S.DRAINING: [S.HEALTHY, S.JOINED, S.DRAINING],
    S.LEFT: [S.HEALTHY, S.JOINED, S.LEFT],
    S.FAILED: [S.FAILED],
}

ALL_PAIRS = list(itertools.product(NodeState, NodeState))
ALLOWED = [(a, b) for a, b in ALL_PAIRS if b in EXPECTED[a]]
REFUSED = [(a, b) for a, b in ALL_PAIRS if b not in EXPECTED[a]]


def pair_id(pair: tuple[NodeState, NodeState]) -> str:
    return f"{pair[0].value}->{pair[1].value}"


def ticking_clock(start: float = 1000.0) -> Iterator[float]:
    return itertools.count(start, 1.0)


def at(state: NodeState, clock: Iterator[float] | None = None) -> Lifecycle:
    ticks = ticking_clock() if clock is None else clock
    lc = Lifecycle(clock=lambda: next(ticks))
    for step in PATHS[state]:
        lc.advance(step, "setting up the test")
    assert lc.state is state
    return lc


def test_table_is_the_one_written_down() -> None:
    assert {s: set(nxt) for s, nxt in TRANSITIONS.items()} == EXPECTED


def test_every_state_is_in_the_table_and_reachable_from_booting() -> None:
    assert set(TRANSITIONS) == set(NodeState)
    assert set(PATHS) == set(NodeState)


def test_no_state_moves_to_itself() -> None:
    assert all(s not in TRANSITIONS[s] for s in NodeState)


def test_left_and_failed_are_the_only_terminal_states() -> None:
    assert {S.LEFT, S.FAILED} == TERMINAL


def test_table_cannot_be_changed_at_runtime() -> None:
    with pytest.raises(TypeError):
        TRANSITIONS[S.LEFT] = frozenset({S.BOOTING})  # type: ignore[index]


def test_states_are_their_redis_strings() -> None:
    assert isinstance(S.CHECKPOINTING, str)
    assert str(S.CHECKPOINTING) == "checkpointing"
    assert f"{S.JOINED}" == "joined"
    assert S("draining") is S.DRAINING


def test_a_new_lifecycle_is_booting_with_no_history() -> None:
    lc = Lifecycle()
    assert lc.state is S.BOOTING
    assert lc.history == []
    assert not lc.terminal


@pytest.mark.parametrize("pair", ALLOWED, ids=pair_id)
def test_allowed_transition_moves_and_is_recorded(pair: tuple[NodeState, NodeState]) -> None:
    frm, to = pair
    lc = at(frm)
    assert lc.can(to)
    before = len(lc.history)
    t = lc.advance(to, "because the test says so")
    assert (t.frm, t.to, t.reason) == (frm, to, "because the test says so")
    assert lc.state is to
    assert lc.history[before:] == [t]
    assert lc.terminal == (to in (S.LEFT, S.FAILED))


@pytest.mark.parametrize("pair", REFUSED, ids=pair_id)
def test_refused_transition_raises_and_changes_nothing(pair: tuple[NodeState, NodeState]) -> None:
    frm, to = pair
    lc = at(frm)
    history = lc.history
    assert not lc.can(to)
    with pytest.raises(IllegalTransition) as exc:
        lc.advance(to, "a stale notice")
    err = exc.value
    assert (err.frm, err.to, err.allowed) == (frm, to, frozenset(EXPECTED[frm]))
    message = str(err)
    assert f"{frm.value} -> {to.value}" in message
    assert "a stale notice" in message
    for nxt in EXPECTED[frm]:
        assert nxt.value in message
    if not EXPECTED[frm]:
        assert "terminal" in message
    assert lc.state is frm
    assert lc.history == history


@pytest.mark.parametrize("pair", ALL_PAIRS, ids=pair_id)
def test_try_advance_moves_when_allowed_and_does_nothing_otherwise(
    pair: tuple[NodeState, NodeState],
) -> None:
    frm, to = pair
    lc = at(frm)
    history = lc.history
    t = lc.try_advance(to, "maybe")
    if to in EXPECTED[frm]:
        assert t is not None and (t.frm, t.to, t.reason) == (frm, to, "maybe")
        assert lc.state is to and lc.history == [*history, t]
    else:
        assert t is None
        assert lc.state is frm and lc.history == history


def test_illegal_transition_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="allowed next states are: healthy, left, failed"):
        Lifecycle().advance(S.JOINED)


@pytest.mark.parametrize("terminal", [S.LEFT, S.FAILED], ids=lambda s: s.value)
def test_terminal_states_allow_nothing_further(terminal: NodeState) -> None:
    lc = at(terminal)
    assert lc.terminal
    assert not any(lc.can(s) for s in NodeState)
    with pytest.raises(IllegalTransition, match=f"{terminal.value} is terminal"):
        lc.advance(S.BOOTING)


def test_a_drain_ends_in_left_even_when_the_checkpoint_did_not_commit() -> None:
    lc = at(S.DRAINING)
    lc.advance(S.LEFT, "drained; emergency checkpoint did not commit before the deadline")
    assert lc.terminal and lc.state is S.LEFT


def test_a_stop_during_the_health_check_leaves_without_failing() -> None:
    lc = Lifecycle()
    lc.advance(S.LEFT, "SIGTERM during the health check")
    assert lc.state is S.LEFT


def test_early_checkpoints_can_repeat() -> None:
    lc = at(S.JOINED)
    for _ in range(3):
        lc.advance(S.CHECKPOINTING, "rebalance recommendation")
        lc.advance(S.JOINED, "early checkpoint committed")
    assert [t.to for t in lc.history[-6:]] == [S.CHECKPOINTING, S.JOINED] * 3


def test_history_records_each_move_with_the_injected_clock_and_reason() -> None:
    clock = ticking_clock(1000.0)
    lc = Lifecycle(clock=lambda: next(clock))
    lc.advance(S.HEALTHY, "health check passed")
    lc.advance(S.JOINED, "round 3")
    lc.advance(S.DRAINING, "aws spot terminate, deadline in 118 s")
    lc.advance(S.LEFT)
    assert lc.history == [
        Transition(S.BOOTING, S.HEALTHY, 1000.0, "health check passed"),
        Transition(S.HEALTHY, S.JOINED, 1001.0, "round 3"),
        Transition(S.JOINED, S.DRAINING, 1002.0, "aws spot terminate, deadline in 118 s"),
        Transition(S.DRAINING, S.LEFT, 1003.0, ""),
    ]


def test_a_refused_move_does_not_read_the_clock() -> None:
    reads: list[float] = []

    def clock() -> float:
        reads.append(1.0)
        return 1.0

    lc = Lifecycle(clock=clock)
    with pytest.raises(IllegalTransition):
        lc.advance(S.DRAINING)
    assert reads == []


def test_history_is_a_copy() -> None:
    lc = at(S.JOINED)
    lc.history.clear()
    assert len(lc.history) == 2


def test_transitions_are_frozen() -> None:
    t = Lifecycle().advance(S.HEALTHY)
    with pytest.raises(AttributeError):
        t.to = S.FAILED  # type: ignore[misc]


@pytest.fixture
def fast_thread_switches() -> Iterator[None]:
    # Switch threads every few microseconds so that unlocked code would interleave badly.
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


@pytest.mark.usefixtures("fast_thread_switches")
def test_concurrent_advances_keep_one_consistent_chain() -> None:
    lc = at(S.JOINED)
    start = threading.Barrier(8)
    won: list[int] = [0] * 8

    def flip(i: int) -> None:
        start.wait()
        for n in range(2000):
            try:
                lc.advance(S.CHECKPOINTING if (n + i) % 2 else S.JOINED, f"thread {i}")
                won[i] += 1
            except IllegalTransition:
                pass

    threads = [threading.Thread(target=flip, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    history = lc.history
    assert len(history) == 2 + sum(won)
    for before, after in itertools.pairwise(history):
        assert after.frm is before.to
        assert after.to in EXPECTED[after.frm]
        assert after.at > before.at  # the clock is read under the lock, in order
    assert lc.state is history[-1].to


def race(lc: Lifecycle, targets: list[NodeState]) -> list[Transition | IllegalTransition]:
    """Advance ``lc`` to each target from its own thread, all released at once."""
    start = threading.Barrier(len(targets))
    results: list[Transition | IllegalTransition] = []

    def go(to: NodeState) -> None:
        start.wait()
        try:
            results.append(lc.advance(to))
        except IllegalTransition as e:
            results.append(e)

    threads = [threading.Thread(target=go, args=(to,)) for to in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.usefixtures("fast_thread_switches")
def test_racing_to_terminal_states_moves_out_of_joined_once() -> None:
    for _ in range(50):
        lc = at(S.JOINED)
        results = race(lc, [S.DRAINING, S.LEFT, S.FAILED, S.LEFT])
        moved = [r for r in results if isinstance(r, Transition)]
        assert len(results) == 4
        # DRAINING may win and then be followed by LEFT or FAILED; never two moves out of
        # JOINED, and never a move out of a terminal state.
        history = lc.history[2:]
        assert history[0].frm is S.JOINED
        assert [t.frm for t in history[1:]] in ([], [S.DRAINING])
        assert sorted(history, key=id) == sorted(moved, key=id)
        assert lc.terminal or lc.state is S.DRAINING

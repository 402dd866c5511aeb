"""The blocking commands' deadlines, as pure functions of the clock: an answer leaves room
for a WAIT, and no BLPOP or WAIT ends past the time it must end by, even timed out a Redis
timer tick late (the shim's margin before the gRPC deadline is what is left for the reply)."""

from __future__ import annotations

import pytest

from spottrain.quorum import confirm


@pytest.mark.parametrize("timeout", [0.05, 0.2, 1.0, 60.0])
def test_an_answer_leaves_room_for_a_wait_before_the_deadline(timeout: float) -> None:
    by = confirm.answer_by(100.0, timeout, wait_replicas=1)
    room = min(confirm.LAST_WAIT_S + confirm.REDIS_LATE_S, timeout / 2)
    assert 100.0 - by == pytest.approx(room)
    if timeout >= 1.0:  # an answer at the last moment still gets its WAIT
        assert confirm.block_s(by, 100.0, 5.0) == pytest.approx(confirm.LAST_WAIT_S)
    assert confirm.answer_by(100.0, timeout, wait_replicas=0) == 100.0  # nothing to wait for


@pytest.mark.parametrize("slice_s", [0.05, 0.25, 1.25])
def test_no_blocking_command_ends_past_its_time_even_timed_out_late(slice_s: float) -> None:
    until = 100.0
    for i in range(3000):
        now = until - i / 1000
        wait = confirm.block_s(now, until, slice_s)
        if wait is None:  # none fits: the caller gives up now
            assert until - now < confirm.REDIS_LATE_S + 0.01
            continue
        assert 0.01 <= wait <= slice_s  # never 0: BLPOP 0 and WAIT 0 block for ever
        assert now + wait + confirm.REDIS_LATE_S <= until + 1e-9
    assert confirm.block_s(until + 5, until, slice_s) is None


@pytest.mark.parametrize("wait_replicas", [0, 1])
def test_the_shortest_timeout_still_blocks_once_for_its_answer(wait_replicas: int) -> None:
    def blocks(timeout: float) -> bool:
        by = confirm.answer_by(100.0 + timeout, timeout, wait_replicas)
        return confirm.block_s(100.0, by, 1.0) is not None

    shortest = confirm.shortest_timeout_s(wait_replicas)
    assert blocks(shortest + 1e-9) and not blocks(shortest - 0.001)
    assert blocks(60.0) and not blocks(0.0)

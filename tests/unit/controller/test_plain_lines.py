"""The plain lines (a pipe, a file, ``--detach``'s log) say when the fleet has been short of
nodes for a while, with the live view's own line, printed when it appears and goes and not
on every pass; a whole fleet's block is what it always was."""

from __future__ import annotations

import re

import fakeredis

from spottrain.cloud.base import Market, Offer
from spottrain.controller.reconcile.records import LaunchRecord
from spottrain.controller.reconcile.state import RunState
from spottrain.controller.reconcile.summary import Summary
from spottrain.controller.run.drive import PlainLines, format_summary
from spottrain.protocol.keys import RunKeys
from spottrain.protocol.states import LedgerStatus

OFFER = Offer("local", "local", "local-a", "local-cpu", 0, "", Market.SPOT, 0.1, 0.0)
STAMP = re.compile(r"^\[\d\d:\d\d:\d\d\] ")
SHORT = (
    "             fleet short: 1 of 2 nodes for {}, waiting for capacity; "
    "last refusal: local-cpu spot in local-a: capacity: none"
)


def _state(server: fakeredis.FakeServer | None = None) -> RunState:
    state = RunState(fakeredis.FakeRedis(server=server), RunKeys("t-plain"))
    state.put_launch(LaunchRecord("n0", "r0", OFFER, 1000.0, LedgerStatus.LAUNCHED, "vm-0"))
    state.put_launch(
        LaunchRecord("n1", "r1", OFFER, 1001.0, LedgerStatus.FAILED, reason="capacity: none")
    )
    state.set_ctl(phase="running", started_at="900")
    return state


def _summary(*nodes: str, step: int = 100) -> Summary:
    return Summary(
        phase="running",
        step=step,
        loss=1.5,
        world_size=4 * len(nodes),
        nodes={n: "training" for n in nodes},
        preemptions=1,
        steps_lost=3,
        spent_usd=1.25,
        saved_usd=2.5,
        reason="holding 2 nodes",
    )


def _block(s: Summary) -> list[str]:
    """The block as the plain lines always printed it, less its time stamp."""
    lines = format_summary(s)
    return [lines[0], *(f"           {line}" for line in lines[1:])]


def _printed(out: list[str]) -> list[str]:
    """The lines printed, their block's time stamp checked and taken off."""
    assert out and STAMP.match(out[0]), out
    return [STAMP.sub("", out[0]), *out[1:]]


def test_a_whole_fleets_plain_block_is_unchanged() -> None:
    state = _state()
    state.set_ctl(target_nodes="1", spot_short_since="500")
    out: list[str] = []
    PlainLines(out.append, lambda: state, 2, clock=lambda: 2000.0)(_summary("n0"))
    assert _printed(out) == _block(_summary("n0"))
    assert not any("fleet short" in line for line in out)


def test_a_fleet_short_for_a_while_says_it_waits_for_capacity_without_repeating_it() -> None:
    state = _state()
    now = [1000.0]
    out: list[str] = []
    plain = PlainLines(out.append, lambda: state, 2, clock=lambda: now[0])
    plain(_summary("n0"))  # short this moment: a replacement may be booting
    assert _printed(out) == _block(_summary("n0"))
    out.clear()
    now[0] = 1005.0
    plain(_summary("n0", step=101))
    assert out == []  # nothing changed
    now[0] = 1012.0
    plain(_summary("n0", step=102))  # short for long enough: a block that says so
    block = _block(_summary("n0", step=102))
    assert _printed(out) == [*block[:2], SHORT.format("0m12s"), *block[2:]]
    out.clear()
    state.set_ctl(spot_short_since="828")  # dated by the controller's first refusal
    now[0] = 1013.0
    plain(_summary("n0", step=103))
    assert out == []  # said already; the next block (a change, or 30 s) says it again
    plain(_summary("n0", step=125))
    assert SHORT.format("3m05s") in out
    out.clear()
    state.put_launch(LaunchRecord("n2", "r2", OFFER, 1014.0, LedgerStatus.LAUNCHED, "vm-2"))
    plain(_summary("n0", "n2", step=126))  # whole again: the block as always
    assert _printed(out) == _block(_summary("n0", "n2", step=126))


def test_a_redis_that_stops_answering_leaves_the_plain_block_as_it_was() -> None:
    server = fakeredis.FakeServer()
    state = _state(server)
    now = [1000.0]
    out: list[str] = []
    plain = PlainLines(out.append, lambda: state, 2, clock=lambda: now[0])
    plain(_summary("n0"))
    out.clear()
    server.connected = False
    now[0] = 1100.0
    plain(_summary("n0", step=130))
    assert _printed(out) == _block(_summary("n0", step=130))

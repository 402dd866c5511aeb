"""What ``status``, the plain lines of ``up`` and the live view say of VM boots: the failed
ones with their reason, the stage of the booting ones, the failed-launch streak; and never a
control character a VM wrote (its boot reason, an event it added to the stream)."""

from __future__ import annotations

import io

import fakeredis

from spottrain.cloud.base import Market, Offer
from spottrain.controller.reconcile.ledger import FAILED_LAUNCHES
from spottrain.controller.reconcile.records import LaunchRecord
from spottrain.controller.reconcile.state import RunState
from spottrain.controller.reconcile.summary import BOOTING_LINES, Summary, boot_lines, summarize
from spottrain.controller.reconcile.types import FailedLaunches
from spottrain.controller.run.drive import PlainLines, format_summary
from spottrain.controller.view.collect import event_row
from spottrain.controller.view.model import NodeRow, ViewData
from spottrain.controller.view.render import render
from spottrain.protocol import events as stream
from spottrain.protocol.boot import STAGE_CODE, STAGE_ENV, BootReport, BootState
from spottrain.protocol.keys import RunKeys
from spottrain.protocol.states import LedgerStatus

OFFER = Offer("aws", "us-east-1", "us-east-1a", "p5.48xlarge", 8, "H100", Market.SPOT, 30.0, 0.1)
PIP = "pip: no matching distribution for torch==2.13.0 for Python 3.10"
# A reason holding a terminal escape (a retitle, a bell): it must reach no terminal raw.
EVIL = "pip: \x1b]0;owned\x07 failed \x1b[2J\x9b31m"
SHOWN = "pip: \\e]0;owned\\x07 failed \\e[2J\\x9b31m"


def _state() -> RunState:
    state = RunState(fakeredis.FakeRedis(), RunKeys("t-boot"))
    for i in range(4):
        state.put_launch(
            LaunchRecord(f"n{i}", f"r{i}", OFFER, 1000.0 + i, LedgerStatus.LAUNCHED, f"i-{i}")
        )
    state.set_ctl(phase="running")
    state.client.hset(state.keys.node("n0"), mapping={"state": "joined"})
    return state


def _boot(state: RunState, node: str, stage: str, st: BootState, reason: str = "") -> None:
    state.put_boot(BootReport(node, f"i-{node[1:]}", stage, st, reason, 1100.0))


def test_status_lines_name_a_failed_boot_and_a_booting_stage() -> None:
    state = _state()
    _boot(state, "n1", STAGE_ENV, BootState.FAILED, PIP)
    _boot(state, "n2", STAGE_CODE, BootState.BOOTING)
    # n0's agent trains: an old report of its boot is not read again.
    _boot(state, "n0", STAGE_ENV, BootState.FAILED, "stale")
    s = summarize(state, 1200.0)
    boot = boot_lines(state, s)
    assert boot.failed == [f"n1: boot failed in 'install the environment': {PIP}"]
    assert boot.booting == ["n2: booting: fetch the code"]
    lines = format_summary(s, boot)
    assert f"  n1: boot failed in 'install the environment': {PIP}" in lines
    assert "  n2: booting: fetch the code" in lines
    assert not any("stale" in line for line in lines)


def test_the_failed_launch_streak_is_shown_until_a_node_trains() -> None:
    state = _state()
    streak = FailedLaunches(2, "k", f"n3: boot failed in 'install the environment': {PIP}")
    state.set_ctl(**{FAILED_LAUNCHES: streak.to_json()})
    (line,) = boot_lines(state, summarize(state, 1200.0)).failed
    assert line == (
        f"2 VM(s) in a row failed at boot; the last: n3: boot failed in 'install the "
        f"environment': {PIP}"
    )


def test_no_control_character_a_vm_wrote_reaches_status_or_the_plain_lines() -> None:
    state = _state()
    _boot(state, "n1", STAGE_ENV, BootState.FAILED, EVIL)
    state.set_ctl(error=f"3 VMs in a row failed at boot: n1: boot failed in '...': {EVIL}")
    s = summarize(state, 1200.0)
    out: list[str] = []
    PlainLines(out.append, lambda: state)(s)
    text = "\n".join(out)
    assert "\x1b" not in text and "\x07" not in text and "\x9b" not in text
    assert f"n1: boot failed in 'install the environment': {SHOWN}" in text
    assert s.reason.endswith(SHOWN)


def test_many_booting_nodes_are_counted_not_listed() -> None:
    state = RunState(fakeredis.FakeRedis(), RunKeys("t-many"))
    for i in range(20):
        state.put_launch(LaunchRecord(f"n{i}", f"r{i}", OFFER, 1000.0, LedgerStatus.LAUNCHED))
        _boot(state, f"n{i}", STAGE_ENV, BootState.BOOTING)
    booting = boot_lines(state, summarize(state, 1200.0)).booting
    assert len(booting) == BOOTING_LINES
    assert booting[-1] == f"... {20 - BOOTING_LINES + 1} more nodes booting"


def _frame(boot_failed: list[str], booting: list[str], height: int = 30) -> list[str]:
    from rich.console import Console

    s = Summary("running", 10, None, 8, {"n0": "joined"}, 0, 0, 1.0, 2.0, "1 of 4 node(s)")
    nodes = [NodeRow("n0", "aws", "us-east-1a", "p5.48xlarge", "spot", "joined")]
    data = ViewData("t-boot", s, nodes, boot_failed=boot_failed, booting=booting)
    console = Console(file=io.StringIO(), width=120, height=height, color_system=None)
    console.print(render(data, 120, height))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "\x1b" not in out
    return [line.rstrip() for line in out.splitlines()]


def test_the_live_view_shows_failed_boots_before_booting_stages_and_counts_the_rest() -> None:
    failed = [f"n1: boot failed in 'install the environment': {PIP}"]
    lines = _frame(failed, ["n2: booting: fetch the code"])
    assert failed[0] in lines and "n2: booting: fetch the code" in lines
    assert lines.index(failed[0]) < lines.index("n2: booting: fetch the code")
    crowd = _frame(failed, [f"n{i}: booting: fetch the code" for i in range(2, 12)])
    assert failed[0] in crowd
    assert "... 8 more boot lines (spottrain status)" in crowd
    assert sum("booting: fetch the code" in line for line in crowd) == 2


def test_an_event_with_an_escape_sequence_is_shown_escaped() -> None:
    row = stream.envelope("boot", "n1", at=1.0, stage=STAGE_ENV, reason=EVIL)
    e = event_row({**row, "id": "1-0"})
    assert "\x1b" not in e.detail and "\\e]0;owned" in e.detail

"""The live view's renderer, a pure function of plain data: what a frame shows, and that it
fits the terminal (no line wider, no more lines than it has) from a roomy one to 80x24 and
below; and the figures the collector keeps between frames (step rate, time short)."""

from __future__ import annotations

import io
import re

import fakeredis
import pytest

from spottrain.cloud.base import Market, Offer
from spottrain.controller.reconcile.records import LaunchRecord
from spottrain.controller.reconcile.state import RunState
from spottrain.controller.reconcile.summary import Summary
from spottrain.controller.view import collect
from spottrain.controller.view.model import EventRow, NodeRow, ViewData
from spottrain.controller.view.render import render
from spottrain.protocol.keys import RunKeys
from spottrain.protocol.states import LedgerStatus


def _text(data: ViewData, width: int, height: int) -> list[str]:
    from rich.console import Console

    console = Console(file=io.StringIO(), width=width, height=height, color_system=None)
    console.print(render(data, width, height))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "\x1b" not in out
    return [line.rstrip() for line in out.splitlines()]


def _data(zones: int = 2, per_zone: int = 1, events: int = 5, **kw: object) -> ViewData:
    nodes = [
        NodeRow(
            f"n{z}-{i}",
            "aws",
            f"us-east-1{'abcdefghijklmnopqrstuvwxyz'[z]}",
            "p5.48xlarge",
            "spot",
            ("training", "training", "draining")[i % 3],
        )
        for z in range(zones)
        for i in range(per_zone)
    ]
    s = Summary(
        phase="running",
        step=1380,
        loss=0.5071,
        world_size=16,
        nodes={n.node: n.state for n in nodes},
        preemptions=2,
        steps_lost=13,
        spent_usd=1234.5,
        saved_usd=2000.0,
        reason="2 of 2 node(s): training on us-east-1a p5.48xlarge spot",
        at_risk=["n0-0 at risk (rebalance): replacement n9 launching"],
    )
    evs = [
        EventRow(1_800_000_000 + i, f"n{i}", "launched", f"zone=us-east-1a n={i} " + "x" * 80)
        for i in range(events)
    ]
    fields: dict[str, object] = {"step_rate": 2.5, "elapsed_s": 3725.0, "events": evs}
    return ViewData("tiny-gpt-1795372219", s, nodes, **{**fields, **kw})  # type: ignore[arg-type]


def test_a_frame_shows_the_run_and_fits_the_terminal() -> None:
    short = "fleet short: 1 of 2 nodes for 3m05s, waiting for capacity"
    lines = _text(_data(short=short, notes=["2 checkpoint commits refused"]), 120, 40)
    text = "\n".join(lines)
    assert lines[0] == "spottrain  run tiny-gpt-1795372219  running  1h02m"
    assert lines[1] == "step 1380  2.50 steps/s  loss 0.507  world 16"
    assert lines[2].startswith("preemptions 2 (steps lost 13)  $1,234.50 spent  $2,000.00 saved")
    assert re.search(r"^zone\s+type\s+market\s+nodes\s+states$", text, re.M)
    assert re.search(r"^aws/us-east-1a\s+p5.48xlarge\s+spot\s+1\s+n0-0 training$", text, re.M)
    for line in (short, "n0-0 at risk (rebalance): replacement n9 launching"):
        assert line in lines
    assert "2 checkpoint commits refused" in lines
    assert "running: 2 of 2 node(s): training on us-east-1a p5.48xlarge spot" in lines
    # Every event fits (the newest last), each cut at the width.
    assert lines[-6] == "recent events" and " n4 " in lines[-1]
    assert all(len(line) <= 120 for line in lines) and lines[-1].endswith("…")


@pytest.mark.parametrize(("width", "height"), [(80, 24), (60, 12), (40, 8)])
def test_a_big_fleet_on_a_small_terminal_is_cut_to_fit(width: int, height: int) -> None:
    data = _data(zones=20, per_zone=30, events=40, short="fleet short: " + "y" * 200)
    lines = _text(data, width, height)
    assert len(lines) <= height - 1, lines  # the cursor's line stays free: no scrolling
    assert all(len(line) <= width for line in lines), lines
    text = "\n".join(lines)
    # Compact: no market column; zones beyond the height are one "+N more zones" row that
    # counts their nodes by state.
    assert "market" not in text
    (more,) = [line for line in lines if re.match(r"\+\d+ more zones|\d+ zo", line)]
    assert re.search(r"\s(\d+)\s+\d+ training, \d+ drai", more), more
    if height >= 24:
        # 30 nodes in a zone are counted, not named; and a few events remain.
        assert re.search(r"aws/us-east-1a .* 30\s+20 training, 10 draining", text)
        assert text.count(" launched ") >= 2 and " n39 " in lines[-1]


def test_a_replica_run_shows_its_quorum_and_an_empty_fleet_says_so() -> None:
    rows = [f"  replica-{i}   live     nodes n{i}  step 5  quorum 3" for i in range(3)]
    head = ["quorum redis: id 3 (membership since 3), 3 member(s)", "replicas: 3 (3 live)"]
    lines = _text(_data(zones=0, replica=head + rows, step_rate=None, elapsed_s=None), 100, 30)
    assert lines[0] == "spottrain  run tiny-gpt-1795372219  running"
    assert lines[1] == "step 1380  loss 0.507  world 16"
    assert lines[3:8] == head + rows
    assert "fleet: no nodes yet" in lines


def test_the_collector_keeps_the_step_rate_and_how_long_the_fleet_is_short() -> None:
    client = fakeredis.FakeRedis()
    keys = RunKeys("t-view")
    state = RunState(client, keys)
    offer = Offer("local", "local", "local-a", "local-cpu", 0, "", Market.SPOT, 0.1, 0.0)
    state.put_launch(LaunchRecord("n0", "r0", offer, 1000.0, LedgerStatus.LAUNCHED, "vm-0"))
    state.put_launch(
        LaunchRecord("n1", "r1", offer, 1001.0, LedgerStatus.FAILED, reason="capacity: none")
    )
    state.set_ctl(phase="running", started_at="900")
    client.hset(keys.node("n0"), mapping={"state": "training"})
    state.event("progress", step=1)  # left out: the step line says it
    state.event("launched", node_name="n0", zone="local-a")
    now = [1000.0]

    class Info:
        run_id = "t-view"
        lighthouse = ""

        def spec(self) -> object:
            raise ValueError("no spec")  # an elastic run: no replica figures

    c = collect.Collector(Info(), state, 2, clock=lambda: now[0])  # type: ignore[arg-type]
    client.hset(keys.progress, mapping={"step": "10"})
    first = c.frame()
    assert first.step_rate is None and first.elapsed_s == 100.0
    assert first.nodes == [NodeRow("n0", "local", "local-a", "local-cpu", "spot", "training")]
    assert first.short.startswith("fleet short: 1 of 2 nodes for 0m00s, waiting for capacity")
    assert "local-cpu spot in local-a: capacity: none" in first.short
    assert [(e.node, e.kind, e.detail) for e in first.events] == [
        ("n0", "launched", "zone=local-a")
    ]
    now[0] += 20
    client.hset(keys.progress, mapping={"step": "60"})
    second = c.frame()
    assert second.step_rate == 2.5 and "for 0m20s" in second.short
    state.set_ctl(target_nodes="1")  # `spottrain scale 1`: no longer short
    assert c.frame().short == ""


def test_the_collector_reads_what_the_vms_say_of_their_boot_and_the_frame_shows_it() -> None:
    from spottrain.protocol.boot import STAGE_CODE, STAGE_ENV, BootReport, BootState

    client = fakeredis.FakeRedis()
    keys = RunKeys("t-view-boot")
    state = RunState(client, keys)
    offer = Offer("local", "local", "local-a", "local-cpu", 0, "", Market.SPOT, 0.1, 0.0)
    for i in range(3):
        state.put_launch(LaunchRecord(f"n{i}", f"r{i}", offer, 1000.0, LedgerStatus.LAUNCHED))
    client.hset(keys.node("n0"), mapping={"state": "joined"})
    state.put_boot(BootReport("n1", "vm-1", STAGE_ENV, BootState.FAILED, "pip: \x1b[31mno", 1.0))
    state.put_boot(BootReport("n2", "vm-2", STAGE_CODE, BootState.BOOTING, "", 1.0))

    class Info:
        run_id = "t-view-boot"
        lighthouse = ""

        def spec(self) -> object:
            raise ValueError("no spec")

    frame = collect.Collector(Info(), state, 3, clock=lambda: 1010.0).frame()  # type: ignore[arg-type]
    assert frame.boot_failed == ["n1: boot failed in 'install the environment': pip: \\e[31mno"]
    assert frame.booting == ["n2: booting: fetch the code"]
    lines = _text(frame, 120, 30)
    assert "n1: boot failed in 'install the environment': pip: \\e[31mno" in lines
    assert "n2: booting: fetch the code" in lines

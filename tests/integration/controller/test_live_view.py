"""The live view for real: ``spottrain status -f`` in a pseudo-terminal redraws one view in
place (rich's cursor movements, the fleet table, the step rising, the final lines), and the
same command through a pipe prints the plain lines with no escape code."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pexpect
import pytest
import redis
import yaml
from spec_samples import LOCAL

from spottrain.cloud.base import Market, Offer
from spottrain.controller.reconcile.records import LaunchRecord
from spottrain.controller.reconcile.state import RunState
from spottrain.controller.run.records import RunInfo
from spottrain.protocol.keys import RunKeys
from spottrain.protocol.states import LedgerStatus, RunPhase

ESC = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class FakeRun:
    """A run with no VM: its record on disk and the figures a controller and its agents
    would write to its (real) Redis, moved on by the test."""

    def __init__(
        self,
        home: Path,
        endpoint: str,
        client: redis.Redis,
        keys: RunKeys,
        job: dict[str, Any] = LOCAL,
    ) -> None:
        self.info = RunInfo(
            run_id=keys.run_id,
            spec_text=yaml.safe_dump(job),
            spec_source="job.yaml",
            base_dir=str(home),
            redis_url=endpoint,
            embedded_redis=False,
            created_at=time.time(),
        )
        self.info.save()
        self.state = RunState(client, keys)
        self.state.set_ctl(phase=RunPhase.RUNNING, started_at=str(time.time() - 75))
        for i, zone in enumerate(("local-a", "local-b")):
            offer = Offer("local", "local", zone, "local-cpu", 0, "", Market.SPOT, 0.1, 0.05)
            rec = LaunchRecord(
                f"n{i}", f"r{i}", offer, time.time() - 60, LedgerStatus.LAUNCHED, f"vm-{i}"
            )
            self.state.put_launch(rec)
            client.hset(keys.node(f"n{i}"), mapping={"state": "training"})
            self.state.event("launched", node_name=f"n{i}", zone=zone, itype="local-cpu")

    def step(self, step: int, loss: float) -> None:
        self.state.client.hset(
            self.state.keys.progress,
            mapping={"step": str(step), "loss": str(loss), "world_size": "4"},
        )

    def finish(self, step: int) -> None:
        self.state.client.hset(
            self.state.keys.progress, mapping={"finished": "1", "final_step": str(step)}
        )
        self.state.set_ctl(phase=RunPhase.DONE)


@pytest.fixture
def run(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    redis_server: Any,
    redis_client: redis.Redis,
    run_keys: RunKeys,
) -> FakeRun:
    monkeypatch.setenv("SPOTTRAIN_HOME", str(tmp_path / "home"))
    return FakeRun(tmp_path, redis_server.endpoint, redis_client, run_keys)


def _cmd(run_id: str, *more: str) -> list[str]:
    return [sys.executable, "-m", "spottrain.controller.cli", "status", run_id, "-f", *more]


def _step(n: int) -> str:
    """``step N`` as rich writes it (styles between the words)."""
    return rf"step (?:\x1b\[[0-9;]*m)*{n}\b"


def test_status_follow_redraws_in_place_in_a_terminal(run: FakeRun) -> None:
    run.step(10, 2.5)
    env = {**os.environ, "TERM": "xterm-256color"}
    env.pop("COLUMNS", None)
    env.pop("LINES", None)
    cmd = _cmd(run.info.run_id, "--interval", "0.2")
    child = pexpect.spawn(cmd[0], cmd[1:], env=env, dimensions=(30, 100), timeout=30)
    try:
        child.expect(_step(10))
        first = child.before + child.after
        run.step(20, 2.0)
        run.state.event("checkpoint-copied", step=20)
        child.expect("checkpoint-copied")
        redraw = child.before
        run.finish(30)
        child.expect("training finished")
        child.expect(pexpect.EOF)
        tail = child.before
    finally:
        child.close(force=True)
    text = ESC.sub("", (first + redraw).decode())
    # The frame: header, the fleet table by zone with its header, the events.
    assert f"run {run.info.run_id}  running" in text
    assert re.search(r"zone\s+type\s+market\s+nodes\s+states", text), text
    assert re.search(r"local/local-a\s+local-cpu\s+spot\s+1\s+n0 training", text)
    assert "recent events" in text and "launched" in text
    # In place: the next frame moves the cursor back up over the last one and erases it.
    assert b"\x1b[1A" in redraw and b"\x1b[2K" in redraw
    assert re.search(_step(20).encode(), redraw)
    final = ESC.sub("", tail.decode())
    assert "steps trained          30" in final
    assert child.exitstatus == 0


def test_a_small_terminals_frames_fit_it(run: FakeRun) -> None:
    """In a 60 x 14 pseudo-terminal no line of the view is wider than the terminal (a wider
    one would wrap and break the redraw) and each redraw climbs no more lines than it has."""
    run.step(10, 2.5)
    for i in range(12):
        run.state.event("checkpoint-copied", step=i, url="file:///" + "x" * 120)
    env = {**os.environ, "TERM": "xterm-256color"}
    env.pop("COLUMNS", None)
    env.pop("LINES", None)
    cmd = _cmd(run.info.run_id, "--interval", "0.2")
    child = pexpect.spawn(cmd[0], cmd[1:], env=env, dimensions=(14, 60), timeout=30)
    try:
        child.expect(_step(10))
        run.step(20, 2.0)
        child.expect(_step(20))
        run.step(30, 1.5)
        child.expect(_step(30))
        shown = child.before + child.after
        run.finish(30)
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert b"\x1b[1A" in shown, "no redraw in place"
    for climb in re.findall(rb"(?:\x1b\[2K\x1b\[1A)+", shown):
        assert climb.count(b"\x1b[1A") <= 14, climb
    # Cursor movements (stripped) and carriage returns start a line over at column 0.
    for line in re.split(r"[\r\n]", ESC.sub("\r", shown.decode())):
        assert len(line) <= 60, line


def test_a_dumb_terminal_gets_the_plain_lines(run: FakeRun) -> None:
    """``TERM=dumb`` on a terminal: no view, the plain lines, no cursor movement."""
    run.step(10, 2.5)
    env = {**os.environ, "TERM": "dumb"}
    cmd = _cmd(run.info.run_id, "--interval", "0.2")
    child = pexpect.spawn(cmd[0], cmd[1:], env=env, dimensions=(30, 100), timeout=30)
    try:
        child.expect(r"\] step 10  loss 2\.500  world 4 ")
        out = child.before + child.after
        run.finish(10)
        child.expect(pexpect.EOF)
        out += child.before
    finally:
        child.close(force=True)
    assert b"\x1b[1A" not in out and b"\x1b[2K" not in out
    assert "nodes: n0 training, n1 training" in ESC.sub("", out.decode())


def test_status_follow_through_a_pipe_prints_plain_lines_and_json(run: FakeRun) -> None:
    run.step(10, 2.5)
    proc = subprocess.Popen(
        _cmd(run.info.run_id, "--interval", "0.2"), stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "step 10" in line:
            run.step(40, 1.5)
        if "step 40" in line:
            run.finish(40)
    assert proc.wait(30) == 0
    out = "".join(lines)
    assert "\x1b" not in out
    assert lines[0] == f"run {run.info.run_id}\n"
    assert re.search(r"^\[\d\d:\d\d:\d\d\] step 10  loss 2.500  world 4 ", out, re.M)
    assert "           nodes: n0 training, n1 training\n" in out
    assert "training finished\n" in out and "  steps trained          40\n" in out

    # --json: one object per refresh, the last one the run's end.
    proc2 = subprocess.run(
        _cmd(run.info.run_id, "--json", "--interval", "0.2"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    docs = [json.loads(x) for x in proc2.stdout.splitlines()]
    assert docs and docs[-1]["phase"] == "done" and docs[-1]["final_step"] == 40
    assert docs[-1]["run_id"] == run.info.run_id and "ckpt_refused" in docs[-1]


def test_status_follow_through_a_pipe_says_a_short_fleet_waits_for_capacity(run: FakeRun) -> None:
    """The plain lines of ``status -f`` read the run's Redis for the shortfall, as the live
    view does: `scale 3` on two nodes, with a capacity refusal on record."""
    offer = Offer("local", "local", "local-c", "local-cpu", 0, "", Market.SPOT, 0.1, 0.05)
    run.state.put_launch(
        LaunchRecord("n2", "r2", offer, time.time(), LedgerStatus.FAILED, reason="capacity: none")
    )
    run.state.set_ctl(target_nodes="3", spot_short_since=str(time.time() - 185))
    run.step(10, 2.5)
    proc = subprocess.Popen(
        _cmd(run.info.run_id, "--interval", "0.2"), stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "fleet short" in line:
            run.finish(10)
    assert proc.wait(30) == 0
    short = [line for line in lines if "fleet short" in line]
    assert short and re.fullmatch(
        r" {13}fleet short: 2 of 3 nodes for 3m0\ds, waiting for capacity; "
        r"last refusal: local-cpu spot in local-c: capacity: none\n",
        short[0],
    )
    at = lines.index(short[0])
    assert lines[at - 1] == "             nodes: n0 training, n1 training\n"


def test_a_replica_runs_view_shows_its_quorum(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    redis_server: Any,
    redis_client: redis.Redis,
    run_keys: RunKeys,
) -> None:
    from spottrain.controller.view.collect import Collector

    monkeypatch.setenv("SPOTTRAIN_HOME", str(tmp_path / "home"))
    job = {**LOCAL, "train": {**LOCAL["train"], "fault_tolerance": "replica"}}
    run = FakeRun(tmp_path, redis_server.endpoint, redis_client, run_keys, job)
    redis_client.hset(
        run_keys.replica_holders,
        "replica-0",
        json.dumps({"state": "live", "step": 5, "quorum_id": 2, "at": time.time()}),
    )
    frame = Collector(run.info, run.state, 2).frame()
    assert frame.replica[:2] == [
        "quorum redis: none formed yet; 0 heartbeating, round 0",
        "replicas: 1 (1 live)",
    ]
    assert frame.replica[2].startswith("  replica-0   live     nodes -  step 5  quorum 2")


def test_ups_passes_redraw_the_view_and_a_broken_view_falls_back_to_plain_lines(
    run: FakeRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ``up`` and ``resume`` hand each controller pass (drive.py's ``live.passes``)."""
    import io

    from rich.console import Console

    from spottrain.controller.reconcile.summary import summarize
    from spottrain.controller.run.drive import PlainLines
    from spottrain.controller.view import collect
    from spottrain.controller.view.live import LiveView

    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=100, height=30)
    plain: list[str] = []
    view = LiveView(console)
    show = view.passes(run.info, run.state, 2, PlainLines(plain.append))
    for step in (10, 20):
        run.step(step, 1.0)
        show(summarize(run.state, time.time()))
    out = screen.getvalue()
    assert re.search(_step(20), out) and "\x1b[1A" in out and "\x1b[2K" in out
    assert "local/local-b" in ESC.sub("", out) and plain == []

    def broken(self: object, summary: object = None) -> object:
        raise RuntimeError("a bug in the view")

    monkeypatch.setattr(collect.Collector, "frame", broken)
    show(summarize(run.state, time.time()))
    show(summarize(run.state, time.time()))
    view.stop()
    # The controller goes on; its figures as the plain lines from here (printed once: the
    # second pass changed nothing).
    assert len(plain) == 3 and re.match(r"\[\d\d:\d\d:\d\d\] step 20  loss 1.000", plain[0])

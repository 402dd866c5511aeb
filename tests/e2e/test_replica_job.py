"""``spottrain up examples/local_replica_job.yaml``, end to end and shortened: three one-VM
replicas on the local cloud (real agents, torchrun, torchft lighthouse and managers), one
preempted with notice and one killed without; the survivors train on, both backfills heal
from a live peer and join, and no committed step is lost."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from ._fleet import REPO, Cli

pytestmark = [pytest.mark.slow, pytest.mark.waits]

STEPS = 240
# Generous: a noticed leave costs the survivors about one step plus the lighthouse's join
# timeout, a kill about its heartbeat timeout (1 s); a loaded 2-core machine may add a few
# seconds, never half a minute.
PAUSE_BOUND_S = 30.0


def _job(tmp: Path) -> Path:
    example = REPO / "examples" / "local_replica_job.yaml"
    spec: dict[str, Any] = yaml.safe_load(example.read_text())
    spec["code"]["archive"]["path"] = str(REPO)
    spec["train"]["command"] = re.sub(
        r"--steps \d+",
        f"--steps {STEPS} --progress {tmp / 'progress.jsonl'}",
        spec["train"]["command"],
    )
    spec["checkpoint"]["volume"]["path"] = str(tmp / "volume")
    trace = tmp / "preemptions.yaml"
    # Earlier than the example's (30 s, 60 s): the shorter run must see both backfills join.
    trace.write_text("- {at_s: 18, notice: true}\n- {at_s: 36, notice: false}\n")
    spec["local"]["preemptions"]["trace"] = str(trace)
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _field(line: str, name: str) -> str:
    return line.split(f"{name}=")[1].split()[0]


def _committed_gaps(progress: Path) -> float:
    """The longest gap between two consecutive steps one replica committed, from the
    replicas' own per-step lines (each a JSON row with its time ``t``)."""
    last: dict[str, tuple[int, float]] = {}
    longest = 0.0
    for line in progress.read_text().splitlines():
        row = json.loads(line)
        if row.get("event") or not row.get("committed"):
            continue
        step = int(row["step"]) + 1  # the row names the step it trained from
        prev = last.get(row["replica"])
        if prev is not None and prev[0] == step - 1:
            longest = max(longest, row["t"] - prev[1])
        last[row["replica"]] = (step, row["t"])
    return longest


def test_replica_job_loses_no_step_and_reports_its_pauses(tmp_path: Path, home: Path) -> None:
    cli = Cli(home)
    out = cli.run("up", str(_job(tmp_path)), timeout=400)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    run_id = out.stdout.split()[1].rstrip(":")
    assert "training finished" in out.stdout
    assert f"steps trained          {STEPS}" in out.stdout
    assert "preemptions survived   2" in out.stdout
    assert "steps lost             0" in out.stdout

    discarded = re.search(r"discarded attempts +(\d+)", out.stdout)
    assert discarded, out.stdout[-2000:]
    pause = re.search(r"longest pause +([0-9.]+) s", out.stdout)
    assert pause, out.stdout[-2000:]
    pause_s = float(pause.group(1))
    assert 0 < pause_s < PAUSE_BOUND_S
    # The summary's figure is the replicas' own: their per-step lines say the same, within
    # the few milliseconds between the line and the holder row.
    assert abs(_committed_gaps(tmp_path / "progress.jsonl") - pause_s) < 0.5

    events = cli.events(run_id)
    assert any("inject-preemption" in e and "notice=1" in e for e in events)
    assert any("inject-preemption" in e and "notice=0" in e for e in events)
    # Both backfills joined: two nodes launched after the first three took a replica slot,
    # joined, and their workers ended with the run (exit 0), none failed.
    launched = [_field(e, "node_name") for e in events if " launched " in e]
    backfills = launched[3:]
    assert len(backfills) == 2, launched

    def of(node: str, what: str) -> list[str]:
        return [e for e in events if e.split()[1:2] == [node] and what in e]

    for node in backfills:
        assert of(node, "replica-slot"), node
        assert of(node, "state=joined"), node
        assert of(node, "torchrun-exited") and all(
            "code=0" in e for e in of(node, "torchrun-exited")
        ), of(node, "torchrun")
    assert not [e for e in events if "state=failed" in e]

    report = cli.run("report", run_id, "--png", str(tmp_path / "report.png"))
    assert report.returncode == 0, report.stderr
    text = report.stdout
    assert re.search(r"replicas +\d+ slot\(s\) used, 3 taking part at most, quorum id \d+", text)
    assert " left on notice: step rate " in text and " killed: step rate " in text
    assert len(re.findall(r" joined: step rate ", text)) >= 2, text

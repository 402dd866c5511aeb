"""``spottrain up`` on a terminal, for real: a tiny local job driven in a pseudo-terminal
shows the code's archive line, then one view redrawn in place (the fleet table, the step
rising) and the final lines."""

from __future__ import annotations

import io
import os
import re
import sys
from pathlib import Path

import pexpect
import pytest
import yaml

from ._fleet import REPO

pytestmark = pytest.mark.slow

ESC = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")


def test_up_on_a_terminal_redraws_one_view_until_the_summary(home: Path, tmp_path: Path) -> None:
    job = {
        "name": "tiny",
        "code": {"archive": {"path": str(REPO)}},
        "train": {"command": "examples/gpt_train.py --steps 60 --every-steps 20 --step-time 0.1"},
        "nodes": {"min": 1, "max": 1, "gpus": 0, "workers": 1},
        "resources": {"clouds": ["local"]},
        "budget": {"max_usd": 50},
        "checkpoint": {
            "volume": {"path": str(tmp_path / "volume"), "write_gbps": 1},
            "every_steps": 20,
            "size_gb": 0.001,
        },
        "local": {"zones": {"local-a": {"capacity": 2}}, "notice_s": 20},
    }
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(job))
    env = {**os.environ, "SPOTTRAIN_HOME": str(home), "TERM": "xterm-256color"}
    env.pop("COLUMNS", None)
    env.pop("LINES", None)
    child = pexpect.spawn(
        sys.executable,
        ["-m", "spottrain.controller.cli", "up", str(spec)],
        env=env,
        cwd=str(REPO),
        dimensions=(30, 100),
        timeout=240,
    )
    child.logfile_read = io.BytesIO()
    try:
        child.expect(r"code archived: \d+ files")
        # The table's header (styles between its words).
        child.expect(r"(?:\s|\x1b\[[0-9;]*m)+".join(["zone", "type", "market", "nodes", "states"]))
        steps = set()
        while len(steps) < 2:
            child.expect(rb"step (?:\x1b\[[0-9;]*m)*([1-9]\d*)\b")
            steps.add(int(child.match.group(1)))
        child.expect("training finished")
        child.expect(pexpect.EOF)
        tail = ESC.sub(b"", child.before).decode()
    finally:
        child.close(force=True)
    raw = child.logfile_read.getvalue()
    assert "steps trained          60" in tail, tail
    assert child.exitstatus == 0
    # One view, redrawn: each frame after the first moves the cursor back over the last and
    # erases it; the steps rose between frames.
    frames = raw.count(b"spottrain  run ")
    assert frames >= 3 and raw.count(b"\x1b[1A") >= frames - 1
    assert len(steps) >= 2

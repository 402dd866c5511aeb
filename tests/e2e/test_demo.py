"""The README's main command runs: the spot demo trains to the last step, and the notice and
the systemd-style shutdown cost no steps."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.waits
def test_the_spot_demo_loses_no_step_to_a_notice_or_a_shutdown() -> None:
    res = subprocess.run(
        [sys.executable, str(REPO / "examples" / "spot_demo.py"), "--steps", "200"],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=REPO,
    )
    out = res.stdout
    assert res.returncode == 0, out[-3000:] + res.stderr[-3000:]
    assert "steps trained            200 of 200" in out
    for label in ("notice -> emergency checkpoint", "SIGTERM -> emergency checkpoint"):
        line = next(x for x in out.splitlines() if label in x)
        assert re.search(r", 0 steps redone", line), line


def test_a_demo_whose_training_ended_first_stops_with_a_plain_message(tmp_path: Path) -> None:
    """A fast machine can finish training before a scenario step: the demo must end at once
    and say so, not wait for a world size that can no longer form."""
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from demo_progress import Progress
    finally:
        sys.path.remove(str(REPO / "examples"))
    from spottrain.agent.testing.local_launcher import LocalElasticJob

    job = LocalElasticJob(tmp_path, "127.0.0.1:1", "ended-run", script="unused.py")
    # A node that trains five steps at world size 1 and exits, as a finished job does.
    lines = "".join(
        json.dumps({"t": 0.0, "node": "n", "rank": 0, "world": 1, "round": 0, "step": s}) + "\n"
        for s in range(1, 6)
    )
    write = f"open({str(job.progress)!r}, 'w').write({lines!r})"
    node = job._start("node-a", [sys.executable, "-c", write])
    try:
        started = time.monotonic()
        with pytest.raises(SystemExit) as ended:
            Progress(job).run_until(lambda: Progress(job).status()[1] == 3, 120, "world size 3")
        assert "training ended at step 5 before world size 3" in str(ended.value)
        assert "--steps" in str(ended.value)
        assert time.monotonic() - started < 60  # it did not wait for the timeout
    finally:
        node.kill()

"""The README's main command runs: the spot demo trains to the last step, and the notice and
the systemd-style shutdown cost no steps."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


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

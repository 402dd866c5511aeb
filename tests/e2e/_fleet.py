"""What the fleet end-to-end tests share: the ``spottrain`` CLI run in a subprocess against
a home of its own, polling until something holds, and ending every run a home left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def cli(home: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """``spottrain ARGS`` with ``SPOTTRAIN_HOME=home``, run from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", "spottrain.controller.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "SPOTTRAIN_HOME": str(home), "PYTHONUNBUFFERED": "1"},
        cwd=REPO,
        timeout=timeout,
    )


def wait(fn: Callable[[], Any], what: str, timeout: float = 120, poll: float = 1.0) -> Any:
    """Call ``fn`` every ``poll`` seconds until it returns something true, and return that.

    Raises:
        AssertionError: ``timeout`` seconds passed first.
    """
    deadline = time.monotonic() + timeout
    while not (value := fn()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll)
    return value


def down_every_run(home: Path, timeout: float = 180) -> None:
    """Whatever a failed test left: end every run of this home, at once."""
    for run in (home / "runs").glob("*") if (home / "runs").exists() else []:
        cli(home, "down", run.name, "--now", timeout=timeout)


class Cli:
    """The CLI bound to one home."""

    def __init__(self, home: Path) -> None:
        self.home = home

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return cli(self.home, *args, timeout=timeout)

    def status(self, run: str) -> dict[str, Any]:
        out = self.run("status", run, "--json")
        assert out.returncode == 0, out.stderr
        return dict(json.loads(out.stdout))

    def events(self, run: str) -> list[str]:
        return self.run("logs", run).stdout.splitlines()

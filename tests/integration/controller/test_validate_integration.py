"""``spottrain validate`` of a job's ``train.integration`` (issue 27), as a user runs it: a
plain script's line says what a notice gives it, ``--json`` names the integration, and
replica mode with anything but the SDK is refused in one line with the reason and the fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from spec_samples import LOCAL, spec_with

REPO = Path(__file__).resolve().parents[3]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spottrain.controller.cli", "validate", *args],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        cwd=REPO,
        timeout=120,
    )


def _write(tmp_path: Path, data: dict[str, object]) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_a_plain_jobs_validate_says_what_a_notice_gives_its_script(tmp_path: Path) -> None:
    spec = _write(tmp_path, spec_with(LOCAL, "train.integration", "plain"))
    out = _run(str(spec))
    assert out.returncode == 0, out.stderr
    assert (
        "  integration plain: on a notice the workers get SIGTERM at once and have until the "
        "deadline less the agent's notice margin (5 s) to save on their own; then SIGKILL\n"
    ) in out.stdout
    assert json.loads(_run(str(spec), "--json").stdout)["integration"] == "plain"
    sdk = _run(str(_write(tmp_path, LOCAL)))
    assert "integration" not in sdk.stdout
    assert json.loads(_run(str(tmp_path / "job.yaml"), "--json").stdout)["integration"] == "sdk"


def test_replica_mode_with_a_framework_is_refused_in_one_line(tmp_path: Path) -> None:
    data = spec_with(
        spec_with(LOCAL, "train.fault_tolerance", "replica"), "train.integration", "hf"
    )
    out = _run(str(_write(tmp_path, data)))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert lines[1:] == [
        "  train (line 5): integration hf cannot run in replica mode: replica mode drives "
        "torchft's manager and its DDP/HSDP wrappers from spottrain's TrainSession, and the "
        "Hugging Face Trainer owns its training loop and process group: use fault_tolerance: "
        "elastic, or train with the SDK (integration: sdk)"
    ]

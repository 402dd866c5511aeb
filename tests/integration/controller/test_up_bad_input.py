"""``spottrain up`` on bad input: Redis unreachable or refusing, a cloud refusing every
launch, a budget that cannot start a node. Each ends with a clear error, a non-zero exit,
and nothing left running."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from spec_samples import VALID, spec_with

from spottrain.cloud.local.compute import LocalProvider
from spottrain.cloud.local.settings import LocalSettings
from spottrain.controller.run.embedded_redis import RedisServer

REPO = Path(__file__).resolve().parents[3]
# VALID's 7B checkpoint does not fit GCP's notice window (`up` would stop at exit 3): 1B does.
FITS = spec_with(VALID, "checkpoint.params", "1B")


def _up(
    home: Path, spec: dict[str, Any], tmp: Path, *args: str, **env: str
) -> subprocess.CompletedProcess[str]:
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "spottrain.controller.cli",
            "up",
            str(path),
            "--interval",
            "0.2",
            *args,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "SPOTTRAIN_HOME": str(home), **env},
        cwd=REPO,
        timeout=120,
    )


def _local_spec(tmp: Path, budget: float = 50) -> dict[str, Any]:
    code = tmp / "code"
    code.mkdir(exist_ok=True)
    (code / "train.py").write_text("print('never runs')\n")
    return {
        "name": "bad",
        "code": {"archive": {"path": str(code)}},
        "train": {"command": "train.py"},
        "nodes": {"min": 1, "max": 2, "gpus": 0},
        "resources": {"clouds": ["local"]},
        "budget": {"max_usd": budget},
        "checkpoint": {"volume": {"path": str(tmp / "vol"), "write_gbps": 1}, "every_steps": 10},
        "local": {"zones": {"local-a": {"capacity": 2}}},
    }


def _no_vms(home: Path) -> None:
    instances = home / "local" / "instances"
    records = [p for p in instances.glob("*.json")] if instances.exists() else []
    assert records == [], f"VMs were created: {records}"


def _no_redis_left(home: Path) -> None:
    """The run's embedded Redis ended with it: nothing answers on its port."""
    runs = list(home.glob("runs/*/run.json"))
    assert runs, "the run left no record"
    for run in runs:
        url = json.loads(run.read_text())["redis_url"]
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        with socket.socket() as s, pytest.raises(OSError):
            s.settimeout(1)
            s.connect(("127.0.0.1", port))


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_redis_is_a_clear_error_before_anything_launches(tmp_path: Path) -> None:
    spec = spec_with(FITS, "redis", {"url": f"redis://127.0.0.1:{_dead_port()}"})
    out = _up(tmp_path / "home", spec, tmp_path)
    assert out.returncode == 1
    assert "spottrain: " in out.stderr and "127.0.0.1" in out.stderr
    assert "Traceback" not in out.stderr


def test_redis_that_wants_a_password_says_how_to_give_it(tmp_path: Path) -> None:
    with RedisServer(password="s3cret") as server:
        spec = spec_with(FITS, "redis", {"url": f"redis://{server.endpoint}"})
        out = _up(tmp_path / "home", spec, tmp_path)
    assert out.returncode == 1
    assert "SPOTTRAIN_REDIS_PASSWORD" in out.stderr, out.stderr
    assert "s3cret" not in out.stderr + out.stdout


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("auth", "refused (injected auth refusal)"),
        ("quota", "every allowed offer was refused by its cloud"),
    ],
)
def test_a_cloud_refusing_every_launch_ends_the_run_with_nothing_leaked(
    tmp_path: Path, kind: str, expected: str
) -> None:
    home = tmp_path / "home"
    cloud = LocalProvider(LocalSettings(home / "local", zones={"local-a": 2}))
    cloud.set_refusal(kind)
    out = _up(home, _local_spec(tmp_path), tmp_path)
    assert out.returncode == 1, out.stdout[-2000:]
    assert expected in out.stdout + out.stderr
    _no_vms(home)
    _no_redis_left(home)


def test_a_budget_that_cannot_start_a_node_is_refused(tmp_path: Path) -> None:
    home = tmp_path / "home"
    out = _up(home, _local_spec(tmp_path, budget=1), tmp_path)
    assert out.returncode == 1
    assert "cannot cover an hour of the cheapest node" in out.stdout
    assert "raise budget.max_usd" in out.stdout
    _no_vms(home)
    _no_redis_left(home)
    # The run ended on its own: its embedded Redis is gone too.
    status = subprocess.run(
        [sys.executable, "-m", "spottrain.controller.cli", "status", "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "SPOTTRAIN_HOME": str(home)},
        cwd=REPO,
    )
    assert status.returncode == 0 and '"phase": "failed"' in status.stdout


def _too_big_for_the_window(spec: dict[str, Any]) -> dict[str, Any]:
    # 100 GB at 1 GB/s: 100 s, past the local cloud's 30 s notice window.
    return spec_with(spec, "checkpoint", {**spec["checkpoint"], "size_gb": 100})


def test_up_refuses_a_checkpoint_that_does_not_fit_a_notice_window(tmp_path: Path) -> None:
    home = tmp_path / "home"
    out = _up(home, _too_big_for_the_window(_local_spec(tmp_path)), tmp_path)
    assert out.returncode == 3, out.stderr
    # The same line as `spottrain validate`, with the parts of the window model.
    assert (
        "local: 100 GB at 1 GB/s takes 100.0 s; with 2.0 s to see the notice, 0.6 s to read "
        "the request and agree on the step"
    ) in out.stderr
    assert "of the 30 s notice window: does NOT fit: 83 s short" in out.stderr
    assert "nothing launched" in out.stderr and "--force" in out.stderr
    assert not list(home.glob("runs/*/run.json")), "a run was created"
    _no_vms(home)


def test_up_force_launches_past_the_window_and_records_a_warning(tmp_path: Path) -> None:
    home = tmp_path / "home"
    # budget=1 cannot start a node: the run ends on its own once it has begun.
    spec = _too_big_for_the_window(_local_spec(tmp_path, budget=1))
    out = _up(home, spec, tmp_path, "--force")
    assert out.returncode == 1, out.stderr
    assert "warning (--force): local: 100 GB" in out.stderr
    assert "cannot cover an hour of the cheapest node" in out.stdout
    logs = subprocess.run(
        [sys.executable, "-m", "spottrain.controller.cli", "logs"],
        capture_output=True,
        text=True,
        env={**os.environ, "SPOTTRAIN_HOME": str(home)},
        cwd=REPO,
        timeout=60,
    )
    assert logs.returncode == 0, logs.stderr
    warnings = [line for line in logs.stdout.splitlines() if "notice-window" in line]
    assert len(warnings) == 1 and "does NOT fit: 83 s short" in warnings[0], logs.stdout
    _no_vms(home)
    _no_redis_left(home)

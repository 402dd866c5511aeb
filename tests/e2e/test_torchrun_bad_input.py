"""Bad input through the real torchrun command line: each fails fast with one line that names
the cause."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.ports import free_port

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).resolve().parents[2] / "examples" / "elastic_train.py")


def torchrun(endpoint: str, conf: str = "", env: dict[str, str] | None = None) -> str:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--rdzv-backend=redis",
        f"--rdzv-endpoint={endpoint}",
        "--rdzv-id=bad-input",
    ]
    if conf:
        cmd.append(f"--rdzv-conf={conf}")
    cmd += [SCRIPT, "--ckpt-dir", "/nonexistent", "--progress", "/dev/null"]
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})}
    )
    assert out.returncode != 0
    return out.stderr


def last_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if "Error:" in ln]
    assert lines, stderr[-2000:]
    return lines[-1]


# One bad endpoint and one bad conf: every conf error leaves torchrun the same way (the conf
# is parsed whole before anything connects), and tests/unit/agent/test_rdzv_config.py checks
# each message (a bad value, a non-boolean tls, an unknown key) without a torchrun each.
@pytest.mark.parametrize(
    ("endpoint", "conf", "needle"),
    [
        ("127.0.0.1:notaport", "", "port 'notaport' must be a number"),
        ("127.0.0.1:6379", "password=hunter2", "rdzv conf 'password' is refused"),
    ],
)
def test_malformed_endpoint_or_conf_fails_with_one_line_naming_it(
    endpoint: str, conf: str, needle: str
) -> None:
    stderr = torchrun(endpoint, conf)
    line = last_error_line(stderr)
    assert needle in line
    assert "hunter2" not in stderr


def test_unreachable_redis_fails_with_one_line_naming_the_address() -> None:
    port = free_port()
    line = last_error_line(torchrun(f"127.0.0.1:{port}", "socket_timeout=1"))
    assert "cannot reach Redis" in line and str(port) in line


def test_wrong_password_fails_with_one_line_saying_so(tmp_path: Path) -> None:
    with RedisServer(data_dir=tmp_path, password="right") as server:
        line = last_error_line(torchrun(server.endpoint, env={"SPOTTRAIN_REDIS_PASSWORD": "no"}))
        assert "refused the password" in line
        line = last_error_line(torchrun(server.endpoint, env={"SPOTTRAIN_REDIS_PASSWORD": ""}))
        assert "requires a password" in line

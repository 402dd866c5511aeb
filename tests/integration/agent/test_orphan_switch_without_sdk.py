"""The dead man's switch of a real agent whose script does not use the SDK (it reports no
step): no controller at all, yet the VM stays while the script's workers compute, and ends
itself once they idle for the orphan timeout. What counts as training for such a script is
the CPU its workers use (agent/orphan.py); every wait here ends on a condition."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import redis

from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys

AGENT = [sys.executable, "-m", "spottrain.agent.cli"]
TIMEOUT_S = 3.0


# A script without the SDK: it burns CPU (and says how much) until told to stop, then idles.
BURN = """
import os, sys, time
stop, progress = sys.argv[1], sys.argv[2]
while not os.path.exists(stop):
    start = time.process_time()
    while time.process_time() - start < 0.1:
        pass
    with open(progress + ".part", "w") as f:
        f.write(f"{time.process_time():.2f}")
    os.replace(progress + ".part", progress)
while True:
    time.sleep(1)
"""


def _burnt(progress: Path) -> float:
    try:
        return float(progress.read_text())
    except (OSError, ValueError):
        return 0.0


def test_a_script_without_the_sdk_keeps_its_vm_while_its_workers_compute(
    redis_server: RedisServer, redis_client: redis.Redis, run_keys: RunKeys, tmp_path: Path
) -> None:
    timeout = TIMEOUT_S
    script, stop, progress, ended = (tmp_path / n for n in ("burn.py", "stop", "cpu", "ended"))
    script.write_text(BURN)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPOTTRAIN_")}
    agent = subprocess.Popen(
        [
            *AGENT,
            "run",
            f"--redis={redis_server.endpoint}",
            f"--run-id={run_keys.run_id}",
            "--node-id=n1",
            "--no-health-check",
            "--max-restarts=0",
            f"--orphan-timeout={timeout:g}",
            f"--self-terminate-cmd=touch {ended}",
            # No checkpoint can come from this script: the drain waits 1 s for none.
            "--sigterm-grace=6",
            "--notice-margin=5",
            "--",
            str(script),
            str(stop),
            str(progress),
        ],
        env={**clean, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Well past two orphan timeouts of computing (CPU seconds never exceed wall seconds).
        wait_for(
            lambda: _burnt(progress) >= 2 * timeout or ended.exists() or agent.poll() is not None,
            "the workers to compute for two orphan timeouts",
        )
        assert not ended.exists(), "the VM ended while its workers were computing"
        assert agent.poll() is None
        stop.touch()
        wait_for(lambda: agent.poll() is not None, "the agent to end its idle VM")
        assert ended.exists()
    finally:
        if agent.poll() is None:
            agent.kill()
        _, err = agent.communicate()
    events = [
        {k.decode(): v.decode() for k, v in f.items()}
        for _, f in redis_client.xrange(run_keys.events)
    ]
    (orphan,) = [e for e in events if e["type"] == "orphaned"]
    assert "no step reported (the SDK's) and its workers used" in orphan["reason"], err


def wait_for(cond: Callable[[], bool], what: str, limit_s: float = 120.0) -> None:
    """Poll ``cond`` until it holds; fail naming ``what`` after ``limit_s`` (a deadlock guard,
    not a pace)."""
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, f"waited {limit_s:g} s for {what}"
        time.sleep(0.05)

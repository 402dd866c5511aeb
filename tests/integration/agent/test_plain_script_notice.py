"""A plain torchrun script (``train.integration: plain``: it imports nothing of spottrain's)
under a real agent and a real torchrun on the CPU: a notice SIGTERMs its workers at once,
so the script has the whole window less the agent's notice margin to save on its own, not
the margin alone (issue 27). Every wait here ends on a condition."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import redis

from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.env import ENV_INTEGRATION
from spottrain.protocol.keys import RunKeys
from spottrain.protocol.notices import inject_notice

AGENT = [sys.executable, "-m", "spottrain.agent.cli"]
NOTICE_IN_S = 60.0
MARGIN_S = 5.0
SIGTERM_GRACE_S = 200.0

# What a user writes: a SIGTERM handler that only raises a flag, and a loop that saves (to a
# temporary name, then an atomic rename) once it sees it, and exits 0. The save takes a few
# seconds, as a real state would; the handler may run twice (torchrun passes SIGTERM on).
PLAIN = """
import json, os, signal, sys, time
out = sys.argv[1]
with open(os.path.join(out, "env.json"), "w") as f:
    json.dump({k: v for k, v in os.environ.items() if k.startswith(("SPOTTRAIN_", "TORCH_"))}, f)
stop = []
def on_sigterm(signum, frame):
    if not stop:
        stop.append(time.time())
signal.signal(signal.SIGTERM, on_sigterm)
open(os.path.join(out, "ready"), "w").close()
while not stop:
    time.sleep(0.05)
with open(os.path.join(out, "sigterm_at"), "w") as f:
    f.write(repr(stop[0]))
tmp = os.path.join(out, "ckpt.tmp")
with open(tmp, "wb") as f:
    for i in range(6):
        f.write(bytes([i]) * 1024)
        f.flush()
        time.sleep(0.5)
    os.fsync(f.fileno())
os.replace(tmp, os.path.join(out, "ckpt.bin"))
sys.exit(0)
"""


def test_a_plain_script_gets_sigterm_at_once_on_a_notice_and_saves_whole(
    redis_server: RedisServer, redis_client: redis.Redis, run_keys: RunKeys, tmp_path: Path
) -> None:
    agent, out = start_agent(PLAIN, redis_server, run_keys, tmp_path)
    try:
        wait_for(
            lambda: ((out / "ready").exists() and _joined(redis_client, run_keys)) or _ended(agent),
            "the worker to start and the node to join",
        )
        assert agent.poll() is None, agent.communicate()[1]
        inject_notice(redis_client, run_keys, "n1", "terminate", NOTICE_IN_S)
        wait_for(lambda: _ended(agent), "the agent to drain and end", limit_s=NOTICE_IN_S + 60)
    finally:
        if agent.poll() is None:
            agent.kill()
        _, err = agent.communicate()
    events = _events(redis_client, run_keys)
    (notice,) = [e for e in events if e["type"] == "notice"]
    deadline = float(notice["deadline"])
    sigterm_at = float((out / "sigterm_at").read_text())
    # Today's agent waited for a commit that never came: SIGTERM ~5 s before the deadline.
    assert deadline - sigterm_at >= 30, (deadline - sigterm_at, err)
    assert (out / "ckpt.bin").read_bytes() == b"".join(bytes([i]) * 1024 for i in range(6))
    assert not (out / "ckpt.tmp").exists()
    env = json.loads((out / "env.json").read_text())
    # The worker can check the spec's integration; its torchrun kills it no sooner than the
    # agent's longest window.
    assert env[ENV_INTEGRATION] == "plain"
    assert int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) >= SIGTERM_GRACE_S
    signals = [e for e in events if e["type"] == "workers-signalled"]
    assert len(signals) == 1, [e["type"] for e in events]
    signalled = signals[0]
    assert float(signalled["window_s"]) >= 30
    assert float(signalled["margin_s"]) == MARGIN_S
    assert not any(e["type"] == "checkpoint-requested" for e in events)
    assert not any(e["type"] == "workers-killed" for e in events), err
    (drained,) = [e for e in events if e["type"] == "drained"]
    assert json.loads(drained["left_rendezvous"]) is True, drained
    # A drain's exit 0 is not the end of training.
    assert redis_client.hget(run_keys.progress, "finished") is None
    assert not any(e["type"] == "script-finished" for e in events)


def test_a_plain_script_that_ends_by_itself_ends_the_run(
    redis_server: RedisServer, redis_client: redis.Redis, run_keys: RunKeys, tmp_path: Path
) -> None:
    # Its workers all return 0, which torchrun takes for the job done: the agent says so to
    # the run, or the controller would take the node for lost and backfill it.
    agent, _ = start_agent("import sys; sys.exit(0)", redis_server, run_keys, tmp_path)
    try:
        wait_for(lambda: _ended(agent), "the agent to end")
    finally:
        if agent.poll() is None:
            agent.kill()
        _, err = agent.communicate()
    assert agent.returncode == 0, err
    assert redis_client.hget(run_keys.progress, "finished") == b"1"
    assert [e for e in _events(redis_client, run_keys) if e["type"] == "script-finished"]


def start_agent(
    text: str, redis_server: RedisServer, run_keys: RunKeys, tmp_path: Path
) -> tuple[subprocess.Popen[str], Path]:
    """The real agent of node n1, running script ``text`` (given its output folder) under
    torchrun as a spec with ``train.integration: plain`` would."""
    script, out = tmp_path / "plain.py", tmp_path / "out"
    script.write_text(text)
    out.mkdir()
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
            "--poll-interval=0.2",
            f"--notice-margin={MARGIN_S:g}",
            # A SIGTERM's window past torchrun's default of 150 s: torchrun must not cut it.
            f"--sigterm-grace={SIGTERM_GRACE_S:g}",
            "--",
            str(script),
            str(out),
        ],
        # As the boot script sets it for a spec with train.integration: plain.
        env={**clean, ENV_INTEGRATION: "plain", "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    return agent, out


def _joined(client: redis.Redis, keys: RunKeys) -> bool:
    raw = client.hget(keys.node("n1"), "state")
    return raw is not None and raw.decode() == "joined"


def _ended(agent: subprocess.Popen[str]) -> bool:
    return agent.poll() is not None


def _events(client: redis.Redis, keys: RunKeys) -> list[dict[str, str]]:
    return [
        {k.decode(): v.decode() for k, v in fields.items()}
        for _, fields in client.xrange(keys.events)
    ]


def wait_for(cond: Callable[[], bool], what: str, limit_s: float = 120.0) -> None:
    """Poll ``cond`` until it holds; fail naming ``what`` after ``limit_s`` (a deadlock guard,
    not a pace)."""
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, f"waited {limit_s:g} s for {what}"
        time.sleep(0.05)

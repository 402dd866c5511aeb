"""The agent's shutdown, through the real ``spottrain-agent run``: a SIGTERM ends it within
the last flush's bound even when its logs store hangs (an S3 endpoint that takes requests
and never answers), and with a store that answers, what the agent wrote while it drained
is in the last chunk shipped.

The agent runs as the unit runs it (its output appended to the file it ships) and is kept
alive without torchrun: its worker user does not exist, so it fails its start, and with
``--orphan-timeout`` it then waits for its VM to be ended, as an agent whose training ended
does, until the SIGTERM."""

from __future__ import annotations

import gzip
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from spottrain.agent.config import EXIT_CONFIG
from spottrain.agent.logship.shipper import FINAL_FLUSH_S
from spottrain.cloud.storage import LocalStore
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.node_logs import parse_chunk_key

SLACK_S = 5.0  # what a loaded machine may add to the bound
LINGERING = b"torchrun ended: waiting for the VM to be ended"


class Blackhole:
    """A TCP server that reads each request and never answers: a hung S3 endpoint."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests = 0
        self._held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            self._held.append(conn)
            if conn.recv(65536):
                self.requests += 1

    def close(self) -> None:
        self.sock.close()
        for conn in self._held:
            conn.close()


@pytest.fixture
def blackhole() -> Iterator[Blackhole]:
    hole = Blackhole()
    yield hole
    hole.close()


def _agent(
    redis_server: RedisServer, log: Path, logs_to: str, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTTRAIN_", "AWS_"))}
    argv = [
        *(sys.executable, "-m", "spottrain.agent.cli", "run", f"--redis={redis_server.url}"),
        *("--run-id=run-1", "--node-id=n1", "--no-health-check", "--orphan-timeout=3600"),
        "--worker-user=spottrain-no-such-user",
        *(f"--logs-file={log}", f"--logs-to={logs_to}", "--vm-id=vm-1"),
        "--logs-chunk-seconds=1",  # its first lines are cut, and put, while it lingers
        *("--", "train.py"),
    ]
    with log.open("ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=out, env={**clean, **env})


def _wait(what: Callable[[], bool], proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while not what():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


def _sigterm(proc: subprocess.Popen[bytes]) -> tuple[int, float]:
    """SIGTERM the agent; its exit code and how long it took to exit."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return code, time.monotonic() - t0


def test_a_sigterm_ends_the_agent_within_the_flush_bound_while_its_store_hangs(
    redis_server: RedisServer, blackhole: Blackhole, tmp_path: Path
) -> None:
    log = tmp_path / "node.log"
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": blackhole.url,
    }
    proc = _agent(redis_server, log, "s3://spottrain-logs/logs", env)
    _wait(lambda: LINGERING in log.read_bytes() and blackhole.requests > 0, proc, log)
    # A put is in flight and will not be answered for minutes (boto3's 60 s read timeout,
    # then its retries): the agent's drain and last flush must not wait for it.
    code, took = _sigterm(proc)
    text = log.read_text()
    assert code == EXIT_CONFIG, text
    assert took < FINAL_FLUSH_S + SLACK_S, f"the agent took {took:.1f}s to exit\n{text}"
    assert "log shipping:" in text and "of this node's output were not shipped" in text


def test_what_the_agent_writes_while_it_drains_is_in_its_last_chunk(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    log, store = tmp_path / "node.log", tmp_path / "store"
    store.mkdir()
    proc = _agent(redis_server, log, str(store), {})
    reader = LocalStore(str(store))
    # Its lines so far are shipped: what follows the SIGTERM is left to the drain's flush.
    _wait(lambda: LINGERING in log.read_bytes() and reader.list("run-1/n1/vm-1/"), proc, log)
    code, took = _sigterm(proc)
    console = log.read_bytes()
    assert code == EXIT_CONFIG, console.decode()
    assert took < FINAL_FLUSH_S + SLACK_S
    names = sorted(n for n in map(parse_chunk_key, reader.list("run-1/n1/")) if n)
    assert [n.seq for n in names] == list(range(len(names))) and len(names) >= 2
    bodies = [gzip.decompress(reader.get_bytes(n.key())) for n in names]
    assert b"".join(bodies) == console  # everything, nothing after the last chunk
    # The SIGTERM's notice, logged as the drain began, came after the chunks before it.
    assert b"WARNING notice:" in bodies[-1] and b'"kind": "sigterm"' in bodies[-1]
    assert b"WARNING notice:" not in b"".join(bodies[:-1])

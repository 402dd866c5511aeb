"""A VM killed mid-chunk, against moto's S3 and the GCS fake: the shipper runs in a process
of its own (as in the agent), ships a few chunks, and is SIGKILLed with a chunk half
filled. Every chunk it shipped reads back whole (one gzip member of whole lines, numbered
with no gaps), and what is lost is only what was written after the last cut. And an
agent that cannot start ships why."""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from fakes.gcs_server import GcsServer
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage as gcs
from moto.server import ThreadedMotoServer

from spottrain.cloud.aws.s3 import S3Store
from spottrain.cloud.gcp.gcs import GcsStore
from spottrain.cloud.storage import LocalStore, ObjectStore
from spottrain.ports import free_port
from spottrain.protocol.node_logs import node_prefix, parse_chunk_key

BUCKET = "spottrain-logs"
LINE = 500  # bytes a line
CHUNK = 20 * LINE  # --logs-chunk-mb 0.01 (the smallest the spec allows): twenty lines a chunk


def _aws() -> Any:
    return boto3.Session(
        aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
    )


@pytest.fixture(scope="module")
def s3() -> Iterator[tuple[str, dict[str, str], ObjectStore]]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    _aws().client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": endpoint,
    }
    reader = S3Store(BUCKET, "runs/logs", session=_aws(), endpoint_url=endpoint)
    yield f"s3://{BUCKET}/runs/logs", env, reader
    server.stop()


@pytest.fixture(scope="module")
def gs() -> Iterator[tuple[str, dict[str, str], ObjectStore]]:
    with GcsServer() as server:
        server.create_bucket(BUCKET)
        client = gcs.Client(
            project="test",
            credentials=AnonymousCredentials(),
            client_options={"api_endpoint": server.url},
        )
        env = {"STORAGE_EMULATOR_HOST": server.url, "GOOGLE_CLOUD_PROJECT": "test"}
        yield f"gs://{BUCKET}/runs/logs", env, GcsStore(BUCKET, "runs/logs", client=client)


def _line(i: int) -> bytes:
    return (f"{i:06d} step {i} loss 0.{i:04d} " + "x" * LINE)[: LINE - 1].encode() + b"\n"


def _wait(what: Callable[[], bool], proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        assert time.monotonic() < deadline, "the shipper did not ship in time"
        time.sleep(0.05)


@pytest.mark.parametrize("backend", ["s3", "gs"])
def test_a_vm_killed_mid_chunk_loses_only_its_unshipped_tail(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url, env, reader = request.getfixturevalue(backend)
    log = tmp_path / "node.log"
    log.touch()
    node = f"node-{backend}"
    # Cut by size only: a time cut must not race the kill.
    args = ["--node-id", node, "--vm-id", "vm-1", "--logs-to", url, "--logs-file", str(log)]
    sizes = ["--logs-chunk-mb", f"{CHUNK / 1e6}", "--logs-chunk-seconds", "3600"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "spottrain.agent.logship", "--run-id", "run-1", *args, *sizes],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    prefix = node_prefix("run-1", node)
    try:
        written = b""
        with log.open("ab") as f:
            for i in range(100):  # five whole chunks
                f.write(_line(i))
            f.flush()
            written = b"".join(_line(i) for i in range(100))
            _wait(lambda: len(reader.list(prefix)) >= 5, proc, timeout=60)
            for i in range(100, 110):  # half of the sixth
                f.write(_line(i))
            f.flush()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    keys = reader.list(prefix)
    names = [parse_chunk_key(k) for k in keys]
    assert all(n is not None and n.vm == "vm-1" for n in names), keys
    assert sorted(n.seq for n in names if n) == list(range(len(keys))), "a gap in the chunks"
    bodies = [gzip.decompress(reader.get_bytes(k)) for k in sorted(keys)]
    assert all(len(b) == CHUNK and b.endswith(b"\n") for b in bodies)
    shipped = b"".join(bodies)
    assert shipped == written[: len(shipped)] and len(shipped) == 5 * CHUNK
    # The loss is the half-filled chunk: the ten lines written after the last cut.
    lost = b"".join(_line(i) for i in range(100, 110))
    assert log.read_bytes() == shipped + lost and len(lost) < CHUNK


def test_an_agent_that_cannot_start_ships_why(tmp_path: Path) -> None:
    # As the unit runs it: the agent's stdout and stderr appended to the file it ships.
    log, store = tmp_path / "node.log", tmp_path / "store"
    store.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTTRAIN_")}
    with log.open("ab") as out:
        where = [f"--redis=redis://127.0.0.1:{free_port()}", "--run-id=run-1", "--node-id=n1"]
        logs = [f"--logs-file={log}", f"--logs-to={store}", "--vm-id=vm-9"]
        res = subprocess.run(
            [sys.executable, "-m", "spottrain.agent.cli", "run", *where, *logs, "--", "t.py"],
            stdout=out,
            stderr=out,
            env=env,
            timeout=60,
        )
    assert res.returncode == 2
    reader = LocalStore(str(store))
    shipped = b"".join(gzip.decompress(reader.get_bytes(k)) for k in reader.list("run-1/n1/vm-9/"))
    assert b"INFO log shipping:" in shipped and b"ERROR stopped:" in shipped, shipped
    assert b"Redis" in shipped.split(b"ERROR stopped:")[1]

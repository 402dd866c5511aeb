"""The run's torchft lighthouse: the real binary, kept up by the controller's supervisor on
its port, its address in the run's (real) Redis, gone when the run ends, surviving a
controller that dies; and `status` of a replica run."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from spec_samples import LOCAL

from spottrain.controller.reconcile.state import RunState
from spottrain.controller.run.lighthouse import (
    INSTALL_HINT,
    _alive,
    find_lighthouse_binary,
    running_pid,
    serving,
    start_lighthouse,
)
from spottrain.controller.run.records import RunError, RunInfo
from spottrain.controller.run.run_lighthouse import end_lighthouse, supervise_lighthouse
from spottrain.controller.run.run_redis import open_redis
from spottrain.ports import free_port
from spottrain.protocol.keys import RunKeys

torchft = pytest.importorskip("torchft._torchft", reason="needs the replica extra")


def _wait(cond: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def run_info(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_server: Any, run_keys: RunKeys
) -> Iterator[RunInfo]:
    """A replica run's record (its lighthouse on a free loopback port); whatever lighthouse
    it started is stopped afterwards, even when the test failed."""
    monkeypatch.setenv("SPOTTRAIN_HOME", str(tmp_path / "home"))
    address = f"127.0.0.1:{free_port()}"
    info = RunInfo(
        run_id=run_keys.run_id,
        spec_text=yaml.safe_dump(LOCAL),
        spec_source="job.yaml",
        base_dir=str(tmp_path),
        redis_url=redis_server.endpoint,
        embedded_redis=False,
        created_at=time.time(),
        lighthouse=address,
        lighthouse_bind=address,
    )
    info.save()
    yield info
    pid = running_pid(info.dir, address)
    end_lighthouse(info)
    if pid is not None and _alive(pid):
        os.kill(pid, signal.SIGKILL)


def _quorum(client: Any, replica: str, step: int) -> Any:
    return client.quorum(
        replica_id=replica,
        timeout=timedelta(seconds=30),
        address=f"http://{replica}:1",
        store_address=f"{replica}:2",
        step=step,
        world_size=1,
    )


@contextlib.contextmanager
def _heartbeating(address: str, replica: str) -> Iterator[None]:
    """What a replica's manager does beside its quorum call (the call itself beats once)."""
    stop = threading.Event()

    def beat() -> None:
        client = torchft.LighthouseClient(f"http://{address}", timedelta(seconds=10))
        while not stop.wait(0.1):
            client.heartbeat(replica)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def test_a_killed_lighthouse_serves_again_on_its_port_with_its_address_rewritten(
    run_info: RunInfo, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    state = RunState(redis_client, run_keys)
    keeper = supervise_lighthouse(run_info, state)
    assert keeper is not None
    try:
        address = run_info.lighthouse
        assert redis_client.get(run_keys.replica_lighthouse) == address.encode()
        client = torchft.LighthouseClient(f"http://{address}", timedelta(seconds=10))
        assert _quorum(client, "replica-0", 5).quorum_id == 1
        # replica-0 stops heartbeating: the quorum of replica-1 forms once it expired.
        with _heartbeating(address, "replica-1"):
            assert _quorum(client, "replica-1", 6).quorum_id == 2

        first = running_pid(run_info.dir, address)
        assert first is not None
        redis_client.delete(run_keys.replica_lighthouse)
        killed_at = time.monotonic()
        os.kill(first, signal.SIGKILL)
        _wait(lambda: not serving(address, timeout=0.2), "the killed lighthouse to stop serving")
        _wait(lambda: serving(address, timeout=0.2), "the lighthouse to serve again")
        downtime = time.monotonic() - killed_at
        again = running_pid(run_info.dir, address)
        assert again is not None and again != first and not _alive(first)
        _wait(lambda: redis_client.get(run_keys.replica_lighthouse) is not None, "the address")
        assert redis_client.get(run_keys.replica_lighthouse) == address.encode()

        # The same client reaches the new process; the stock lighthouse starts its ids over.
        assert _quorum(client, "replica-1", 7).quorum_id == 1
        restarts = [e for e in state.events() if e["type"] == "lighthouse-restart"]
        assert len(restarts) == 1 and restarts[0]["address"] == address
        assert restarts[0]["restarts"] == "1" and float(restarts[0]["down_s"]) > 0
        print(f"lighthouse downtime after kill -9, until it serves again: {downtime:.3f} s")
    finally:
        keeper.stop()
    end_lighthouse(run_info)
    assert running_pid(run_info.dir, run_info.lighthouse) is None
    assert again is not None and not _alive(again)
    assert not serving(run_info.lighthouse, timeout=0.5)


def test_the_lighthouse_outlives_a_controller_that_dies_and_down_stops_it(
    run_info: RunInfo, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    # A controller process starts it and dies (SIGKILL, no cleanup of its own).
    code = (
        "import sys, time; from pathlib import Path\n"
        "from spottrain.controller.run.lighthouse import start_lighthouse\n"
        "start_lighthouse(Path(sys.argv[1]), sys.argv[2], 1)\n"
        "print('up', flush=True); time.sleep(600)\n"
    )
    controller = subprocess.Popen(
        [sys.executable, "-c", code, str(run_info.dir), run_info.lighthouse_bind],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert controller.stdout is not None and controller.stdout.readline() == "up\n"
    finally:
        controller.kill()
        controller.wait()
    pid = running_pid(run_info.dir, run_info.lighthouse_bind)
    assert pid is not None and serving(run_info.lighthouse)
    # The next controller adopts it rather than starting another.
    keeper = supervise_lighthouse(run_info, RunState(redis_client, run_keys))
    assert keeper is not None
    keeper.stop()
    assert running_pid(run_info.dir, run_info.lighthouse_bind) == pid
    end_lighthouse(run_info)  # what `down` does
    assert not _alive(pid) and not serving(run_info.lighthouse, timeout=0.5)


def test_a_missing_lighthouse_binary_says_how_to_install_it(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    with pytest.raises(RunError) as e:
        find_lighthouse_binary(str(tmp_path / "bin" / "python"))
    assert "\n" not in str(e.value) and INSTALL_HINT in str(e.value)
    assert "train.fault_tolerance" in str(e.value)


def test_a_port_taken_by_something_else_is_a_one_line_error(tmp_path: Path) -> None:
    import socket

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        bind = f"127.0.0.1:{squatter.getsockname()[1]}"
        with pytest.raises(RunError, match="did not start") as e:
            start_lighthouse(tmp_path, bind, 1, timeout=30)
    assert "\n" not in str(e.value)
    assert running_pid(tmp_path, bind) is None


def test_status_shows_the_replicas_and_the_lighthouse(
    run_info: RunInfo,
    redis_client: redis.Redis,
    run_keys: RunKeys,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from spottrain.controller.cli import main as cli

    now = time.time()
    redis_client.hset(
        run_keys.replica_slots,
        mapping={
            "replica-0": json.dumps({"nodes": ["n0"], "at": now}),
            "replica-1": json.dumps({"nodes": ["n1"], "at": now}),
            "replica-10": json.dumps({"nodes": ["n5"], "at": now}),
        },
    )
    holder = {"step": 41, "quorum_id": 3, "participants": 2, "discarded": 1, "at": now - 4}
    redis_client.hset(
        run_keys.replica_holders,
        mapping={
            "replica-0": json.dumps({**holder, "state": "live"}),
            "replica-1": json.dumps({**holder, "state": "leaving", "discarded": 0}),
        },
    )
    assert cli.main(["status", run_info.run_id]) == 0
    out = capsys.readouterr().out.splitlines()
    at = out.index(f"  lighthouse {run_info.lighthouse} DOWN")  # nothing listens there
    assert out[at + 1] == "  replicas: 3 (1 live)"
    line, _, seen = out[at + 2].partition("  seen ")
    assert " ".join(line.split()) == (
        "replica-0 live nodes n0 step 41 quorum 3 (2 taking part) discarded 1"
    )
    assert seen.endswith("s ago") and 4 <= int(seen.removesuffix("s ago")) < 60
    assert out[at + 3].split()[:3] == ["replica-1", "leaving", "nodes"]
    assert out[at + 4].split()[:4] == ["replica-10", "joining", "nodes", "n5"]

    assert cli.main(["status", run_info.run_id, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["lighthouse"] == {"address": run_info.lighthouse, "up": False}
    assert [r["replica_id"] for r in doc["replicas"]] == ["replica-0", "replica-1", "replica-10"]
    assert doc["replicas"][0]["nodes"] == ["n0"] and doc["replicas"][0]["discarded"] == 1


def test_status_of_an_elastic_run_has_no_replica_lines(
    run_info: RunInfo, capsys: pytest.CaptureFixture[str]
) -> None:
    from spottrain.controller.cli import main as cli

    run_info.lighthouse = run_info.lighthouse_bind = ""
    run_info.save()
    assert cli.main(["status", run_info.run_id]) == 0
    assert "lighthouse" not in capsys.readouterr().out
    assert cli.main(["status", run_info.run_id, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert "replicas" not in doc and "lighthouse" not in doc


def _replica_job(tmp_path: Path, quorum: str = "lighthouse") -> Path:
    replica = {"fault_tolerance": "replica", "replica": {"quorum": quorum}}
    job = {**LOCAL, "train": {**LOCAL["train"], **replica}}
    path = tmp_path / f"job-{quorum}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_up_of_a_replica_job_without_the_extra_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from spottrain.controller.cli import main as cli

    monkeypatch.setenv("SPOTTRAIN_HOME", str(tmp_path / "home"))
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "bin" / "python"))
    assert cli.main(["up", str(_replica_job(tmp_path))]) == 1
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and INSTALL_HINT in errors[0]
    assert not (tmp_path / "home" / "runs").exists() or not any(
        (tmp_path / "home" / "runs").iterdir()
    )  # nothing started: no Redis, no run


def test_a_new_replica_run_records_where_its_lighthouse_listens_only_with_that_quorum(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from spottrain.controller.run.create import create_run
    from spottrain.controller.run.run_redis import stop_embedded_redis
    from spottrain.spec import load_spec

    monkeypatch.setenv("SPOTTRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SPOTTRAIN_LIGHTHOUSE", raising=False)
    info = create_run(load_spec(_replica_job(tmp_path)))
    try:
        saved = RunInfo.load(info.run_id)
        host, _, port = saved.lighthouse.rpartition(":")
        assert host == "127.0.0.1" and saved.lighthouse_bind == saved.lighthouse
        assert 0 < int(port) < 65536
    finally:
        stop_embedded_redis(info)
    # The Redis quorum (the default) needs no lighthouse: none placed, none supervised,
    # none to stop, and no lighthouse binary needed.
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-venv" / "bin" / "python"))
    info = create_run(load_spec(_replica_job(tmp_path, "redis")), run_id="redis-q-1")
    try:
        saved = RunInfo.load(info.run_id)
        assert (saved.lighthouse, saved.lighthouse_bind) == ("", "")
        assert (
            supervise_lighthouse(saved, RunState(open_redis(saved), RunKeys(saved.run_id))) is None
        )
        end_lighthouse(saved)
        assert not (saved.dir / "lighthouse").exists()
    finally:
        stop_embedded_redis(info)

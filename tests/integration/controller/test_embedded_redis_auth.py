"""The embedded Redis of a local run: a fresh password per run, kept in the run's directory
(mode 0600), given to redis-server through its standard input and to the local VMs as a file
path, never on a command line; only 127.0.0.1, protected mode on."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from redis.backoff import NoBackoff
from redis.retry import Retry

from spottrain.cloud.base import Market, Offer
from spottrain.controller.run.code import boot_renderer
from spottrain.controller.run.create import create_run
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.controller.run.records import RunError, RunInfo
from spottrain.controller.run.run_redis import (
    EMBEDDED_MAXCLIENTS,
    embedded_password_file,
    maxclients_note,
    maxclients_within_fd_limit,
    open_redis,
    restart_embedded_redis,
    stop_embedded_redis,
)
from spottrain.spec import load_spec


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _port(info: RunInfo) -> int:
    return int(info.redis_url.rsplit(":", 1)[1].split("/")[0])


def _bare(port: int, **kwargs: Any) -> redis.Redis:
    """A client with no retries: redis-py retries a refused password (an AuthenticationError
    is a ConnectionError) and a closed port three times with backoff, 8 s per refusal."""
    return redis.Redis(host="127.0.0.1", port=port, retry=Retry(NoBackoff(), 0), **kwargs)


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RunInfo]:
    monkeypatch.setenv("SPOTTRAIN_HOME", str(tmp_path / "home"))
    # A password the user exported for some other Redis must not be what the run uses.
    monkeypatch.setenv("SPOTTRAIN_REDIS_PASSWORD", "not-this-one")
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text("print('hi')\n")
    spec = {
        "name": "auth",
        "code": {"archive": {"path": str(code)}},
        "train": {"command": "train.py"},
        "nodes": {"min": 1, "max": 1, "gpus": 0},
        "resources": {"clouds": ["local"]},
        "budget": {"max_usd": 5},
        "checkpoint": {
            "volume": {"path": str(tmp_path / "vol"), "write_gbps": 1},
            "every_steps": 10,
        },
        "local": {"zones": {"local-a": {"capacity": 1}}},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    info = create_run(load_spec(tmp_path / "job.yaml"))
    try:
        yield info
    finally:
        stop_embedded_redis(info)


def test_each_run_gets_its_own_password_in_a_file_only_its_owner_reads(run: RunInfo) -> None:
    path = embedded_password_file(run.dir)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    password = path.read_text().strip()
    assert len(password) >= 32
    assert password not in run.redis_url
    assert password not in (run.dir / "run.json").read_text()


def test_a_client_without_the_runs_password_is_refused(run: RunInfo) -> None:
    anonymous = _bare(_port(run), socket_timeout=2)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    wrong = _bare(_port(run), password="not-this-one")
    with pytest.raises(redis.AuthenticationError):
        wrong.ping()
    client = open_redis(run, run.spec())
    assert client.ping()
    assert client.config_get("protected-mode") == {"protected-mode": "yes"}
    assert client.config_get("bind")["bind"] == "127.0.0.1"
    # Persisted (AOF every second), and room for the Redis quorum's clients at 12,500
    # replicas, as far as this machine's open-files limit goes.
    assert client.config_get("appendonly") == {"appendonly": "yes"}
    assert client.config_get("appendfsync") == {"appendfsync": "everysec"}
    got = int(client.config_get("maxclients")["maxclients"])
    assert got == maxclients_within_fd_limit()  # 19968 under a hard limit of 20000
    assert maxclients_note(EMBEDDED_MAXCLIENTS) is None
    assert maxclients_note(19_968) == (
        "the run's Redis holds at most 19968 clients, as this machine's open-files limit "
        "allows: about 4992 VMs of a replica run (12,500 need 50000); raise the hard limit "
        "(ulimit -Hn, systemd LimitNOFILE=) to 50032"
    )
    # A run that needs fewer (4 clients a VM) hears nothing about it.
    assert maxclients_note(19_968, vms=4_992) is None
    assert maxclients_note(19_968, vms=4_993) is not None


def test_the_password_is_on_no_command_line_of_redis_server(run: RunInfo) -> None:
    password = embedded_password_file(run.dir).read_text().strip()
    pid = int((run.dir / "redis" / "redis.pid").read_text())
    assert "redis-server" in _cmdline(pid)
    assert password not in _cmdline(pid)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                assert password not in _cmdline(int(entry)), f"process {entry}"
            except OSError:
                continue


def test_a_restarted_embedded_redis_keeps_the_runs_password_and_data(run: RunInfo) -> None:
    open_redis(run).set("kept", "yes")
    stop_embedded_redis(run)
    with pytest.raises(redis.ConnectionError):
        _bare(_port(run), socket_timeout=1).ping()
    restart_embedded_redis(run)
    with pytest.raises(redis.AuthenticationError):
        _bare(_port(run), socket_timeout=2).ping()
    assert open_redis(run).get("kept") == b"yes"


def test_local_vms_get_the_password_file_not_the_password(run: RunInfo) -> None:
    password = embedded_password_file(run.dir).read_text().strip()
    boot = boot_renderer(run.spec(), run)(
        "n1", Offer("local", "local", "local-a", "cpu", 0, "", Market.SPOT, 0.0, 0.0)
    )
    assert password not in boot
    env = json.loads(boot)["env"]
    assert env["SPOTTRAIN_REDIS_PASSWORD_FILE"] == str(embedded_password_file(run.dir))


def test_a_redis_server_with_a_password_keeps_it_off_its_command_line(tmp_path: Path) -> None:
    with RedisServer(data_dir=tmp_path, password="pw-only-on-stdin") as server:
        assert server.proc is not None
        assert "pw-only-on-stdin" not in _cmdline(server.proc.pid)
        with pytest.raises(redis.AuthenticationError):
            _bare(server.port).ping()
        assert server.client().ping()


def test_a_local_secret_env_must_exist_and_be_private_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("SPOTTRAIN_HOME", str(home))
    spec = {
        "name": "sec",
        "code": {"archive": {"path": str(tmp_path)}},
        "train": {"command": "train.py", "secret_env": {"HF_TOKEN": "hf-token"}},
        "nodes": {"min": 1, "max": 1, "gpus": 0},
        "resources": {"clouds": ["local"]},
        "budget": {"max_usd": 5},
        "checkpoint": {"volume": {"path": str(tmp_path / "v"), "write_gbps": 1}, "every_steps": 5},
        "local": {"zones": {"local-a": {"capacity": 1}}},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    secret = home / "secrets" / "hf-token"
    with pytest.raises(
        RunError, match=f"no secret 'hf-token' on the local cloud: write it to {secret}"
    ):
        create_run(load_spec(tmp_path / "job.yaml"))
    secret.parent.mkdir(parents=True)
    secret.write_text("hf_value\n")
    secret.chmod(0o644)
    with pytest.raises(RunError, match=f"readable by others: chmod 600 {secret}"):
        create_run(load_spec(tmp_path / "job.yaml"))
    assert not (home / "runs").exists() or not any((home / "runs").iterdir())

"""The shipper against a real local store, driven step by step with a clock of its own:
names and order, whole gzip chunks, retries, the cap; and how the flags, the spec and the
boot script agree on the settings."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import pytest
import yaml
from spec_samples import LOCAL, spec_with

from spottrain.agent.cli import build_parser
from spottrain.agent.logship import settings as ship
from spottrain.agent.logship.costs import shipping_cost
from spottrain.agent.logship.settings import ShipSettings, ship_settings
from spottrain.agent.logship.shipper import CAP_MARKER, LogShipper
from spottrain.cloud.storage import LocalStore, StorageUnavailable
from spottrain.controller.run.boot import NodeIdentity, agent_env
from spottrain.protocol import env as env_names
from spottrain.protocol.node_logs import parse_chunk_key
from spottrain.spec import parse_spec
from spottrain.spec import sections as spec_sections


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def _settings(tmp_path: Path, **kw: object) -> ShipSettings:
    base: dict[str, object] = dict(
        url=str(tmp_path / "store"),
        file=str(tmp_path / "node.log"),
        run_id="run-1",
        node="node-0",
        vm="vm-a",
        chunk_s=15.0,
        chunk_bytes=1000,
        backlog_bytes=100_000,
    )
    base.update(kw)
    return ShipSettings(**base)  # type: ignore[arg-type]


def _chunks(store: LocalStore) -> list[tuple[int, bytes]]:
    out = []
    for key in store.list("run-1/node-0/"):
        name = parse_chunk_key(key)
        assert name is not None, key
        out.append((name.seq, gzip.decompress(store.get_bytes(key))))
    return sorted(out)


def test_the_shipper_ships_whole_lines_in_order_and_flushes_at_close(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    store = LocalStore(str(tmp_path / "store"))
    clock = Clock()
    shipper = LogShipper(_settings(tmp_path), store=store, clock=clock)
    log = tmp_path / "node.log"
    lines = [f"step {i} loss {1 / (i + 1):.6f}\n".encode() for i in range(120)]
    with log.open("ab") as f:
        f.write(b"".join(lines[:60]))  # ~1.5 KB: one chunk cut by size
        f.flush()
        shipper.poll()
        assert shipper.ship_one() and not shipper.ship_one()
        clock.now += 15  # the rest of the first read is now due
        f.write(b"".join(lines[60:]) + b"half a li")
        f.flush()
        shipper.poll()
        while shipper.ship_one():
            pass
    assert shipper.close(timeout=5.0)
    got = _chunks(store)
    assert [seq for seq, _ in got] == list(range(len(got)))  # no gaps
    assert all(body.endswith(b"\n") for _, body in got)
    assert b"".join(body for _, body in got) == b"".join(lines) + b"half a li\n"
    keys = store.list("run-1/node-0/vm-a/")
    assert len({parse_chunk_key(k).started_ms for k in keys}) == 1  # type: ignore[union-attr]
    # An agent restarted on this VM goes on where the last one stopped, having shipped all.
    clock.now += 60
    again = LogShipper(_settings(tmp_path), store=store, clock=clock)
    with log.open("ab") as f:
        f.write(b"after the restart\n")
    again.poll()
    assert again.close(timeout=5.0)
    restarted = [k for k in store.list("run-1/node-0/vm-a/") if k not in keys]
    assert [gzip.decompress(store.get_bytes(k)) for k in restarted] == [b"after the restart\n"]


def test_a_failing_store_is_retried_and_the_cap_ends_shipping_with_a_marker(
    tmp_path: Path,
) -> None:
    (tmp_path / "store").mkdir()

    class Flaky(LocalStore):
        fails = 2

        def put_bytes(self, key: str, data: bytes) -> None:
            if self.fails:
                self.fails -= 1
                raise StorageUnavailable("the bucket is having a moment")
            super().put_bytes(key, data)

    store = Flaky(str(tmp_path / "store"))
    shipper = LogShipper(_settings(tmp_path, max_bytes=8192), store=store, clock=Clock())
    shipper.retry_s = (0.0,)
    # Incompressible lines: the 8 KB cap comes after a few chunks.
    with (tmp_path / "node.log").open("wb") as f:
        for _ in range(40):
            f.write(os.urandom(300).hex().encode() + b"\n")
    shipper.poll()
    shipper.chunker.flush()
    while shipper.ship_one():
        pass
    assert store.fails == 0 and shipper.capped
    got = _chunks(store)
    assert [seq for seq, _ in got] == list(range(len(got)))
    assert got[-1][1] == CAP_MARKER.format(mb=0.008192, file=shipper.s.file).encode()
    assert shipper.shipped_bytes <= 8192
    assert sum(os.path.getsize(p) for p in (tmp_path / "store/run-1").rglob("*.gz")) <= 8192


def test_flags_spec_and_boot_script_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    # The agent's defaults are the spec's, and the boot script sets only what differs.
    assert ship.DEFAULT_LOG_CHUNK_S == spec_sections.DEFAULT_LOG_CHUNK_S
    assert ship.DEFAULT_LOG_CHUNK_MB == spec_sections.DEFAULT_LOG_CHUNK_MB
    assert ship.DEFAULT_LOG_MAX_MB == spec_sections.DEFAULT_LOG_MAX_MB
    assert ship.DEFAULT_LOG_BACKLOG_MB == spec_sections.DEFAULT_LOG_BACKLOG_MB
    assert ship.MIN_LOG_CHUNK_MB == spec_sections.MIN_LOG_CHUNK_MB
    assert ship.MAX_LOG_CHUNK_MB == spec_sections.MAX_LOG_CHUNK_MB
    spec = parse_spec(yaml.safe_dump(spec_with(LOCAL, "logs", {"chunk_seconds": 30}))).spec
    node = NodeIdentity("run-1", "node-0", "local", "local-a", "local-small")
    env = agent_env(spec, node, "redis://127.0.0.1:1", copy_to="file:///tmp/st/checkpoints")
    assert env_names.ENV_LOGS_TO not in env
    assert env[env_names.ENV_LOGS_CHUNK_S] == "30"
    for name in (env_names.ENV_LOGS_CHUNK_MB, env_names.ENV_LOGS_MAX_MB):
        assert name not in env
    for k, v in {**env, env_names.ENV_LOGS_FILE: "/var/log/x.log"}.items():
        monkeypatch.setenv(k, v)
    args = build_parser().parse_args(["run"])
    s = ship_settings(args)
    assert s is not None
    # No logs.to: beside the checkpoint copies the local cloud really makes.
    assert s.url == "file:///tmp/st/checkpoints/logs"
    assert (s.chunk_s, s.chunk_bytes, s.max_bytes) == (30.0, 4_000_000, 1_024_000_000)
    assert (s.run_id, s.node, s.file) == ("run-1", "node-0", "/var/log/x.log")
    named = spec_with(LOCAL, "logs", {"to": "/srv/logs"})
    env = agent_env(parse_spec(yaml.safe_dump(named)).spec, node, "redis://127.0.0.1:1")
    assert env[env_names.ENV_LOGS_TO] == "/srv/logs"
    monkeypatch.delenv(env_names.ENV_LOGS_FILE)
    assert ship_settings(build_parser().parse_args(["run"])) is None  # no file: no shipping
    monkeypatch.setenv(env_names.ENV_LOGS_FILE, "/x")
    monkeypatch.setenv(env_names.ENV_LOGS_CHUNK_MB, "lots")
    with pytest.raises(ValueError, match="--logs-chunk-mb 'lots'"):
        ship_settings(build_parser().parse_args(["run"]))


@pytest.mark.parametrize("raw", ["0.000001", "0", "300"])
def test_a_chunk_size_outside_the_specs_range_is_refused(
    monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    """Below the spec's minimum (a byte a chunk: a PUT a byte) or above its maximum."""
    monkeypatch.setenv(env_names.ENV_LOGS_FILE, "/x")
    monkeypatch.setenv(env_names.ENV_LOGS_TO, "file:///tmp/logs")
    monkeypatch.setenv(env_names.ENV_LOGS_CHUNK_MB, raw)
    with pytest.raises(ValueError, match=f"--logs-chunk-mb '{raw}'.* must be from 0.01 to 256"):
        ship_settings(build_parser().parse_args(["run"]))


def test_the_cost_of_shipping_at_1000_and_12500_nodes() -> None:
    small, large = shipping_cost(1000), shipping_cost(12_500)
    assert small.puts_per_s == pytest.approx(1000 / 15)
    assert small.put_usd_per_day == pytest.approx(28.80)
    assert large.puts_per_s == pytest.approx(12_500 / 15)
    assert large.put_usd_per_day == pytest.approx(360.0)
    assert shipping_cost(12_500, store="gcs").put_usd_per_day == pytest.approx(360.0)
    # A node printing past chunk_mb per chunk_s puts more often; a silent one never.
    assert shipping_cost(1, bytes_per_s=1e6).puts_per_s == pytest.approx(0.25)
    assert shipping_cost(1, bytes_per_s=0).puts_per_s == 0


def test_no_chunk_carries_the_redis_password_a_worker_printed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers get the Redis password in their environment; one dumps it."""
    monkeypatch.setenv("SPOTTRAIN_REDIS_PASSWORD", "env-password-123")
    (tmp_path / "store").mkdir()
    store = LocalStore(str(tmp_path / "store"))
    shipper = LogShipper(_settings(tmp_path), store=store, clock=Clock())
    (tmp_path / "node.log").write_text("SPOTTRAIN_REDIS_PASSWORD=env-password-123\nstep 1\n")
    shipper.poll()
    assert shipper.close(timeout=5.0)
    shipped = b"".join(body for _, body in _chunks(store))
    assert shipped == b"SPOTTRAIN_REDIS_PASSWORD=[redacted]\nstep 1\n"


def test_no_chunk_carries_a_secret_the_boot_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's env dump prints the password file's value and the job's secrets: what
    reaches the store has none, whether the boot noted a secret before the shipper started
    or after."""
    from spottrain.cloud.vmboot.loader import Secrets

    monkeypatch.delenv("SPOTTRAIN_REDIS_PASSWORD", raising=False)
    (tmp_path / "password").write_text("file-password-456\n")
    noted = Secrets(str(tmp_path / "run" / "redact"))
    noted.remember("hf_token_789")
    settings = _settings(tmp_path, password_file=str(tmp_path / "password"), redact_file=noted.path)
    (tmp_path / "store").mkdir()
    store = LocalStore(str(tmp_path / "store"))
    shipper = LogShipper(settings, store=store, clock=Clock())
    dump = "REDIS=redis://:file-password-456@h:6379\nHF_TOKEN=hf_token_789\nGIT=ghp_later_0000\n"
    (tmp_path / "node.log").write_text(dump)
    noted.remember("ghp_later_0000")  # a value the boot read after the agent started
    shipper.poll()
    assert shipper.close(timeout=5.0)
    shipped = b"".join(body for _, body in _chunks(store)).decode()
    for secret in ("file-password-456", "hf_token_789", "ghp_later_0000"):
        assert secret not in shipped
    assert shipped.count("[redacted]") == 3 and "HF_TOKEN=[redacted]\n" in shipped
    # The node's own file keeps what was written (the VM's disk is the VM's).
    assert (tmp_path / "node.log").read_text() == dump

"""Unit tests of the rendezvous settings parsed from torchrun's --rdzv-endpoint/--rdzv-conf
(spottrain.agent.rendezvous.config). Pure: no Redis, no network."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from spottrain.agent.rendezvous.config import (
    RedisRendezvousConfig,
    RendezvousConfigError,
    parse_config,
)
from spottrain.protocol.env import ENV_NODE
from spottrain.redis_conn import DEFAULT_PASSWORD_ENV, RedisSettings

RUN_ID = "train-gpt-1732270000"
ENDPOINT = "redis.internal:6379"
SECRET = "hunter2-Secret"


def parse(
    conf: Mapping[str, Any] | None = None,
    *,
    endpoint: str = ENDPOINT,
    run_id: str = RUN_ID,
    environ: Mapping[str, str] | None = None,
) -> RedisRendezvousConfig:
    """parse_config with an empty environment unless one is given, so the host's own
    SPOTTRAIN_* variables never leak into a test."""
    return parse_config(
        endpoint=endpoint,
        run_id=run_id,
        conf={} if conf is None else conf,
        environ={} if environ is None else environ,
    )


def refused(
    conf: Mapping[str, Any] | None = None,
    *,
    endpoint: str = ENDPOINT,
    run_id: str = RUN_ID,
    environ: Mapping[str, str] | None = None,
) -> str:
    """The message of the RendezvousConfigError parse_config raises; it must be one line."""
    with pytest.raises(RendezvousConfigError) as err:
        parse(conf, endpoint=endpoint, run_id=run_id, environ=environ)
    message = str(err.value)
    assert message
    assert "\n" not in message, message
    return message


# -- defaults -----------------------------------------------------------------------------


def test_the_defaults_suit_a_spot_fleet() -> None:
    cfg = parse(environ={ENV_NODE: "node-a"})
    assert cfg.keep_alive_interval_s == 1
    assert cfg.keep_alive_max_attempt == 5
    assert cfg.dead_after_s == 5
    assert cfg.last_call_timeout_s == 10
    assert cfg.ttl_s == 86400
    assert cfg.join_timeout_s == 1800
    assert cfg.close_timeout_s == 30
    assert cfg.heartbeat_timeout_s == 5
    assert cfg.read_timeout_s == 60
    assert cfg.key_prefix == "spottrain"
    assert cfg.run_id == RUN_ID


def test_the_redis_settings_come_from_the_endpoint_with_no_tls_and_no_password() -> None:
    cfg = parse(environ={ENV_NODE: "node-a"})
    assert cfg.redis == RedisSettings(host="redis.internal", port=6379)
    assert cfg.redis.password is None
    assert cfg.redis.tls is False


def test_the_keys_are_those_of_the_run_under_the_configured_prefix() -> None:
    cfg = parse({"key_prefix": "staging"})
    assert cfg.keys.base == f"staging:{{{RUN_ID}}}"


def test_the_dead_after_time_is_interval_times_attempts() -> None:
    cfg = parse({"keep_alive_interval": "2", "keep_alive_max_attempt": "3"})
    assert cfg.dead_after_s == 6


@pytest.mark.parametrize(
    ("key", "attribute"),
    [
        ("ttl", "ttl_s"),
        ("read_timeout", "read_timeout_s"),
        ("join_timeout", "join_timeout_s"),
        ("last_call_timeout", "last_call_timeout_s"),
        ("close_timeout", "close_timeout_s"),
        ("heartbeat_timeout", "heartbeat_timeout_s"),
        ("keep_alive_interval", "keep_alive_interval_s"),
        ("keep_alive_max_attempt", "keep_alive_max_attempt"),
    ],
)
@pytest.mark.parametrize("raw", ["120", " 120 ", 120])
def test_each_integer_conf_key_sets_its_setting(key: str, attribute: str, raw: object) -> None:
    cfg = parse({key: raw, "ttl": "100000"} if key != "ttl" else {key: raw})
    assert getattr(cfg, attribute) == 120


def test_db_socket_timeout_username_and_prefix_come_from_the_conf() -> None:
    cfg = parse({"db": "3", "socket_timeout": "9", "username": "alice", "key_prefix": "p.1"})
    assert cfg.redis.db == 3
    assert cfg.redis.socket_timeout == 9.0
    assert cfg.redis.username == "alice"
    assert cfg.key_prefix == "p.1"


# -- torchrun's own keys ------------------------------------------------------------------


def test_torchruns_timeout_and_rank_keys_are_accepted() -> None:
    cfg = parse({"timeout": "900", "rank": "0"})
    assert cfg.join_timeout_s == 900


def test_torchruns_timeout_is_the_join_timeout_unless_join_timeout_is_given() -> None:
    cfg = parse({"timeout": "900", "join_timeout": "60"})
    assert cfg.join_timeout_s == 60


def test_torchruns_c10d_keys_are_accepted_so_a_command_line_can_switch_backends() -> None:
    cfg = parse({"is_host": "true", "store_type": "tcp", "rank": "3"})
    assert cfg.join_timeout_s == 1800


def test_a_bad_torchrun_timeout_is_refused_naming_the_key() -> None:
    assert "timeout='soon'" in refused({"timeout": "soon"})


# -- refused keys -------------------------------------------------------------------------


def test_a_password_key_is_refused_and_the_message_points_to_the_env_var_and_file() -> None:
    message = refused({"password": SECRET})
    assert "'password' is refused" in message
    assert f"${DEFAULT_PASSWORD_ENV}" in message
    assert "password_file" in message
    assert SECRET not in message


def test_a_password_key_is_refused_even_with_a_password_file(tmp_path: Path) -> None:
    path = tmp_path / "pw"
    path.write_text("from-file")
    assert "'password' is refused" in refused({"password": SECRET, "password_file": str(path)})


@pytest.mark.parametrize("key", ["pasword", "keepalive", "TLS", "timeout_s"])
def test_an_unknown_conf_key_is_refused_naming_the_key(key: str) -> None:
    message = refused({key: "1"})
    assert "unknown rdzv conf key" in message
    assert key in message.split(";")[0]
    assert "allowed:" in message


def test_all_unknown_keys_are_named_at_once() -> None:
    message = refused({"zzz": "1", "aaa": "2", "ttl": "100000"})
    assert "aaa, zzz" in message


# -- bad values ---------------------------------------------------------------------------

INT_KEYS = [
    "ttl",
    "read_timeout",
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "socket_timeout",
    "db",
    "timeout",
]


@pytest.mark.parametrize("key", INT_KEYS)
@pytest.mark.parametrize("value", ["abc", "1.5", "", "1e3", True])
def test_a_non_integer_value_is_refused_naming_the_key(key: str, value: object) -> None:
    message = refused({key: value})
    assert f"rdzv conf {key}=" in message
    assert "must be an integer" in message


POSITIVE_KEYS = [
    "ttl",
    "read_timeout",
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "socket_timeout",
]


@pytest.mark.parametrize("key", POSITIVE_KEYS)
@pytest.mark.parametrize("value", ["0", "-1", -5])
def test_a_zero_or_negative_value_is_refused_naming_the_key(key: str, value: object) -> None:
    message = refused({key: value})
    # The message names the setting (`ttl_s`, or "socket timeout" in words).
    assert key.replace("_", " ") in message.replace("_", " ")
    assert str(value).strip() in message


@pytest.mark.parametrize("value", ["-1", "16"])
def test_a_db_outside_0_to_15_is_refused(value: str) -> None:
    message = refused({"db": value})
    assert f"db {value} must be between 0 and 15" in message


@pytest.mark.parametrize("value", ["maybe", "2", "yes please"])
def test_a_non_boolean_tls_is_refused_naming_the_key(value: str) -> None:
    assert f"rdzv conf tls={value!r} must be true or false" in refused({"tls": value})


@pytest.mark.parametrize(
    ("run_id", "fragment"),
    [("bad id", "run id 'bad id'"), ("", "run id ''"), ("a:b", "run id 'a:b'")],
)
def test_a_bad_run_id_is_refused_as_a_config_error(run_id: str, fragment: str) -> None:
    assert fragment in refused(run_id=run_id)


def test_a_bad_key_prefix_is_refused_as_a_config_error() -> None:
    assert "key prefix 'a:b'" in refused({"key_prefix": "a:b"})


@pytest.mark.parametrize("node_id", ["has space", "tab\there", "x" * 129])
def test_a_bad_node_id_is_refused(node_id: str) -> None:
    assert "node_id" in refused({"node_id": node_id})


# -- ttl ----------------------------------------------------------------------------------


def test_a_ttl_smaller_than_ten_times_the_dead_after_time_is_refused() -> None:
    message = refused({"ttl": "49"})  # dead after 5 s -> ttl must be >= 50
    assert "ttl (49 s) must be at least 10x" in message
    assert "(5 s)" in message


def test_a_ttl_of_exactly_ten_times_the_dead_after_time_is_accepted() -> None:
    assert parse({"ttl": "50"}).ttl_s == 50


def test_the_ttl_floor_follows_the_keep_alive_settings() -> None:
    conf = {"keep_alive_interval": "2", "keep_alive_max_attempt": "10", "ttl": "199"}
    assert "(20 s)" in refused(conf)
    assert parse({**conf, "ttl": "200"}).ttl_s == 200


# -- TLS ----------------------------------------------------------------------------------


def test_a_rediss_endpoint_turns_tls_on() -> None:
    cfg = parse(endpoint="rediss://redis.internal:6380")
    assert cfg.redis.tls is True
    assert cfg.redis.port == 6380


@pytest.mark.parametrize("value", ["true", "1", "yes", "on", "TRUE", True])
def test_tls_true_in_the_conf_turns_tls_on(value: object) -> None:
    assert parse({"tls": value}).redis.tls is True


@pytest.mark.parametrize("value", ["false", "0", "no", "off", False])
def test_tls_false_in_the_conf_keeps_tls_off(value: object) -> None:
    assert parse({"tls": value}).redis.tls is False


def test_an_agreeing_tls_key_and_rediss_endpoint_are_accepted() -> None:
    assert parse({"tls": "true"}, endpoint="rediss://h").redis.tls is True
    assert parse({"tls": "false"}, endpoint="redis://h").redis.tls is False


@pytest.mark.parametrize(
    ("endpoint", "tls"), [("rediss://h:6379", "false"), ("redis://h:6379", "true")]
)
def test_a_tls_key_that_contradicts_the_endpoint_scheme_is_refused(endpoint: str, tls: str) -> None:
    message = refused({"tls": tls}, endpoint=endpoint)
    assert "disagree about TLS" in message
    assert endpoint in message


def test_a_ca_file_is_accepted_with_tls() -> None:
    cfg = parse({"tls_ca_file": "/etc/ca.pem"}, endpoint="rediss://h")
    assert cfg.redis.tls_ca_file == "/etc/ca.pem"


def test_a_ca_file_without_tls_is_refused() -> None:
    assert "tls_ca_file is set but TLS is off" in refused({"tls_ca_file": "/etc/ca.pem"})


# -- passwords ----------------------------------------------------------------------------


def test_the_password_comes_from_the_default_env_var_in_environ() -> None:
    cfg = parse(environ={DEFAULT_PASSWORD_ENV: SECRET})
    assert cfg.redis.password == SECRET


def test_the_password_comes_from_a_custom_env_var_named_by_password_env() -> None:
    environ = {"MY_REDIS_PW": "custom", DEFAULT_PASSWORD_ENV: "default"}
    assert parse({"password_env": "MY_REDIS_PW"}, environ=environ).redis.password == "custom"


def test_the_password_comes_from_password_file_over_the_env_var(tmp_path: Path) -> None:
    path = tmp_path / "pw"
    path.write_text(f"{SECRET}\n")
    cfg = parse({"password_file": str(path)}, environ={DEFAULT_PASSWORD_ENV: "from-env"})
    assert cfg.redis.password == SECRET


def test_the_password_never_shows_in_the_config_repr(tmp_path: Path) -> None:
    cfg = parse(environ={DEFAULT_PASSWORD_ENV: SECRET})
    assert SECRET not in repr(cfg)


def test_a_missing_password_file_is_a_config_error_naming_the_path(tmp_path: Path) -> None:
    path = tmp_path / "missing"
    message = refused({"password_file": str(path)})
    assert str(path) in message


def test_an_empty_password_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "pw"
    path.write_text("\n")
    assert "is empty" in refused({"password_file": str(path)})


def test_the_environ_argument_is_used_instead_of_the_process_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(DEFAULT_PASSWORD_ENV, "from-os")
    monkeypatch.setenv(ENV_NODE, "os-node")
    cfg = parse(environ={})
    assert cfg.redis.password is None
    assert cfg.node_id != "os-node"


def test_without_environ_the_process_environment_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEFAULT_PASSWORD_ENV, "from-os")
    monkeypatch.setenv(ENV_NODE, "os-node")
    cfg = parse_config(endpoint=ENDPOINT, run_id=RUN_ID, conf={})
    assert cfg.redis.password == "from-os"
    assert cfg.node_id == "os-node"


# -- node id ------------------------------------------------------------------------------


def test_the_node_id_comes_from_the_conf_first() -> None:
    cfg = parse({"node_id": "conf-node"}, environ={ENV_NODE: "env-node"})
    assert cfg.node_id == "conf-node"


def test_the_node_id_comes_from_spottrain_node_id_when_the_conf_has_none() -> None:
    assert parse(environ={ENV_NODE: "env-node"}).node_id == "env-node"


def test_the_node_id_falls_back_to_the_host_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "vm-1234")
    assert parse(environ={}).node_id == "vm-1234"


# -- endpoint -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "endpoint",
    [
        pytest.param("", id="empty"),
        pytest.param("h:0", id="port-0"),
        pytest.param("h:70000", id="port-70000"),
        pytest.param("h:abc", id="port-abc"),
        pytest.param("http://h:6379", id="scheme"),
        pytest.param("bad host:6379", id="host"),
        pytest.param("[::1", id="unclosed-bracket"),
        pytest.param("redis://h/x", id="path"),
    ],
)
def test_a_malformed_endpoint_is_refused_with_a_message_starting_with_the_flag(
    endpoint: str,
) -> None:
    assert refused(endpoint=endpoint).startswith("--rdzv-endpoint")


def test_a_password_in_the_endpoint_is_refused_without_echoing_it() -> None:
    message = refused(endpoint=f"redis://:{SECRET}@h:6379")
    assert message.startswith("--rdzv-endpoint")
    assert f"${DEFAULT_PASSWORD_ENV}" in message
    assert SECRET not in message


def test_an_unclosed_bracket_in_an_endpoint_url_is_a_config_error() -> None:
    assert refused(endpoint="redis://[::1:6379").startswith("--rdzv-endpoint")


def test_a_db_number_in_the_endpoint_url_selects_that_db() -> None:
    cfg = parse(endpoint="redis://redis.internal:6379/3")
    assert cfg.redis.db == 3


def test_an_ipv6_endpoint_is_accepted() -> None:
    cfg = parse(endpoint="[::1]:7000")
    assert (cfg.redis.host, cfg.redis.port) == ("::1", 7000)

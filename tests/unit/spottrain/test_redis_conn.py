"""Unit tests of spottrain.redis_conn: endpoint parsing, passwords, settings and error
messages. Pure: no Redis server, no network."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from spottrain.redis_conn import (
    DEFAULT_PASSWORD_ENV,
    DEFAULT_PORT,
    RedisAuthError,
    RedisConfigError,
    RedisSettings,
    RedisUnavailableError,
    connect,
    describe_error,
    parse_endpoint,
    ping,
    resolve_password,
)

SECRET = "hunter2-Secret"


# -- parse_endpoint -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        pytest.param("redis.internal", ("redis.internal", DEFAULT_PORT, None), id="host"),
        pytest.param("10.0.0.5", ("10.0.0.5", DEFAULT_PORT, None), id="ipv4"),
        pytest.param("redis.internal:6380", ("redis.internal", 6380, None), id="host-port"),
        pytest.param("  10.0.0.5:7000 \n", ("10.0.0.5", 7000, None), id="surrounding-space"),
        pytest.param("localhost:1", ("localhost", 1, None), id="port-1"),
        pytest.param("localhost:65535", ("localhost", 65535, None), id="port-65535"),
        pytest.param("[::1]:6380", ("::1", 6380, None), id="ipv6-port"),
        pytest.param("[fe80::1]", ("fe80::1", DEFAULT_PORT, None), id="ipv6-no-port"),
        pytest.param("redis://h:6380", ("h", 6380, False), id="redis-url"),
        pytest.param("redis://h", ("h", DEFAULT_PORT, False), id="redis-url-no-port"),
        pytest.param("redis://h:6380/", ("h", 6380, False), id="redis-url-slash"),
        pytest.param("rediss://h:6380", ("h", 6380, True), id="rediss-url"),
        pytest.param("rediss://h", ("h", DEFAULT_PORT, True), id="rediss-url-no-port"),
        pytest.param("redis://[::1]:7000", ("::1", 7000, False), id="redis-url-ipv6"),
        pytest.param("redis://h:6380/3", ("h", 6380, False), id="redis-url-db"),
        pytest.param("rediss://h/15", ("h", DEFAULT_PORT, True), id="rediss-url-db"),
    ],
)
def test_parse_endpoint_reads_host_port_and_tls(
    endpoint: str, expected: tuple[str, int, bool | None]
) -> None:
    assert parse_endpoint(endpoint)[:3] == expected


@pytest.mark.parametrize(
    ("endpoint", "fragment"),
    [
        pytest.param("", "endpoint is empty", id="empty"),
        pytest.param("   ", "endpoint is empty", id="blank"),
        pytest.param("h:0", "must be a number from 1 to 65535", id="port-0"),
        pytest.param("h:70000", "must be a number from 1 to 65535", id="port-70000"),
        pytest.param("h:65536", "must be a number from 1 to 65535", id="port-65536"),
        pytest.param("h:abc", "must be a number from 1 to 65535", id="port-abc"),
        pytest.param("h:-1", "must be a number from 1 to 65535", id="port-negative"),
        pytest.param("redis://h:0", "must be a number from 1 to 65535", id="url-port-0"),
        pytest.param("rediss://h:70000", "must be a number from 1 to 65535", id="url-port-big"),
        pytest.param("[::1]:abc", "must be a number from 1 to 65535", id="ipv6-port-abc"),
        pytest.param("http://h:6379", "use redis:// or rediss://", id="scheme-http"),
        pytest.param("unix:///tmp/redis.sock", "use redis:// or rediss://", id="scheme-unix"),
        pytest.param("redis://h/x", "only a db number is allowed", id="path-not-db"),
        pytest.param("redis://h/1/2", "only a db number is allowed", id="path-two-parts"),
        pytest.param("redis://h/123", "only a db number is allowed", id="path-3-digits"),
        pytest.param("[::1", "is not [IPv6]:PORT", id="ipv6-unclosed"),
        pytest.param("[::1]6379", "is not [IPv6]:PORT", id="ipv6-no-colon"),
        pytest.param(":6379", "is not a host name or IP address", id="no-host"),
        pytest.param("redis://:6379", "is not a host name or IP address", id="url-no-host"),
        pytest.param("red is:6379", "is not a host name or IP address", id="host-space"),
        pytest.param("host/x:6379", "is not a host name or IP address", id="host-slash"),
        pytest.param("hö st", "is not a host name or IP address", id="host-non-ascii"),
        pytest.param("h;rm -rf:6379", "is not a host name or IP address", id="host-semicolon"),
        pytest.param("[g::1]:6379", "is not an IPv6 address", id="ipv6-non-hex"),
    ],
)
def test_parse_endpoint_refuses_a_malformed_endpoint_with_a_one_line_reason(
    endpoint: str, fragment: str
) -> None:
    with pytest.raises(RedisConfigError) as err:
        parse_endpoint(endpoint)
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "endpoint",
    [
        f"redis://:{SECRET}@h:6379",
        f"rediss://default:{SECRET}@h:6379/0",
        f"redis://alice:{SECRET}@[::1]:6379",
    ],
)
def test_a_password_in_the_url_is_refused_without_echoing_it(endpoint: str) -> None:
    with pytest.raises(RedisConfigError) as err:
        parse_endpoint(endpoint)
    message = str(err.value)
    assert "embeds credentials" in message
    assert f"${DEFAULT_PASSWORD_ENV}" in message
    assert "password_file" in message
    assert SECRET not in message


def test_a_user_name_alone_in_the_url_is_refused_too() -> None:
    with pytest.raises(RedisConfigError, match="embeds credentials"):
        parse_endpoint("redis://alice@h:6379")


def test_a_password_containing_an_at_sign_is_not_echoed() -> None:
    with pytest.raises(RedisConfigError) as err:
        parse_endpoint("redis://:top@secret@h:6379")
    assert "secret" not in str(err.value)


@pytest.mark.parametrize(
    "endpoint",
    [
        pytest.param(f"http://user:{SECRET}@h:6379", id="unknown-scheme"),
        pytest.param(f"redis://:{SECRET}/x@h:6379", id="slash-in-password"),
        pytest.param(f"user:{SECRET}@h:6379", id="no-scheme"),
    ],
)
def test_no_endpoint_error_echoes_an_embedded_password(endpoint: str) -> None:
    with pytest.raises(RedisConfigError) as err:
        parse_endpoint(endpoint)
    assert SECRET not in str(err.value)


def test_an_unclosed_bracket_in_a_url_is_a_redis_config_error() -> None:
    with pytest.raises(RedisConfigError):
        parse_endpoint("redis://[::1:6379")


@pytest.mark.parametrize("address", ["::1", "2001:db8::1"])
def test_a_bare_ipv6_address_is_refused_or_read_whole(address: str) -> None:
    try:
        host, port, _, _ = parse_endpoint(address)
    except RedisConfigError as exc:
        assert "[" in str(exc)  # tells the user to bracket it
    else:
        assert (host, port) == (address, DEFAULT_PORT)


def test_a_host_with_a_trailing_newline_is_refused() -> None:
    with pytest.raises(RedisConfigError):
        parse_endpoint("host\n:6379")


# -- resolve_password ---------------------------------------------------------------------


def test_the_password_file_wins_over_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "pw"
    path.write_text("from-file\n")
    environ = {DEFAULT_PASSWORD_ENV: "from-env"}
    assert resolve_password(password_file=str(path), environ=environ) == "from-file"


def test_the_password_file_is_stripped_of_surrounding_whitespace(tmp_path: Path) -> None:
    path = tmp_path / "pw"
    path.write_text("  s3cret \n\n")
    assert resolve_password(password_file=str(path), environ={}) == "s3cret"


def test_a_missing_password_file_is_an_error_naming_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope" / "pw"
    environ = {DEFAULT_PASSWORD_ENV: "from-env"}
    with pytest.raises(RedisConfigError) as err:
        resolve_password(password_file=str(path), environ=environ)
    assert str(path) in str(err.value)
    assert "cannot read" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_directory_as_password_file_is_an_error_naming_the_path(tmp_path: Path) -> None:
    with pytest.raises(RedisConfigError, match="cannot read") as err:
        resolve_password(password_file=str(tmp_path), environ={})
    assert str(tmp_path) in str(err.value)


@pytest.mark.parametrize("content", ["", "\n", "   \n\t"])
def test_an_empty_password_file_is_an_error(tmp_path: Path, content: str) -> None:
    path = tmp_path / "pw"
    path.write_text(content)
    with pytest.raises(RedisConfigError, match="is empty") as err:
        resolve_password(password_file=str(path), environ={DEFAULT_PASSWORD_ENV: "x"})
    assert str(path) in str(err.value)


def test_the_password_comes_from_the_default_environment_variable() -> None:
    assert resolve_password(environ={DEFAULT_PASSWORD_ENV: "from-env"}) == "from-env"


def test_the_password_comes_from_a_custom_environment_variable() -> None:
    environ = {"MY_PW": "custom", DEFAULT_PASSWORD_ENV: "default"}
    assert resolve_password("MY_PW", environ=environ) == "custom"


@pytest.mark.parametrize(
    ("password_env", "environ"),
    [
        pytest.param(DEFAULT_PASSWORD_ENV, {}, id="unset"),
        pytest.param(DEFAULT_PASSWORD_ENV, {DEFAULT_PASSWORD_ENV: ""}, id="empty"),
        pytest.param(None, {DEFAULT_PASSWORD_ENV: "x"}, id="no-variable-configured"),
        pytest.param("", {"": "x"}, id="empty-variable-name"),
    ],
)
def test_no_password_anywhere_means_none(password_env: str | None, environ: dict[str, str]) -> None:
    assert resolve_password(password_env, None, environ) is None


def test_resolve_password_reads_the_process_environment_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(DEFAULT_PASSWORD_ENV, "from-os-environ")
    assert resolve_password() == "from-os-environ"


# -- RedisSettings ------------------------------------------------------------------------


def test_redis_settings_defaults_are_plain_redis_on_6379_db_0() -> None:
    s = RedisSettings(host="h")
    assert (s.port, s.db, s.tls, s.tls_ca_file, s.password, s.socket_timeout) == (
        6379,
        0,
        False,
        None,
        None,
        5.0,
    )


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        pytest.param({"port": 0}, "port 0 must be between 1 and 65535", id="port-0"),
        pytest.param({"port": 65536}, "port 65536 must be between", id="port-65536"),
        pytest.param({"port": -1}, "port -1 must be between", id="port-negative"),
        pytest.param({"db": -1}, "db -1 must be between 0 and 15", id="db-negative"),
        pytest.param({"db": 16}, "db 16 must be between 0 and 15", id="db-16"),
        pytest.param(
            {"socket_timeout": 0}, "socket timeout 0 must be a positive number", id="timeout-0"
        ),
        pytest.param(
            {"socket_timeout": -1.5},
            "socket timeout -1.5 must be a positive",
            id="timeout-negative",
        ),
        pytest.param({"tls_ca_file": "/ca.pem"}, "tls_ca_file is set but TLS is off", id="ca"),
        pytest.param({"host": ""}, "is not a host name or IP address", id="host-empty"),
        pytest.param({"host": "a b"}, "is not a host name or IP address", id="host-space"),
    ],
)
def test_redis_settings_refuse_bad_values(kwargs: dict[str, object], fragment: str) -> None:
    kwargs.setdefault("host", "h")
    with pytest.raises(RedisConfigError) as err:
        RedisSettings(**kwargs)  # type: ignore[arg-type]
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_redis_settings_accept_a_ca_file_with_tls() -> None:
    s = RedisSettings(host="h", tls=True, tls_ca_file="/ca.pem")
    assert s.tls_ca_file == "/ca.pem"


@pytest.mark.parametrize("port", [1, 65535])
@pytest.mark.parametrize("db", [0, 15])
def test_redis_settings_accept_the_limits_of_port_and_db(port: int, db: int) -> None:
    s = RedisSettings(host="h", port=port, db=db)
    assert (s.port, s.db) == (port, db)


def test_the_repr_of_redis_settings_never_shows_the_password() -> None:
    s = RedisSettings(host="h", username="alice", password=SECRET)
    assert SECRET not in repr(s)
    assert SECRET not in str(s)
    assert SECRET not in s.address
    assert "alice" in repr(s)  # the rest is still there to debug with


@pytest.mark.parametrize(
    ("settings", "address"),
    [
        (RedisSettings(host="h"), "redis://h:6379/0"),
        (RedisSettings(host="h", port=7000, db=2, tls=True), "rediss://h:7000/2"),
        (RedisSettings(host="::1"), "redis://[::1]:6379/0"),
    ],
)
def test_the_address_is_a_url_without_credentials(settings: RedisSettings, address: str) -> None:
    assert settings.address == address


# -- describe_error -----------------------------------------------------------------------

PLAIN = RedisSettings(host="redis.internal", port=6380)
WITH_PASSWORD = RedisSettings(host="redis.internal", port=6380, password=SECRET)


@pytest.mark.parametrize(
    ("exc", "settings", "fragments"),
    [
        pytest.param(
            redis.ConnectionError("Error 111 connecting to redis.internal:6380. Refused."),
            PLAIN,
            ["cannot reach Redis at redis://redis.internal:6380/0", "Error 111", "runs"],
            id="connection",
        ),
        pytest.param(
            redis.TimeoutError("Timeout reading from socket"),
            PLAIN,
            ["did not answer in time", "Timeout reading from socket", "firewalled"],
            id="timeout",
        ),
        pytest.param(
            redis.AuthenticationError("invalid username-password pair"),
            PLAIN,
            ["requires a password", f"${DEFAULT_PASSWORD_ENV}", "password_file"],
            id="auth-without-password",
        ),
        pytest.param(
            redis.AuthenticationError("invalid username-password pair"),
            WITH_PASSWORD,
            ["refused the password", "invalid username-password pair", "password_file"],
            id="auth-with-password",
        ),
        pytest.param(
            redis.ResponseError("WRONGPASS invalid username-password pair or user is disabled."),
            WITH_PASSWORD,
            ["refused the password", "WRONGPASS", f"${DEFAULT_PASSWORD_ENV}"],
            id="wrongpass-with-password",
        ),
        pytest.param(
            redis.ResponseError("WRONGPASS invalid username-password pair"),
            PLAIN,
            ["requires a password"],
            id="wrongpass-without-password",
        ),
        pytest.param(
            redis.ResponseError("NOAUTH Authentication required."),
            PLAIN,
            ["requires a password"],
            id="noauth",
        ),
        pytest.param(
            redis.ConnectionError("first line\nsecond line\nthird"),
            PLAIN,
            ["first line"],
            id="multi-line-message",
        ),
        pytest.param(
            redis.ConnectionError(""),
            PLAIN,
            ["(ConnectionError)"],
            id="empty-message",
        ),
        pytest.param(
            redis.ResponseError("ERR unknown command 'FOO'"),
            PLAIN,
            ["failed: ERR unknown command"],
            id="other-response-error",
        ),
        pytest.param(
            redis.ConnectionError(
                "Error 1 connecting to redis.internal:6380. [SSL: CERTIFICATE_VERIFY_FAILED] "
                "certificate verify failed: Hostname mismatch"
            ),
            RedisSettings(host="redis.internal", port=6380, tls=True),
            ["TLS certificate we do not trust", "Hostname mismatch", "name 'redis.internal'"],
            id="certificate",
        ),
    ],
)
def test_describe_error_gives_one_actionable_line(
    exc: BaseException, settings: RedisSettings, fragments: list[str]
) -> None:
    line = describe_error(exc, settings)
    assert "\n" not in line
    assert "\r" not in line
    assert settings.address in line
    for fragment in fragments:
        assert fragment in line
    assert SECRET not in line


def test_describe_error_drops_every_line_after_the_first() -> None:
    line = describe_error(redis.ConnectionError("first line\nsecond line"), PLAIN)
    assert "second line" not in line


# -- ping (with a stub client: no network) ------------------------------------------------


class _FailingClient:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def ping(self) -> bool:
        raise self.exc


@pytest.mark.parametrize(
    ("exc", "raised"),
    [
        (redis.AuthenticationError("invalid password"), RedisAuthError),
        (redis.ResponseError("NOAUTH Authentication required."), RedisAuthError),
        (redis.ResponseError("WRONGPASS invalid username-password pair"), RedisAuthError),
        (redis.ConnectionError("Connection refused"), RedisUnavailableError),
        (redis.TimeoutError("Timeout"), RedisUnavailableError),
        (redis.ResponseError("LOADING Redis is loading the dataset"), RedisUnavailableError),
    ],
)
def test_ping_turns_redis_errors_into_auth_or_unavailable(
    exc: BaseException, raised: type[Exception]
) -> None:
    with pytest.raises(raised) as err:
        ping(_FailingClient(exc), PLAIN)  # type: ignore[arg-type]
    assert err.value.__cause__ is exc
    assert str(err.value) == describe_error(exc, PLAIN)


def test_ping_returns_quietly_when_redis_answers() -> None:
    class _Ok:
        calls = 0

        def ping(self) -> bool:
            _Ok.calls += 1
            return True

    assert ping(_Ok(), PLAIN) is None  # type: ignore[arg-type,func-returns-value]
    assert _Ok.calls == 1


@pytest.mark.parametrize(
    ("endpoint", "db"),
    [("redis://h:6380/3", 3), ("rediss://h/15", 15), ("redis://h", None), ("h:1", None)],
)
def test_parse_endpoint_reads_the_db_of_a_url(endpoint: str, db: int | None) -> None:
    assert parse_endpoint(endpoint).db == db


def test_a_tls_client_requires_a_certificate_that_names_the_host() -> None:
    # redis-py 5 checks no host name unless told to; whatever version runs, say it.
    client = connect(RedisSettings(host="redis.internal", tls=True, tls_ca_file="/ca.pem"))
    kwargs = client.connection_pool.connection_kwargs
    assert kwargs["ssl_check_hostname"] is True
    assert kwargs["ssl_cert_reqs"] == "required"
    assert kwargs["ssl_ca_certs"] == "/ca.pem"

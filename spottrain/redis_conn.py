"""Connecting to the job's Redis: address, TLS, auth, and errors a person can act on.

Passwords never travel in a URL or on a command line (both end up in logs and in
``/proc/*/cmdline``): they come from an environment variable or from a file.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from spottrain.protocol.env import ENV_REDIS_PASSWORD, ENV_REDIS_USERNAME

DEFAULT_PORT = 6379
DEFAULT_PASSWORD_ENV = ENV_REDIS_PASSWORD  # the variable read when a spec names none

_HOSTNAME_RE = re.compile(r"^[A-Za-z0-9_.-]+\Z")
_IPV6_RE = re.compile(r"^[0-9a-fA-F:.]*:[0-9a-fA-F:.]*\Z")


class RedisConfigError(ValueError):
    """The Redis address or its options are malformed."""


class RedisUnavailableError(ConnectionError):
    """Redis could not be reached."""


class RedisAuthError(PermissionError):
    """Redis refused our credentials."""


@dataclass(frozen=True)
class RedisSettings:
    """Where the job's Redis is and how to talk to it.

    Attributes:
        host: Host name or IP address.
        port: TCP port.
        db: Database number.
        tls: Use TLS (``rediss://``).
        tls_ca_file: CA bundle that signs the server certificate (TLS only).
        username: ACL user name, if the server uses ACLs.
        password: The password, already resolved from the environment or a file.
        socket_timeout: Seconds a single command may take before it is a lost connection.
    """

    host: str
    port: int = DEFAULT_PORT
    db: int = 0
    tls: bool = False
    tls_ca_file: str | None = None
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    socket_timeout: float = 5.0

    def __post_init__(self) -> None:
        if not (_HOSTNAME_RE.match(self.host) or _IPV6_RE.match(self.host)):
            raise RedisConfigError(f"Redis host {self.host!r} is not a host name or IP address")
        if not 0 < self.port < 65536:
            raise RedisConfigError(f"Redis port {self.port} must be between 1 and 65535")
        if not 0 <= self.db <= 15:
            raise RedisConfigError(f"Redis db {self.db} must be between 0 and 15")
        if self.socket_timeout <= 0:
            raise RedisConfigError(
                f"Redis socket timeout {self.socket_timeout} must be a positive number of seconds"
            )
        if self.tls_ca_file is not None and not self.tls:
            raise RedisConfigError("tls_ca_file is set but TLS is off: use rediss:// or tls=true")

    @property
    def address(self) -> str:
        scheme = "rediss" if self.tls else "redis"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}/{self.db}"


class Endpoint(NamedTuple):
    """A parsed Redis endpoint; ``tls`` and ``db`` are None when the endpoint does not say."""

    host: str
    port: int
    tls: bool | None
    db: int | None


def parse_endpoint(endpoint: str) -> Endpoint:
    """Parse ``HOST[:PORT]``, ``[IPv6]:PORT`` or ``redis[s]://HOST[:PORT][/DB]``.

    Raises:
        RedisConfigError: malformed, or credentials embedded in it.
    """
    text = endpoint.strip()
    if not text:
        raise RedisConfigError("the Redis endpoint is empty: give HOST:PORT or redis://HOST:PORT")
    if "@" in text:
        # Never echo it: whatever precedes the '@' is probably a password.
        raise RedisConfigError(
            "the Redis endpoint embeds credentials (it contains '@'): put the password in "
            f"${DEFAULT_PASSWORD_ENV} or a password_file instead"
        )
    tls: bool | None = None
    db: int | None = None
    if "://" in text:
        try:
            parts = urlsplit(text)
        except ValueError as exc:
            raise RedisConfigError(f"Redis endpoint {endpoint!r} is malformed: {exc}") from None
        if parts.scheme not in ("redis", "rediss"):
            raise RedisConfigError(
                f"Redis endpoint {endpoint!r} has scheme {parts.scheme!r}: use redis:// or rediss://"
            )
        if parts.query or parts.fragment:
            raise RedisConfigError(
                f"Redis endpoint {endpoint!r} has a query or fragment: give only HOST:PORT/DB"
            )
        if parts.path not in ("", "/"):
            if not re.fullmatch(r"/[0-9]{1,2}", parts.path):
                raise RedisConfigError(
                    f"Redis endpoint {endpoint!r} has path {parts.path!r}: only a db number "
                    "is allowed"
                )
            db = int(parts.path[1:])
        tls = parts.scheme == "rediss"
        text = parts.netloc
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise RedisConfigError(f"Redis endpoint {endpoint!r} is not [IPv6]:PORT")
        port_text = rest[1:]
        if not _IPV6_RE.match(host):
            raise RedisConfigError(f"Redis endpoint {endpoint!r}: {host!r} is not an IPv6 address")
    else:
        if text.count(":") > 1:
            raise RedisConfigError(
                f"Redis endpoint {endpoint!r}: write an IPv6 address in brackets, [::1]:6379"
            )
        host, _, port_text = text.partition(":")
        if ":" in text and not port_text:
            port_text = "missing"
        if not host or not _HOSTNAME_RE.match(host):
            raise RedisConfigError(
                f"Redis endpoint {endpoint!r}: {host!r} is not a host name or IP address"
            )
    if port_text == "":
        port = DEFAULT_PORT
    elif port_text.isdigit() and 0 < int(port_text) < 65536:
        port = int(port_text)
    else:
        raise RedisConfigError(
            f"Redis endpoint {endpoint!r}: port {port_text!r} must be a number from 1 to 65535"
        )
    return Endpoint(host, port, tls, db)


def resolve_password(
    password_env: str | None = DEFAULT_PASSWORD_ENV,
    password_file: str | None = None,
    environ: dict[str, str] | None = None,
) -> str | None:
    """Find the Redis password: a file wins over the environment; None means no auth.

    Raises:
        RedisConfigError: the password file cannot be read or is empty.
    """
    env = os.environ if environ is None else environ
    if password_file:
        path = Path(password_file)
        try:
            secret = path.read_text().strip()
        except OSError as exc:
            raise RedisConfigError(
                f"cannot read the Redis password_file {path}: {exc.strerror}"
            ) from exc
        if not secret:
            raise RedisConfigError(f"the Redis password_file {path} is empty")
        return secret
    if password_env:
        value = env.get(password_env)
        if value:
            return value
    return None


def settings_from_url(
    url: str,
    *,
    password_file: str | None = None,
    password_env: str | None = DEFAULT_PASSWORD_ENV,
    socket_timeout: float = 5.0,
) -> RedisSettings:
    """Settings for ``HOST:PORT`` or ``redis[s]://HOST:PORT[/DB]``, the password resolved
    from ``password_file`` or the environment.

    Raises:
        RedisConfigError: the endpoint or the password file is wrong.
    """
    host, port, tls, db = parse_endpoint(url)
    # A password from the environment may be a user's (a node's workers get their run's
    # workers' user: agent/worker_acl.py); a password file is always the default user's.
    username = os.environ.get(ENV_REDIS_USERNAME) if password_env and not password_file else None
    return RedisSettings(
        host=host,
        port=port,
        db=db or 0,
        tls=bool(tls),
        username=username or None,
        password=resolve_password(password_env, password_file),
        socket_timeout=socket_timeout,
    )


def connect(settings: RedisSettings, *, retries: int = 3) -> redis.Redis:
    """Return a client for ``settings``; nothing is sent until the first command.

    Commands that fail on a dropped connection are retried a few times with backoff, so a
    Redis restart costs a pause, not an error. With TLS the server's certificate must be
    signed by a trusted CA (``tls_ca_file``, else the system's) and name ``settings.host``.
    """
    kwargs: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "db": settings.db,
        "username": settings.username,
        "password": settings.password,
        "socket_timeout": settings.socket_timeout,
        "socket_connect_timeout": min(settings.socket_timeout, 5.0),
        "health_check_interval": 30,
        "retry": Retry(ExponentialBackoff(cap=1.0, base=0.05), retries),
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError],
    }
    if settings.tls:
        kwargs["ssl"] = True
        # Said explicitly: redis-py 5 (which ``redis>=5`` allows) does not check the host name
        # by default, so any certificate the CA ever signed would pass for this server.
        kwargs["ssl_cert_reqs"] = "required"
        kwargs["ssl_check_hostname"] = True
        if settings.tls_ca_file:
            kwargs["ssl_ca_certs"] = settings.tls_ca_file
    return redis.Redis(**kwargs)


def describe_error(exc: BaseException, settings: RedisSettings) -> str:
    """One line that says what went wrong talking to Redis and what to do about it."""
    where = settings.address
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, redis.AuthenticationError) or _is_auth_reply(exc):
        if settings.password is None:
            return (
                f"Redis at {where} requires a password: set ${DEFAULT_PASSWORD_ENV} "
                "(or the configured password variable) or a password_file"
            )
        return (
            f"Redis at {where} refused the password ({text}): check ${DEFAULT_PASSWORD_ENV} "
            "or the password_file"
        )
    if settings.tls and _is_certificate_failure(exc):
        return (
            f"Redis at {where} presented a TLS certificate we do not trust ({text}): it must be "
            f"signed by the CA in tls_ca_file (or a system CA) and name {settings.host!r} "
            "(DNS or IP subject alternative name); connect by the name the certificate gives"
        )
    if isinstance(exc, redis.TimeoutError):
        return f"Redis at {where} did not answer in time ({text}): is it overloaded or firewalled?"
    if isinstance(exc, redis.ConnectionError):
        return (
            f"cannot reach Redis at {where} ({text}): check that it runs and that this machine "
            "can reach that address"
        )
    return f"Redis at {where} failed: {text}"


def _is_certificate_failure(exc: BaseException) -> bool:
    return isinstance(exc, redis.ConnectionError) and "CERTIFICATE_VERIFY_FAILED" in str(exc)


def _is_auth_reply(exc: BaseException) -> bool:
    msg = str(exc)
    return isinstance(exc, redis.ResponseError) and (
        msg.startswith("NOAUTH") or msg.startswith("WRONGPASS") or "invalid password" in msg
    )


def ping(client: redis.Redis, settings: RedisSettings) -> None:
    """Check that Redis answers and accepts us.

    Raises:
        RedisAuthError: the password is missing or wrong.
        RedisUnavailableError: Redis cannot be reached or does not answer.
    """
    try:
        client.ping()
    except (redis.AuthenticationError, redis.ResponseError) as exc:
        if isinstance(exc, redis.AuthenticationError) or _is_auth_reply(exc):
            raise RedisAuthError(describe_error(exc, settings)) from exc
        raise RedisUnavailableError(describe_error(exc, settings)) from exc
    except redis.RedisError as exc:
        raise RedisUnavailableError(describe_error(exc, settings)) from exc

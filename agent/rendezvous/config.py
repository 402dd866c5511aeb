"""Settings of the Redis rendezvous, parsed from torchrun's ``--rdzv-endpoint``/``--rdzv-conf``.

Every default is chosen for spot fleets; the reasons sit beside the values.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spottrain.protocol.env import ENV_NODE
from spottrain.protocol.keys import DEFAULT_PREFIX, RunKeys
from spottrain.redis_conn import (
    DEFAULT_PASSWORD_ENV,
    RedisConfigError,
    RedisSettings,
    parse_endpoint,
    resolve_password,
)

# A node that misses this many beats (keep_alive_interval x keep_alive_max_attempt = 5 s) is
# dead. torch's default is 5 s x 3 = 15 s, because its heartbeat rewrites the whole pickled
# state by compare-and-set; ours is one ZADD, so beating every second is cheap even at 1,000
# nodes, and a survivor learns of a crashed or frozen peer three times sooner. A Python thread
# on a healthy VM does not stall for 5 s; a false positive costs one restart, never a split
# brain (the node rejoins under a new identity).
DEFAULT_KEEP_ALIVE_INTERVAL_S = 1
DEFAULT_KEEP_ALIVE_MAX_ATTEMPT = 5
# torch waits 30 s after the minimum is reached for more nodes. We complete a round as soon as
# every live node has joined, so the last call only matters when a live node is slow to rejoin.
DEFAULT_LAST_CALL_S = 10
# A spot fleet may wait a long time for capacity: a long join timeout keeps nodes waiting
# for peers instead of failing the job.
DEFAULT_JOIN_S = 1800
DEFAULT_CLOSE_S = 30
DEFAULT_HEARTBEAT_S = 5
# Every write refreshes this TTL, so a running job never expires; an abandoned run's keys go
# away a day after its last write.
DEFAULT_TTL_S = 24 * 3600
# Store reads block up to this long (torch's c10d default is 60 s).
DEFAULT_READ_TIMEOUT_S = 60


# Keys torchrun itself puts in the conf: --rdzv-timeout ends up as "timeout" and --node-rank
# as "rank"; torch's own c10d keys are accepted so a command line can switch backends.
_TORCH_KEYS = frozenset({"timeout", "rank", "is_host", "store_type"})
_KNOWN_KEYS = frozenset(
    {
        "tls",
        "tls_ca_file",
        "db",
        "key_prefix",
        "username",
        "password_env",
        "password_file",
        "ttl",
        "read_timeout",
        "join_timeout",
        "last_call_timeout",
        "close_timeout",
        "heartbeat_timeout",
        "keep_alive_interval",
        "keep_alive_max_attempt",
        "node_id",
        "socket_timeout",
    }
)


class RendezvousConfigError(ValueError):
    """A rendezvous endpoint or conf value is malformed; the message names it."""


@dataclass(frozen=True)
class RedisRendezvousConfig:
    """Everything the Redis rendezvous needs, validated on construction."""

    run_id: str
    redis: RedisSettings
    key_prefix: str = DEFAULT_PREFIX
    node_id: str = field(default_factory=socket.gethostname)
    ttl_s: int = DEFAULT_TTL_S
    read_timeout_s: int = DEFAULT_READ_TIMEOUT_S
    join_timeout_s: int = DEFAULT_JOIN_S
    last_call_timeout_s: int = DEFAULT_LAST_CALL_S
    close_timeout_s: int = DEFAULT_CLOSE_S
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_S
    keep_alive_interval_s: int = DEFAULT_KEEP_ALIVE_INTERVAL_S
    keep_alive_max_attempt: int = DEFAULT_KEEP_ALIVE_MAX_ATTEMPT

    def __post_init__(self) -> None:
        RunKeys(self.run_id, self.key_prefix)  # validates both
        for name in (
            "ttl_s",
            "read_timeout_s",
            "join_timeout_s",
            "last_call_timeout_s",
            "close_timeout_s",
            "heartbeat_timeout_s",
            "keep_alive_interval_s",
            "keep_alive_max_attempt",
        ):
            if getattr(self, name) <= 0:
                raise RendezvousConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.ttl_s < 10 * self.dead_after_s:
            raise RendezvousConfigError(
                f"ttl ({self.ttl_s} s) must be at least 10x the heartbeat timeout "
                f"({self.dead_after_s} s), or live keys could expire"
            )
        if not self.node_id or len(self.node_id) > 128 or any(c.isspace() for c in self.node_id):
            raise RendezvousConfigError(
                f"node_id {self.node_id!r} must be 1-128 characters without spaces"
            )

    @property
    def keys(self) -> RunKeys:
        return RunKeys(self.run_id, self.key_prefix)

    @property
    def dead_after_s(self) -> int:
        """Seconds without a heartbeat after which a node is declared dead."""
        return self.keep_alive_interval_s * self.keep_alive_max_attempt


def _as_int(conf: Mapping[str, Any], key: str, default: int) -> int:
    raw = conf.get(key)
    if raw is None:
        return default
    if isinstance(raw, bool):
        raise RendezvousConfigError(f"rdzv conf {key}={raw!r} must be an integer")
    if isinstance(raw, int):
        return raw
    text = str(raw).strip()
    try:
        return int(text)
    except ValueError:
        raise RendezvousConfigError(f"rdzv conf {key}={text!r} must be an integer") from None


def _as_bool(conf: Mapping[str, Any], key: str, default: bool) -> bool:
    raw = conf.get(key)
    if raw is None:
        return default
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise RendezvousConfigError(f"rdzv conf {key}={raw!r} must be true or false")


def parse_config(
    *,
    endpoint: str,
    run_id: str,
    conf: Mapping[str, Any],
    environ: Mapping[str, str] | None = None,
) -> RedisRendezvousConfig:
    """Build the rendezvous settings from torchrun's endpoint, run id and ``--rdzv-conf``.

    Raises:
        RendezvousConfigError: a malformed endpoint, an unknown key, a bad value, or a
            ``password=`` key (command lines are world-readable and torchrun logs its conf).
    """
    env = dict(os.environ if environ is None else environ)
    if "password" in conf:
        raise RendezvousConfigError(
            "rdzv conf 'password' is refused: command lines are world-readable and torchrun "
            f"logs its conf; set ${DEFAULT_PASSWORD_ENV} or password_file=PATH instead"
        )
    unknown = sorted(set(conf) - _KNOWN_KEYS - _TORCH_KEYS)
    if unknown:
        raise RendezvousConfigError(
            f"unknown rdzv conf key(s) {', '.join(unknown)}; allowed: "
            f"{', '.join(sorted(_KNOWN_KEYS))}"
        )
    try:
        host, port, url_tls, url_db = parse_endpoint(endpoint or "")
    except RedisConfigError as exc:
        raise RendezvousConfigError(f"--rdzv-endpoint: {exc}") from None
    db = _as_int(conf, "db", 0 if url_db is None else url_db)
    if url_db is not None and "db" in conf and db != url_db:
        raise RendezvousConfigError(
            f"--rdzv-endpoint {endpoint!r} and rdzv conf db={conf['db']} name different dbs"
        )
    tls = _as_bool(conf, "tls", bool(url_tls))
    if url_tls is not None and "tls" in conf and tls != url_tls:
        raise RendezvousConfigError(
            f"--rdzv-endpoint {endpoint!r} and rdzv conf tls={conf['tls']} disagree about TLS"
        )
    password_env = str(conf.get("password_env", DEFAULT_PASSWORD_ENV))
    password_file = conf.get("password_file")
    socket_timeout = _as_int(conf, "socket_timeout", 5)
    join_default = _as_int(conf, "timeout", DEFAULT_JOIN_S)
    try:
        password = resolve_password(
            password_env, str(password_file) if password_file else None, env
        )
        redis = RedisSettings(
            host=host,
            port=port,
            db=db,
            tls=tls,
            tls_ca_file=str(conf["tls_ca_file"]) if conf.get("tls_ca_file") else None,
            username=str(conf["username"]) if conf.get("username") else None,
            password=password,
            socket_timeout=float(socket_timeout),
        )
        return RedisRendezvousConfig(
            run_id=run_id,
            redis=redis,
            key_prefix=str(conf.get("key_prefix", DEFAULT_PREFIX)),
            node_id=str(conf.get("node_id") or env.get(ENV_NODE) or socket.gethostname()),
            ttl_s=_as_int(conf, "ttl", DEFAULT_TTL_S),
            read_timeout_s=_as_int(conf, "read_timeout", DEFAULT_READ_TIMEOUT_S),
            join_timeout_s=_as_int(conf, "join_timeout", join_default),
            last_call_timeout_s=_as_int(conf, "last_call_timeout", DEFAULT_LAST_CALL_S),
            close_timeout_s=_as_int(conf, "close_timeout", DEFAULT_CLOSE_S),
            heartbeat_timeout_s=_as_int(conf, "heartbeat_timeout", DEFAULT_HEARTBEAT_S),
            keep_alive_interval_s=_as_int(
                conf, "keep_alive_interval", DEFAULT_KEEP_ALIVE_INTERVAL_S
            ),
            keep_alive_max_attempt=_as_int(
                conf, "keep_alive_max_attempt", DEFAULT_KEEP_ALIVE_MAX_ATTEMPT
            ),
        )
    except RendezvousConfigError:
        raise
    except ValueError as exc:  # RedisConfigError and RunKeys' checks
        raise RendezvousConfigError(str(exc)) from None

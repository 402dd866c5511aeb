"""A torchelastic ``RendezvousBackend`` on Redis, plus the liveness records around it.

The rendezvous state is torch's pickled ``_RendezvousState``, stored with an integer fencing
token in one hash and replaced only by an atomic compare-and-set (a Lua script). Liveness is
kept out of that blob: each member beats by ``ZADD`` into a sorted set scored with the Redis
server's clock, so heartbeats never conflict with each other or with state writes, and skewed
VM clocks cannot make a live node look dead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from spottrain.protocol.keys import RunKeys
from spottrain.redis_conn import RedisSettings, describe_error

from .membership import MARK_GONE_LUA

log = logging.getLogger(__name__)

T = TypeVar("T")

# KEYS[1] state hash. ARGV: token ('' = none), new state, ttl ms.
# Returns {0} when nothing is stored and a token was given, {1, new_token} when stored,
# {2, token, state} when the token is not current (stale, invalid or missing).
_CAS = """
local cur = redis.call('HMGET', KEYS[1], 'token', 'state')
local token, state = cur[1], cur[2]
if not token and not state then
  if ARGV[1] ~= '' then return {0} end
  redis.call('HSET', KEYS[1], 'token', '1', 'state', ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {1, '1'}
end
if not token or not state or not tonumber(token) then
  return redis.error_reply('SPOTTRAIN_CORRUPT rendezvous state hash has no valid token/state')
end
if ARGV[1] ~= '' and ARGV[1] == token then
  local new = tostring(tonumber(token) + 1)
  redis.call('HSET', KEYS[1], 'token', new, 'state', ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {1, new}
end
return {2, token, state}
"""

# KEYS[1] state hash. ARGV[1] the token the caller holds ('' = none).
# Returns {} when nothing is stored, {token} when the caller's token is current (its copy of
# the state is too: no need to send the state again), else {token, state}.
_GET_IF_CHANGED = """
local cur = redis.call('HMGET', KEYS[1], 'token', 'state')
if not cur[1] and not cur[2] then return {} end
if cur[1] and cur[2] and cur[1] == ARGV[1] then return {cur[1]} end
return {cur[1] or '', cur[2] or ''}
"""

# KEYS: presence zset, gone hash, then every other key of the rendezvous whose TTL to refresh.
# ARGV: member, ttl ms. Returns server time in ms, or the reason the member is gone.
_BEAT = """
local reason = redis.call('HGET', KEYS[2], ARGV[1])
if reason then return {0, reason} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now, ARGV[1])
for i = 1, #KEYS do redis.call('PEXPIRE', KEYS[i], ARGV[2]) end
return {1, now}
"""

# KEYS: presence zset, gone hash. ARGV: dead-after ms, prune-after ms, the gone hash's
# version the caller holds. The gone hash only grows, with a version counter in its field
# '#v', so it is sent only when it changed since the caller last read it.
# Returns {now ms, live count, {stale members}, version, {gone member, reason, ...} or {}}.
_LIVENESS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cutoff = now - tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - tonumber(ARGV[2])))
local stale = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. cutoff)
local live = redis.call('ZCOUNT', KEYS[1], cutoff, '+inf')
local version = redis.call('HGET', KEYS[2], '#v') or '0'
local gone = {}
if version ~= ARGV[3] then gone = redis.call('HGETALL', KEYS[2]) end
return {now, live, stale, version, gone}
"""

# KEYS: view hash. ARGV: round, world size, participants (JSON), ttl ms.
# Only a newer round replaces the view, so racing publishers cannot move it backwards.
_PUBLISH_VIEW = """
local cur = tonumber(redis.call('HGET', KEYS[1], 'round') or '-1')
if tonumber(ARGV[1]) <= cur then return 0 end
redis.call('HSET', KEYS[1], 'round', ARGV[1], 'world_size', ARGV[2], 'participants', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 1
"""


@dataclass(frozen=True)
class Liveness:
    """What Redis knows about who is alive, read in one round trip."""

    now_ms: int
    live_count: int
    stale: frozenset[str]
    gone: dict[str, str]


class MemberGoneError(RuntimeError):
    """This member left or was declared dead; it may only come back under a new identity."""

    def __init__(self, member: str, reason: str) -> None:
        super().__init__(f"rendezvous member {member} is gone ({reason})")
        self.member = member
        self.reason = reason


class RedisRendezvousBackend(RendezvousBackend):
    """Rendezvous state and liveness in Redis.

    Args:
        client: A Redis client (see :func:`spottrain.redis_conn.connect`).
        settings: Where that client points (used in error messages).
        keys: The run's key schema.
        ttl_s: Every write refreshes the rendezvous keys' TTL to this.
    """

    def __init__(
        self, client: redis.Redis, settings: RedisSettings, keys: RunKeys, ttl_s: int
    ) -> None:
        self._client = client
        self._settings = settings
        self._keys = keys
        self._ttl_ms = ttl_s * 1000
        self._cas = client.register_script(_CAS)
        self._get_if_changed = client.register_script(_GET_IF_CHANGED)
        self._beat = client.register_script(_BEAT)
        self._liveness = client.register_script(_LIVENESS)
        self._mark_gone = client.register_script(MARK_GONE_LUA)
        self._publish_view = client.register_script(_PUBLISH_VIEW)
        self._lock = threading.Lock()
        self._last_failure = float("-inf")
        # The last state and gone map read, so that unchanged ones are not sent again.
        self._known: tuple[bytes, int] | None = None
        self._gone_version = ""
        self._gone: dict[str, str] = {}

    @property
    def name(self) -> str:
        return "redis"

    @property
    def keys(self) -> RunKeys:
        return self._keys

    @property
    def client(self) -> redis.Redis:
        return self._client

    def seconds_since_failure(self) -> float:
        """Seconds since a call to Redis last failed (inf if never)."""
        with self._lock:
            return time.monotonic() - self._last_failure

    # -- torch's backend contract -------------------------------------------------------------
    def get_state(self) -> tuple[bytes, Any] | None:
        """See torch's ``RendezvousBackend.get_state``; the token is an int.

        Every node polls the state about once a second; the state travels only when its
        token moved since this backend last saw it.
        """
        known = self._known
        reply = self._call(
            lambda: self._get_if_changed(
                keys=[self._keys.rdzv_state], args=[str(known[1]) if known else ""]
            )
        )
        if not reply:
            self._known = None
            return None
        if len(reply) == 1 and known is not None:
            return known
        token, state = reply[0] or None, reply[1] or None
        parsed = self._parse_token(token, state)
        assert state is not None  # _parse_token refuses a missing state
        self._known = (state, parsed)
        return self._known

    def set_state(self, state: bytes, token: Any | None = None) -> tuple[bytes, Any, bool] | None:
        """See torch's ``RendezvousBackend.set_state``.

        A token that this backend never issued (not an int) is treated as stale: the current
        state comes back with ``has_set`` False.
        """
        if token is None:
            token_arg = ""
        elif isinstance(token, int) and not isinstance(token, bool) and token > 0:
            token_arg = str(token)
        else:
            current = self.get_state()
            return None if current is None else (current[0], current[1], False)
        reply = self._call(
            lambda: self._cas(keys=[self._keys.rdzv_state], args=[token_arg, state, self._ttl_ms])
        )
        code = int(reply[0])
        if code == 0:
            return None
        if code == 1:
            self._known = (state, int(reply[1]))
            return state, int(reply[1]), True
        current = (reply[2], self._parse_token(reply[1], reply[2]))
        self._known = current
        return current[0], current[1], False

    @staticmethod
    def _parse_token(token: bytes | None, state: bytes | None) -> int:
        if token is None or state is None:
            raise RendezvousStateError(
                "The rendezvous state in Redis is corrupt (token or state missing); "
                "delete the run's rdzv:state key or use a new run id."
            )
        try:
            return int(token)
        except ValueError:
            raise RendezvousStateError(
                f"The rendezvous state in Redis is corrupt (token {token[:32]!r}); "
                "delete the run's rdzv:state key or use a new run id."
            ) from None

    # -- liveness ------------------------------------------------------------------------------
    def _rdzv_keys(self) -> list[str]:
        k = self._keys
        return [k.rdzv_presence, k.rdzv_gone, k.rdzv_state, k.rdzv_members, k.rdzv_view]

    def heartbeat(self, member: str) -> int:
        """Record that ``member`` is alive; return the Redis server time in ms.

        Raises:
            MemberGoneError: the member left or was declared dead.
            RendezvousConnectionError: Redis cannot be reached.
        """
        reply = self._call(lambda: self._beat(keys=self._rdzv_keys(), args=[member, self._ttl_ms]))
        if int(reply[0]) == 0:
            raise MemberGoneError(member, _text(reply[1]))
        return int(reply[1])

    def read_liveness(self, dead_after_s: float) -> Liveness:
        """Who is stale (no beat for ``dead_after_s``), how many are live, and who is gone."""
        dead_ms = int(dead_after_s * 1000)
        reply = self._call(
            lambda: self._liveness(
                keys=[self._keys.rdzv_presence, self._keys.rdzv_gone],
                args=[dead_ms, max(dead_ms * 20, 60_000), self._gone_version],
            )
        )
        version = _text(reply[3])
        if version != self._gone_version:
            flat = [_text(x) for x in reply[4]]
            gone = dict(zip(flat[::2], flat[1::2], strict=True))
            gone.pop("#v", None)
            self._gone, self._gone_version = gone, version
        return Liveness(
            now_ms=int(reply[0]),
            live_count=int(reply[1]),
            stale=frozenset(_text(m) for m in reply[2]),
            gone=dict(self._gone),
        )

    def mark_gone(self, members: Iterable[str], reason: str) -> None:
        """Record that ``members`` left or died; they can never beat again under those names."""
        names = list(members)
        if names:
            self._call(
                lambda: self._mark_gone(
                    keys=[self._keys.rdzv_presence, self._keys.rdzv_gone],
                    args=[reason, self._ttl_ms, *names],
                )
            )

    def register_member(self, node_id: str, member: str) -> None:
        """Map a node id to its current rendezvous member, so the node's agent can make it
        leave by node id."""
        key = self._keys.rdzv_members

        def op() -> None:
            pipe = self._client.pipeline()
            pipe.hset(key, node_id, member)
            pipe.pexpire(key, self._ttl_ms)
            pipe.execute()

        self._call(op)

    def publish_view(self, round_: int, world_size: int, participants: list[str]) -> None:
        """Publish the membership view of a complete round (a no-op for an older round)."""
        import json

        self._call(
            lambda: self._publish_view(
                keys=[self._keys.rdzv_view],
                args=[round_, world_size, json.dumps(participants), self._ttl_ms],
            )
        )

    # -- errors -------------------------------------------------------------------------------
    def _call(self, op: Callable[[], T]) -> T:
        try:
            return op()
        except redis.ResponseError as exc:
            msg = str(exc)
            if "SPOTTRAIN_CORRUPT" in msg or msg.startswith("WRONGTYPE"):
                raise RendezvousStateError(
                    f"The rendezvous state in Redis is corrupt ({msg}); delete the run's "
                    "rdzv keys or use a new run id."
                ) from exc
            self._note_failure()
            raise RendezvousConnectionError(describe_error(exc, self._settings)) from exc
        except redis.RedisError as exc:
            self._note_failure()
            raise RendezvousConnectionError(describe_error(exc, self._settings)) from exc

    def _note_failure(self) -> None:
        with self._lock:
            self._last_failure = time.monotonic()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

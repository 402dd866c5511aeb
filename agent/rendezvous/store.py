"""A ``torch.distributed.Store`` on Redis, so no node hosts a store whose loss ends the job.

torchelastic's agents use it during a rendezvous (rank assignment, the address of the
workers' own store, the exit barrier). Reads block until the key exists or the store's
timeout passes, like ``TCPStore``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

import redis
import torch.distributed as dist
from torch._C._distributed_c10d import Store as _TorchStore

from spottrain.protocol.keys import RunKeys
from spottrain.redis_conn import RedisSettings, describe_error

T = TypeVar("T")

# Same semantics as TCPStore.compare_set: a missing key counts as "" for `expected`.
_COMPARE_SET = """
local cur = redis.call('GET', KEYS[1])
if (not cur and ARGV[1] == '') or (cur and cur == ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return ARGV[2]
end
if not cur then return ARGV[1] end
return cur
"""

_ADD = """
local v = redis.call('INCRBY', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return v
"""

_APPEND = """
local n = redis.call('APPEND', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return n
"""

_POLL_START_S = 0.002
_POLL_CAP_S = 0.05


def _to_bytes(value: str | bytes | bytearray | Sequence[int]) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class RedisStore(_TorchStore):
    """A ``torch.distributed.Store`` backed by one Redis database.

    Args:
        client: A Redis client.
        settings: Where it points (for error messages).
        keys: The run's key schema; every store key lives under ``keys.store_key``.
        ttl_s: Each write sets this TTL.
        timeout: How long blocking reads wait by default.

    Raises (from its methods):
        torch.distributed.DistStoreError: a blocking read timed out.
        torch.distributed.DistNetworkError: Redis could not be reached.
    """

    def __init__(
        self,
        client: redis.Redis,
        settings: RedisSettings,
        keys: RunKeys,
        ttl_s: int,
        timeout: timedelta = timedelta(seconds=60),
    ) -> None:
        super().__init__()
        self._client = client
        self._settings = settings
        self._keys = keys
        self._ttl_ms = ttl_s * 1000
        self._timeout = timeout
        self.set_timeout(timeout)
        self._compare_set = client.register_script(_COMPARE_SET)
        self._add = client.register_script(_ADD)
        self._append = client.register_script(_APPEND)

    def set_timeout(self, timeout: timedelta) -> None:
        # torch's helpers swap the timeout around a barrier; keep the base class's copy too.
        self._timeout = timeout
        super().set_timeout(timeout)

    def _k(self, key: str) -> str:
        return self._keys.store_key(key)

    def _call(self, op: Callable[[], T]) -> T:
        try:
            return op()
        except redis.RedisError as exc:
            raise dist.DistNetworkError(
                "Redis store: " + describe_error(exc, self._settings)
            ) from exc

    # -- writes -------------------------------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        self._call(lambda: self._client.set(self._k(key), _to_bytes(value), px=self._ttl_ms))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values")

        def op() -> None:
            pipe = self._client.pipeline(transaction=True)
            for key, value in zip(keys, values, strict=True):
                pipe.set(self._k(key), _to_bytes(value), px=self._ttl_ms)
            pipe.execute()

        self._call(op)

    def add(self, key: str, amount: int) -> int:
        return int(self._call(lambda: self._add(keys=[self._k(key)], args=[amount, self._ttl_ms])))

    def append(self, key: str, value: str | bytes) -> None:
        self._call(lambda: self._append(keys=[self._k(key)], args=[_to_bytes(value), self._ttl_ms]))

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        reply = self._call(
            lambda: self._compare_set(
                keys=[self._k(key)],
                args=[_to_bytes(expected_value), _to_bytes(desired_value), self._ttl_ms],
            )
        )
        return _to_bytes(reply)

    def delete_key(self, key: str) -> bool:
        return bool(self._call(lambda: self._client.delete(self._k(key))))

    # -- reads --------------------------------------------------------------------------------
    def check(self, keys: list[str]) -> bool:
        if not keys:
            return True
        names = [self._k(k) for k in keys]
        # EXISTS counts a key once per time it is named.
        return int(self._call(lambda: self._client.exists(*names))) == len(names)

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        names = [self._k(k) for k in keys]
        limit = self._timeout.total_seconds()
        deadline = time.monotonic() + limit
        delay = _POLL_START_S
        while True:
            values = self._call(lambda: self._client.mget(names))
            if all(v is not None for v in values):
                return [bytes(v) for v in values]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [k for k, v in zip(keys, values, strict=True) if v is None]
                raise dist.DistStoreError(
                    f"Redis store: timed out after {limit:.3g} s waiting for key(s) {missing[:5]}"
                )
            # Sleep at most until the deadline, so the last look happens right at it.
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, _POLL_CAP_S)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if not keys:
            return
        names = [self._k(k) for k in keys]
        limit = (self._timeout if timeout is None else timeout).total_seconds()
        deadline = time.monotonic() + limit
        delay = _POLL_START_S
        # EXISTS counts a key once per time it is named.
        while int(self._call(lambda: self._client.exists(*names))) < len(names):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise dist.DistStoreError(
                    f"Redis store: timed out after {limit:.3g} s waiting for key(s) {keys[:5]}"
                )
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, _POLL_CAP_S)

    def num_keys(self) -> int:
        def op() -> int:
            return sum(1 for _ in self._client.scan_iter(match=self._keys.store_pattern, count=500))

        return self._call(op)

"""The agent's shim: one per VM, on 127.0.0.1, with its own two Redis connections (one
whose requests block for a round, one for heartbeats, leaves and rosters)."""

from __future__ import annotations

from spottrain.protocol.keys import RunKeys
from spottrain.quorum.model import QuorumConfig
from spottrain.redis_conn import RedisSettings, connect

from .server import LighthouseShim


def start_local_shim(
    settings: RedisSettings, keys: RunKeys, config: QuorumConfig, *, port: int = 0
) -> LighthouseShim:
    """A started shim for the run ``keys`` on ``127.0.0.1:port`` (0: a free port).

    Raises:
        OSError: the port is taken.
        spottrain.redis_conn.RedisUnavailableError: Redis cannot be reached.
    """
    from spottrain.quorum.client import QuorumClient

    blocking = QuorumClient(connect(settings), keys, config)
    control = QuorumClient(connect(settings), keys, config)
    return LighthouseShim(blocking, control, config, bind=f"127.0.0.1:{port}").start()

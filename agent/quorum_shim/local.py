"""The agent's shim: one per VM, on 127.0.0.1, with its own two Redis connections (one
whose requests block for a round, one for heartbeats, leaves, rosters and the relay lease);
with a relay group, it also serves the group's relay method (:mod:`.relay`) to other VMs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from spottrain.protocol.keys import RunKeys
from spottrain.quorum.model import QuorumConfig
from spottrain.redis_conn import RedisSettings, connect

from .server import LighthouseShim


@dataclass(frozen=True)
class RelayPlan:
    """Where this shim's relay group is and how other VMs reach its relay method."""

    group: int  # slot index // group size
    bind: str  # host:port the relay method listens on ("0.0.0.0:29513")
    address: str  # host:port other VMs dial: the lease's value


def start_local_shim(
    settings: RedisSettings,
    keys: RunKeys,
    config: QuorumConfig,
    *,
    port: int = 0,
    wait_replicas: int = 0,
    relay: RelayPlan | None = None,
    on_lease: Callable[[bool], None] | None = None,
) -> LighthouseShim:
    """A started shim for the run ``keys`` on ``127.0.0.1:port`` (0: a free port); with
    ``wait_replicas``, each formed round is on that many Redis replicas before it is used;
    with ``relay``, its requests travel through the group's relay (``on_lease`` hears when
    this shim takes or loses the group's lease).

    Raises:
        OSError: the port (or the relay's) is taken.
        spottrain.redis_conn.RedisUnavailableError: Redis cannot be reached.
    """
    from spottrain.quorum.client import QuorumClient

    blocking = QuorumClient(connect(settings), keys, config, wait_replicas=wait_replicas)
    control_redis = connect(settings)
    control = QuorumClient(control_redis, keys, config)
    if relay is None:
        return LighthouseShim(blocking, control, config, bind=f"127.0.0.1:{port}").start()
    from .member import RelayedQuorum
    from .relay import Lease, lease_key

    lease = Lease(
        control_redis, lease_key(keys, relay.group), relay.address, 3 * config.heartbeat_timeout_ms
    )
    backend = RelayedQuorum(
        blocking,
        lease,
        config,
        bind=relay.bind,
        wait_replicas=wait_replicas,
        on_lease=on_lease,
    )
    try:
        shim = LighthouseShim(backend, control, config, bind=f"127.0.0.1:{port}")
    except BaseException:
        backend.stop()
        raise
    backend.start()
    return shim.start()

"""What torchrun gets in replica mode: a rendezvous of the replica's own nodes, and the
workers' replica variables (slot, manager port, lighthouse, quorum floor).

With the quorum in Redis (``--quorum redis``, the default) the "lighthouse" the workers'
managers call is this agent's own shim (:mod:`.quorum_shim`) on 127.0.0.1; with
``--quorum lighthouse`` it is the controller's torchft lighthouse.

Each replica runs its own torchrun; its Redis rendezvous id is the run id plus the slot (and
the slot's generation from the second on, see :mod:`.replica_slots`), so every rendezvous key
(round, presence, members, torch's store) is the replica's own and a node that leaves or dies
re-forms only its replica's group, never another replica's. A new generation gets fresh keys:
its predecessor's, closed once its torchrun ended, expire with the rendezvous' own TTL (every
rendezvous write sets it; 24 h by default).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from spottrain.protocol.env import (
    ENV_FAULT_TOLERANCE,
    ENV_LIGHTHOUSE,
    ENV_MANAGER_PORT,
    ENV_MIN_REPLICAS,
    ENV_NODES_PER_REPLICA,
    ENV_QUORUM,
    ENV_REPLICA_ID,
)
from spottrain.protocol.keys import RunKeys

from .replica_slots import LEGACY_GEN

log = logging.getLogger("spottrain.agent")

# torchft's own names for the same two settings: its Manager reads them when it is built
# without arguments (the lighthouse as a URL).
TORCHFT_LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"
TORCHFT_MANAGER_PORT = "TORCHFT_MANAGER_PORT"

# The manager's port on a VM: fixed, so a firewall rule can name it (torchft's lighthouse is
# by convention on 29510; torchrun's store on 29500).
DEFAULT_MANAGER_PORT = 29512
# The agent's lighthouse shim with the Redis quorum: local to the VM (127.0.0.1 only).
DEFAULT_SHIM_PORT = 29511
QUORUMS = ("redis", "lighthouse")
_LIGHTHOUSE_POLL_S = 0.5


def replica_rdzv_id(run_id: str, slot: str, gen: int = LEGACY_GEN) -> str:
    """torchrun's ``--rdzv-id`` for generation ``gen`` of the replica in ``slot``: every
    rendezvous key under it. The first generation keeps the plain ``<run>.<slot>`` (what
    readers that predate generations look up)."""
    suffix = f".g{gen}" if gen > LEGACY_GEN else ""
    return RunKeys(f"{run_id}.{slot}{suffix}").run_id


def check_lighthouse(address: str, source: str) -> str:
    """``address`` if it is host:port (an http:// in front tolerated); else a one-line
    ValueError naming ``source``."""
    bare = address.removeprefix("http://")
    host, sep, port = bare.rpartition(":")
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(
            f"{source} {address!r} is not HOST:PORT of the run's lighthouse (e.g. 10.0.0.5:29510)"
        )
    return bare


@dataclass(frozen=True)
class ReplicaLaunch:
    """One torchrun launch of one replica."""

    run_id: str
    slot: str
    nodes_per_replica: int
    min_replicas: int
    lighthouse: str
    manager_port: int
    gen: int = LEGACY_GEN
    quorum: str = "lighthouse"

    @property
    def rdzv_id(self) -> str:
        return replica_rdzv_id(self.run_id, self.slot, self.gen)

    @property
    def nnodes(self) -> str:
        return f"{self.nodes_per_replica}:{self.nodes_per_replica}"

    def worker_env(self) -> dict[str, str]:
        """The variables the workers of this replica get beside torchrun's own."""
        return {
            ENV_FAULT_TOLERANCE: "replica",
            ENV_REPLICA_ID: self.slot,
            ENV_NODES_PER_REPLICA: str(self.nodes_per_replica),
            ENV_MIN_REPLICAS: str(self.min_replicas),
            ENV_LIGHTHOUSE: self.lighthouse,
            ENV_MANAGER_PORT: str(self.manager_port),
            ENV_QUORUM: self.quorum,
            TORCHFT_LIGHTHOUSE: f"http://{self.lighthouse}",
            TORCHFT_MANAGER_PORT: str(self.manager_port),
        }


def wait_lighthouse(
    client: redis.Redis,
    keys: RunKeys,
    timeout: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    stopped: Callable[[], bool] = lambda: False,
) -> str | None:
    """The lighthouse address the controller wrote in Redis, waiting up to ``timeout``
    seconds for it (the controller may still be starting it); None if it never came or
    ``stopped()`` turned true.

    Raises:
        ValueError: the key holds something that is not HOST:PORT.
    """
    deadline = clock() + timeout
    said = False
    while True:
        try:
            raw = client.get(keys.replica_lighthouse)
        except redis.RedisError as exc:
            log.warning("cannot read the lighthouse address from Redis (%s); retrying", exc)
            raw = None
        if raw:
            text = raw.decode() if isinstance(raw, bytes) else str(raw)
            return check_lighthouse(text, f"Redis key {keys.replica_lighthouse}")
        if clock() >= deadline or stopped():
            return None
        if not said:
            log.info(
                "waiting up to %.0f s for the run's lighthouse address in Redis key %s "
                "(the controller writes it once the lighthouse is up)",
                timeout,
                keys.replica_lighthouse,
            )
            said = True
        time.sleep(_LIGHTHOUSE_POLL_S)


def plan_launch(
    client: redis.Redis,
    keys: RunKeys,
    *,
    slot: str,
    gen: int = LEGACY_GEN,
    nodes_per_replica: int,
    min_replicas: int,
    lighthouse: str,
    lighthouse_wait: float,
    manager_port: int,
    local_cloud: bool,
    stopped: Callable[[], bool] = lambda: False,
    quorum: str = "lighthouse",
) -> ReplicaLaunch | str:
    """This launch's settings, or why there can be none (a one-line reason).

    The lighthouse given to the agent wins (with the Redis quorum: the agent's own shim);
    else the controller's, read now (it may have restarted the lighthouse elsewhere since
    the last launch).
    """
    if not lighthouse:
        try:
            found = wait_lighthouse(client, keys, lighthouse_wait, stopped=stopped)
        except ValueError as exc:
            return str(exc)
        if found is None:
            return (
                f"no lighthouse address in Redis key {keys.replica_lighthouse} after "
                f"{lighthouse_wait:g} s: is the controller running the run's lighthouse? "
                "(or give --lighthouse / SPOTTRAIN_LIGHTHOUSE)"
            )
        lighthouse = found
    if local_cloud or manager_port == 0:
        # All local "VMs" share one host: a fixed port would collide between replicas.
        from spottrain.ports import free_port

        manager_port = free_port()
    return ReplicaLaunch(
        run_id=keys.run_id,
        slot=slot,
        nodes_per_replica=nodes_per_replica,
        min_replicas=min_replicas,
        lighthouse=check_lighthouse(lighthouse, "lighthouse"),
        manager_port=manager_port,
        gen=gen,
        quorum=quorum,
    )

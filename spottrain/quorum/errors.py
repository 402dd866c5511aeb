"""The Redis quorum's errors: each message says what happened and what to do."""

from __future__ import annotations


class QuorumError(RuntimeError):
    """Base of the quorum's errors."""


class QuorumGone(QuorumError):
    """This replica identity left or was dropped (its heartbeats stopped): it can never rejoin
    under the same id. Restart the replica's manager, which joins under a new one."""


class QuorumTimeout(QuorumError):
    """No quorum formed in time (too few replicas, or Redis unreachable the whole time)."""


class QuorumCorrupt(QuorumError):
    """A quorum key holds something the scripts did not write; the message names the key and
    how to reset the quorum's keys."""


class QuorumNotReplicated(QuorumTimeout):
    """The run's Redis could not put the quorum on enough of its own replicas by the request's
    deadline: a formed round that fewer than ``wait_replicas`` Redis replicas acknowledged
    (``WAIT``), or writes refused because ``min-replicas-to-write`` found too few replicas
    (``NOREPLICAS``). The answer is not used: an asynchronous failover could lose it. A
    timeout like any other to its caller, which asks again."""


def is_noreplicas(message: str) -> bool:
    """Whether an error reply is Redis refusing a write for want of replicas (a pipeline's
    error names its command first)."""
    return message.startswith("NOREPLICAS") or ": NOREPLICAS " in message


def not_enough_replicas(message: str) -> QuorumNotReplicated:
    """The error for a NOREPLICAS reply ``message``."""
    return QuorumNotReplicated(
        f"the run's Redis refuses the quorum's writes ({message.split(' script: ')[0]}): "
        "it has min-replicas-to-write set and not that many Redis replicas connected with a "
        "lag under min-replicas-max-lag; reconnect the missing replica (INFO replication: "
        "connected_slaves and each replica's lag on the primary, master_link_status on the "
        "replica) or lower min-replicas-to-write"
    )


def unacknowledged(what: str, acked: int, need: int, connected: int | None) -> QuorumNotReplicated:
    """The error for ``what`` (a formed round) that only ``acked`` of the ``need`` Redis
    replicas acknowledged by the deadline; ``connected``: the primary's replicas, if known."""
    on_primary = "" if connected is None else f"; the primary has {connected} connected"
    return QuorumNotReplicated(
        f"{what} formed, but only {acked} of the {need} Redis replicas it must be on "
        f"(wait_replicas) acknowledged it by the request's deadline{on_primary}; it is not "
        "used, since a failover could lose it. Check the replicas' link (INFO replication: "
        "connected_slaves on the primary, master_link_status on each replica), or set "
        "train.replica.wait_replicas (--quorum-wait-replicas) to 0 to use rounds without "
        "waiting for a Redis replica"
    )

"""The Redis quorum's errors: each message says what happened and what to do.

A Redis that refuses the quorum's writes is told apart from garbage in the quorum's keys here,
in one place (:func:`refusal`): its error replies (``READONLY``, ``LOADING``, ``BUSY``,
``OOM``, ``MISCONF``, ``NOREPLICAS``, ``UNBLOCKED``) become a :class:`QuorumRedisRefused`
that names the cause and the fix, which a request rides out until its deadline.
"""

from __future__ import annotations

import re

import redis


class QuorumError(RuntimeError):
    """Base of the quorum's errors."""


class QuorumGone(QuorumError):
    """This replica identity left or was dropped (its heartbeats stopped): it can never rejoin
    under the same id. Restart the replica's manager, which joins under a new one."""


class QuorumTimeout(QuorumError):
    """No quorum formed in time (too few replicas, or Redis unreachable the whole time)."""


class QuorumNotFormed(QuorumTimeout):
    """Redis answered throughout, but the request's round did not form by its deadline: fewer
    than ``min_replicas`` replicas asked, or not more than half of the heartbeating ones. The
    replicas' doing, not Redis's nor a relay's: a relay passes it on and is kept."""


class QuorumCorrupt(QuorumError):
    """A quorum key holds something the scripts did not write; the message names the key and
    how to reset the quorum's keys."""


class QuorumRedisRefused(QuorumTimeout):
    """The run's Redis refused the quorum's commands, for a reason of its own that the
    quorum's keys do not share (a request or a join with a timeout rides it out until its
    deadline; heartbeats, leaves and reads raise it at once): ``cause`` is Redis's error code
    (``READONLY``: a replica, not the primary; ``UNBLOCKED``: demoted while the quorum
    waited; ``LOADING``: loading its data; ``BUSY``: running a long script; ``OOM``:
    maxmemory reached; ``MISCONF``: cannot write to disk; ``NOREPLICAS``:
    min-replicas-to-write) or ``WAIT`` (fewer Redis replicas acknowledged than
    ``wait_replicas``). Nothing is wrong with the quorum's keys, nor with a relay that
    passes this on. A timeout like any other to its caller, which asks again."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause

    def for_replica(self, replica_id: str) -> QuorumRedisRefused:
        """The same error for one member of a relay batch (one object each: the relay
        hands them to different threads)."""
        return type(self)(f"replica {replica_id}: {self}", self.cause)


# What a request (a join with a timeout, a relay batch, a WAIT) rides out until its deadline:
# a lost connection (reconnect, re-send: requests are idempotent; redis-py's BusyLoadingError
# is one) and a Redis refusing the quorum's writes.
RETRIED = (redis.ConnectionError, redis.TimeoutError, QuorumRedisRefused)


class QuorumNotReplicated(QuorumRedisRefused):
    """The run's Redis could not put the quorum on enough of its own replicas by the request's
    deadline: a formed round that fewer than ``wait_replicas`` Redis replicas acknowledged
    (``WAIT``), or writes refused because ``min-replicas-to-write`` found too few replicas
    (``NOREPLICAS``). The answer is not used: an asynchronous failover could lose it."""


# Redis's error codes for a refusal; redis-py strips the code off the ones it maps to a class.
_CODES = ("NOREPLICAS", "READONLY", "UNBLOCKED", "LOADING", "BUSY", "OOM", "MISCONF")
_CODE_OF = {
    redis.ReadOnlyError: "READONLY",
    redis.OutOfMemoryError: "OOM",
    redis.BusyLoadingError: "LOADING",
}
_CODE = re.compile(rf"({'|'.join(_CODES)}) ")
_PIPELINE = " of pipeline caused error: "  # redis-py's prefix: "Command # 2 (DEL k)" + this


def redis_reply(error: BaseException | str) -> str:
    """Redis's own error reply in ``error``: without redis-py's pipeline prefix, the script's
    ``script: <sha>, on @user_script:1.`` suffix or the scripts' ``QCORRUPT <key>`` head, and
    with the error code redis-py strips off the replies it maps to a class."""
    text = str(error).split(" script: ")[0]
    text = text.partition(_PIPELINE)[2] or text
    if text.startswith("QCORRUPT "):
        text = text.split(" ", 2)[2] if text.count(" ") >= 2 else ""
    code = next((c for t, c in _CODE_OF.items() if isinstance(error, t)), None)
    if code is not None and not text.startswith(f"{code} "):
        text = f"{code} {text}"
    return text


def refusal_code(error: BaseException | str) -> str | None:
    """The code of a refusal reply (:data:`_CODES`), None for any other error."""
    match = _CODE.match(redis_reply(error))
    return match.group(1) if match else None


def refusal(error: BaseException | str, where: str = "") -> QuorumRedisRefused | None:
    """The error for a Redis refusal (``where``: the address it came from, if known); None
    when ``error`` is not one (garbage in a key, a bug: the caller's own error)."""
    if isinstance(error, QuorumRedisRefused):
        return error
    code = refusal_code(error)
    if code is None:
        return None
    reply = redis_reply(error)
    if code == "NOREPLICAS":
        return not_enough_replicas(reply)
    return QuorumRedisRefused(_MESSAGES[code](f" at {where}" if where else "", reply), code)


def from_wire(cause: str, message: str) -> QuorumRedisRefused:
    """A refusal a relay passed on (its ``cause`` and message), as the relay raised it."""
    kind = QuorumNotReplicated if cause in ("NOREPLICAS", "WAIT") else QuorumRedisRefused
    return kind(message, cause)


def not_enough_replicas(message: str) -> QuorumNotReplicated:
    """The error for a NOREPLICAS reply ``message``."""
    return QuorumNotReplicated(
        f"the run's Redis refuses the quorum's writes ({redis_reply(message)}): "
        "it has min-replicas-to-write set and not that many Redis replicas connected with a "
        "lag under min-replicas-max-lag; reconnect the missing replica (INFO replication: "
        "connected_slaves and each replica's lag on the primary, master_link_status on the "
        "replica) or lower min-replicas-to-write",
        "NOREPLICAS",
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
        "waiting for a Redis replica",
        "WAIT",
    )


def _read_only(at: str, reply: str) -> str:
    return (
        f"the run's Redis{at} is a read-only replica, not the primary, and refuses the "
        f"quorum's writes ({reply}): after a failover, connections to the old primary get "
        "this. Point the run's Redis address at the new primary (an address that follows "
        "failovers: the agents reconnect on every retry), or promote this one "
        "(REPLICAOF NO ONE) if no primary is left"
    )


def _unblocked(at: str, reply: str) -> str:
    return (
        f"the run's Redis{at} stopped being the primary while the quorum waited on it "
        f"({reply}): a failover demoted it. Point the run's Redis address at the new primary "
        "(an address that follows failovers: the agents reconnect on every retry)"
    )


def _loading(at: str, reply: str) -> str:
    return (
        f"the run's Redis{at} is loading its data into memory (after a restart, or a "
        f"replica's full sync) and answers nothing else until it is done ({reply}). Wait for "
        "the load (INFO persistence: loading, loading_eta_seconds): the requests resume by "
        "themselves"
    )


def _busy(at: str, reply: str) -> str:
    return (
        f"the run's Redis{at} is running a script or function past busy-reply-threshold and "
        f"answers nothing else until it ends ({reply}). Wait for it, or find it (SLOWLOG GET, "
        "CLIENT LIST) and end it (SCRIPT KILL, FUNCTION KILL)"
    )


def _out_of_memory(at: str, reply: str) -> str:
    return (
        f"the run's Redis{at} refuses the quorum's writes because its memory is full "
        f"({reply}): used_memory is above maxmemory and the policy evicts nothing. Raise "
        "maxmemory (CONFIG SET maxmemory, or a larger Redis) or free memory (INFO memory, "
        "MEMORY DOCTOR, redis-cli --bigkeys); keep maxmemory-policy noeviction, since an "
        "evicting policy could drop the quorum's keys. Not corruption: keep the quorum's keys"
    )


def _disk_error(at: str, reply: str) -> str:
    return (
        f"the run's Redis{at} refuses writes because it cannot persist to disk ({reply}): "
        "a snapshot (RDB) or append-only file write failed. Fix the disk it writes to (free "
        "space, its dir's permissions; INFO persistence: rdb_last_bgsave_status, "
        "aof_last_write_status, and the Redis log); writes resume once a save succeeds "
        "(BGSAVE). Not corruption: keep the quorum's keys"
    )


_MESSAGES = {
    "READONLY": _read_only,
    "UNBLOCKED": _unblocked,
    "LOADING": _loading,
    "BUSY": _busy,
    "OOM": _out_of_memory,
    "MISCONF": _disk_error,
}

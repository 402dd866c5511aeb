"""``wait_replicas``: an answer is used only once that many Redis replicas hold it.

The client writes the marker key ``quorum_key("waited")`` and runs ``WAIT`` on the same
connection (``WAIT`` counts the acknowledgements of its own connection's last write, and a
connection that wrote nothing counts every connected replica at once), again until the
request's deadline.

Deadlines: every blocking command (``BLPOP``, ``WAIT``) is given a timeout that ends
:data:`REDIS_LATE_S` before the time it must end by (:func:`block_s`): Redis times blocked
commands out on its timer, up to a tick late. With ``wait_replicas`` a request's answer must
be in by :func:`answer_by`, early enough for a last ``WAIT``. So a request ends by its
deadline, its last WAIT included: the shim answers torchft's manager a margin before the
gRPC deadline, and a command running past ours would run into theirs (the manager would see
its own deadline, not what went wrong).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import redis

from spottrain.quorum import errors
from spottrain.quorum.errors import QuorumRedisRefused

if TYPE_CHECKING:
    from spottrain.quorum.client import QuorumClient

# The WAIT kept for an answer that formed at the last moment: it is not thrown away for
# want of a Redis replica's round trip.
LAST_WAIT_S = 0.1
# Redis times a blocked command out on its timer, hz (10 by default) times a second: up to
# this long after the timeout it was given (measured: BLPOP 0.13 s returns after 0.2 s).
REDIS_LATE_S = 0.1
# A blocking command's shortest timeout (0 would block for ever).
_MIN_BLOCK_S = 0.01
_TRANSIENT = (redis.ConnectionError, redis.TimeoutError, QuorumRedisRefused)


def answer_by(deadline: float, timeout: float, wait_replicas: int) -> float:
    """When a request of ``timeout`` seconds ending at ``deadline`` must have its answer, so
    that a WAIT still fits before the deadline (half the timeout at most: a short request
    gets both halves)."""
    if wait_replicas <= 0:
        return deadline
    return deadline - min(LAST_WAIT_S + REDIS_LATE_S, max(0.0, timeout) / 2)


def block_s(now: float, until: float, slice_s: float) -> float | None:
    """The timeout to give the next blocking command so that it ends by ``until`` even when
    Redis times it out late: a slice, cut there; None when too little is left for one."""
    room = until - REDIS_LATE_S - now
    return None if room < _MIN_BLOCK_S else max(_MIN_BLOCK_S, min(slice_s, room))


def confirm(c: QuorumClient, deadline: float, what: str) -> None:
    """Return once ``c``'s ``wait_replicas`` Redis replicas hold every write Redis made
    before this call (the answers just read included), WAITing again until ``deadline``.

    Raises:
        QuorumNotReplicated: fewer acknowledged (or writes were refused for want of
            replicas) by then; the message says how many and what to check.
        QuorumRedisRefused: Redis refused the marker's write until then (a replica, full
            memory, a disk error, ...).
        QuorumTimeout: Redis was unreachable until the deadline.
    """
    need = c._wait_replicas
    failures, acked, failed = 0, 0, None
    while need > 0:
        wait = block_s(time.monotonic(), deadline, c._slice_s())
        if wait is None and failed is not None:
            c._raise_for(failed)
        if wait is None:
            raise errors.unacknowledged(what, acked, need, _connected_replicas(c))
        try:
            acked, failed = _wait_once(c, need, int(wait * 1000)), None
        except _TRANSIENT as e:
            failures, failed = failures + 1, e
            c._back_off(failures, deadline, e)
            continue
        if acked >= need:
            return


def _wait_once(c: QuorumClient, need: int, ms: int) -> int:
    # One connection for both: WAIT counts the acknowledgements of its own connection's
    # last write, and every write before the marker (the FORM's) is on the replica
    # before the marker is.
    pipe = c._redis.pipeline(transaction=False)
    pipe.set(c._keys.quorum_key("waited"), "1")
    pipe.execute_command("WAIT", need, ms)
    marked, acked = pipe.execute(raise_on_error=False)
    for got in (marked, acked):
        if isinstance(got, redis.ResponseError):
            raise c._error(got)
    return int(acked)


def _connected_replicas(c: QuorumClient) -> int | None:
    try:
        return int(c._redis.info("replication").get("connected_slaves", 0))
    except (redis.RedisError, ValueError):
        return None  # the message goes without it

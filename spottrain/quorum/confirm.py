"""``wait_replicas``: an answer is used only once that many Redis replicas hold it.

The client writes the marker key ``quorum_key("waited")`` and runs ``WAIT`` on the same
connection (``WAIT`` counts the acknowledgements of its own connection's last write, and a
connection that wrote nothing counts every connected replica at once), again until the
request's deadline.

Deadlines: every blocking command (``BLPOP``, ``WAIT``) is given a timeout that ends
:data:`REDIS_LATE_S` before the time it must end by (:func:`block_s`): Redis times blocked
commands out on its timer, up to a tick late. With ``wait_replicas`` a request's answer must
be in by :func:`answer_by`, early enough for a last ``WAIT``, and the last ``WAIT`` brings the
count of connected replicas for the message with it (no command follows it). So a request
ends by its deadline, its last WAIT included: the shim answers torchft's manager a margin
before the gRPC deadline, and a command running past ours would run into theirs (the manager
would see its own deadline, not what went wrong). No blocking command outlasts its
connection's socket timeout either (:func:`longest_block_s`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import redis

from spottrain.quorum import errors

if TYPE_CHECKING:
    from spottrain.quorum.client import QuorumClient

# The WAIT kept for an answer that formed at the last moment: it is not thrown away for
# want of a Redis replica's round trip.
LAST_WAIT_S = 0.1
# Redis times a blocked command out on its timer, hz (10 by default) times a second: up to
# this long after the timeout it was given (measured: BLPOP 0.13 s returns after 0.2 s).
REDIS_LATE_S = 0.1
# A blocking command's shortest timeout (0 would block for ever).
MIN_BLOCK_S = 0.01
# Kept, besides REDIS_LATE_S, between a blocking command's timeout and its connection's socket
# timeout: for the reply's way back (a busy Redis's queue, the network, a busy VM's thread).
SOCKET_MARGIN_S = 0.25


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
    return None if room < MIN_BLOCK_S else max(MIN_BLOCK_S, min(slice_s, room))


def longest_block_s(socket_timeout: float | None) -> float | None:
    """The longest timeout to give a blocking command on a connection whose socket times out
    after ``socket_timeout`` seconds (None: never; then no limit). redis-py does not lengthen
    the socket's timeout for ``BLPOP`` or ``WAIT``: a longer one would end as a lost
    connection (a reconnect, the command sent again) instead of as Redis's own timeout."""
    if socket_timeout is None:
        return None
    return max(MIN_BLOCK_S, socket_timeout - REDIS_LATE_S - SOCKET_MARGIN_S)


def shortest_timeout_s(wait_replicas: int) -> float:
    """The shortest timeout in which a request (or a relay batch) still blocks once for its
    answer (:func:`block_s` before :func:`answer_by`); with less it gives up at once."""
    need = REDIS_LATE_S + MIN_BLOCK_S
    if wait_replicas <= 0:
        return need
    share = LAST_WAIT_S + REDIS_LATE_S  # answer_by's, half the timeout at most
    return 2 * need if need <= share else need + share


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
    failures, acked, failed, connected = 0, 0, None, None
    while need > 0:
        now, slice_s = time.monotonic(), c._slice_s()
        wait = block_s(now, deadline, slice_s)
        if wait is None and failed is not None:
            c._raise_for(failed)
        if wait is None:  # no command after the last WAIT: it counted the replicas
            raise errors.unacknowledged(what, acked, need, connected)
        # Possibly the last WAIT (no other fits after it, should Redis end it late).
        last = block_s(now + wait + REDIS_LATE_S, deadline, slice_s) is None
        try:
            acked, counted = _wait_once(c, need, int(wait * 1000), count=last)
            failed, connected = None, connected if counted is None else counted
        except errors.RETRIED as e:
            failures, failed = failures + 1, e
            c._back_off(failures, deadline, e)
            continue
        if acked >= need:
            return


def _wait_once(c: QuorumClient, need: int, ms: int, *, count: bool) -> tuple[int, int | None]:
    """WAIT's count of acknowledgements, and with ``count`` the primary's connected
    replicas (None: unknown), read right after the WAIT in the same round trip."""
    # One connection for both: WAIT counts the acknowledgements of its own connection's
    # last write, and every write before the marker (the FORM's) is on the replica
    # before the marker is.
    pipe = c._redis.pipeline(transaction=False)
    pipe.set(c._keys.quorum_key("waited"), "1")
    pipe.execute_command("WAIT", need, ms)
    if count:  # for the message: no command may follow the last WAIT (the deadline)
        pipe.info("replication")
    got = pipe.execute(raise_on_error=False)
    for reply in got[:2]:
        if isinstance(reply, redis.ResponseError):
            raise c._error(reply)
    return int(got[1]), _connected_replicas(got[2]) if count else None


def _connected_replicas(info: object) -> int | None:
    if not isinstance(info, dict):
        return None  # an error reply: the message goes without the count
    try:
        return int(info.get("connected_slaves", 0))
    except (TypeError, ValueError):
        return None

"""A replica the Redis quorum refused restarts at once, under a new id.

The quorum refuses a replica id for good once it left or was dropped (frozen past the
heartbeat timeout): a woken replica must not slip back into a quorum that went on without
it. Its shim answers the manager's Quorum call at once (gRPC NOT_FOUND), but torchft 0.2.0's
manager does not give up on that: its Rust client retries the call until the quorum timeout
(120 s here) and then drops the error without waking the waiting ``start_quorum``
(``_run_quorum``'s "We don't broadcast in cases when this method returns an error"), so the
worker would sit out the whole timeout before anything restarted it.

:class:`RefusalGuard` ends that wait: while a quorum call is in flight for longer than a
poll, it asks the node's shim (a local call: Redis is not read) whether this replica's id was
refused, and if so the worker exits with :data:`EXIT_REPLICA_GONE`. torchrun
(``--max-restarts``) then starts the replica's workers again; torchft gives each new manager
a fresh uuid, so the replica joins under a new id through the same shim, heals from a live
peer and trains. The process exits with ``os._exit``: the quorum thread blocked inside
torchft's Rust call would hold an ordinary exit until the timeout. With several nodes per
replica only the first node's shim sees the manager's id; the other nodes' workers lose
their manager when the first node's exit, and fail and restart with them.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable

log = logging.getLogger("spottrain.replica")

# EX_TEMPFAIL: a worker of a replica the quorum refused; torchrun restarts it.
EXIT_REPLICA_GONE = 75
REFUSED_METHOD = "/spottrain.QuorumShim/Refused"

# Why the quorum refused a replica id, or None: raises OSError when it cannot be asked.
Refused = Callable[[str], str | None]


def shim_refused(address: str) -> Refused:
    """Asks the agent's lighthouse shim on ``address`` (host:port) whether it refused an id."""
    import grpc

    channel = grpc.insecure_channel(address.removeprefix("http://"))
    call = channel.unary_unary(
        REFUSED_METHOD, request_serializer=str.encode, response_deserializer=bytes.decode
    )

    def ask(replica_id: str) -> str | None:
        try:
            why = call(replica_id, timeout=2.0)
        except grpc.RpcError as exc:
            raise OSError(f"the lighthouse shim did not answer: {exc}") from exc
        return why or None

    return ask


def exit_refused(replica_id: str, why: str) -> None:
    """The default reaction: say why, then end the process at once for torchrun to restart."""
    log.error(
        "replica %s was refused by the quorum (%s): exiting with code %d so torchrun restarts "
        "this replica's workers, whose manager joins under a new id",
        replica_id,
        why,
        EXIT_REPLICA_GONE,
    )
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_REPLICA_GONE)


class RefusalGuard:
    """Watches one quorum call at a time (:meth:`arm` before it, :meth:`disarm` after): once
    it has taken ``poll_s``, asks ``refused`` every ``poll_s`` and calls ``on_refused(id,
    why)`` when this replica's id was refused. A quick quorum asks nothing."""

    def __init__(
        self,
        refused: Refused,
        on_refused: Callable[[str, str], None] = exit_refused,
        *,
        poll_s: float = 0.25,
    ) -> None:
        self.refused, self.on_refused, self.poll_s = refused, on_refused, poll_s
        self.asked = 0
        self._replica_id: str | None = None
        self._armed = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spottrain-refusal", daemon=True)
        self._thread.start()

    def arm(self, replica_id: str) -> None:
        self._replica_id = replica_id
        self._armed.set()

    def disarm(self) -> None:
        self._armed.clear()
        self._replica_id = None

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._armed.wait(0.5):
                continue
            if self._stop.wait(self.poll_s):
                return
            rid = self._replica_id
            if rid is None:
                continue  # the quorum came back within the poll
            try:
                self.asked += 1
                why = self.refused(rid)
            except Exception:
                continue  # the shim is away (the agent restarting): nothing to learn
            if why is not None and self._replica_id == rid:
                self.on_refused(rid, why)
                self.disarm()

    def stop(self) -> None:
        self._stop.set()
        self._armed.set()
        self._thread.join(timeout=5)

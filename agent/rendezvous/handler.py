"""The ``redis`` rendezvous handler: torch's dynamic rendezvous, fixed for spot fleets.

It subclasses torch's ``DynamicRendezvousHandler`` and keeps its join/leave state machine,
changing four things (each pinned by ``tests/unit/agent/test_torch_internals.py`` where it leans on
torch's private behaviour):

* **Liveness** is a sorted set of heartbeats stamped by the Redis clock (see
  :mod:`.backend`), not timestamps inside the pickled state; dead members are removed from
  every list and recorded as *gone*.
* **Prompt restarts.** torch's agent restarts healthy workers only when
  ``num_nodes_waiting()`` is non-zero. Ours is also non-zero when a member of the current
  round died or left, or when this node itself was dropped, so survivors stop waiting in a
  collective whose peer will never answer.
* **No split brain.** A member declared dead is *gone* for good: its heartbeats are refused,
  and when it wakes it sees that, restarts its workers and rejoins under a fresh identity,
  as a new member of a new round.
* **Explicit leave.** :func:`.membership.leave_node` (or :meth:`~RedisRendezvousHandler.leave`)
  removes a member at once, so the others re-form without waiting for its heartbeat to
  expire; the node's own torchrun then stops its workers and exits. torch's ``shutdown()``
  closes the rendezvous for everyone, which is not what a preempted VM wants.

The rendezvous round is exposed as a fencing number: :attr:`round`, the environment variable
``SPOTTRAIN_RDZV_ROUND`` that every worker inherits, and the run's ``rdzv:view`` key.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from datetime import timedelta
from typing import Any

import redis
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousInfo,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousSettings,
    RendezvousTimeout,
    _DistributedRendezvousOpExecutor,
    _NodeDesc,
    _RendezvousExitOp,
)

from spottrain.protocol.env import ENV_RDZV_MEMBER, ENV_ROUND
from spottrain.redis_conn import connect, describe_error

from .backend import MemberGoneError, RedisRendezvousBackend
from .config import RedisRendezvousConfig, parse_config
from .membership import GONE_DEAD, GONE_FINISHED, GONE_LEFT
from .state_holder import OwnMemberGoneError, RedisStateHolder, member_name
from .store import RedisStore

log = logging.getLogger(__name__)


class BrokenRoundError(RendezvousError):
    """The round completed, then lost a member before it started: its ranks have a gap."""


class RedisRendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic handler on Redis, with prompt restarts, fencing and explicit leave.

    Build it with :func:`create_handler`; torchrun does so through the ``redis`` entry point.
    """

    _holder: RedisStateHolder

    def __init__(
        self,
        node: _NodeDesc,
        settings: RendezvousSettings,
        store: RedisStore,
        state_holder: RedisStateHolder,
        backend: RedisRendezvousBackend,
        config: RedisRendezvousConfig,
        local_addr: str | None,
    ) -> None:
        super().__init__(node, settings, backend.name, store, state_holder)
        self._holder = state_holder
        self._backend = backend
        self._config = config
        self._local_addr = local_addr
        self._joined_round: int | None = None
        self._joined_members: frozenset[_NodeDesc] = frozenset()
        self._finished = False
        self._last_reason: str | None = None
        self._beat_stop = threading.Event()
        self._beat_thread: threading.Thread | None = None
        self._holder.own_node = node
        self._backend.register_member(config.node_id, self.member)
        self._ensure_beating()

    # -- identity ------------------------------------------------------------------------------
    @property
    def member(self) -> str:
        """This handler's current member name in Redis."""
        return member_name(self._this_node)

    @property
    def round(self) -> int | None:
        """The round this node last joined: the fencing number for checkpoint commits."""
        return self._joined_round

    @property
    def config(self) -> RedisRendezvousConfig:
        return self._config

    @property
    def use_agent_store(self) -> bool:
        # Workers build their own store on rank 0's node each round: torch's shared agent
        # store breaks rejoining after the first round.
        return False

    @property
    def _gone_reason(self) -> str | None:
        """Why this node's current member is gone (left, dead), or None. One record, shared
        with the state holder, which learns it from a sync as the heartbeat does from a beat."""
        return self._holder.own_gone_reason

    @_gone_reason.setter
    def _gone_reason(self, reason: str | None) -> None:
        self._holder.own_gone_reason = reason

    def _left_signal(self) -> SignalException:
        """What stops torchrun's workers once this node has left: torch's agent handles it as
        a termination signal and does not close the rendezvous."""
        return SignalException(
            f"node {self._config.node_id} left the rendezvous; stopping", signal.SIGTERM
        )

    def _renew_identity(self) -> None:
        old = self.member
        self._this_node = self._node_desc_generator.generate(self._local_addr)
        self._op_executor = _DistributedRendezvousOpExecutor(
            self._this_node, self._holder, self._settings
        )
        self._holder.own_node = self._this_node
        self._gone_reason = None
        self._holder._last_sync_time = -1  # read (and sanitize) afresh before joining again
        self._joined_round = None
        self._joined_members = frozenset()
        self._backend.register_member(self._config.node_id, self.member)
        log.warning(
            "rendezvous %s: %s rejoins as new member %s", self.get_run_id(), old, self.member
        )

    # -- heartbeats ----------------------------------------------------------------------------
    def _ensure_beating(self) -> None:
        if self._beat_thread is not None and self._beat_thread.is_alive():
            return
        self._beat_stop.clear()
        self._beat_thread = threading.Thread(
            target=self._beat_loop, name=f"spottrain-rdzv-heartbeat-{self.member}", daemon=True
        )
        self._beat_thread.start()

    def _beat_once(self) -> None:
        if self._gone_reason is not None:
            return
        member = self.member
        try:
            self._backend.heartbeat(member)
        except MemberGoneError as exc:
            # The identity may have been renewed while this beat was in flight: only the
            # current member's fate counts.
            if member == self.member:
                self._gone_reason = exc.reason
                log.warning("rendezvous %s: %s", self.get_run_id(), exc)

    def _beat_loop(self) -> None:
        interval = self._config.keep_alive_interval_s
        failing_since: float | None = None
        while not self._beat_stop.is_set():
            try:
                self._beat_once()
                if failing_since is not None:
                    log.warning(
                        "rendezvous %s: Redis reachable again after %.1f s",
                        self.get_run_id(),
                        time.monotonic() - failing_since,
                    )
                failing_since = None
            except RendezvousConnectionError as exc:
                if failing_since is None:
                    failing_since = time.monotonic()
                    log.warning("rendezvous %s: heartbeat failed: %s", self.get_run_id(), exc)
            self._beat_stop.wait(interval)

    def _start_heartbeats(self) -> None:
        self._ensure_beating()

    def _stop_heartbeats(self) -> None:
        # torch stops its keep-alive timer for the duration of a join; ours must go on
        # beating through it, or a slow round would get this node declared dead.
        pass

    def _stop_beating(self) -> None:
        self._beat_stop.set()
        if self._beat_thread is not None and self._beat_thread is not threading.current_thread():
            self._beat_thread.join(timeout=5)

    # -- the handler API -----------------------------------------------------------------------
    def next_rendezvous(self) -> RendezvousInfo:
        # Each round's workers get their own store on the new rank 0 (see use_agent_store).
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        while True:
            # Beat now: it tells us at once whether we were declared dead or asked to leave.
            with contextlib.suppress(RendezvousConnectionError):  # the join reports an outage
                self._beat_once()
            if self._gone_reason == GONE_LEFT:
                raise self._left_signal()
            if self._gone_reason is not None:
                self._renew_identity()
                # Be live under the new identity before joining, so that peers completing
                # a round wait for this node instead of leaving it for the next one.
                with contextlib.suppress(RendezvousConnectionError):
                    self._beat_once()
            self._ensure_beating()
            self._dissolve_round()
            self._holder.joining = True
            try:
                info = super().next_rendezvous()
            except OwnMemberGoneError as exc:
                # Declared dead while joining (a stall longer than the heartbeat timeout):
                # start over under a new identity.
                self._gone_reason = exc.reason
                continue
            except BrokenRoundError as exc:
                log.warning("rendezvous %s: %s; re-forming", self.get_run_id(), exc)
                with self._heartbeat_lock:
                    self._op_executor.run(
                        _RendezvousExitOp(), time.monotonic() + self._config.close_timeout_s
                    )
                continue
            finally:
                self._holder.joining = False
            break
        state = self._holder.state
        self._joined_round = state.round
        self._joined_members = frozenset(state.participants)
        self._last_reason = None
        os.environ[ENV_ROUND] = str(state.round)
        os.environ[ENV_RDZV_MEMBER] = self.member
        try:
            ordered = sorted(state.participants, key=lambda n: state.participants[n])
            self._backend.publish_view(
                state.round, len(state.participants), [member_name(n) for n in ordered]
            )
        except RendezvousConnectionError as exc:
            log.warning("rendezvous %s: could not publish the view: %s", self.get_run_id(), exc)
        return info

    def _dissolve_round(self) -> None:
        """End the round this node trained in, for every member, in one write.

        A node that calls ``next_rendezvous`` again restarts its workers, which breaks every
        collective of its round, so all its members must re-form. torch makes each of them
        leave the round on its own, wait for the next one, then join it: about three
        contended writes of the whole state per member, which grows quadratically with the
        fleet. Instead the first member to get here closes the round for all (clears its
        participants and moves to the next round); the others then join the new round with
        one write each.
        """
        if self._joined_round is None:
            return  # a node that never trained here has no round to end
        deadline = time.monotonic() + self._config.close_timeout_s
        while time.monotonic() < deadline:
            with self._heartbeat_lock:
                self._holder._last_sync_time = -1  # read afresh
                self._holder.sync()
                state = self._holder.state
                if not state.complete or state.round != self._joined_round:
                    return  # someone else already ended it
                state.participants.clear()
                state.complete = False
                state.deadline = None
                state.round += 1
                self._holder.mark_dirty()
                if self._holder.sync():
                    log.info(
                        "rendezvous %s: ended round %d for all its members",
                        self.get_run_id(),
                        self._joined_round,
                    )
                    return

    def _get_world(self) -> tuple[int, int]:
        # torch keeps the ranks of a complete round when a member is dropped from it, so a
        # round that lost a member between completing and starting has a gap (rank 1 of a
        # world of 1, say) and its rank 0 may never publish the workers' address. Re-form it.
        state = self._holder.state
        ranks = sorted(state.participants.values())
        if ranks != list(range(len(ranks))):
            raise BrokenRoundError(
                f"round {state.round} lost a member before it started (ranks {ranks})"
            )
        return super()._get_world()

    def _membership_change(self) -> str | None:
        """Why this node's workers must restart now, or None."""
        if self._gone_reason == GONE_DEAD:
            return "this node was declared dead; it rejoins as a new member"
        if self._joined_round is None:
            return None
        state = self._holder.state
        if state.round != self._joined_round:
            return f"round {state.round} replaced round {self._joined_round}"
        if self._this_node not in state.participants:
            return "this node is no longer a participant"
        missing = self._joined_members - set(state.participants)
        if missing:
            return "member(s) left or died: " + ", ".join(sorted(member_name(n) for n in missing))
        return None

    def num_nodes_waiting(self) -> int:
        """Nodes waiting to join, or at least 1 when the current round lost a member.

        torch's agent polls this between worker health checks and restarts its healthy
        workers when it is non-zero. A Redis outage answers 0: a training that is not
        changing membership goes on without Redis.

        Raises:
            SignalException: this node was made to leave; torchrun stops its workers.
        """
        try:
            with self._heartbeat_lock:
                self._holder.sync()
        except RendezvousConnectionError:
            return 0
        if self._gone_reason == GONE_LEFT:
            self._stop_beating()
            raise self._left_signal()
        waiting = len(self._holder.state.wait_list)
        reason = self._membership_change()
        if reason is not None:
            if reason != self._last_reason:
                log.warning("rendezvous %s: restarting workers: %s", self.get_run_id(), reason)
                self._last_reason = reason
            return max(waiting, 1)
        return waiting

    def leave(self) -> None:
        """Leave the rendezvous now: the others re-form without waiting for a timeout.

        This node never rejoins under this identity; its torchrun stops its workers at its
        next health check.
        """
        self._backend.mark_gone([self.member], GONE_LEFT)
        self._gone_reason = GONE_LEFT
        try:
            with self._heartbeat_lock:
                self._op_executor.run(
                    _RendezvousExitOp(), time.monotonic() + self._config.close_timeout_s
                )
        except RendezvousConnectionError:
            pass  # the others drop us anyway: we are marked gone
        self._stop_beating()

    def shutdown(self) -> bool:
        """Close the rendezvous (the job is over), unless this node left it."""
        if self._gone_reason == GONE_LEFT:
            self._stop_beating()
            return True
        ok = bool(super().shutdown())
        self._stop_beating()
        with contextlib.suppress(RendezvousConnectionError):
            self._backend.mark_gone([self.member], GONE_FINISHED)
        return ok


def create_handler(params: RendezvousParameters) -> RedisRendezvousHandler:
    """Build the handler from torchrun's parameters (the ``redis`` backend's creator).

    Raises:
        RendezvousConfigError: a malformed endpoint or conf value.
        RendezvousConnectionError: Redis is unreachable or refused our credentials.
    """
    conf: dict[str, Any] = dict(params.config)
    config = parse_config(endpoint=params.endpoint, run_id=params.run_id, conf=conf)
    client = connect(config.redis)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise RendezvousConnectionError(describe_error(exc, config.redis)) from None
    keys = config.keys
    backend = RedisRendezvousBackend(client, config.redis, keys, config.ttl_s)
    store = RedisStore(
        client, config.redis, keys, config.ttl_s, timedelta(seconds=config.read_timeout_s)
    )
    settings = RendezvousSettings(
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        RendezvousTimeout(
            join=timedelta(seconds=config.join_timeout_s),
            last_call=timedelta(seconds=config.last_call_timeout_s),
            close=timedelta(seconds=config.close_timeout_s),
            heartbeat=timedelta(seconds=config.heartbeat_timeout_s),
        ),
        keep_alive_interval=timedelta(seconds=config.keep_alive_interval_s),
        keep_alive_max_attempt=config.keep_alive_max_attempt,
    )
    holder = RedisStateHolder(backend, settings, config.dead_after_s)
    node = RedisRendezvousHandler._node_desc_generator.generate(params.local_addr)
    return RedisRendezvousHandler(node, settings, store, holder, backend, config, params.local_addr)

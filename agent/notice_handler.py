"""What the agent does with a notice, against its deadline.

One handler takes every notice from every watcher. Notices seen again are dropped; a second
draining notice while a drain runs can only bring its deadline forward. For a draining
notice it: marks the node draining, asks the trainers for an emergency checkpoint (a request
in Redis; rank 0 polls it and every rank saves at the same step), waits until the checkpoint
commits or until the deadline minus a safety margin, then leaves the rendezvous explicitly
(the peers re-form at once) and stops the workers. A rebalance recommendation asks for an
early checkpoint and tells the controller; the node keeps training.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from spottrain.keys import RunKeys

from .lifecycle import Lifecycle, NodeState
from .node_record import NodeRecord
from .notices import Notice

log = logging.getLogger(__name__)

DEFAULT_GRACE = 60.0  # seconds, for a draining notice whose source gives no deadline
EARLY_CHECKPOINT_WAIT = 300.0


@dataclass
class DrainOutcome:
    notice: Notice
    committed_step: int | None
    waited_s: float
    left: bool


class NoticeHandler:
    """Acts on notices for one node.

    Args:
        client: The job's Redis.
        keys: The run's keys.
        node_id: This node.
        lifecycle: The node's lifecycle (advanced here).
        record: Where states and events go.
        stop_workers: Stops torchrun and every worker; given the seconds it may take.
        margin: Seconds before the deadline at which waiting for the checkpoint stops.
        clock: Unix time source.
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        node_id: str,
        lifecycle: Lifecycle,
        record: NodeRecord,
        stop_workers: Callable[[float], None],
        *,
        margin: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.keys = keys
        self.node_id = node_id
        self.lifecycle = lifecycle
        self.record = record
        self.stop_workers = stop_workers
        self.margin = margin
        self.clock = clock
        self._lock = threading.Lock()
        self._seen: set[tuple[str, str]] = set()
        self._deadline: float | None = None
        self._thread: threading.Thread | None = None
        self._early_thread: threading.Thread | None = None
        self.outcome: DrainOutcome | None = None
        self.done = threading.Event()

    @property
    def draining(self) -> bool:
        return self._thread is not None

    def submit(self, notice: Notice) -> None:
        """Take a notice from any watcher (thread-safe, returns at once)."""
        with self._lock:
            if notice.dedup_key in self._seen:
                if notice.drains and self._thread is not None:
                    self._bring_forward(notice)
                return
            self._seen.add(notice.dedup_key)
            self.record.event("notice", **notice.to_dict())
            log.warning("notice: %s", notice.to_json())
            if notice.drains:
                if self._thread is not None:
                    self._bring_forward(notice)
                    return
                self._deadline = self._deadline_of(notice)
                self._thread = threading.Thread(
                    target=self._drain, args=(notice,), name="spottrain-drain", daemon=True
                )
                self._thread.start()
            elif self._thread is None and self._early_thread is None:
                self._early_thread = threading.Thread(
                    target=self._early, args=(notice,), name="spottrain-early", daemon=True
                )
                self._early_thread.start()

    def _deadline_of(self, notice: Notice) -> float:
        return notice.deadline if notice.deadline is not None else notice.seen_at + DEFAULT_GRACE

    def _bring_forward(self, notice: Notice) -> None:
        d = self._deadline_of(notice)
        if self._deadline is None or d < self._deadline:
            self._deadline = d

    # -- the drain --------------------------------------------------------------------------
    def _drain(self, notice: Notice) -> None:
        t0 = self.clock()
        joined = self.lifecycle.state in (NodeState.JOINED, NodeState.CHECKPOINTING)
        self._advance(NodeState.DRAINING, f"{notice.kind.value} from {notice.source}")
        step = None
        if joined:
            request_id, asked_at = self._request(notice, drain=True)
            step = self._wait_commit(request_id, asked_at, drain=True)
        else:
            self.record.event("drain-without-checkpoint", reason="the node had not joined")
        waited = self.clock() - t0
        # Withdrawn before leaving: the round that forms next must not read it again.
        self._clear_request()
        left = self._leave()
        remaining = max(1.0, (self._deadline or self.clock()) - self.clock())
        self.stop_workers(remaining)
        self.outcome = DrainOutcome(notice, step, waited, left)
        self.record.event(
            "drained",
            committed_step=step,
            waited_s=round(waited, 3),
            left_rendezvous=left,
            source=notice.source,
        )
        self._advance(NodeState.LEFT, "drained")
        self.done.set()

    def _request(self, notice: Notice, *, drain: bool) -> tuple[int, float]:
        asked_at = self.clock()
        try:
            request_id = int(self.client.incr(self.keys.ckpt_request_seq))
            body = {
                "id": request_id,
                "drain": drain,
                "deadline": None if not drain else self._deadline,
                "at": asked_at,
                "source": notice.source,
                "kind": notice.kind.value,
            }
            self.client.hset(self.keys.ckpt_requests, self.node_id, json.dumps(body))
        except redis.RedisError as exc:
            # The workers still save if they got SIGTERM themselves; say what happened.
            log.error("could not ask for a checkpoint through Redis: %s", exc)
            self.record.event("checkpoint-request-failed", error=str(exc))
            return 0, asked_at
        self.record.event("checkpoint-requested", request_id=request_id, drain=drain)
        return request_id, asked_at

    def _wait_commit(self, request_id: int, asked_at: float, *, drain: bool) -> int | None:
        """Wait for a checkpoint that covers the request; return its step, or None when the
        deadline (minus the margin) came first."""
        while True:
            until = (self._deadline or float("inf")) - self.margin if drain else None
            if until is not None and self.clock() >= until:
                self.record.event("checkpoint-missed", request_id=request_id)
                log.error("no checkpoint committed before the deadline margin: leaving anyway")
                return None
            last = self._last_commit()
            if last is not None and _covers(last, request_id, asked_at, drain):
                step = int(last["step"])
                self.record.event("checkpoint-seen", step=step, request_id=request_id)
                return step
            time.sleep(0.1)

    def _last_commit(self) -> dict[str, str] | None:
        try:
            raw = self.client.hgetall(self.keys.ckpt_last)
        except redis.RedisError:
            return None
        if not raw:
            return None
        return {k.decode(): v.decode() for k, v in raw.items()}

    def _leave(self) -> bool:
        from .rendezvous.membership import leave_node

        try:
            leave_node(self.client, self.keys, self.node_id)
            return True
        except LookupError:
            return False  # never joined a round: nobody waits for it
        except redis.RedisError as exc:
            log.error("could not leave the rendezvous (%s): peers will time it out", exc)
            return False

    def _clear_request(self) -> None:
        with contextlib.suppress(redis.RedisError):
            self.client.hdel(self.keys.ckpt_requests, self.node_id)

    # -- the early checkpoint ---------------------------------------------------------------
    def _early(self, notice: Notice) -> None:
        if self.lifecycle.state is not NodeState.JOINED:
            self.record.event("early-checkpoint-skipped", reason="the node has not joined")
            self._early_thread = None
            return
        self._advance(NodeState.CHECKPOINTING, f"{notice.kind.value} from {notice.source}")
        request_id, asked_at = self._request(notice, drain=False)
        deadline = self.clock() + EARLY_CHECKPOINT_WAIT
        step = None
        while self.clock() < deadline and not self.draining:
            last = self._last_commit()
            if last is not None and _covers(last, request_id, asked_at, drain=False):
                step = int(last["step"])
                break
            time.sleep(0.2)
        if not self.draining:
            self._clear_request()
            self.record.event("early-checkpoint", step=step, source=notice.source)
            if self.lifecycle.can(NodeState.JOINED):
                self._advance(NodeState.JOINED, "early checkpoint done")
        self._early_thread = None

    def _advance(self, state: NodeState, reason: str) -> None:
        if self.lifecycle.try_advance(state, reason) is not None:
            self.record.set_state(state.value, reason)


def _covers(last: dict[str, str], request_id: int, asked_at: float, drain: bool) -> bool:
    """Whether the committed checkpoint ``last`` answers a request.

    It does when it names the request (or a later one), or, for a drain, when it is a drain
    save committed after the request was made: workers that got SIGTERM themselves save
    for the drain before rank 0 has even read the request, and they save nothing after it.
    """
    if request_id and int(last.get("request_id", 0)) >= request_id:
        return True
    return drain and last.get("drain") == "1" and float(last.get("at", 0)) >= asked_at - 1.0

"""What the agent does with a notice, against its deadline.

One handler takes every notice from every source. Notices seen again (the same source and
event id, see :attr:`~.notice.Notice.dedup_key`) are dropped; a second
draining notice while a drain runs can only bring its deadline forward. For a draining
notice it: marks the node draining, asks the trainers for an emergency checkpoint (a request
in Redis; rank 0 polls it and every rank saves at the same step), waits until the checkpoint
commits or until the deadline minus a safety margin, then leaves the rendezvous explicitly
(the peers re-form at once) and stops the workers. A plain script (``train.integration:
plain``) answers no request: its workers get SIGTERM at once, with the whole window less the
margin to save on their own, then SIGKILL; the node leaves the rendezvous once they are down.
A rebalance recommendation asks for an early checkpoint and marks the node at risk in its
record (``at_risk``), where the controller reads it to start a replacement; the node keeps
training until the controller drains it.
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

from spottrain.protocol.keys import RunKeys
from spottrain.protocol.states import NodeState

from ..lifecycle import Lifecycle
from ..node_record import NodeRecord
from .notice import Notice

log = logging.getLogger(__name__)

DEFAULT_GRACE = 60.0  # seconds, for a draining notice whose source gives no deadline
EARLY_CHECKPOINT_WAIT = 300.0
CLOCK_SLACK = 2.0  # seconds of clock difference allowed between this host and rank 0's

# Number the request and publish it in one step: a request visible under a lower id than
# one published after it would let "the newest id was served" skip it.
REQUEST_LUA = """
local id = redis.call('INCR', KEYS[1])
local body = cjson.decode(ARGV[2])
body['id'] = id
redis.call('HSET', KEYS[2], ARGV[1], cjson.encode(body))
return id
"""


def worker_window(deadline: float, now: float, margin: float, cap: float) -> float:
    """Seconds the workers get between SIGTERM and SIGKILL when they are signalled at ``now``
    for a drain due at ``deadline``: up to ``margin`` before the deadline (the agent keeps
    that for itself: the leave, the copy, the logs), at most ``cap`` (torchrun's own
    shutdown timeout, past which it kills them itself), and never under a second."""
    return max(1.0, min(cap, deadline - margin - now))


@dataclass
class DrainOutcome:
    notice: Notice
    committed_step: int | None
    waited_s: float
    left: bool
    refused: str | None = None  # why the trainers' commit for it was refused, if one was


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
        ckpt_dir: The checkpoint directory, read when Redis cannot say what committed.
        clock: Unix time source.
        scoped_leave: Replica mode: leaves the node's replica's own rendezvous and says
            whether it is out; called after the workers stop instead of leaving the run's
            rendezvous before (a replica's workers leave their quorum themselves, and an
            earlier leave would make torchrun cut that short).
        quorum_leave: Replica mode with the Redis quorum: called with ``now=False`` once the
            drain is asked for (the replica's id leaves the quorum when its manager stops,
            at the step boundary where the worker leaves: the survivors do not wait for a
            heartbeat timeout).
        signal_first: A plain script (``train.integration: plain``): a draining notice
            SIGTERMs the workers at once instead of asking for a checkpoint nobody answers.
        max_window: The most seconds the workers may get between SIGTERM and SIGKILL
            (torchrun's shutdown timeout).
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
        ckpt_dir: str = "",
        clock: Callable[[], float] = time.time,
        workers_done: Callable[[], bool] = lambda: False,
        on_drained: Callable[[DrainOutcome, list[Notice]], None] | None = None,
        scoped_leave: Callable[[], bool] | None = None,
        quorum_leave: Callable[[bool], None] | None = None,
        signal_first: bool = False,
        max_window: float = float("inf"),
    ) -> None:
        self.client = client
        self.signal_first = signal_first
        self.max_window = max_window
        self.quorum_leave = quorum_leave
        self.scoped_leave = scoped_leave
        self.on_drained = on_drained
        self.workers_done = workers_done
        self.keys = keys
        self.node_id = node_id
        self.lifecycle = lifecycle
        self.record = record
        self.stop_workers = stop_workers
        self.margin = margin
        self.ckpt_dir = ckpt_dir
        self.clock = clock
        self._lock = threading.Lock()
        self._seen: set[tuple[str, str]] = set()
        self._notices: list[Notice] = []
        self._deadline: float | None = None
        self._thread: threading.Thread | None = None
        self._early_thread: threading.Thread | None = None
        self.outcome: DrainOutcome | None = None
        self.done = threading.Event()
        self._refused: str | None = None
        self._at_risk = False

    @property
    def draining(self) -> bool:
        return self._thread is not None

    def submit(self, notice: Notice) -> None:
        """Take a notice from any source (thread-safe, returns at once)."""
        with self._lock:
            if notice.dedup_key in self._seen:
                if notice.drains and self._thread is not None:
                    self._bring_forward(notice)
                return
            self._seen.add(notice.dedup_key)
            self._notices.append(notice)
            self.record.event("notice", **notice.to_dict())
            log.warning("notice: %s", notice.to_json())
            if notice.kind.reclaims:
                # The controller may end the drained VM before the cloud reclaims it, and the
                # cloud then reports no interruption: the node says it was one (also when
                # the drain had begun on another notice: GCE's shutdown comes with it).
                self.record.mark(preempted=f"{notice.kind.value} from {notice.source}")
            if notice.drains:
                if self._thread is not None:
                    self._bring_forward(notice)
                    return
                self._deadline = self._deadline_of(notice)
                self._thread = threading.Thread(
                    target=self._drain, args=(notice,), name="spottrain-drain", daemon=True
                )
                self._thread.start()
            elif not self._at_risk:
                # The controller starts a replacement for an at-risk node and drains this
                # one once the replacement joined (a handover with nothing lost).
                self._at_risk = True
                self.record.mark(
                    at_risk=f"{notice.kind.value} recommendation",
                    at_risk_since=f"{self.clock():.3f}",
                )
            if not notice.drains and self._thread is None and self._early_thread is None:
                self._early_thread = threading.Thread(
                    target=self._early, args=(notice,), name="spottrain-early", daemon=True
                )
                self._early_thread.start()

    @property
    def deadline(self) -> float | None:
        """The deadline of the drain in progress (unix seconds), if any."""
        return self._deadline

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
        self._refused = None
        if self.signal_first:
            step, left = self._drain_by_signal()
        else:
            step, left = self._drain_by_request(notice, joined)
        waited = self.clock() - t0
        self.outcome = DrainOutcome(notice, step, waited, left, self._refused)
        self.record.event(
            "drained",
            committed_step=step,
            waited_s=round(waited, 3),
            left_rendezvous=left,
            source=notice.source,
            **({"refused": self._refused} if self._refused and step is None else {}),
        )
        if self.on_drained is not None:
            # After the commit and the leave: what runs here may let the VM go.
            with self._lock:
                seen = list(self._notices)
            try:
                self.on_drained(self.outcome, seen)
            except Exception as exc:
                log.exception("after the drain: %s", exc)
                self.record.event("after-drain-failed", error=str(exc))
        self._advance(NodeState.LEFT, "drained")
        self.done.set()

    def _drain_by_signal(self) -> tuple[int | None, bool]:
        """A plain script's drain: SIGTERM now, SIGKILL ``margin`` before the deadline, then
        leave the rendezvous (before, torchrun could restart the saving workers for the
        membership change, which kills them 30 s later whatever the window)."""
        self._signal_workers(self._window(self.margin), "integration plain: it saves on SIGTERM")
        left = self._leave() if self.scoped_leave is None else self.scoped_leave()
        return None, left

    def _drain_by_request(self, notice: Notice, joined: bool) -> tuple[int | None, bool]:
        """Ask for a checkpoint and wait for its commit (or the deadline minus the margin),
        leave the rendezvous, then stop the workers by the deadline."""
        step = None
        if joined:
            request_id = self._request(notice, drain=True)
            if request_id == 0:
                # Redis cannot carry the request: stop the workers instead. torchrun passes
                # SIGTERM on, and workers that get it save at one step with every other rank.
                self.record.event("checkpoint-by-signal", reason="Redis refused the request")
                self._signal_workers(self._window(self.margin), "Redis refused the request")
            self._leave_quorum()
            step = self._wait_commit(request_id, notice.seen_at, drain=True)
        else:
            self.record.event("drain-without-checkpoint", reason="the node had not joined")
        # Withdrawn before leaving: the round that forms next must not read it again.
        self._clear_request()
        left = self._leave() if self.scoped_leave is None else False
        why = "the checkpoint committed" if step is not None else "no checkpoint by the margin"
        self._signal_workers(self._window(0.0), why)
        if self.scoped_leave is not None:
            left = self.scoped_leave()
        return step, left

    def _window(self, margin: float) -> float:
        return worker_window(self._deadline or self.clock(), self.clock(), margin, self.max_window)

    def _signal_workers(self, window: float, why: str) -> None:
        """SIGTERM the workers, SIGKILL what is left ``window`` seconds later; the node's
        events say when and how long they had (``spottrain logs`` shows it)."""
        self.record.event(
            "workers-signalled",
            signal="SIGTERM",
            window_s=round(window, 3),
            margin_s=self.margin,
            deadline=self._deadline,
            why=why,
        )
        self.stop_workers(window)

    def _leave_quorum(self) -> None:
        if self.quorum_leave is None:
            return
        try:
            self.quorum_leave(False)
        except Exception as exc:  # the drain goes on: the quorum drops the id at its timeout
            log.error("could not leave the replica quorum: %s", exc)

    def _request(self, notice: Notice, *, drain: bool) -> int:
        """Write a checkpoint request for the trainers; return its id (0: Redis refused)."""
        body = {
            "drain": drain,
            "deadline": None if not drain else self._deadline,
            "at": self.clock(),
            "source": notice.source,
            "kind": notice.kind.value,
        }
        try:
            request_id = int(
                self.client.eval(
                    REQUEST_LUA,
                    2,
                    self.keys.ckpt_request_seq,
                    self.keys.ckpt_requests,
                    self._field(drain),
                    json.dumps(body),
                )
            )
        except redis.RedisError as exc:
            log.error("could not ask for a checkpoint through Redis: %s", exc)
            self.record.event("checkpoint-request-failed", error=str(exc))
            return 0
        self.record.event("checkpoint-requested", request_id=request_id, drain=drain)
        return request_id

    def _field(self, drain: bool) -> str:
        # A drain and an early checkpoint of one node are two fields: withdrawing one never
        # deletes the other.
        return self.node_id if drain else f"{self.node_id}:early"

    def _wait_commit(self, request_id: int, noticed_at: float, *, drain: bool) -> int | None:
        """Wait for a checkpoint that covers the request; return its step, or None when the
        deadline (minus the margin) came first."""
        while True:
            until = (self._deadline or float("inf")) - self.margin if drain else None
            if until is not None and self.clock() >= until:
                self.record.event("checkpoint-missed", request_id=request_id)
                log.error("no checkpoint committed before the deadline margin: leaving anyway")
                return None
            if self.workers_done():
                # torchrun finished on its own (training ended): nobody is left to save.
                self.record.event("checkpoint-not-needed", request_id=request_id)
                return None
            for last in self._commits():
                if _covers(last, request_id, noticed_at, drain):
                    step = int(last["step"])
                    self.record.event("checkpoint-seen", step=step, request_id=request_id)
                    return step
            self._note_refusal(request_id, noticed_at, drain)
            time.sleep(0.1)

    def _note_refusal(self, request_id: int, noticed_at: float, drain: bool) -> None:
        """Report, once, a refused commit that would have answered the request. The wait
        goes on: a newer round's rank 0 reads the same request and may still commit."""
        if self._refused is not None:
            return
        try:
            raw = self.client.hgetall(self.keys.ckpt_refused)
        except redis.RedisError:
            return
        last = {k.decode(): v.decode() for k, v in raw.items()}
        if not last or not _covers(last, request_id, noticed_at, drain):
            return
        self._refused = f"step {last.get('step', '?')}: {last.get('reason', '')}"
        log.error("the checkpoint for this drain was refused: %s", self._refused)
        self.record.event(
            "drain-checkpoint-refused",
            step=last.get("step", ""),
            request_id=request_id,
            reason=last.get("reason", ""),
        )

    def _commits(self) -> list[dict[str, str]]:
        """The newest commit as Redis has it, and, when Redis is silent, as the checkpoint
        directory has it (the committing rank's report to Redis can fail)."""
        try:
            raw = self.client.hgetall(self.keys.ckpt_last)
            if raw:
                return [{k.decode(): v.decode() for k, v in raw.items()}]
        except redis.RedisError:
            pass
        if not self.ckpt_dir:
            return []
        from ..checkpoint.directory import CheckpointDir
        from ..checkpoint.files import CheckpointDirError

        try:
            manifest = CheckpointDir(self.ckpt_dir).newest_manifest()
        except CheckpointDirError:
            return []
        if manifest is None:
            return []
        return [
            {
                "step": str(manifest.step),
                "request_id": str(manifest.request_id),
                "drain": "1" if manifest.extra.get("drain") else "0",
                "at": str(manifest.created_at),
            }
        ]

    def _leave(self) -> bool:
        from ..rendezvous.membership import leave_node

        try:
            leave_node(self.client, self.keys, self.node_id)
            return True
        except LookupError:
            return False  # never joined a round: nobody waits for it
        except redis.RedisError as exc:
            log.error("could not leave the rendezvous (%s): peers will time it out", exc)
            return False

    def _clear_request(self, drain: bool = True) -> None:
        with contextlib.suppress(redis.RedisError):
            self.client.hdel(self.keys.ckpt_requests, self._field(drain))

    # -- the early checkpoint ---------------------------------------------------------------
    def _early(self, notice: Notice) -> None:
        skip = (
            "integration plain: nothing answers a checkpoint request"
            if self.signal_first
            else "the node has not joined"
            if self.lifecycle.state is not NodeState.JOINED
            else ""
        )
        if skip:
            self.record.event("early-checkpoint-skipped", reason=skip)
            self._early_thread = None
            return
        self._advance(NodeState.CHECKPOINTING, f"{notice.kind.value} from {notice.source}")
        request_id = self._request(notice, drain=False)
        deadline = self.clock() + EARLY_CHECKPOINT_WAIT
        step = None
        while request_id and self.clock() < deadline and not self.draining and step is None:
            for last in self._commits():
                if _covers(last, request_id, notice.seen_at, drain=False):
                    step = int(last["step"])
            time.sleep(0.2)
        self._clear_request(drain=False)
        if not self.draining:
            self.record.event("early-checkpoint", step=step, source=notice.source)
            if self.lifecycle.can(NodeState.JOINED):
                self._advance(NodeState.JOINED, "early checkpoint done")
        self._early_thread = None

    def _advance(self, state: NodeState, reason: str = "") -> None:
        self.record.advance(self.lifecycle, state, reason)


def _covers(last: dict[str, str], request_id: int, noticed_at: float, drain: bool) -> bool:
    """Whether the committed checkpoint ``last`` answers a request.

    It does when it names the request (or a later one) and, for a drain, is a drain save
    (an early checkpoint requested later by another node is not: its workers train on). A
    drain save committed after the notice was seen answers a drain too: workers that got
    SIGTERM themselves save for the drain before rank 0 has even read the request, and save
    nothing after it. The committing rank's clock may be another host's: allow a little.
    """
    is_drain = last.get("drain") == "1"
    if request_id and int(last.get("request_id", 0)) >= request_id and (is_drain or not drain):
        return True
    return drain and is_drain and float(last.get("at", 0)) >= noticed_at - CLOCK_SLACK

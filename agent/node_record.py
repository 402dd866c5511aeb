"""The agent's presence in Redis: its node record, its heartbeat and the event stream.

Redis can restart or be unreachable for a while; none of this may stop a training that is
running. Writes that fail are logged once and retried at the next beat, and events are kept
in a short backlog until Redis takes them again.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis

from spottrain.protocol import events
from spottrain.protocol.keys import RunKeys
from spottrain.protocol.states import NodeState

from .lifecycle import Lifecycle

log = logging.getLogger(__name__)

_BACKLOG = 1000


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    cloud: str
    zone: str = ""
    instance_type: str = ""
    gpus: int = 0
    address: str = ""

    def fields(self) -> dict[str, str]:
        return {
            "node_id": self.node_id,
            "cloud": self.cloud,
            "zone": self.zone,
            "instance_type": self.instance_type,
            "gpus": str(self.gpus),
            "address": self.address,
        }


class NodeRecord:
    """Writes one node's record, heartbeat and events.

    Args:
        client: The job's Redis.
        keys: The run's keys.
        info: What the node is.
        heartbeat_interval: Seconds between beats.
        heartbeat_ttl: The heartbeat key expires this long after the last beat, so a node
            that dies without a word disappears from the fleet view by itself.
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        info: NodeInfo,
        *,
        heartbeat_interval: float = 2.0,
        heartbeat_ttl: float = 10.0,
    ) -> None:
        self.client = client
        self.keys = keys
        self.info = info
        self.interval = heartbeat_interval
        self.ttl_ms = int(heartbeat_ttl * 1000)
        self._backlog: collections.deque[dict[str, str]] = collections.deque(maxlen=_BACKLOG)
        self._lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        self.state: str = NodeState.BOOTING
        self._marks: dict[str, str] = {}

    def register(self, state: str) -> None:
        """Create the node's record (raises if Redis is unreachable: the agent cannot start
        without it)."""
        self.state = state
        pipe = self.client.pipeline(transaction=True)
        pipe.sadd(self.keys.nodes, self.info.node_id)
        pipe.hset(
            self.keys.node(self.info.node_id),
            mapping={
                **self.info.fields(),
                "run_id": self.keys.run_id,
                "state": state,
                "registered_at": str(time.time()),
            },
        )
        pipe.set(self.keys.heartbeat(self.info.node_id), state, px=self.ttl_ms)
        pipe.execute()

    def start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="spottrain-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            self.beat()

    def beat(self) -> bool:
        try:
            # Under the state lock: a beat that read the old state must not land after
            # set_state wrote the new one.
            with self._state_lock:
                pipe = self.client.pipeline(transaction=False)
                pipe.set(self.keys.heartbeat(self.info.node_id), self.state, px=self.ttl_ms)
                pipe.hset(
                    self.keys.node(self.info.node_id), mapping={"state": self.state, **self._marks}
                )
                pipe.execute()
            self.flush()
            if self._failing:
                log.warning("Redis is back: heartbeats resumed")
            self._failing = False
            return True
        except redis.RedisError as exc:
            if not self._failing:
                log.warning("heartbeat to Redis failed (%s); training goes on, retrying", exc)
            self._failing = True
            return False

    def set_state(self, state: str, reason: str = "") -> None:
        with self._state_lock:
            self.state = state
            try:
                self.client.hset(
                    self.keys.node(self.info.node_id), mapping={"state": state, "reason": reason}
                )
            except redis.RedisError as exc:
                log.warning("could not record state %s in Redis: %s", state, exc)
        self.event("state", state=state, reason=reason)

    def mark(self, **fields: str) -> None:
        """Set fields of the node's record that the controller acts on (``at_risk``); each
        beat writes them again, so a Redis that restarted, or a write that failed, gets
        them back."""
        with self._state_lock:
            self._marks.update(fields)
            try:
                self.client.hset(self.keys.node(self.info.node_id), mapping=fields)
            except redis.RedisError as exc:
                log.warning("could not record %s in Redis (the next beat retries): %s", fields, exc)

    def put(self, **fields: str) -> None:
        """Set fields of the node's record once (what is worth knowing until it is written
        again, not on every beat: a worker failure's lines); a write that fails is
        logged."""
        try:
            self.client.hset(self.keys.node(self.info.node_id), mapping=fields)
        except redis.RedisError as exc:
            log.warning("could not record %s in Redis: %s", ", ".join(fields), exc)

    def advance(self, lifecycle: Lifecycle, state: NodeState, reason: str = "") -> bool:
        """Move ``lifecycle`` to ``state`` and record it, if that move is allowed now."""
        if lifecycle.try_advance(state, reason) is None:
            return False
        self.set_state(state.value, reason)
        return True

    def event(self, type_: str, **fields: Any) -> None:
        """Append an event to the run's stream (kept in a backlog while Redis is away)."""
        entry = events.envelope(type_, self.info.node_id, at=time.time(), **fields)
        with self._lock:
            self._backlog.append(entry)
        self.flush()

    def flush(self) -> None:
        with self._lock:
            while self._backlog:
                entry = self._backlog[0]
                try:
                    events.append(self.client, self.keys.events, entry)
                except redis.RedisError:
                    return
                self._backlog.popleft()

    def stop(self, *, remove_heartbeat: bool) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.flush()
        if remove_heartbeat:
            try:
                self.client.delete(self.keys.heartbeat(self.info.node_id))
            except redis.RedisError as exc:
                log.warning("could not remove the heartbeat (it expires by itself): %s", exc)

"""The injected-notice monitor: notices written to Redis for this node (the
controller's drains, operators and tests; the format is in
:mod:`spottrain.protocol.notices`).

An injected notice's id is its body as queued: the same body queued again is the same event
(a controller that asks twice), a different one is a new event.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

import redis

from spottrain.protocol.keys import RunKeys
from spottrain.protocol.notices import DEFAULT_IN_S, DEFAULT_KIND, decode_injected

from .notice import Notice, NoticeKind

log = logging.getLogger(__name__)

SOURCE = "redis"


def parse_injected(raw: bytes | str) -> Notice:
    """An injected notice: JSON ``{"kind": ..., "in": seconds}`` or ``{"deadline": unix}``.

    Raises:
        ValueError: On a body that is not a JSON object, an unknown kind or a bad time.
        TypeError: On a time of the wrong type.
    """
    body = decode_injected(raw)
    kind = NoticeKind(body.get("kind", DEFAULT_KIND))
    now = time.time()
    if body.get("deadline") is not None:
        deadline: float | None = float(body["deadline"])
    elif body.get("in") is not None:
        deadline = now + float(body["in"])
    else:
        deadline = None if kind is NoticeKind.REBALANCE else now + DEFAULT_IN_S
    return Notice(
        source=SOURCE,
        kind=kind,
        deadline=deadline,
        seen_at=now,
        detail={"injected": body},
        id=json.dumps(body, sort_keys=True),
    )


class InjectedNotices:
    """Pops this node's injected notices from Redis in a daemon thread."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        node_id: str,
        on_notice: Callable[[Notice], None],
    ) -> None:
        self.client = client
        self.key = keys.notices(node_id)
        self.on_notice = on_notice
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spottrain-injected", daemon=True)

    def start(self) -> InjectedNotices:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                item = self.client.blpop([self.key], timeout=1)
            except redis.RedisError:
                self._stop.wait(1.0)
                continue
            if item is None:
                continue
            try:
                self.on_notice(parse_injected(item[1]))
            except (ValueError, KeyError, TypeError) as exc:
                log.error("ignored a malformed injected notice %r: %s", item[1], exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=3)

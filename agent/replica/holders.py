"""Which replicas hold the training state: rank 0 of each replica writes its row of
``RunKeys.replica_holders`` (at most about once a second) and polls its node's drain
request; a leaver learns atomically (Lua) whether any other live holder remains.

A row: ``{"state": "live"|"leaving", "step", "quorum_id", "participants", "discarded",
"at"}``. A replica writes ``live`` only once it holds the state (it restored, healed or
committed a step); a row whose ``at`` is older than ``stale_s`` is a replica that died
without leaving. Redis being away never stops training: the board logs once and goes on.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from spottrain.protocol.keys import RunKeys

log = logging.getLogger("spottrain.replica")

LIVE = "live"
LEAVING = "leaving"
# A holder row older than this is a replica that stopped without leaving (seconds). Far
# above the write interval, so that a busy replica is never taken for a dead one.
STALE_S = 10.0

# Mark this replica leaving, then count the other live holders, in one step: two replicas
# leaving at once (a zone reclaim) each see the other leaving, so at least one of them
# writes the emergency checkpoint. Mirrors other_live_holders below.
_LEAVE_LUA = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
local now = tonumber(ARGV[3])
local stale = tonumber(ARGV[4])
local all = redis.call('HGETALL', KEYS[1])
local others = 0
for i = 1, #all, 2 do
  if all[i] ~= ARGV[1] then
    local ok, row = pcall(cjson.decode, all[i + 1])
    if ok and type(row) == 'table' and row['state'] == 'live'
        and tonumber(row['at'] or 0) >= now - stale then
      others = others + 1
    end
  end
end
return others
"""


@dataclass
class HolderRow:
    state: str = LIVE
    step: int = 0
    quorum_id: int = -1
    participants: int = 0
    discarded: int = 0
    at: float = 0.0
    longest_gap_s: float = 0.0
    longest_gap_step: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def parse_row(raw: str | bytes) -> HolderRow | None:
    try:
        body = json.loads(raw)
        return HolderRow(
            state=str(body["state"]),
            step=int(body.get("step", 0)),
            quorum_id=int(body.get("quorum_id", -1)),
            participants=int(body.get("participants", 0)),
            discarded=int(body.get("discarded", 0)),
            at=float(body.get("at", 0.0)),
        )
    except (ValueError, TypeError, KeyError):
        return None


def other_live_holders(
    rows: Mapping[str, str | bytes], me: str, now: float, stale_s: float = STALE_S
) -> int:
    """How many replicas other than ``me`` hold the state and beat recently (the Lua's
    decision, for tests and for readers without Redis)."""
    count = 0
    for name, raw in rows.items():
        who = name.decode() if isinstance(name, bytes) else name
        row = parse_row(raw)
        if who != me and row is not None and row.state == LIVE and row.at >= now - stale_s:
            count += 1
    return count


def must_save_on_leave(others_live: int) -> bool:
    """A leaver writes an emergency checkpoint only when nobody else holds the state."""
    return others_live == 0


def drain_requested(raw: str | bytes | None, now: float, started_at: float) -> bool:
    """Whether a node's checkpoint request (``RunKeys.ckpt_requests``) asks it to drain:
    one with ``drain`` set, made after this worker started and not past its deadline."""
    if raw is None:
        return False
    try:
        body = json.loads(raw)
    except (ValueError, TypeError):
        return False
    if not isinstance(body, dict) or not body.get("drain"):
        return False
    if float(body.get("at", now)) < started_at:
        return False
    deadline = body.get("deadline")
    return deadline is None or float(deadline) > now


class HolderBoard:
    """Rank 0's thread: writes this replica's row each ``interval`` and watches its node's
    drain request. ``client`` None: nothing is written and no drain is seen."""

    def __init__(
        self,
        client: Any,
        keys: RunKeys | None,
        replica: str,
        node: str,
        *,
        interval: float = 1.0,
        stale_s: float = STALE_S,
    ) -> None:
        self.client, self.keys = client, keys
        self.replica, self.node = replica, node
        self.interval, self.stale_s = interval, stale_s
        self.row: HolderRow | None = None  # None until this replica holds the state
        self.drain = threading.Event()
        self._started_at = time.time()
        self._stop = threading.Event()
        self._warned = False
        self._leave = client.register_script(_LEAVE_LUA) if client is not None else None
        self._thread: threading.Thread | None = None
        if client is not None and keys is not None:
            self._thread = threading.Thread(
                target=self._run, name="spottrain-replica-holders", daemon=True
            )
            self._thread.start()

    def update(self, **fields: Any) -> None:
        """Set the row's fields (the thread writes the newest row each interval)."""
        row = self.row or HolderRow()
        for k, v in fields.items():
            setattr(row, k, v)
        self.row = row

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.beat()

    def beat(self) -> None:
        assert self.client is not None and self.keys is not None
        try:
            row = self.row
            pipe = self.client.pipeline(transaction=False)
            if row is not None and row.state == LIVE:
                row.at = time.time()
                pipe.hset(self.keys.replica_holders, self.replica, row.to_json())
            pipe.hget(self.keys.ckpt_requests, self.node)
            *_, request = pipe.execute()
            if drain_requested(request, time.time(), self._started_at):
                self.drain.set()
            self._warned = False
        except Exception as exc:
            if not self._warned:
                log.warning("replica holders: cannot reach Redis (%s); training on", exc)
                self._warned = True

    def live_peers(self) -> int | None:
        """Other live holders now (None: no Redis, or it did not answer)."""
        if self.client is None or self.keys is None:
            return None
        try:
            rows = self.client.hgetall(self.keys.replica_holders)
        except Exception as exc:
            log.warning("replica holders: cannot read them (%s)", exc)
            return None
        return other_live_holders(rows, self.replica, time.time(), self.stale_s)

    def leave(self) -> int | None:
        """Mark this replica leaving; return how many other live holders remain (None:
        Redis could not answer, which the caller treats as "nobody")."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._leave is None or self.keys is None:
            return None
        row = self.row or HolderRow()
        row.state, row.at = LEAVING, time.time()
        try:
            return int(
                self._leave(
                    keys=[self.keys.replica_holders],
                    args=[self.replica, row.to_json(), time.time(), self.stale_s],
                )
            )
        except Exception as exc:
            log.warning("replica holders: cannot ask Redis who else holds the state: %s", exc)
            return None

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

"""What ``status`` shows of a replica run: each replica's slot (its nodes, claimed by the
agents in ``replica_slots``) beside what its rank 0 last said (``replica_holders``: state,
step, quorum id, discarded steps), and the quorum: the Redis quorum's own figures (quorum id,
members, heartbeating replicas, round, epoch, read through :class:`QuorumClient`), or where
torchft's lighthouse listens and whether it answers."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import redis

from spottrain.controller.run.lighthouse import serving
from spottrain.controller.run.records import RunInfo
from spottrain.protocol.keys import RunKeys
from spottrain.quorum.client import QuorumClient, QuorumStatus
from spottrain.quorum.errors import QuorumError
from spottrain.quorum.model import DEFAULT_HEARTBEAT_TIMEOUT_MS, QuorumConfig
from spottrain.spec import FaultTolerance
from spottrain.spec.replica import heartbeat_timeout_s, relay_group_size

# A holder row older than this is a replica that stopped without leaving (the engine's rule,
# agent/replica/holders.py, which the controller may not import).
STALE_S = 10.0


@dataclass(frozen=True)
class ReplicaRow:
    """One replica. ``state``: its holder's ("live", "leaving"); "joining" while its slot is
    claimed and its workers have not reported yet."""

    replica_id: str
    nodes: tuple[str, ...]
    state: str
    step: int | None = None
    quorum_id: int | None = None
    participants: int | None = None
    discarded: int | None = None
    at: float | None = None
    longest_gap_s: float | None = None


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _json(v: str | bytes | None) -> Any:
    try:
        return json.loads(_text(v)) if v is not None else None
    except ValueError:
        return None  # a half-written or foreign row must not break `status`


def _slot_nodes(raw: Any) -> tuple[str, ...]:
    # {"nodes": [...], "at": ...}; a bare list is read too.
    nodes = raw.get("nodes") if isinstance(raw, dict) else raw
    return tuple(str(n) for n in nodes) if isinstance(nodes, list) else ()


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _seconds(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _order(replica_id: str) -> tuple[int, str]:
    """replica-2 before replica-10."""
    m = re.search(r"(\d+)$", replica_id)
    return (int(m.group(1)) if m else -1, replica_id)


def replica_rows(
    slots: Mapping[str | bytes, str | bytes], holders: Mapping[str | bytes, str | bytes]
) -> list[ReplicaRow]:
    """Every replica with a slot or a holder row, in replica order."""
    slot_of = {_text(k): _slot_nodes(_json(v)) for k, v in slots.items()}
    holder_of = {_text(k): _json(v) for k, v in holders.items()}
    rows = []
    for rid in sorted(set(slot_of) | set(holder_of), key=_order):
        h = holder_of.get(rid)
        if not isinstance(h, dict):
            rows.append(ReplicaRow(rid, slot_of.get(rid, ()), "joining"))
            continue
        rows.append(
            ReplicaRow(
                replica_id=rid,
                nodes=slot_of.get(rid, ()),
                state=str(h.get("state") or "?"),
                step=_int(h.get("step")),
                quorum_id=_int(h.get("quorum_id")),
                participants=_int(h.get("participants")),
                discarded=_int(h.get("discarded")),
                at=float(h["at"]) if isinstance(h.get("at"), int | float) else None,
                longest_gap_s=_seconds(h.get("longest_gap_s")),
            )
        )
    return rows


def _dash(v: int | None) -> str:
    return "-" if v is None else str(v)


def _newest_quorum(rows: list[ReplicaRow]) -> int | None:
    return max((r.quorum_id for r in rows if r.quorum_id is not None), default=None)


@dataclass(frozen=True)
class Relays:
    """The quorum relays of a run with ``relay_group_size``: who holds each group's lease.
    ``unheld``: groups with a replica slot and no relay; their members ask Redis directly
    (correct, at a direct request's cost) until one of them takes the lease."""

    group_size: int
    held: dict[int, str]
    unheld: list[int]


def read_relays(
    client: redis.Redis, keys: RunKeys, group_size: int, slots: list[str | bytes]
) -> Relays:
    """One MGET of the leases of the groups the claimed slots fall in (125 keys at 12,500
    replicas in groups of 100)."""
    index = (_text(s).rpartition("-")[2] for s in slots)
    groups = sorted({int(i) // group_size for i in index if i.isdigit()})
    values = client.mget([keys.quorum_relay(g) for g in groups]) if groups else []
    held = {g: _text(v) for g, v in zip(groups, values, strict=True) if v is not None}
    return Relays(group_size, held, [g for g in groups if g not in held])


def _some(items: list[str], most: int = 4) -> str:
    more = f" (+{len(items) - most} more)" if len(items) > most else ""
    return ", ".join(items[:most]) + more


def relay_line(relays: Relays) -> str:
    """``status``'s line for the relays, e.g. ``relays: 2 of 3 groups held (100 replicas a
    group): 0 at 10.0.0.4:29513, 1 at 10.0.0.9:29513; direct: group 2``."""
    total = len(relays.held) + len(relays.unheld)
    line = f"relays: {len(relays.held)} of {total} group(s) held ({relays.group_size} a group)"
    if relays.held:
        line += ": " + _some([f"{g} at {a}" for g, a in sorted(relays.held.items())])
    if relays.unheld:
        line += "; asking Redis directly: group " + _some([str(g) for g in relays.unheld])
    return line


def quorum_line(quorum: QuorumStatus | None, error: str = "") -> str:
    """``status``'s line for the Redis quorum: its id (and the id at which its membership
    last changed), members, heartbeating replicas, the open round and the state's epoch (a
    new epoch means Redis lost the quorum's state)."""
    if quorum is None:
        return f"quorum redis: cannot read it: {error or 'no answer'}"
    beats = f"{quorum.heartbeating} heartbeating, round {quorum.round}"
    if not quorum.qid:
        return f"quorum redis: none formed yet; {beats}"
    return (
        f"quorum redis: id {quorum.qid} (membership since {quorum.version}), "
        f"{quorum.members} member(s), {beats}, epoch {quorum.epoch or '-'}"
    )


def format_replicas(
    rows: list[ReplicaRow],
    lighthouse: str,
    lighthouse_up: bool,
    now: float,
    *,
    head: str | None = None,
) -> list[str]:
    """``status``'s lines for a replica run; ``head`` (the Redis quorum's line) stands
    instead of the lighthouse's."""
    # A replica killed without leaving keeps its "live" row; it stops moving.
    live = sum(r.state == "live" and (r.at is None or now - r.at <= STALE_S) for r in rows)
    discarded = sum(r.discarded or 0 for r in rows)
    gaps = [r.longest_gap_s for r in rows if r.longest_gap_s is not None]
    pause = f"; longest pause {max(gaps):.2f} s" if gaps else ""
    lines = [
        head or f"lighthouse {lighthouse or '-'} {'up' if lighthouse_up else 'DOWN'}",
        f"replicas: {len(rows)} ({live} live)",
    ]
    for r in rows:
        seen = f"  seen {max(0.0, now - r.at):.0f}s ago" if r.at is not None else ""
        lines.append(
            f"  {r.replica_id:<11} {r.state:<8} nodes {','.join(r.nodes) or '-'}  "
            f"step {_dash(r.step)}  quorum {_dash(r.quorum_id)} "
            f"({_dash(r.participants)} taking part)  discarded {_dash(r.discarded)}{seen}"
        )
    if rows:
        lines.append(
            f"newest quorum {_dash(_newest_quorum(rows))}; discarded attempts {discarded}{pause}"
        )
    return lines


@dataclass(frozen=True)
class ReplicaStatus:
    """``kind``: "redis" (``quorum`` holds its figures, or ``quorum_error`` why not) or
    "lighthouse" (``lighthouse``, ``lighthouse_up``)."""

    lighthouse: str
    lighthouse_up: bool
    replicas: list[ReplicaRow]
    kind: str = "lighthouse"
    quorum: QuorumStatus | None = None
    quorum_error: str = ""
    relays: Relays | None = None

    def lines(self, now: float) -> list[str]:
        head = quorum_line(self.quorum, self.quorum_error) if self.kind == "redis" else None
        lines = format_replicas(self.replicas, self.lighthouse, self.lighthouse_up, now, head=head)
        return [*lines[:1], relay_line(self.relays), *lines[1:]] if self.relays else lines

    def to_json(self) -> dict[str, Any]:
        rows = {"replicas": [asdict(r) for r in self.replicas]}
        if self.kind == "redis":
            figures = asdict(self.quorum) if self.quorum else {"error": self.quorum_error}
            relays = {"relays": asdict(self.relays)} if self.relays else {}
            return {"quorum": {"kind": "redis", **figures}, **relays, **rows}
        return {
            "quorum": {"kind": "lighthouse"},
            "lighthouse": {"address": self.lighthouse, "up": self.lighthouse_up},
            **rows,
        }


@dataclass(frozen=True)
class _ReplicaRun:
    """What ``status`` reads a replica run's quorum with, from its spec: the quorum's floor
    (``min_replicas``), the heartbeat timeout its shims run at (the spec's, ``auto``
    resolved for the fleet) and the relay group size (0: no relays)."""

    min_replicas: int
    heartbeat_timeout_ms: int
    relay_group_size: int


def _replica_run(info: RunInfo) -> _ReplicaRun | None:
    """The quorum settings of a replica run; None for an elastic one (or a record whose spec
    no longer parses)."""
    try:
        spec = info.spec()
    except Exception:
        return None
    if spec.train.fault_tolerance is not FaultTolerance.REPLICA:
        return None
    return _ReplicaRun(
        min_replicas=spec.train.replica.min_replicas,
        heartbeat_timeout_ms=round(heartbeat_timeout_s(spec) * 1000),
        relay_group_size=relay_group_size(spec),
    )


def read_quorum(
    client: redis.Redis,
    keys: RunKeys,
    min_replicas: int = 1,
    heartbeat_timeout_ms: int = DEFAULT_HEARTBEAT_TIMEOUT_MS,
) -> tuple[QuorumStatus | None, str]:
    """The Redis quorum's figures, or None and why they cannot be read (garbage in its keys,
    Redis refusing): ``status`` shows the reason instead of failing. A replica counts as
    heartbeating while its last heartbeat is younger than ``heartbeat_timeout_ms``: give
    the run's own (its spec's), the one its shims drop replicas at."""
    config = QuorumConfig(heartbeat_timeout_ms=heartbeat_timeout_ms, min_replicas=min_replicas)
    try:
        quorum = QuorumClient(client, keys, config).status()
    except (QuorumError, redis.RedisError) as e:
        return None, str(e)
    return quorum, ""


def replica_status(info: RunInfo, client: redis.Redis) -> ReplicaStatus | None:
    """A replica run's replicas and quorum; None for an elastic run (no quorum and no
    replica rows). A run records a lighthouse only with ``quorum: lighthouse``; any other
    replica run uses the Redis quorum."""
    keys = RunKeys(info.run_id)
    slots = client.hgetall(keys.replica_slots)
    rows = replica_rows(slots, client.hgetall(keys.replica_holders))
    if not info.lighthouse and (run := _replica_run(info)) is not None:
        quorum, error = read_quorum(client, keys, run.min_replicas, run.heartbeat_timeout_ms)
        group_size = run.relay_group_size
        relays = read_relays(client, keys, group_size, list(slots)) if group_size else None
        return ReplicaStatus(
            "", False, rows, kind="redis", quorum=quorum, quorum_error=error, relays=relays
        )
    published = client.get(keys.replica_lighthouse)
    address = _text(published) if published else info.lighthouse
    if not address and not rows:
        return None
    # Probed where the controller binds it: the advertised host may be a name only the VMs
    # resolve.
    probe = info.lighthouse_bind or address
    return ReplicaStatus(address, bool(probe) and serving(probe), rows)

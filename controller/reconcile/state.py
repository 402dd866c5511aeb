"""The controller's state in Redis: the launch ledger, blocks, the job's own history, its
phase, and the lease that keeps one controller per run.

Everything a controller needs to pick up where a killed one stopped lives here or in the
clouds' tags; nothing lives only in its memory. The ledger is written *before* each launch
(an intent), so a controller killed between the write and the cloud's answer repeats the
launch with the same request id (which creates nothing new) instead of launching twice.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace
from typing import Any

import redis

from spottrain.protocol import events as stream
from spottrain.protocol.boot import BootReport, report_from_fields
from spottrain.protocol.keys import RunKeys

from .records import LaunchRecord, Ledger
from .types import Restore

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# Take the lease if it is free, or extend it if this owner holds it: one step, so no other
# controller can take it between the look and the extension.
_ACQUIRE = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if holder then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
# Extend the lease only while this owner still holds it (a lapsed lease is lost: another
# controller may have acted in between).
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


class LeaseLost(Exception):
    """This controller no longer holds the run's lease: it must not act any further."""


def _key_json(key: tuple[str, ...]) -> str:
    return json.dumps(list(key))


class RunState:
    """One run's controller state in Redis."""

    def __init__(self, client: redis.Redis, keys: RunKeys) -> None:
        self.client = client
        self.keys = keys
        # The lease this state's controller holds (owner, TTL), set by :meth:`hold`: every
        # act step checks it (:meth:`fence`).
        self._held: tuple[str, float] | None = None

    # --- the controller hash -------------------------------------------------------------
    def ctl(self) -> dict[str, str]:
        raw = self.client.hgetall(self.keys.ctl)
        return {k.decode(): v.decode() for k, v in raw.items()}

    def set_ctl(self, **fields: Any) -> None:
        values = {k: v if isinstance(v, str) else json.dumps(v) for k, v in fields.items()}
        self.client.hset(self.keys.ctl, mapping=values)

    # --- the ledger ----------------------------------------------------------------------
    def ledger(self) -> Ledger:
        raw = self.client.hgetall(self.keys.ctl_launches)
        return Ledger({k.decode(): LaunchRecord.from_json(v) for k, v in raw.items()})

    def record_intent(self, rec: LaunchRecord, next_index: int) -> None:
        """Write a launch intent and the next node index in one transaction."""
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(self.keys.ctl_launches, rec.node, rec.to_json())
        pipe.hset(self.keys.ctl, "next_index", str(next_index))
        pipe.execute()

    def put_launch(self, rec: LaunchRecord) -> None:
        self.client.hset(self.keys.ctl_launches, rec.node, rec.to_json())

    def update_launch(self, node: str, **fields: Any) -> LaunchRecord | None:
        raw = self.client.hget(self.keys.ctl_launches, node)
        if raw is None:
            return None
        rec = replace(LaunchRecord.from_json(raw), **fields)
        self.put_launch(rec)
        return rec

    # --- blocks and history --------------------------------------------------------------
    def blocked(self) -> dict[tuple[str, str, str, str], float]:
        raw = self.client.hgetall(self.keys.ctl_blocked)
        out: dict[tuple[str, str, str, str], float] = {}
        for k, v in raw.items():
            parts = json.loads(k)
            out[(parts[0], parts[1], parts[2], parts[3])] = float(v)
        return out

    def block(self, key: tuple[str, str, str, str], until: float) -> None:
        self.client.hset(self.keys.ctl_blocked, _key_json(key), str(until))

    def history(self) -> dict[tuple[str, str, str], dict[str, int]]:
        raw = self.client.hgetall(self.keys.ctl_history)
        out = {}
        for k, v in raw.items():
            cloud, zone, itype = k.decode().split("|")
            out[(cloud, zone, itype)] = json.loads(v)
        return out

    def count(self, key: tuple[str, str, str], what: str) -> None:
        """Add one preemption (``preemptions``) or bad VM (``bad_nodes``) to the history."""
        field_name = "|".join(key)
        raw = self.client.hget(self.keys.ctl_history, field_name)
        counts = json.loads(raw) if raw else {}
        counts[what] = int(counts.get(what, 0)) + 1
        self.client.hset(self.keys.ctl_history, field_name, json.dumps(counts))

    # --- what the agents and trainers report ---------------------------------------------
    def node_records(self, names: list[str]) -> dict[str, dict[str, str]]:
        pipe = self.client.pipeline(transaction=False)
        for n in names:
            pipe.hgetall(self.keys.node(n))
        out = {}
        for n, raw in zip(names, pipe.execute(), strict=True):
            if raw:
                out[n] = {k.decode(): v.decode() for k, v in raw.items()}
        return out

    def heartbeats(self, names: list[str]) -> dict[str, bool]:
        pipe = self.client.pipeline(transaction=False)
        for n in names:
            pipe.exists(self.keys.heartbeat(n))
        return {n: bool(v) for n, v in zip(names, pipe.execute(), strict=True)}

    def boot_reports(self, names: list[str]) -> dict[str, BootReport]:
        """The boot hashes of ``names`` (one round trip), each node's that holds a report."""
        pipe = self.client.pipeline(transaction=False)
        for n in names:
            pipe.hgetall(self.keys.boot(n))
        out = {}
        for n, raw in zip(names, pipe.execute(), strict=True):
            if raw:
                fields = {
                    k.decode(errors="replace"): v.decode(errors="replace") for k, v in raw.items()
                }
                report = report_from_fields(n, fields)
                if report is not None:
                    out[n] = report
        return out

    def put_boot(self, report: BootReport) -> None:
        """Write a node's boot hash and its ``boot`` event, as the VM's loader does (the
        controller writes one it read from the VM's console: ``source=console``)."""
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(self.keys.boot(report.node), mapping=report.fields())
        entry = stream.envelope(
            "boot",
            report.node,
            at=report.at,
            vm=report.vm,
            stage=report.stage,
            state=report.state.value,
            reason=report.reason,
            source=report.source.value,
        )
        stream.append(pipe, self.keys.events, entry)
        pipe.execute()

    def progress(self) -> dict[str, str]:
        raw = self.client.hgetall(self.keys.progress)
        return {k.decode(): v.decode() for k, v in raw.items()}

    def ckpt_last(self) -> dict[str, str]:
        raw = self.client.hgetall(self.keys.ckpt_last)
        return {k.decode(): v.decode() for k, v in raw.items()}

    def ckpt_refused(self) -> dict[str, str]:
        """How many checkpoint commits were refused as stale, and the newest refusal."""
        raw = self.client.hgetall(self.keys.ckpt_refused)
        return {k.decode(): v.decode() for k, v in raw.items()}

    def restores(self) -> list[Restore]:
        """Every restart of the job's workers, oldest first."""
        out = []
        for raw in self.client.lrange(self.keys.restores, 0, -1):
            r = json.loads(raw)
            out.append(Restore(int(r["step"]), int(r["reached"])))
        return out

    # --- events --------------------------------------------------------------------------
    def events(self) -> list[dict[str, str]]:
        """Every event of the run still in the stream, oldest first, each with its stream
        id as ``id``."""
        return stream.read(self.client, self.keys.events)

    def event(self, type_: str, **fields: Any) -> None:
        # ``at`` from this module's clock: tests freeze it by patching this module's ``time``.
        entry = stream.envelope(type_, "controller", at=time.time(), **fields)
        stream.append(self.client, self.keys.events, entry)

    # --- the lease -----------------------------------------------------------------------
    def acquire(self, owner: str, ttl_s: float) -> bool:
        """Take or renew the run's lease in one step; False when another controller holds
        it."""
        ms = int(ttl_s * 1000)
        return bool(self.client.eval(_ACQUIRE, 1, self.keys.ctl_lease, owner, ms))

    def renew(self, owner: str, ttl_s: float) -> bool:
        """Extend the lease ``owner`` holds, compared and extended in one step; False when
        it is no longer ``owner``'s (expired or taken)."""
        ms = int(ttl_s * 1000)
        return bool(self.client.eval(_RENEW, 1, self.keys.ctl_lease, owner, ms))

    def hold(self, owner: str | None, ttl_s: float = 0.0) -> None:
        """From now on :meth:`fence` renews ``owner``'s lease (None: no lease is checked)."""
        self._held = (owner, ttl_s) if owner else None

    def fence(self) -> None:
        """Renew the held lease before a side effect on a cloud or a node.

        Raises:
            LeaseLost: the lease is gone; the caller must stop acting at once.
        """
        if self._held is None:
            return
        owner, ttl = self._held
        if not self.renew(owner, ttl):
            self._held = None
            raise LeaseLost(f"lost the lease of run {self.keys.run_id} (now {self.lease_holder()})")

    def beat(self, owner: str, ttl_s: float) -> None:
        """Stamp the controller's heartbeat; it lapses ``ttl_s`` after the last pass."""
        self.client.set(self.keys.ctl_alive, owner, px=int(ttl_s * 1000))

    def lease_holder(self) -> str | None:
        v = self.client.get(self.keys.ctl_lease)
        return v.decode() if v is not None else None

    def release(self, owner: str) -> None:
        # Compare and delete in one step: never drop a lease another controller took over.
        self.client.eval(_RELEASE, 1, self.keys.ctl_lease, owner)


def new_owner() -> str:
    return f"ctl-{uuid.uuid4().hex[:12]}"

"""The launch ledger as data: one record per node's launch, what it cost and saved, and the
job's own history per (cloud, zone, instance type). Read and written by :mod:`.state`;
folded against what the clouds list by :mod:`.ledger`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from spottrain.cloud.base import Market, Offer
from spottrain.protocol.states import LedgerStatus

from .types import ZoneHistory


def offer_to_dict(o: Offer) -> dict[str, Any]:
    d = asdict(o)
    d["market"] = o.market.value
    return d


def offer_from_dict(d: dict[str, Any]) -> Offer:
    return Offer(**{**d, "market": Market(d["market"])})


@dataclass(frozen=True)
class LaunchRecord:
    """One node's launch in the ledger.

    Attributes:
        status: ``intent`` (written, the cloud not yet asked or not yet answered),
            ``launched``, ``failed`` (the cloud refused; nothing runs), ``ended`` (the VM is
            gone).
        od_price: the on-demand price of the same type and region, for "$ saved".
        replaces: the at-risk node this one was launched to replace ("" for none).
    """

    node: str
    request_id: str
    offer: Offer
    launched_at: float
    status: str = LedgerStatus.INTENT
    instance_id: str = ""
    ended_at: float | None = None
    interrupted: bool = False
    od_price: float = 0.0
    reason: str = ""
    replaces: str = ""

    def to_json(self) -> str:
        d = asdict(self)
        d["offer"] = offer_to_dict(self.offer)
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> LaunchRecord:
        d = json.loads(text)
        d["offer"] = offer_from_dict(d["offer"])
        return cls(**d)

    def hours(self, now: float) -> float:
        """VM-hours this launch has run (a refused launch ran none)."""
        if self.status == LedgerStatus.FAILED:
            return 0.0
        end = self.ended_at if self.ended_at is not None else now
        return max(0.0, end - self.launched_at) / 3600.0

    def cost(self, now: float) -> float:
        """USD this VM has cost so far."""
        return self.hours(now) * self.offer.price_per_hour

    def saved(self, now: float) -> float:
        """USD saved against the on-demand price of the same VM."""
        if self.od_price <= 0:
            return 0.0
        return self.hours(now) * (self.od_price - self.offer.price_per_hour)


@dataclass
class Ledger:
    """All launch records of a run, by node."""

    records: dict[str, LaunchRecord] = field(default_factory=dict)

    def spent(self, now: float) -> float:
        return sum(r.cost(now) for r in self.records.values())

    def saved(self, now: float) -> float:
        return sum(r.saved(now) for r in self.records.values())


def zone_history(
    counts: Mapping[tuple[str, str, str], Mapping[str, int]], ledger: Ledger, now: float
) -> dict[tuple[str, str, str], ZoneHistory]:
    """The planner's view of the job's history: ``counts`` (preemptions and bad VMs, from
    Redis) with node-hours from the ledger."""
    hours: dict[tuple[str, str, str], float] = {}
    for r in ledger.records.values():
        k = (r.offer.cloud, r.offer.zone, r.offer.instance_type)
        hours[k] = hours.get(k, 0.0) + r.hours(now)
    return {
        k: ZoneHistory(
            preemptions=int(counts.get(k, {}).get("preemptions", 0)),
            bad_nodes=int(counts.get(k, {}).get("bad_nodes", 0)),
            node_hours=hours.get(k, 0.0),
        )
        for k in set(hours) | set(counts)
    }

"""Observe, read-only: what the clouds list for the run and what its agents report, made
into the planner's :class:`~.types.Observed`.

Nothing here writes Redis or changes a cloud: the ledger's fold and the controller's
bookkeeping are decided by the pure functions of :mod:`.ledger` and returned as steps for
:mod:`.execute` to take.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from spottrain.catalog import Catalog
from spottrain.cloud.base import AuthError, Instance, Market, Offer, Provider, ProviderError
from spottrain.controller.reconcile.offers import offer_query
from spottrain.protocol.crashes import CRASH_FIELD, TRAINED_FIELD, Crash
from spottrain.protocol.states import LIVE_LAUNCHES, NodeState
from spottrain.spec import JobSpec

from .ledger import FAILED_LAUNCHES, CountPreemption, Step, bookkeeping, fold_ledger
from .records import Ledger, zone_history
from .state import RunState
from .summary import COMPUTE_FRESH_S, finished, node_compute_s
from .types import SLOW_WATCH, FailedLaunches, NodeObs, Observed, SlowWatch


def catalog_offer(
    catalog: Catalog, cloud: str, region: str, zone: str, instance_type: str, market: Market
) -> Offer:
    """The offer a VM was bought on, from the catalog (a VM adopted without its offer).

    Raises:
        ValueError: the catalog does not know the type or its region.
    """
    t = catalog.get(cloud, instance_type)
    return Offer(
        cloud=cloud,
        region=region,
        zone=zone,
        instance_type=instance_type,
        gpus=t.gpus,
        gpu_type=t.gpu_type,
        market=market,
        price_per_hour=catalog.price(cloud, instance_type, region, market),
        interruption_risk=t.interruption_risk if market is Market.SPOT else 0.0,
    )


def od_price(catalog: Catalog, offer: Offer) -> float:
    """The on-demand price of an offer's type and region ("$ saved" is against it); the
    offer's own price when the catalog has none."""
    try:
        return catalog.price(offer.cloud, offer.instance_type, offer.region, Market.ON_DEMAND)
    except ValueError:
        return offer.price_per_hour


@dataclass
class Observation:
    """One pass's view.

    Attributes:
        obs: the planner's input (after the fold and the bookkeeping).
        ledger: the ledger after the fold.
        listed: each node's own VM as listed (the one whose request id the ledger holds).
        steps: the fold's and the bookkeeping's writes, in order, for the executor.
        offer_errors: (cloud, error) for each cloud whose offers could not be listed.
    """

    obs: Observed
    ledger: Ledger
    listed: dict[str, Instance]
    steps: list[Step]
    offer_errors: list[tuple[str, str]]


@dataclass
class Observer:
    """Reads the clouds and Redis for one run, keeping the offers it listed last."""

    spec: JobSpec
    run_id: str
    providers: Mapping[str, Provider]
    state: RunState
    catalog: Catalog
    _offers: list[Offer] = field(default_factory=list)
    _offers_at: float = -math.inf

    def instances(self) -> list[Instance]:
        found: list[Instance] = []
        for prov in self.providers.values():
            found.extend(prov.list(self.run_id))
        return found

    def offers(self, now: float, ttl_s: float) -> tuple[list[Offer], list[tuple[str, str]]]:
        """The clouds' offers (those listed within ``ttl_s`` reused), and the clouds that
        could not list them."""
        if now - self._offers_at < ttl_s and self._offers:
            return self._offers, []
        offers: list[Offer] = []
        errors: list[tuple[str, str]] = []
        for cloud, prov in self.providers.items():
            try:
                offers.extend(prov.offers(offer_query(self.spec, cloud, self.catalog)))
            except AuthError:
                raise
            except ProviderError as e:
                errors.append((cloud, str(e)))
        self._offers, self._offers_at = offers, now
        return offers, errors

    def offer_for(self, inst: Instance) -> Offer:
        for o in self._offers:
            if o.key == (inst.cloud, inst.zone, inst.instance_type, inst.market.value):
                return o
        return catalog_offer(
            self.catalog, inst.cloud, inst.region, inst.zone, inst.instance_type, inst.market
        )

    def observe(self, now: float, *, lost_grace_s: float, offers_ttl_s: float) -> Observation:
        """Gather the planner's input. Raises ProviderError when a cloud cannot be listed
        (a pass on a partial view could relaunch what exists)."""
        instances = self.instances()
        offers, errors = self.offers(now, offers_ttl_s)
        ledger, steps = fold_ledger(
            self.state.ledger(),
            instances,
            now,
            lost_grace_s,
            self.offer_for,
            lambda o: od_price(self.catalog, o),
        )
        by_node = {}
        for inst in instances:
            rec = ledger.records.get(inst.node)
            if rec is not None and inst.request_id == rec.request_id:
                by_node[inst.node] = inst
        obs = self._observed(now, ledger, by_node, offers, steps)
        obs, more = bookkeeping(obs)
        return Observation(obs, ledger, by_node, [*steps, *more], errors)

    def _nodes(self, ledger: Ledger, by_node: Mapping[str, Instance], now: float) -> list[NodeObs]:
        live_records = [r for r in ledger.records.values() if r.status in LIVE_LAUNCHES]
        names = [r.node for r in live_records]
        agents = self.state.node_records(names)
        beats = self.state.heartbeats(names)
        # The boot reports of the nodes whose agent has not registered or still boots, in
        # one round trip (a settled node's boot is over, and its report no longer read).
        boots = self.state.boot_reports([n for n in names if _booting(agents.get(n))])
        live_names = set(names)
        timing = {n: compute_report(agents.get(n, {}), now) for n in names}
        return [
            NodeObs(
                name=r.node,
                instance=by_node.get(r.node),
                offer=r.offer,
                launched_at=r.launched_at,
                agent_state=agents.get(r.node, {}).get("state"),
                alive_beat=beats.get(r.node, False),
                compute_s=node_compute_s(agents.get(r.node, {}), now),
                compute_at=timing[r.node].at,
                compute_samples=timing[r.node].samples,
                step_s=timing[r.node].step_s,
                agent_reason=agents.get(r.node, {}).get("reason", ""),
                boot=boots.get(r.node),
                at_risk=agents.get(r.node, {}).get("at_risk", ""),
                preempted=agents.get(r.node, {}).get("preempted", ""),
                # Only while the node it replaces lives: after that it is an ordinary node.
                replaces=r.replaces if r.replaces in live_names else "",
                crash=Crash.from_json(agents.get(r.node, {}).get(CRASH_FIELD)),
                trained=agents.get(r.node, {}).get(TRAINED_FIELD) == "1",
            )
            for r in live_records
        ]

    def _observed(
        self,
        now: float,
        ledger: Ledger,
        by_node: Mapping[str, Instance],
        offers: list[Offer],
        steps: list[Step],
    ) -> Observed:
        nodes = self._nodes(ledger, by_node, now)
        ctl = self.state.ctl()
        home = tuple(ctl["home"].split("|")) if ctl.get("home") else None
        # The history as it will be once the fold's preemptions are counted.
        counts = {k: dict(v) for k, v in self.state.history().items()}
        for s in steps:
            if isinstance(s, CountPreemption):
                seen = counts.setdefault(s.key, {})
                seen["preemptions"] = int(seen.get("preemptions", 0)) + 1
        return Observed(
            now=now,
            nodes=nodes,
            offers=offers,
            blocked=self.state.blocked(),
            history=zone_history(counts, ledger, now),
            spent_usd=ledger.spent(now),
            finished=finished(self.state),
            finished_at=_float(ctl.get("finished_at")),
            stopped=ctl.get("stopped", ""),
            restores=self.state.restores(),
            home=home if home and len(home) == 3 else None,
            below_min_since=_float(ctl.get("below_min_since")),
            spot_short_since=_float(ctl.get("spot_short_since")),
            next_index=int(ctl.get("next_index", "0")),
            job_tag=self.run_id,
            moving=bool(ctl.get("moving")),
            failed=FailedLaunches.from_json(ctl.get(FAILED_LAUNCHES)),
            last_refusal=ctl.get("last_refusal", ""),
            committed_step=_int(self.state.ckpt_last().get("step")),
            slow=SlowWatch.from_json(ctl.get(SLOW_WATCH)),
        )


@dataclass(frozen=True)
class ComputeReport:
    """What the straggler check reads from a node's record besides its compute seconds
    (:func:`.summary.node_compute_s`): when the newest fresh figure was measured, the
    fewest steps a fresh figure is the median of (from the ``compute_n:<local rank>``
    fields; 0 where a rank wrote none) and the node's wall seconds per step (from
    ``step_time``)."""

    at: float | None
    samples: int
    step_s: float | None


def compute_report(record: Mapping[str, str], now: float) -> ComputeReport:
    """A node's :class:`ComputeReport` from its record; garbled fields count as absent."""
    ats: list[float] = []
    samples: list[int] = []
    for k, v in record.items():
        if not k.startswith("compute:"):
            continue
        try:
            secs, at = (float(x) for x in v.split())
            n = int(record.get("compute_n:" + k[len("compute:") :], "0"))
        except ValueError:
            continue
        if now - at <= COMPUTE_FRESH_S and math.isfinite(secs) and secs >= 0:
            ats.append(at)
            samples.append(n)
    step = _float_or_none(record.get("step_time"))
    return ComputeReport(
        max(ats) if ats else None,
        min(samples) if samples else 0,
        step if step is not None and math.isfinite(step) and step >= 0 else None,
    )


def _float_or_none(v: str | None) -> float | None:
    try:
        return float(v) if v else None
    except ValueError:
        return None


def _float(v: str | None) -> float | None:
    return float(v) if v else None


def _int(v: str | None) -> int | None:
    try:
        return int(v) if v else None
    except ValueError:
        return None


def _booting(agent: Mapping[str, str] | None) -> bool:
    """A node whose agent has not registered, or whose agent still boots."""
    return agent is None or agent.get("state") in (None, NodeState.BOOTING)

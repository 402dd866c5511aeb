"""What an offer costs: the risk-weighted price the ranking uses, and the open offers best
first."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from spottrain.cloud.base import Market, Offer
from spottrain.spec import SpotPolicy

from .types import Action, Launch, Observed, Policy, ZoneHistory

HOURS_PER_MONTH = 730.0


def hourly_risk(
    offer: Offer, history: Mapping[tuple[str, str, str], ZoneHistory], prior_h: float
) -> float:
    """Expected interruptions per VM-hour: the bundled band (a monthly share) blended with
    the preemptions this job saw on this zone and type, weighted by node-hours."""
    if offer.market is Market.ON_DEMAND:
        return 0.0
    prior_rate = offer.interruption_risk / HOURS_PER_MONTH
    seen = history.get((offer.cloud, offer.zone, offer.instance_type))
    if seen is None:
        return prior_rate
    events = seen.preemptions + seen.bad_nodes
    return (prior_rate * prior_h + events) / (prior_h + seen.node_hours)


def effective_price(
    offer: Offer, policy: Policy, history: Mapping[tuple[str, str, str], ZoneHistory]
) -> float:
    """USD per VM-hour including what interruptions are expected to cost: each one stalls
    the whole fleet (``max_nodes`` VMs) for ``stall_s``."""
    rate = hourly_risk(offer, history, policy.prior_hours)
    stall_h = policy.stall_s / 3600.0
    return offer.price_per_hour * (1.0 + rate * policy.max_nodes * stall_h)


def hourly_cost(prices: Counter[float]) -> float:
    """USD per hour of nodes counted by price (summed by price, so the figure does not
    depend on the order the nodes came in)."""
    return sum((price * count for price, count in sorted(prices.items())), 0.0)


def zone_key(o: Offer) -> tuple[str, str, str]:
    return (o.cloud, o.zone, o.instance_type)


def allowed_markets(policy: Policy, obs: Observed, now: float) -> tuple[Market, ...]:
    if policy.spot_policy is SpotPolicy.SPOT:
        return (Market.SPOT,)
    if policy.spot_policy is SpotPolicy.ON_DEMAND:
        return (Market.ON_DEMAND,)
    short = (
        obs.spot_short_since is not None and now - obs.spot_short_since >= policy.fallback_after_s
    )
    return (Market.SPOT, Market.ON_DEMAND) if short else (Market.SPOT,)


def candidates(
    policy: Policy,
    obs: Observed,
    blocked: set[tuple[str, str, str, str]],
    home: tuple[str, str, str] | None,
    now: float,
    *,
    only_home: bool,
) -> list[Offer]:
    """Open offers, best first: allowed market, not blocked, in the home zone and type when
    asked; spot before on-demand, then by risk-weighted price."""
    markets = allowed_markets(policy, obs, now)
    out = [
        o
        for o in obs.offers
        if o.market in markets
        and o.key not in blocked
        and (not only_home or home is None or (o.cloud, o.zone, o.instance_type) == home)
    ]
    if home is not None and not only_home and policy.same_zone:
        # A move keeps the GPU type when it can: prefer offers of the same type.
        same_type = [o for o in out if o.instance_type == home[2]]
        out = same_type or out
    return sorted(
        out,
        key=lambda o: (
            o.market is not Market.SPOT,
            effective_price(o, policy, obs.history),
            o.cloud,
            o.zone,
            o.instance_type,
        ),
    )


def spread_pick(
    offers: Sequence[Offer], staying_zones: Counter[str], actions: Sequence[Action]
) -> Offer:
    """With spreading, the cheapest offer in the zone that has the fewest nodes (staying
    nodes counted by zone, plus this pass's launches)."""
    per_zone = Counter(staying_zones)
    per_zone.update(a.offer.zone for a in actions if isinstance(a, Launch))
    return min(offers, key=lambda o: (per_zone[o.zone], offers.index(o)))

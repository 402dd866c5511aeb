"""What a job may run on: the offer query of each cloud its spec allows (instance types,
regions and zones the catalog knows, markets by the spot policy, price cap)."""

from __future__ import annotations

from spottrain.catalog import Catalog, bundled
from spottrain.cloud.base import Market, OfferQuery
from spottrain.spec import JobSpec, SpotPolicy


def regions_of(spec: JobSpec, cloud: str, catalog: Catalog) -> tuple[str, ...]:
    known = set(catalog.regions(cloud))
    return tuple(r for r in spec.resources.regions if r in known)


def offer_query(spec: JobSpec, cloud: str, catalog: Catalog | None = None) -> OfferQuery:
    """The offers of ``cloud`` that ``spec`` allows.

    The spot policy decides the markets: ``spot`` asks for spot only, ``on-demand`` for
    on-demand only, ``spot-then-on-demand`` for both (the planner decides when on-demand is
    used).
    """
    cat = catalog or bundled()
    types = tuple(t for t in spec.resources.instance_types if t in cat.types(cloud))
    if cloud == "local":
        regions: tuple[str, ...] = ()
        zones = spec.resources.zones
    else:
        regions = regions_of(spec, cloud, cat)
        zones = tuple(z for z in spec.resources.zones if any(z.startswith(r) for r in regions))
        if spec.resources.zones and not regions:
            zones = spec.resources.zones
    markets = {
        SpotPolicy.SPOT: (Market.SPOT,),
        SpotPolicy.ON_DEMAND: (Market.ON_DEMAND,),
        SpotPolicy.SPOT_THEN_ON_DEMAND: (Market.SPOT, Market.ON_DEMAND),
    }[spec.spot.policy]
    return OfferQuery(
        regions=regions,
        zones=zones,
        instance_types=types,
        markets=markets,
        max_price_per_hour=spec.resources.max_price_per_hour,
        min_gpus=spec.nodes.gpus,
    )

"""The offers of the gcp cloud: the catalog's machine types and prices in the configured
regions and zones."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from spottrain.catalog import Catalog
from spottrain.cloud.base.provider import Market, Offer, OfferQuery, sort_offers
from spottrain.cloud.gcp.settings import CLOUD


def catalog_offers(
    catalog: Catalog,
    regions: Sequence[str],
    query: OfferQuery,
    zones_with: Callable[[str], frozenset[str]] | None,
) -> list[Offer]:
    """Every region x zone x machine type x market of the catalog in ``regions`` that
    ``query`` allows, at the catalog's prices, cheapest first.

    ``zones_with``, when given, names the zones that have a machine type (asked of the API);
    zones without it are left out.
    """
    regions = [r for r in regions if not query.regions or r in query.regions]
    found: list[Offer] = []
    for name, itype in sorted(catalog.types(CLOUD).items()):
        if query.instance_types and name not in query.instance_types:
            continue
        if itype.gpus < query.min_gpus:
            continue
        type_regions = [r for r in regions if not itype.regions or r in itype.regions]
        if not type_regions:
            continue
        available = zones_with(name) if zones_with is not None else None
        for region in type_regions:
            for zone in catalog.gcp_zones(region):
                if available is not None and zone not in available:
                    continue
                for market in query.markets:
                    offer = Offer(
                        cloud=CLOUD,
                        region=region,
                        zone=zone,
                        instance_type=name,
                        gpus=itype.gpus,
                        gpu_type=itype.gpu_type,
                        market=market,
                        price_per_hour=catalog.price(CLOUD, name, region, market),
                        interruption_risk=(
                            itype.interruption_risk if market is Market.SPOT else 0.0
                        ),
                        network=itype.network,
                    )
                    if query.allows(offer):
                        found.append(offer)
    return sort_offers(found)

"""The offers of the aws cloud: EC2's spot prices, and the offers of a region from what EC2
lists and the catalog."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from spottrain.catalog import Catalog
from spottrain.cloud.aws.settings import CLOUD
from spottrain.cloud.base.provider import Market, Offer

log = logging.getLogger(__name__)


def spot_prices(client: Any, types: list[str]) -> dict[tuple[str, str], float]:
    """The latest spot price per (type, zone), from EC2's spot price history."""
    latest: dict[tuple[str, str], tuple[datetime, float]] = {}
    # With a start time of now, EC2 returns the price in effect now per zone, not days
    # of history. AWS's now, not the cache's (injectable) clock.
    pages = client.get_paginator("describe_spot_price_history").paginate(
        InstanceTypes=types,
        ProductDescriptions=["Linux/UNIX"],
        StartTime=datetime.now(UTC),
    )
    for page in pages:
        for row in page.get("SpotPriceHistory", []):
            key = (row["InstanceType"], row["AvailabilityZone"])
            stamp = row["Timestamp"]
            if key not in latest or stamp > latest[key][0]:
                latest[key] = (stamp, float(row["SpotPrice"]))
    return {key: price for key, (_, price) in latest.items()}


def zone_offers(
    catalog: Catalog,
    region: str,
    zones: Mapping[str, set[str]],
    described: Mapping[str, Any],
    spot: Mapping[tuple[str, str], float],
    max_spot_price: float | None,
) -> list[Offer]:
    """The offers of one region: each type in each zone where EC2 lists it, on demand at the
    catalog's price and spot at ``spot``'s (the catalog's where it has no row), unless above
    ``max_spot_price``. GPU count and EFA support come from ``described`` (EC2's
    ``describe_instance_types`` answer), the catalog filling in for types it lacks."""
    known = catalog.types(CLOUD)
    info = {t["InstanceType"]: t for t in described.get("InstanceTypes", [])}
    offers: list[Offer] = []
    for name, type_zones in zones.items():
        entry = known[name]
        gpus, network = entry.gpus, entry.network
        api = info.get(name)
        if api is not None:
            gpus = sum(int(g.get("Count", 0)) for g in api.get("GpuInfo", {}).get("Gpus", []))
            network = "efa" if api.get("NetworkInfo", {}).get("EfaSupported") else ""
            if gpus != entry.gpus:
                log.warning(
                    "aws %s has %d GPUs per EC2, %d per the catalog; using EC2's",
                    name,
                    gpus,
                    entry.gpus,
                )
        on_demand = catalog.price(CLOUD, name, region, Market.ON_DEMAND)
        table_spot = catalog.price(CLOUD, name, region, Market.SPOT)
        for zone in sorted(type_zones):
            on_demand_offer = Offer(
                cloud=CLOUD,
                region=region,
                zone=zone,
                instance_type=name,
                gpus=gpus,
                gpu_type=entry.gpu_type,
                market=Market.ON_DEMAND,
                price_per_hour=on_demand,
                interruption_risk=0.0,
                network=network,
            )
            offers.append(on_demand_offer)
            price = spot.get((name, zone), table_spot)
            cap = max_spot_price
            if cap is not None and price > cap:
                continue  # EC2 would refuse the bid (SpotMaxPriceTooLow)
            offers.append(
                replace(
                    on_demand_offer,
                    market=Market.SPOT,
                    price_per_hour=price,
                    interruption_risk=entry.interruption_risk,
                )
            )
    return offers

"""The bundled table of GPU instance types: GPUs, list prices and interruption bands.

The figures, their date and their sources live in ``data/catalog.json`` (read its ``notes``).
They are planning figures, not live quotes: AWS spot prices come live from the price history
where it has a row, and the controller refines each interruption band with the preemptions
the job itself sees. ``SPOTTRAIN_CATALOG=/path/to/catalog.json`` replaces the whole table,
for a newer snapshot or negotiated prices.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from spottrain.protocol.env import ENV_CATALOG

# How an on-demand VM is bought: the word of the cloud layer's ``Market.ON_DEMAND`` (a str
# enum, so a Market compares equal to its word); the floor does not import the cloud layer.
ON_DEMAND = "on-demand"


class UnknownInstanceType(ValueError):
    """An instance type the bundled table does not know (so no price and no GPU count)."""


class UnknownRegion(ValueError):
    """A region the bundled table has no prices for."""


@dataclass(frozen=True)
class InstanceType:
    """One instance type as the table knows it.

    Attributes:
        cloud: ``aws``, ``gcp`` or ``local``.
        name: the cloud's name for it.
        gpus: GPUs per VM.
        gpu_type: the GPU model, the same words across clouds (``H100``, ``A100-80GB``).
        network: ``efa`` (AWS Elastic Fabric Adapter), ``gpudirect`` (GCP GPUDirect-TCPX) or
            ``""``.
        on_demand: USD per hour in the cloud's reference region.
        spot_fraction: the spot price estimate as a share of on-demand.
        interruption_band: the Spot Instance Advisor's band (``"5-10%"``).
        interruption_risk: the band's midpoint as a share (``0.075``).
        accelerator: GCP's accelerator type name, for the types that need one spelled out.
        regions: regions the type is offered in (GCP); empty means every priced region.
    """

    cloud: str
    name: str
    gpus: int
    gpu_type: str
    network: str
    on_demand: float
    spot_fraction: float
    interruption_band: str
    interruption_risk: float
    accelerator: str = ""
    regions: tuple[str, ...] = ()


class Catalog:
    """The parsed table. Build it with :meth:`load`."""

    def __init__(self, data: dict[str, Any], source: str) -> None:
        self.source = source
        self.as_of: str = data["as_of"]
        self._data = data
        bands: dict[str, float] = data["interruption_bands"]
        self._types: dict[str, dict[str, InstanceType]] = {}
        for cloud, key in (("aws", "instance_types"), ("gcp", "machine_types")):
            self._types[cloud] = {
                name: _parse_type(cloud, name, row, bands) for name, row in data[cloud][key].items()
            }
        local: dict[str, InstanceType] = {}
        for name, row in data["local"]["instance_types"].items():
            twin_cloud, twin_name = row["priced_as"]
            twin = self._types[twin_cloud][twin_name]
            local[name] = InstanceType(
                cloud="local",
                name=name,
                gpus=int(row["gpus"]),
                gpu_type=row["gpu_type"],
                network="",
                on_demand=twin.on_demand,
                spot_fraction=twin.spot_fraction,
                interruption_band=row["interruption_band"],
                interruption_risk=bands[row["interruption_band"]],
            )
        self._types["local"] = local

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None) -> Catalog:
        """Read ``path``, else ``$SPOTTRAIN_CATALOG``, else the bundled table.

        Raises:
            ValueError: the file is not a catalog, with the file and the missing part named.
        """
        chosen = path or os.environ.get(ENV_CATALOG)
        if chosen:
            text = Path(chosen).read_text()
            source = str(chosen)
        else:
            text = resources.files(__package__).joinpath("data/catalog.json").read_text()
            source = "bundled"
        try:
            return cls(json.loads(text), source)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"instance catalog {source} is not valid ({type(e).__name__}: {e}); "
                "copy spottrain/data/catalog.json and edit its figures"
            ) from e

    def types(self, cloud: str) -> dict[str, InstanceType]:
        """Every type the table knows for ``cloud``, by name."""
        return dict(self._types[cloud])

    def get(self, cloud: str, name: str) -> InstanceType:
        """The type ``name`` of ``cloud``.

        Raises:
            UnknownInstanceType: with the closest known names.
        """
        known = self._types.get(cloud)
        if known is None:
            raise ValueError(f"unknown cloud {cloud!r}: use aws, gcp or local")
        try:
            return known[name]
        except KeyError:
            close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise UnknownInstanceType(
                f"{cloud} instance type {name!r} is not in the catalog{hint}; known: "
                f"{', '.join(sorted(known))}. spottrain needs its GPU count and price: add it "
                f"to a copy of the catalog and point {ENV_CATALOG} at it"
            ) from None

    def regions(self, cloud: str) -> list[str]:
        """Regions the table has prices for."""
        if cloud == "local":
            return ["local"]
        return list(self._data[cloud]["region_multiplier"])

    def region_multiplier(self, cloud: str, region: str) -> float:
        """How much more a VM costs in ``region`` than in the reference region.

        Raises:
            UnknownRegion: with the regions that are priced.
        """
        if cloud == "local":
            return 1.0
        table: dict[str, float] = self._data[cloud]["region_multiplier"]
        try:
            return float(table[region])
        except KeyError:
            raise UnknownRegion(
                f"{cloud} region {region!r} has no prices in the catalog; priced regions: "
                f"{', '.join(table)} (or add it to a copy of the catalog, see {ENV_CATALOG})"
            ) from None

    def price(self, cloud: str, name: str, region: str, market: str) -> float:
        """The table's USD per hour for one VM (``market``: a ``Market``, on-demand or spot)."""
        t = self.get(cloud, name)
        base = t.on_demand * self.region_multiplier(cloud, region)
        return round(base if market == ON_DEMAND else base * t.spot_fraction, 4)

    def gcp_zones(self, region: str) -> list[str]:
        """The zones of a GCP region that the table lists."""
        zones: dict[str, list[str]] = self._data["gcp"]["zones"]
        if region not in zones:
            raise UnknownRegion(
                f"gcp region {region!r} has no zones in the catalog; known: {', '.join(zones)}"
            )
        return list(zones[region])


def _parse_type(
    cloud: str, name: str, row: dict[str, Any], bands: dict[str, float]
) -> InstanceType:
    band = row["interruption_band"]
    if band not in bands:
        raise ValueError(f"{cloud} {name}: interruption band {band!r} is not one of {list(bands)}")
    return InstanceType(
        cloud=cloud,
        name=name,
        gpus=int(row["gpus"]),
        gpu_type=row["gpu_type"],
        network=row.get("network", ""),
        on_demand=float(row["on_demand"]),
        spot_fraction=float(row["spot_fraction"]),
        interruption_band=band,
        interruption_risk=float(bands[band]),
        accelerator=row.get("accelerator", ""),
        regions=tuple(row.get("regions", ())),
    )


@cache
def bundled() -> Catalog:
    """The table every provider uses unless given another (read once per process)."""
    return Catalog.load()

"""Zones and their machine types, from the bundled catalog (plus the GPU shapes below)."""

from __future__ import annotations

from typing import Any

from spottrain.catalog import bundled

from .common import API, not_found
from .listing import aggregated_page, list_page
from .state import GceState

# The GPU machine types the fake knows, beyond those in the catalog: (vCPUs, memory MB).
_SHAPES = {
    "a3-highgpu-8g": (208, 1_872_000),
    "a2-ultragpu-8g": (96, 1_384_448),
    "a2-highgpu-8g": (96, 696_320),
    "g2-standard-96": (96, 393_216),
}


class MachineTypesMixin(GceState):
    def _machine_type(self, zone: str, name: str) -> dict[str, Any]:
        cpus, memory = _SHAPES.get(name, (8, 32_768))
        body: dict[str, Any] = {
            "kind": "compute#machineType",
            "id": str(abs(hash(name)) % 10**12),
            "name": name,
            "description": f"{cpus} vCPUs, {memory // 1024} GB RAM",
            "guestCpus": cpus,
            "memoryMb": memory,
            "zone": zone,
            "selfLink": f"{API}/projects/{self.project}/zones/{zone}/machineTypes/{name}",
            "isSharedCpu": False,
        }
        itype = bundled().types("gcp").get(name)
        if itype is not None and itype.accelerator:
            body["accelerators"] = [
                {"guestAcceleratorType": itype.accelerator, "guestAcceleratorCount": itype.gpus}
            ]
        return body

    def _serve_machine_types(
        self, call: str, zone: str, name: str, query: dict[str, str], raw: bytes
    ) -> tuple[int, dict[str, Any]] | None:
        if call == "machineTypes.get":
            if name not in self._machine_types[zone]:
                raise not_found(f"projects/{self.project}/zones/{zone}/machineTypes/{name}")
            return 200, self._machine_type(zone, name)
        if call == "machineTypes.list":
            items = [self._machine_type(zone, t) for t in sorted(self._machine_types[zone])]
            return 200, list_page(
                f"projects/{self.project}/zones/{zone}/machineTypes",
                "compute#machineTypeList",
                items,
                query,
                self.page_size,
            )
        if call == "machineTypes.aggregatedList":
            scoped = {
                z: [self._machine_type(z, t) for t in sorted(ts)]
                for z, ts in sorted(self._machine_types.items())
            }
            return 200, aggregated_page(
                f"projects/{self.project}/aggregated/machineTypes",
                "compute#machineTypeAggregatedList",
                "machineTypes",
                scoped,
                query,
                self.page_size,
            )
        return None


def catalog_zones() -> dict[str, set[str]]:
    catalog = bundled()
    zones: dict[str, set[str]] = {}
    for region in catalog.regions("gcp"):
        for zone in catalog.gcp_zones(region):
            zones.setdefault(zone, set())
    for name, itype in catalog.types("gcp").items():
        for region in itype.regions or catalog.regions("gcp"):
            for zone in catalog.gcp_zones(region):
                zones[zone].add(name)
    return zones

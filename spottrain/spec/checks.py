"""What a spec is checked against beyond its own fields: the catalog (instance types,
regions, zones), the files it names, the object stores each allowed cloud's VMs can read, and
whether an emergency checkpoint fits each cloud's notice window."""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from spottrain.catalog import Catalog, UnknownInstanceType, UnknownRegion
from spottrain.trace import load_trace

from .clouds import LocalCloudSpec
from .code import ArchiveCode
from .replica import replica_gpu_types_problem
from .sections import Integration

if TYPE_CHECKING:
    from .job import JobSpec


# Seconds between a cloud's preemption notice and the VM's end (AWS: the two-minute spot
# interruption notice; GCP: the 30 s preemption notice).
NOTICE_WINDOW_S = {"aws": 120.0, "gcp": 30.0}
# What the agent keeps back from a notice window before it stops waiting for the emergency
# checkpoint (its --notice-margin), plus the commit and the leave.
DRAIN_OVERHEAD_S = 10.0
# Before the write can start: the agent's watchers poll the metadata every 2 s (a notice is
# seen up to that late, and GCP's 30 s run from the notice, not from when it is seen), rank 0
# polls Redis for the checkpoint request every 0.2 s, and the ranks agree on the save step
# at agreement steps, about every 0.2 s of steps (at least one step, at most 64): a request
# is acted on within two agreements (agent/sdk/agreement.py;
# tests/unit/spottrain/test_spec.py checks these against the agent's defaults).
NOTICE_DETECT_S = 2.0
REQUEST_POLL_S = 0.2
AGREE_INTERVAL_S = 0.2
MAX_AGREE_EVERY = 64


# The cloud whose VMs can read each object-store scheme (file:// is a path on the VM).
_STORE_CLOUD = {"s3://": "aws", "gs://": "gcp"}


def stores_readable(spec: JobSpec, clouds: Collection[str]) -> None:
    """Raise ValueError unless every allowed cloud's VMs can read the checkpoint copy and the
    code archive: a VM installs only its own cloud's storage client and holds only its own
    cloud's credentials, so a GCP VM cannot read s3:// (nor an AWS VM gs://), and a job moved
    there would not find its checkpoint or its code."""
    stores = [("checkpoint.copy_to", spec.checkpoint.copy_to)]
    if isinstance(spec.code, ArchiveCode):
        stores.append(("code.archive.store", spec.code.archive.store))
    for where, url in stores:
        if url is None:
            continue
        owner = next((c for p, c in _STORE_CLOUD.items() if url.startswith(p)), None)
        others = sorted(c for c in clouds if c in _STORE_CLOUD.values() and c != owner)
        if owner is None or not others:
            continue
        raise ValueError(
            f"{where}: {url.split('/', 1)[0]}// ({owner} storage) cannot be read by "
            f"{', '.join(others)} VMs (each VM has only its own cloud's storage client and "
            "credentials), so a node there could restore no checkpoint nor fetch the "
            "code; one store per cloud is not supported: use one cloud "
            f"(resources.clouds: [{owner}]), or a file:// store on a file system every VM "
            "mounts"
        )


def check_catalog(spec: JobSpec, catalog: Catalog) -> list[str]:
    """Problems the catalog can see: unknown instance types, regions and zones, and GPU
    types that replica mode's spread placement would mix."""
    problems = []
    clouds = [c for c in spec.resources.clouds]
    for name in spec.resources.instance_types:
        owners = [c for c in clouds if name in catalog.types(c)]
        if not owners:
            errors = []
            for c in clouds:
                try:
                    catalog.get(c, name)
                except UnknownInstanceType as e:
                    errors.append(str(e))
            problems.append(f"resources.instance_types: {errors[0] if errors else name}")
    for region in spec.resources.regions:
        known = [c for c in clouds if region in catalog.regions(c)]
        if not known:
            allowed = sorted({r for c in clouds for r in catalog.regions(c)})
            problems.append(
                f"resources.regions: {region!r} is not a region of {', '.join(clouds)} with "
                f"prices in the catalog; known: {', '.join(allowed)}"
            )
    for zone in spec.resources.zones:
        if "local" in clouds:
            local = spec.local or LocalCloudSpec()
            if zone not in local.zones:
                problems.append(
                    f"resources.zones: {zone!r} is not a zone of local.zones "
                    f"({', '.join(local.zones)})"
                )
            continue
        region = _zone_region(zone)
        if spec.resources.regions and region not in spec.resources.regions:
            problems.append(
                f"resources.zones: {zone!r} is not in any of resources.regions "
                f"({', '.join(spec.resources.regions)})"
            )
    for cloud in clouds:
        if cloud == "local":
            continue
        try:
            for region in spec.resources.regions:
                if region in catalog.regions(cloud):
                    catalog.region_multiplier(cloud, region)
        except UnknownRegion as e:
            problems.append(f"resources.regions: {e}")
    gpu_types = replica_gpu_types_problem(spec, catalog)
    if gpu_types:
        problems.append(gpu_types)
    return problems


def check_files(spec: JobSpec, base_dir: Path) -> list[str]:
    """Problems with the files a spec names (relative to the spec's directory)."""
    problems = []
    if isinstance(spec.code, ArchiveCode):
        path = base_dir / spec.code.archive.path
        if not path.is_dir():
            problems.append(f"code.archive.path: {path} is not a directory")
    trace = spec.local.preemptions.trace if spec.local else None
    if trace:
        try:
            load_trace(base_dir / trace)
        except ValueError as e:
            problems.append(f"local.preemptions.trace: {e}")
    return problems


def _zone_region(zone: str) -> str:
    # us-east-1a -> us-east-1; us-central1-a -> us-central1
    if re.match(r"^[a-z]+-[a-z]+[0-9]+-[a-z]\Z", zone):
        return zone.rsplit("-", 1)[0]
    return zone[:-1]


def agreement_lag_s(step_s: float | None) -> float:
    """The most seconds between rank 0 reading a checkpoint request and the ranks starting
    the save: two agreements, each ``max(1, min(64, int(0.2 / step_s)))`` steps apart (the
    SDK's spacing); with the step time unknown, steps of at most 0.2 s."""
    if step_s is None:
        return 2 * AGREE_INTERVAL_S
    steps = max(1, min(MAX_AGREE_EVERY, int(AGREE_INTERVAL_S / step_s)))
    return 2 * steps * step_s


@dataclass(frozen=True)
class WindowCheck:
    """Whether one emergency checkpoint fits a cloud's notice window: the notice seen
    (``detect_s``), the request read and the step agreed (``agree_s``), the write
    (``write_s``), then the margin, the commit and the leave (``DRAIN_OVERHEAD_S``)."""

    cloud: str
    window_s: float
    write_s: float
    fits: bool
    detect_s: float = NOTICE_DETECT_S
    agree_s: float = REQUEST_POLL_S + 2 * AGREE_INTERVAL_S
    step_known: bool = False
    # A plain script (train.integration: plain) gets SIGTERM at once and stops at its next
    # step: no request to read, no agreement spacing.
    plain: bool = False

    @property
    def needed_s(self) -> float:
        return self.detect_s + self.agree_s + self.write_s + DRAIN_OVERHEAD_S

    def describe(self, size_gb: float, gbps: float) -> str:
        spare = self.window_s - self.needed_s
        verdict = (
            f"fits, {spare:.0f} s to spare"
            if self.fits
            else f"does NOT fit: {-spare:.0f} s short; write faster (more aggregate bandwidth), "
            "shard the checkpoint smaller, or drop this cloud"
        )
        step = (
            ""
            if self.step_known
            else " (step time unknown: steps of at most 0.2 s assumed; set checkpoint.step_s)"
        )
        agree = (
            "for the script to finish its step after SIGTERM"
            if self.plain
            else "to read the request and agree on the step"
        )
        return (
            f"{self.cloud}: {size_gb:.3g} GB at {gbps:g} GB/s takes {self.write_s:.1f} s; with "
            f"{self.detect_s:.1f} s to see the notice, {self.agree_s:.1f} s {agree}{step} and "
            f"{DRAIN_OVERHEAD_S:.0f} s to commit and leave, {self.needed_s:.1f} s of the "
            f"{self.window_s:.0f} s notice window: {verdict}"
        )


def check_notice_windows(spec: JobSpec) -> list[WindowCheck]:
    """For each allowed cloud, whether an emergency checkpoint of the job's estimated size
    fits the notice window at the volume's aggregate write bandwidth, after the notice is
    seen and the step agreed (a plain script: once it finished the step SIGTERM found it
    in). Empty when the spec gives no size (``checkpoint.size_gb`` or
    ``checkpoint.params``)."""
    size = spec.checkpoint.estimated_gb
    if size is None:
        return []
    write_s = size / spec.checkpoint.volume.write_gbps
    step_s = spec.checkpoint.step_s
    plain = spec.train.integration is Integration.PLAIN
    if plain:
        agree_s = AGREE_INTERVAL_S if step_s is None else step_s
    else:
        agree_s = REQUEST_POLL_S + agreement_lag_s(step_s)
    needed = NOTICE_DETECT_S + agree_s + write_s + DRAIN_OVERHEAD_S
    known = step_s is not None
    return [
        WindowCheck(
            cloud, window, write_s, needed <= window, NOTICE_DETECT_S, agree_s, known, plain
        )
        for cloud, window in spec.notice_windows.items()
    ]

"""What a Compute Engine instance insert sends for one launch request: the VM's name and body."""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING

from spottrain.catalog import Catalog
from spottrain.cloud.base.provider import TAG_JOB, TAG_NODE, TAG_REQUEST, LaunchRequest, Market
from spottrain.cloud.gcp.settings import _BUILT_IN_GPU_FAMILIES, _GVNIC_FAMILIES, CLOUD, GcpSettings

if TYPE_CHECKING:
    pass
if TYPE_CHECKING:
    from google.cloud import compute_v1


def instance_name(request_id: str) -> str:
    """The VM name a launch request gets: ``st-`` and the request id where that is a valid
    Compute Engine name, else a shortened, sanitised form with a hash of the id.

    The name is a function of the request id alone, so a repeated launch collides with the
    first and the API refuses it (409), which is what makes launches idempotent.
    """
    if len(request_id) <= 60 and re.match(r"^[a-z0-9-]*[a-z0-9]\Z", request_id):
        return f"st-{request_id}"
    digest = hashlib.sha256(request_id.encode()).hexdigest()[:8]
    base = re.sub(r"[^a-z0-9-]", "-", request_id)[:50].strip("-")
    return f"st-{base}-{digest}" if base else f"st-{digest}"


def instance_body(
    settings: GcpSettings, catalog: Catalog, name: str, request: LaunchRequest
) -> compute_v1.Instance:
    """The instance a launch inserts: scheduling for its market, the job's labels and
    metadata (the boot script), network, boot disk, GPUs and service account."""
    from google.cloud import compute_v1

    s = settings
    offer = request.offer
    zone = offer.zone
    spot = offer.market is Market.SPOT
    scheduling = compute_v1.Scheduling(
        provisioning_model="SPOT" if spot else "STANDARD",
        # GPU VMs cannot live-migrate: a host maintenance stops them.
        on_host_maintenance="TERMINATE",
        # A spot VM must not restart itself; the controller decides where to backfill.
        automatic_restart=not spot,
    )
    if spot or s.max_run_duration_s is not None:
        scheduling.instance_termination_action = s.termination_action
    if s.max_run_duration_s is not None:
        scheduling.max_run_duration = compute_v1.Duration(seconds=s.max_run_duration_s)
    labels = request.all_tags()
    items = [
        compute_v1.Items(key=TAG_JOB, value=request.job),
        compute_v1.Items(key=TAG_NODE, value=request.node),
        compute_v1.Items(key=TAG_REQUEST, value=request.request_id),
    ]
    if request.user_data:
        items.insert(0, compute_v1.Items(key="startup-script", value=request.user_data))
    nic = compute_v1.NetworkInterface()
    network, subnetwork = network_for(settings, offer.region)
    if network:
        nic.network = network
    if subnetwork:
        nic.subnetwork = subnetwork
    if s.external_ip:
        nic.access_configs = [compute_v1.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")]
    if offer.instance_type.startswith(_GVNIC_FAMILIES):
        nic.nic_type = "GVNIC"
    body = compute_v1.Instance(
        name=name,
        machine_type=f"zones/{zone}/machineTypes/{offer.instance_type}",
        labels=labels,
        metadata=compute_v1.Metadata(items=items),
        scheduling=scheduling,
        disks=[
            compute_v1.AttachedDisk(
                boot=True,
                auto_delete=True,
                initialize_params=compute_v1.AttachedDiskInitializeParams(
                    source_image=s.source_image,
                    disk_size_gb=s.boot_disk_gb,
                    disk_type=f"zones/{zone}/diskTypes/{s.boot_disk_type}",
                    labels=labels,
                ),
            )
        ],
        network_interfaces=[nic],
    )
    accelerators = guest_accelerators(catalog, zone, offer.instance_type)
    if accelerators:
        body.guest_accelerators = accelerators
    if s.service_account:
        body.service_accounts = [
            compute_v1.ServiceAccount(email=s.service_account, scopes=list(s.scopes))
        ]
    return body


def guest_accelerators(
    catalog: Catalog, zone: str, machine_type: str
) -> list[compute_v1.AcceleratorConfig]:
    """The GPUs to attach to a machine type that does not come with its own."""
    from google.cloud import compute_v1

    if machine_type.startswith(_BUILT_IN_GPU_FAMILIES):
        return []
    itype = catalog.types(CLOUD).get(machine_type)
    if itype is None or not itype.accelerator or not itype.gpus:
        return []
    return [
        compute_v1.AcceleratorConfig(
            accelerator_type=f"zones/{zone}/acceleratorTypes/{itype.accelerator}",
            accelerator_count=itype.gpus,
        )
    ]


def network_for(settings: GcpSettings, region: str) -> tuple[str, str]:
    """The network and subnetwork of a VM in ``region``, as resource paths."""
    s = settings
    network = s.network
    if network and "/" not in network:
        network = f"global/networks/{network}"
    subnetwork = s.subnetwork
    if subnetwork and "/" not in subnetwork:
        subnetwork = f"regions/{region}/subnetworks/{subnetwork}"
    if not network and not subnetwork:
        network = "global/networks/default"
    return network, subnetwork

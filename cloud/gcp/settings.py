"""Where and how spottrain launches on Compute Engine: :class:`GcpSettings`, checked on
construction, and the constants of the gcp cloud."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass


CLOUD = "gcp"

DEFAULT_IMAGE = "projects/deeplearning-platform-release/global/images/family/common-cu124"
DEFAULT_SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)
PREEMPTED_OPERATION = "compute.instances.preempted"
AUTH_HINT = (
    "log in with `gcloud auth application-default login`, or point "
    "GOOGLE_APPLICATION_CREDENTIALS at a service-account key file; the account needs "
    "roles/compute.instanceAdmin.v1 on the project (and roles/iam.serviceAccountUser to "
    "attach a service account to the VMs)"
)

# Machine families whose GPUs come with the machine type: the API refuses guestAccelerators
# for them. Other types (N1) need their GPUs spelled out.
_BUILT_IN_GPU_FAMILIES = ("a2-", "a3-", "a4-", "g2-", "g4-")
# A3 machine types only boot with the gVNIC network interface.
_GVNIC_FAMILIES = ("a3-", "a4-")

_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?\Z")
_PROJECT_RE = re.compile(r"^([a-z0-9.-]+:)?[a-z][a-z0-9-]{4,28}[a-z0-9]\Z")
_REGION_RE = re.compile(r"^[a-z]+-[a-z]+[0-9]+\Z")
_IMAGE_RE = re.compile(
    r"^(https://(www|compute)\.googleapis\.com/compute/v1/)?"
    r"(projects/[a-z0-9.:-]+/)?global/images/(family/)?[a-z]([-a-z0-9]*[a-z0-9])?\Z"
)
_NETWORK_RE = re.compile(
    r"^(https://(www|compute)\.googleapis\.com/compute/v1/)?"
    r"((projects/[a-z0-9.:-]+/)?global/networks/)?[a-z]([-a-z0-9]*[a-z0-9])?\Z"
)
_SUBNET_PATH_RE = re.compile(
    r"^(https://(www|compute)\.googleapis\.com/compute/v1/)?"
    r"(projects/[a-z0-9.:-]+/)?regions/(?P<region>[a-z]+-[a-z]+[0-9]+)/subnetworks/"
    r"[a-z]([-a-z0-9]*[a-z0-9])?\Z"
)
_SUBNET_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?\Z")
_DISK_TYPE_RE = re.compile(r"^[a-z][a-z0-9-]*[a-z0-9]\Z")
_LABEL_VALUE_RE = re.compile(r"^[a-z0-9_-]{1,63}\Z")
_QUOTA_RE = re.compile(r"Quota '(?P<metric>[A-Za-z0-9_]+)' exceeded")
_IN_REGION_RE = re.compile(r"in region (?P<region>[a-z]+-[a-z]+[0-9]+)")

_MAX_RUN_DURATION_S = (30, 120 * 86400)  # what Compute Engine accepts
_MACHINE_TYPES_TTL_S = 3600.0


@dataclass(frozen=True)
class GcpSettings:
    """Where and how spottrain launches Compute Engine VMs.

    Attributes:
        project: the project id (``my-project``, or ``example.com:my-project``).
        regions: the regions spottrain may launch in; empty allows every region the catalog
            prices.
        source_image: the boot image, an image or image family path
            (``projects/P/global/images/family/F``).
        network: the VPC network (a name or a ``global/networks/NAME`` path); empty: the
            project's ``default`` network, unless ``subnetwork`` is set.
        subnetwork: a subnetwork name, taken as ``regions/REGION/subnetworks/NAME`` in whatever
            region a VM launches (the Terraform module creates the same name in each), or a
            full ``regions/R/subnetworks/NAME`` path, which pins ``regions`` to ``(R,)``.
        external_ip: give each VM an ephemeral public address. Off by default: a VM with one
            is reachable from the internet wherever the network's firewall allows (the
            ``default`` network opens SSH to all); without one it needs Cloud NAT to reach
            the internet and Private Google Access to reach Google APIs.
        service_account: the email of the service account the VMs run as; ``default`` is the
            project's Compute Engine default account (usually Editor on the project); empty,
            the default, attaches none (the VMs then cannot reach Cloud Storage).
        scopes: the OAuth scopes of that service account.
        boot_disk_gb: the boot disk's size.
        boot_disk_type: ``pd-balanced``, ``pd-ssd``, ...
        termination_action: what Compute Engine does to a preempted spot VM, ``STOP`` (the
            default) or ``DELETE``. With ``STOP`` the VM stays, stopped, with its labels, so
            ``list`` reports it as interrupted for as long as it exists, even to a controller
            that restarted meanwhile; the controller deletes it. A stopped VM costs only its
            boot disk. With ``DELETE`` the VM vanishes and only a zone operation records the
            preemption, which carries no labels: ``list`` can then report only the VMs this
            provider object launched or listed before they vanished.
        max_run_duration_s: stop (or delete) each VM after this many seconds, a backstop
            against VMs leaked by a dead controller; None: no limit.
        launch_wait_s: how long ``launch`` waits for the insert operation to finish, so that a
            stockout is raised as a CapacityError. 0: return as soon as the insert is accepted
            (a stockout then shows as a VM that never appears in ``list``).
        request_timeout_s: the timeout of each API call.
        verify_zones: ask the API which zones have each machine type before offering them.
    """

    project: str
    regions: tuple[str, ...] = ()
    source_image: str = DEFAULT_IMAGE
    network: str = ""
    subnetwork: str = ""
    external_ip: bool = False
    service_account: str = ""
    scopes: tuple[str, ...] = DEFAULT_SCOPES
    boot_disk_gb: int = 200
    boot_disk_type: str = "pd-balanced"
    termination_action: str = "STOP"
    max_run_duration_s: int | None = None
    launch_wait_s: float = 90.0
    request_timeout_s: float = 60.0
    verify_zones: bool = True

    def __post_init__(self) -> None:
        if not _PROJECT_RE.match(self.project):
            raise ValueError(
                f"gcp project {self.project!r} is not a project id: 6-30 lowercase letters, "
                "digits and '-', starting with a letter (see `gcloud projects list`)"
            )
        if isinstance(self.regions, str):
            raise ValueError(
                f"gcp regions must be a tuple of regions, got the string {self.regions!r}"
            )
        for region in self.regions:
            if not _REGION_RE.match(region):
                raise ValueError(
                    f"gcp region {region!r} is not a region name like 'us-central1' "
                    "(a zone like 'us-central1-a' is not a region)"
                )
        if len(set(self.regions)) != len(self.regions):
            raise ValueError(f"gcp regions {self.regions!r} name a region twice")
        if not _IMAGE_RE.match(self.source_image):
            raise ValueError(
                f"gcp source_image {self.source_image!r} is not an image path: use "
                "projects/PROJECT/global/images/NAME or projects/PROJECT/global/images/family/"
                "FAMILY"
            )
        if self.network and not _NETWORK_RE.match(self.network):
            raise ValueError(
                f"gcp network {self.network!r} is not a network name or a global/networks/NAME path"
            )
        if self.subnetwork:
            pinned = _SUBNET_PATH_RE.match(self.subnetwork)
            if pinned is None and not _SUBNET_NAME_RE.match(self.subnetwork):
                raise ValueError(
                    f"gcp subnetwork {self.subnetwork!r} is not a subnetwork name or a "
                    "regions/REGION/subnetworks/NAME path"
                )
            if pinned is not None and self.regions != (pinned["region"],):
                raise ValueError(
                    f"gcp subnetwork {self.subnetwork!r} lies in region {pinned['region']}, so "
                    f"regions must be ({pinned['region']!r},), got {self.regions!r}; or give the "
                    "subnetwork's bare name to use the same name in every region"
                )
        if self.service_account not in ("", "default") and not re.match(
            r"^[^@\s]+@[^@\s]+\Z", self.service_account
        ):
            raise ValueError(
                f"gcp service_account {self.service_account!r} is not an email, 'default' or empty"
            )
        for scope in self.scopes:
            if not scope.startswith("https://www.googleapis.com/auth/"):
                raise ValueError(
                    f"gcp scope {scope!r} is not an OAuth scope URL "
                    "(https://www.googleapis.com/auth/...)"
                )
        if not 10 <= self.boot_disk_gb <= 65536:
            raise ValueError(f"gcp boot_disk_gb must be in [10, 65536], got {self.boot_disk_gb}")
        if not _DISK_TYPE_RE.match(self.boot_disk_type):
            raise ValueError(
                f"gcp boot_disk_type {self.boot_disk_type!r} is not a disk type name like "
                "'pd-balanced'"
            )
        if self.termination_action not in ("STOP", "DELETE"):
            raise ValueError(
                f"gcp termination_action must be 'STOP' or 'DELETE', got "
                f"{self.termination_action!r}"
            )
        low, high = _MAX_RUN_DURATION_S
        if self.max_run_duration_s is not None and not low <= self.max_run_duration_s <= high:
            raise ValueError(
                f"gcp max_run_duration_s must be in [{low}, {high}] seconds (or None), got "
                f"{self.max_run_duration_s}"
            )
        if not self.launch_wait_s >= 0:
            raise ValueError(f"gcp launch_wait_s must be >= 0, got {self.launch_wait_s}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"gcp request_timeout_s must be > 0, got {self.request_timeout_s}")

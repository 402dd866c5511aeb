"""The spec's per-cloud sections: ``local``, ``aws``, ``gcp``, and ``fleet`` (a group that
Terraform provisioned)."""

from __future__ import annotations

import re
from typing import Literal, Self

from pydantic import Field, field_validator, model_validator

from .fields import (
    _KMS_KEY_RE,
    GCP_SCOPE_PREFIX,
    MAX_NODES,
    PER_NODE_HOUR,
    SECONDS_AFTER_START,
    _Model,
)


class PreemptionTraceRow(_Model):
    at_s: SECONDS_AFTER_START = Field(description="seconds after the job starts")
    node: str | None = Field(None, description="which node (default: a random one)")
    notice: bool = True


class LocalPreemptions(_Model):
    """Preemptions the local cloud injects: a rate, a trace, or both."""

    rate_per_hour: PER_NODE_HOUR = Field(0, description="per node")
    notice_fraction: float = Field(
        1.0, ge=0, le=1, description="share of preemptions that come with a notice"
    )
    trace: str | None = Field(None, description="a YAML/JSON list of {at_s, node, notice}")
    seed: int = 0


class LocalZone(_Model):
    capacity: int = Field(ge=0, le=MAX_NODES, description="nodes this zone can hold")


class LocalCloudSpec(_Model):
    """The local cloud: each VM is a group of processes on this machine."""

    zones: dict[str, LocalZone] = Field(
        default_factory=lambda: {"local-a": LocalZone(capacity=64)}, min_length=1
    )
    launch_latency_s: float = Field(0, ge=0, le=3600)
    notice_s: float = Field(30, gt=0, le=600, description="the notice window of this cloud")
    preemptions: LocalPreemptions = Field(default_factory=LocalPreemptions)

    @field_validator("zones")
    @classmethod
    def _zone_names(cls, v: dict[str, LocalZone]) -> dict[str, LocalZone]:
        for name in v:
            if not re.match(r"^[a-z0-9][a-z0-9-]{0,62}\Z", name):
                raise ValueError(f"zone {name!r}: use lowercase letters, digits and dashes")
        return v


def _endpoint(v: str | None) -> str | None:
    if v is not None and not re.match(r"^https?://[^\s/@]+/?\Z", v):
        raise ValueError(
            f"{v!r} is not an endpoint: give http(s)://HOST[:PORT] (no path, no credentials)"
        )
    return None if v is None else v.rstrip("/")


class AwsEndpoints(_Model):
    """Where the VMs reach AWS's APIs when not at their public names: VPC interface
    endpoints' own DNS names, or an S3-compatible store. The controller reads its own from
    its environment (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL_EC2``...)."""

    s3: str | None = Field(None, description="S3 (path-style addressing is used)")
    secretsmanager: str | None = Field(None, description="Secrets Manager")

    @field_validator("s3", "secretsmanager")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        return _endpoint(v)


class GcpEndpoints(_Model):
    """Where Google's APIs are when not at their public names (Private Service Connect
    endpoints): ``compute`` for the controller (Compute Engine has no environment variable
    for it), ``storage`` and ``secretmanager`` for the VMs. The controller reads its own
    Cloud Storage endpoint from ``API_ENDPOINT_OVERRIDE``."""

    compute: str | None = Field(None, description="Compute Engine's API, for the controller")
    storage: str | None = Field(None, description="Cloud Storage's JSON API, for the VMs")
    secretmanager: str | None = Field(None, description="Secret Manager's REST API, for the VMs")

    @field_validator("compute", "storage", "secretmanager")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        return _endpoint(v)


class AwsCloudSpec(_Model):
    images: dict[str, str] = Field(description="GPU AMI id per region")
    subnets: dict[str, str] = Field(default_factory=dict, description="subnet id per zone")
    security_groups: tuple[str, ...] = ()
    public_ip: bool = Field(
        False,
        description="give VMs a public IP; off, they reach Redis, PyPI and S3 through the "
        "subnet's NAT gateway or VPC endpoints",
    )
    instance_profile: str | None = None
    key_name: str | None = None
    root_volume_gb: int = Field(200, ge=8)
    root_volume_encrypted: bool = Field(True, description="encrypt the root volume")
    root_volume_kms_key: str | None = Field(
        None, description="the KMS key (id, alias/NAME or ARN); default: the account's EBS key"
    )
    placement_group: bool = Field(
        True,
        description="a cluster placement group per zone for EFA types (closer nodes, but "
        "spot capacity can be scarcer inside one)",
    )
    endpoints: AwsEndpoints = Field(default_factory=AwsEndpoints)

    @field_validator("images")
    @classmethod
    def _amis(cls, v: dict[str, str]) -> dict[str, str]:
        for region, ami in v.items():
            if not re.match(r"^ami-[0-9a-f]{8,17}\Z", ami):
                raise ValueError(f"{region}: {ami!r} is not an AMI id (ami-<hex>)")
        return v

    @field_validator("root_volume_kms_key")
    @classmethod
    def _kms_key(cls, v: str | None) -> str | None:
        if v is not None and not _KMS_KEY_RE.match(v):
            raise ValueError("not a KMS key: give its id, alias/NAME, or the key's or alias's ARN")
        return v

    @model_validator(mode="after")
    def _encryption(self) -> Self:
        if self.root_volume_kms_key and not self.root_volume_encrypted:
            raise ValueError(
                "root_volume_kms_key is set but root_volume_encrypted is false: turn "
                "encryption on or drop the key"
            )
        return self


class GcpCloudSpec(_Model):
    project: str = Field(pattern=r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")
    image: str = Field(description="boot image (projects/P/global/images/family/F)")
    network: str | None = None
    subnetwork: str | None = None
    external_ip: bool = Field(
        False,
        description="give VMs an external IP; off, they need Cloud NAT (and Private Google "
        "Access) on their subnetwork",
    )
    service_account: str | None = Field(
        None,
        description="the email of the service account the VMs run as, or 'default' for the "
        "Compute Engine default account",
    )
    scopes: tuple[str, ...] = Field(
        (GCP_SCOPE_PREFIX + "cloud-platform",),
        min_length=1,
        description="OAuth scopes of that account, full URLs or short names",
    )
    boot_disk_gb: int = Field(200, ge=10)
    endpoints: GcpEndpoints = Field(default_factory=GcpEndpoints)

    @field_validator("service_account")
    @classmethod
    def _account(cls, v: str | None) -> str | None:
        if v is not None and v != "default" and not re.match(r"^[^@\s]+@[^@\s]+\Z", v):
            raise ValueError("not a service account email (NAME@PROJECT.iam.gserviceaccount.com)")
        return v

    @field_validator("scopes")
    @classmethod
    def _scopes(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        full = []
        for scope in v:
            if not re.match(r"^[a-z][a-z0-9._-]*\Z", scope.removeprefix(GCP_SCOPE_PREFIX)):
                raise ValueError(
                    f"{scope!r} is not an OAuth scope: give a short name like cloud-platform "
                    f"or a URL like {GCP_SCOPE_PREFIX}devstorage.read_write"
                )
            full.append(scope if scope.startswith(GCP_SCOPE_PREFIX) else GCP_SCOPE_PREFIX + scope)
        return tuple(full)

    @model_validator(mode="after")
    def _named_account(self) -> Self:
        if self.service_account is None:
            raise ValueError(
                "service_account: name the service account the VMs run as (its email; the "
                "terraform/gcp module makes one), with only the roles the job needs; "
                "'default' picks the Compute Engine default account, which usually has "
                "Editor on the whole project"
            )
        return self


class FleetSpec(_Model):
    """A fleet that Terraform provisioned (``terraform/aws``, ``terraform/gcp``): the
    controller adopts its group's VMs instead of launching its own. Copy the values from the
    module's ``spottrain_fleet`` output."""

    managed_by: Literal["terraform"] = Field(description="who created the group")
    cloud: Literal["aws", "gcp"]
    group: str = Field(min_length=1, description="the Auto Scaling group or managed group")
    run_id: str = Field(
        pattern=r"^[a-z0-9][a-z0-9-]{0,62}$",
        description="the module's run_id: the job tag its VMs carry and their run in Redis",
    )
    region: str | None = Field(None, description="AWS: the group's region")
    lifecycle_hook: str | None = Field(None, description="AWS: the termination hook's name")
    project: str | None = Field(None, description="GCP: the project")
    zone: str | None = Field(None, description="GCP: the managed group's zone")

    @model_validator(mode="after")
    def _per_cloud(self) -> Self:
        need = ("region",) if self.cloud == "aws" else ("project", "zone")
        missing = [k for k in need if not getattr(self, k)]
        if missing:
            raise ValueError(
                f"a fleet on {self.cloud} needs {' and '.join(missing)} (from the module's "
                "spottrain_fleet output)"
            )
        other = ("project", "zone") if self.cloud == "aws" else ("region", "lifecycle_hook")
        extra = [k for k in other if getattr(self, k)]
        if extra:
            raise ValueError(f"{', '.join(extra)}: not a setting of a fleet on {self.cloud}")
        return self

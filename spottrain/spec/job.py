"""The whole job spec: :class:`JobSpec`, its sections together and the rules that tie them."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Self

from pydantic import Field, field_validator, model_validator

from spottrain.protocol.keys import validate_job_name
from spottrain.protocol.node_logs import default_logs_url

from .checks import _STORE_CLOUD, NOTICE_WINDOW_S, stores_readable
from .clouds import AwsCloudSpec, FleetSpec, GcpCloudSpec, LocalCloudSpec
from .code import ArchiveCode, CodeSpec
from .fields import _Model
from .packages import PackagesSpec
from .replica import replica_problem
from .sections import (
    BudgetSpec,
    CheckpointSpec,
    ControllerSpec,
    LogsSpec,
    NodesSpec,
    RedisSpec,
    ResourcesSpec,
    SpotSpec,
    TrainSpec,
    WandbSpec,
)

_JOB_KEYS = (
    "name",
    "code",
    "train",
    "nodes",
    "resources",
    "spot",
    "budget",
    "checkpoint",
    "redis",
    "wandb",
    "local",
    "aws",
    "gcp",
    "fleet",
    "controller",
    "logs",
    "packages",
)


class JobSpec(_Model):
    """A whole job. Build it with :func:`load_spec` or :func:`parse_spec`."""

    name: str
    code: CodeSpec
    train: TrainSpec
    nodes: NodesSpec
    resources: ResourcesSpec
    spot: SpotSpec = Field(default_factory=SpotSpec)
    budget: BudgetSpec
    checkpoint: CheckpointSpec
    redis: RedisSpec = Field(default_factory=RedisSpec)
    wandb: WandbSpec | None = None
    local: LocalCloudSpec | None = None
    aws: AwsCloudSpec | None = None
    gcp: GcpCloudSpec | None = None
    fleet: FleetSpec | None = None
    controller: ControllerSpec = Field(default_factory=ControllerSpec)
    logs: LogsSpec = Field(default_factory=LogsSpec)
    packages: PackagesSpec = Field(default_factory=PackagesSpec)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        try:
            return validate_job_name(v)
        except ValueError as e:
            raise ValueError(str(e).replace(f"job name {v!r} is not allowed: ", "")) from None

    @field_validator("code", mode="before")
    @classmethod
    def _one_code_kind(cls, v: Any) -> Any:
        # Say which kinds exist instead of pydantic's three-way union report.
        kinds = ("image", "git", "archive")
        if not isinstance(v, Mapping):
            raise ValueError("give one of: image, git, archive")
        present = [k for k in kinds if k in v]
        unknown = [k for k in v if k not in kinds]
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r}; give exactly one of: {', '.join(kinds)}")
        if len(present) != 1:
            raise ValueError(f"give exactly one of: {', '.join(kinds)} (got {len(present)})")
        return v

    @model_validator(mode="after")
    def _coherent(self) -> Self:
        clouds = set(self.resources.clouds)
        if "local" in clouds and len(clouds) > 1:
            raise ValueError("resources.clouds: the local cloud cannot be mixed with real clouds")
        if self.redis.url == "embedded" and clouds != {"local"}:
            raise ValueError(
                "redis.url: 'embedded' only works for the local cloud; real VMs need a Redis "
                "they can reach (redis[s]://HOST:PORT)"
            )
        if self.fleet is not None and clouds != {self.fleet.cloud}:
            raise ValueError(
                f"resources.clouds: the fleet managed by Terraform is on {self.fleet.cloud}, "
                f"so the job runs there only: set clouds: [{self.fleet.cloud}]"
            )
        for cloud in ("aws", "gcp"):
            if cloud in clouds and getattr(self, cloud) is None and self.fleet is None:
                raise ValueError(
                    f"resources.clouds lists {cloud} but the spec has no `{cloud}:` section "
                    f"(see the README's job spec reference)"
                )
        if (
            isinstance(self.code, ArchiveCode)
            and clouds != {"local"}
            and self.code.archive.store is None
            and self.checkpoint.copy_to is None
        ):
            raise ValueError(
                "code.archive: say where to upload the archive (code.archive.store or "
                "checkpoint.copy_to)"
            )
        stores_readable(self, clouds)
        if self.aws is not None:
            for region in self.aws_regions():
                if region not in self.aws.images:
                    raise ValueError(f"aws.images: no AMI for region {region}")
        return self

    @model_validator(mode="after")
    def _replica_mode(self) -> Self:
        problem = replica_problem(self)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _logs_reachable(self) -> Self:
        # Each VM holds only its own cloud's storage client and credentials (as for
        # checkpoint.copy_to): a store of another cloud would fail on every chunk.
        url = self.logs.to
        owner = next((c for p, c in _STORE_CLOUD.items() if url and url.startswith(p)), None)
        others = sorted(c for c in self.resources.clouds if c != owner and c != "local")
        if owner is not None and others:
            raise ValueError(
                f"logs.to: {owner} storage cannot be written by {', '.join(others)} VMs "
                "(each VM has only its own cloud's storage client and credentials): use a "
                "bucket of that cloud, or leave logs.to out to ship beside checkpoint.copy_to"
            )
        return self

    def launches_vms(self) -> bool:
        """Whether ``spottrain up`` launches AWS or GCP VMs itself (and so renders their boot
        scripts): not for the local cloud, nor for a Terraform fleet."""
        return self.fleet is None and any(c in ("aws", "gcp") for c in self.resources.clouds)

    def files_store(self) -> str | None:
        """Where a run puts what its VMs fetch at boot (the code archive, spottrain's wheel,
        the environment lock, the boot files): ``code.archive.store``, else
        ``<checkpoint.copy_to>/code``; None when the spec names neither."""
        if isinstance(self.code, ArchiveCode) and self.code.archive.store:
            return self.code.archive.store
        if self.checkpoint.copy_to:
            return self.checkpoint.copy_to.rstrip("/") + "/code"
        return None

    def files_store_problem(self) -> str | None:
        """Why ``spottrain up`` cannot launch this job's VMs for want of a store they read at
        boot, or None."""
        if not self.launches_vms() or self.files_store() is not None:
            return None
        return (
            "checkpoint.copy_to: a run ships spottrain's wheel, the environment lock and the "
            "boot files to object storage its VMs read at boot; set checkpoint.copy_to (s3:// "
            "or gs://; it also lets the job move zones) or code.archive.store"
        )

    def logs_url(self) -> str | None:
        """The store each node's output is shipped to: ``logs.to``, else
        ``<checkpoint.copy_to>/logs``; ``None``: nothing is shipped."""
        return self.logs.to or default_logs_url(self.checkpoint.copy_to)

    def aws_regions(self) -> list[str]:
        regions = [r for r in self.resources.regions if not _looks_gcp_region(r)]
        return regions or (list(self.aws.images) if self.aws else [])

    @property
    def notice_windows(self) -> dict[str, float]:
        """The notice window of each allowed cloud, seconds."""
        out: dict[str, float] = {}
        for cloud in self.resources.clouds:
            if cloud == "local":
                out[cloud] = (self.local or LocalCloudSpec()).notice_s
            else:
                out[cloud] = NOTICE_WINDOW_S[cloud]
        return out


def _looks_gcp_region(region: str) -> bool:
    # GCP regions have no dash-digit suffix after the direction: us-central1, europe-west4.
    return re.match(r"^[a-z]+-[a-z]+[0-9]+\Z", region) is not None

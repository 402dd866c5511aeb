"""The job spec: one YAML file that says everything about a job, validated at the edge.

Shared by the controller (which plans and launches from it) and the CLI (``spottrain
validate``); it imports no cloud SDK and no torch. Parsing is strict: an unknown key or a bad
value fails with the key's path, the line in the file, and what is allowed.

The reference for every field is the README's "Job spec" section; each model below carries
the same words in its field descriptions.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal, Self

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from spottrain.cloud.catalog import Catalog, UnknownInstanceType, UnknownRegion, bundled
from spottrain.keys import validate_job_name
from spottrain.redis_conn import DEFAULT_PASSWORD_ENV, RedisConfigError, parse_endpoint

# Seconds between a cloud's preemption notice and the VM's end (AWS: the two-minute spot
# interruption notice; GCP: the 30 s preemption notice).
NOTICE_WINDOW_S = {"aws": 120.0, "gcp": 30.0}
# What the agent keeps back from a notice window before it stops waiting for the emergency
# checkpoint (its --notice-margin), plus the commit and the leave.
DRAIN_OVERHEAD_S = 10.0

_DIGEST_IMAGE_RE = re.compile(r"^[a-z0-9][a-z0-9._/:-]*@sha256:[0-9a-f]{64}\Z")
_COMMIT_RE = re.compile(r"^([0-9a-f]{40}|[0-9a-f]{64})\Z")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMbBtT]?)\s*\Z")
_STORE_RE = re.compile(r"^(s3://|gs://|file://)[^\s]+\Z")


class SpecError(ValueError):
    """A job spec that cannot be used. ``problems`` lists one line per bad key."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"{source}: the job spec is not valid:\n{lines}")


class _Model(BaseModel):
    # Frozen: a parsed spec is a value the controller hands around, never edits.
    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=True)


class ImageCode(_Model):
    """A container image pinned by digest."""

    image: str = Field(description="image reference with @sha256:<digest>")

    @field_validator("image")
    @classmethod
    def _pinned(cls, v: str) -> str:
        if not _DIGEST_IMAGE_RE.match(v):
            raise ValueError(
                "pin the image by digest (registry/repo@sha256:<64 hex>), not by tag: a "
                "backfilled node must run exactly what the others run"
            )
        return v


class GitSource(_Model):
    repo: str = Field(description="clone URL")
    commit: str = Field(description="the full commit hash (40 or 64 hex characters)")
    subdir: str = ""

    @field_validator("commit")
    @classmethod
    def _full_hash(cls, v: str) -> str:
        if not _COMMIT_RE.match(v):
            raise ValueError(
                "give the full commit hash (40 hex characters), not a branch, tag or short "
                "hash: a backfilled node must check out exactly what the others run"
            )
        return v


class GitCode(_Model):
    """A git repository at a commit."""

    git: GitSource


class ArchiveSource(_Model):
    path: str = Field(".", description="directory to archive, relative to the spec file")
    exclude: tuple[str, ...] = Field((), description="extra glob patterns to leave out")
    store: str | None = Field(
        None,
        description="object storage for the archive (s3://, gs://, file://); default: "
        "checkpoint.copy_to + /code",
    )

    @field_validator("store")
    @classmethod
    def _store_url(cls, v: str | None) -> str | None:
        if v is not None and not _STORE_RE.match(v):
            raise ValueError("use s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or file:///DIR")
        return v


class ArchiveCode(_Model):
    """A content-addressed archive of a local directory, uploaded by ``spottrain up``."""

    archive: ArchiveSource


def _code_kind(v: Any) -> str | None:
    if isinstance(v, Mapping):
        kinds = [k for k in ("image", "git", "archive") if k in v]
        return kinds[0] if len(kinds) == 1 else None
    return next((k for k in ("image", "git", "archive") if isinstance(v, _KINDS[k])), None)


CodeSpec = Annotated[
    Annotated[ImageCode, Tag("image")]
    | Annotated[GitCode, Tag("git")]
    | Annotated[ArchiveCode, Tag("archive")],
    Discriminator(_code_kind),
]
_KINDS: dict[str, type] = {"image": ImageCode, "git": GitCode, "archive": ArchiveCode}


class TrainSpec(_Model):
    """What each worker runs (torchrun starts it once per worker)."""

    command: tuple[str, ...] = Field(description="script and arguments (a list, or a string)")
    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("command", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        if isinstance(v, str):
            try:
                return tuple(shlex.split(v))
            except ValueError as e:
                raise ValueError(f"cannot split the command like a shell would: {e}") from None
        return v

    @field_validator("command")
    @classmethod
    def _not_empty(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("give the training script and its arguments")
        return v

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if not _ENV_NAME_RE.match(name):
                raise ValueError(f"{name!r} is not an environment variable name")
            if name.startswith("SPOTTRAIN_"):
                raise ValueError(f"{name}: SPOTTRAIN_* variables are set by spottrain itself")
        return v


class NodesSpec(_Model):
    """How many VMs, and what each runs."""

    min: int = Field(ge=1, description="fewest nodes training may continue with")
    max: int = Field(ge=1, le=10_000, description="most nodes the controller runs")
    gpus: int = Field(8, ge=0, le=16, description="GPUs each node must have (0: CPU job)")
    workers: int | None = Field(
        None, ge=1, le=64, description="workers per node (default: one per GPU, or 1)"
    )

    @model_validator(mode="before")
    @classmethod
    def _scalar(cls, v: Any) -> Any:
        # `nodes: 4` means a fixed size.
        if isinstance(v, int) and not isinstance(v, bool):
            return {"min": v, "max": v}
        return v

    @model_validator(mode="after")
    def _range(self) -> Self:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        return self

    @property
    def workers_per_node(self) -> int:
        return self.workers or max(self.gpus, 1)


class Placement(StrEnum):
    SAME_ZONE = "same-zone"
    SPREAD = "spread"


class SpotPolicy(StrEnum):
    SPOT = "spot"
    SPOT_THEN_ON_DEMAND = "spot-then-on-demand"
    ON_DEMAND = "on-demand"


class ResourcesSpec(_Model):
    """Which offers the job may use. Empty lists allow everything the catalog has."""

    clouds: tuple[Literal["aws", "gcp", "local"], ...] = Field(min_length=1)
    regions: tuple[str, ...] = ()
    zones: tuple[str, ...] = ()
    instance_types: tuple[str, ...] = ()
    max_price_per_hour: float | None = Field(None, gt=0, description="USD per VM-hour")
    placement: Placement = Placement.SAME_ZONE
    move_after_minutes: float = Field(
        10,
        gt=0,
        description="minutes the job may stay below nodes.min in its zone before it moves",
    )

    @field_validator("clouds")
    @classmethod
    def _unique(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(v)) != len(v):
            raise ValueError("list each cloud once")
        return v


class SpotSpec(_Model):
    policy: SpotPolicy = SpotPolicy.SPOT
    fallback_after_minutes: float = Field(
        30, gt=0, description="minutes without spot capacity before on-demand"
    )


class BudgetSpec(_Model):
    max_usd: float = Field(gt=0, description="the job never spends more than this")


class VolumeSpec(_Model):
    path: str = Field("/mnt/spottrain/ckpt", description="checkpoint directory on every node")
    write_gbps: float = Field(
        gt=0, description="aggregate write bandwidth of the volume, GB/s (all nodes together)"
    )

    @field_validator("path")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError("give an absolute path (the same on every node)")
        return v


class CheckpointSpec(_Model):
    volume: VolumeSpec
    every_steps: int | None = Field(None, ge=1)
    every_minutes: float | None = Field(None, gt=0)
    keep: int = Field(3, ge=1, le=1000)
    size_gb: float | None = Field(None, gt=0, description="size of one checkpoint")
    params: str | None = Field(
        None, description="model size ('7B', '350M'); estimates size_gb when it is not given"
    )
    bytes_per_param: float = Field(
        12, gt=0, description="checkpoint bytes per parameter (fp32 weights + Adam: 12)"
    )
    copy_to: str | None = Field(
        None, description="object storage the checkpoints are copied to (s3://, gs://, file://)"
    )

    @field_validator("params")
    @classmethod
    def _params(cls, v: str | None) -> str | None:
        if v is not None:
            parse_count(v)
        return v

    @field_validator("copy_to")
    @classmethod
    def _store_url(cls, v: str | None) -> str | None:
        if v is not None and not _STORE_RE.match(v):
            raise ValueError("use s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or file:///DIR")
        return v

    @model_validator(mode="after")
    def _cadence(self) -> Self:
        if self.every_steps is None and self.every_minutes is None:
            raise ValueError("say how often to checkpoint: every_steps, every_minutes, or both")
        return self

    @property
    def estimated_gb(self) -> float | None:
        """The size of one checkpoint: ``size_gb``, else ``params`` x ``bytes_per_param``."""
        if self.size_gb is not None:
            return self.size_gb
        if self.params is not None:
            return parse_count(self.params) * self.bytes_per_param / 1e9
        return None


class RedisSpec(_Model):
    url: str = Field(
        "embedded", description="redis[s]://HOST:PORT, or 'embedded' (local cloud only)"
    )
    password_env: str = DEFAULT_PASSWORD_ENV
    password_file: str | None = None
    password_secret: str | None = Field(
        None,
        description="the cloud secret VMs read the password from at boot (an AWS Secrets "
        "Manager id or a GCP Secret Manager name)",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_secret(cls, v: Any) -> Any:
        if isinstance(v, Mapping) and "password" in v:
            raise ValueError(
                "do not put the Redis password in the spec: name a variable with "
                "password_env or a file with password_file"
            )
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if v == "embedded":
            return v
        try:
            parse_endpoint(v)
        except RedisConfigError as e:
            raise ValueError(str(e)) from None
        return v

    @field_validator("password_env")
    @classmethod
    def _env_name(cls, v: str) -> str:
        if not _ENV_NAME_RE.match(v):
            raise ValueError(f"{v!r} is not an environment variable name")
        return v


class WandbSpec(_Model):
    project: str = Field(min_length=1)
    entity: str | None = None
    mode: Literal["online", "offline", "disabled"] = "online"


class PreemptionTraceRow(_Model):
    at_s: float = Field(ge=0, description="seconds after the job starts")
    node: str | None = Field(None, description="which node (default: a random one)")
    notice: bool = True


class LocalPreemptions(_Model):
    """Preemptions the local cloud injects: a rate, a trace, or both."""

    rate_per_hour: float = Field(0, ge=0, description="per node")
    notice_fraction: float = Field(
        1.0, ge=0, le=1, description="share of preemptions that come with a notice"
    )
    trace: str | None = Field(None, description="a YAML/JSON list of {at_s, node, notice}")
    seed: int = 0


class LocalZone(_Model):
    capacity: int = Field(ge=0, description="nodes this zone can hold")


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


class AwsCloudSpec(_Model):
    images: dict[str, str] = Field(description="GPU AMI id per region")
    subnets: dict[str, str] = Field(default_factory=dict, description="subnet id per zone")
    security_groups: tuple[str, ...] = ()
    instance_profile: str | None = None
    key_name: str | None = None
    root_volume_gb: int = Field(200, ge=8)
    placement_group: bool = Field(
        True,
        description="a cluster placement group per zone for EFA types (closer nodes, but "
        "spot capacity can be scarcer inside one)",
    )

    @field_validator("images")
    @classmethod
    def _amis(cls, v: dict[str, str]) -> dict[str, str]:
        for region, ami in v.items():
            if not re.match(r"^ami-[0-9a-f]{8,17}\Z", ami):
                raise ValueError(f"{region}: {ami!r} is not an AMI id (ami-<hex>)")
        return v


class GcpCloudSpec(_Model):
    project: str = Field(pattern=r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")
    image: str = Field(description="boot image (projects/P/global/images/family/F)")
    network: str | None = None
    subnetwork: str | None = None
    service_account: str | None = None
    boot_disk_gb: int = Field(200, ge=10)


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


class ControllerSpec(_Model):
    """What the fleet does when its controller, or the controller's Redis, is gone."""

    orphan_timeout_minutes: float = Field(
        30,
        ge=0,
        le=7 * 24 * 60,
        description="each VM ends itself (after an emergency checkpoint) when it has seen no "
        "controller heartbeat and no training step for this long; 0: never",
    )
    redis_outage_minutes: float = Field(
        60,
        gt=0,
        le=7 * 24 * 60,
        description="the controller retries a Redis that does not answer this long, then "
        "stops (the VMs train on; `spottrain resume` drives them again)",
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
        if self.aws is not None:
            for region in self.aws_regions():
                if region not in self.aws.images:
                    raise ValueError(f"aws.images: no AMI for region {region}")
        return self

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


def parse_count(text: str) -> float:
    """Parse a parameter count such as ``7B``, ``350M``, ``1.3b`` or ``125000``.

    Raises:
        ValueError: not a number with an optional K, M, B or T suffix.
    """
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a parameter count: use e.g. 7B, 350M or 125000")
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2).lower()]
    return float(m.group(1)) * scale


def _check_catalog(spec: JobSpec, catalog: Catalog) -> list[str]:
    """Problems the catalog can see: unknown instance types, regions and zones."""
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
    return problems


def _check_files(spec: JobSpec, base_dir: Path) -> list[str]:
    """Problems with the files a spec names (relative to the spec's directory)."""
    from spottrain.cloud.local import load_trace

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


@dataclass(frozen=True)
class LoadedSpec:
    """A spec and where it came from (relative paths in it are relative to ``base_dir``)."""

    spec: JobSpec
    source: str
    base_dir: Path


def parse_spec(
    text: str, source: str = "<spec>", base_dir: Path | None = None, catalog: Catalog | None = None
) -> LoadedSpec:
    """Parse and validate a spec given as YAML text.

    Raises:
        SpecError: malformed YAML, or one line per bad key (path, line, what is allowed).
    """
    try:
        data = yaml.safe_load(text)
        node = yaml.compose(text)
    except yaml.YAMLError as e:
        raise SpecError(source, [f"not valid YAML: {e}"]) from None
    if not isinstance(data, dict):
        raise SpecError(source, ["the spec must be a YAML mapping (key: value lines)"])
    lines = dict(_key_lines(node))
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError(source, [_describe(err, lines) for err in e.errors()]) from None
    base = base_dir or Path.cwd()
    problems = _check_catalog(spec, catalog or bundled()) + _check_files(spec, base)
    if problems:
        raise SpecError(source, problems)
    return LoadedSpec(spec, source, base)


def load_spec(path: str | Path, catalog: Catalog | None = None) -> LoadedSpec:
    """Read, parse and validate the spec file at ``path``.

    Raises:
        SpecError: the file cannot be read, or the spec is not valid.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise SpecError(str(p), [f"cannot read the file: {e.strerror or e}"]) from None
    return parse_spec(text, str(p), p.resolve().parent, catalog)


def _key_lines(node: yaml.Node | None, path: tuple[str, ...] = ()) -> Iterator[tuple[str, int]]:
    """(dotted key path, 1-based line) for every key of a composed YAML document."""
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            sub = (*path, str(key.value))
            yield ".".join(sub), key.start_mark.line + 1
            yield from _key_lines(value, sub)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            sub = (*path, str(i))
            yield ".".join(sub), item.start_mark.line + 1
            yield from _key_lines(item, sub)


def _describe(err: Any, lines: dict[str, int]) -> str:
    loc = [str(p) for p in err["loc"] if not _is_union_tag(p)]
    if loc[:1] == ["code"] and len(loc) > 2 and loc[1] == loc[2]:
        del loc[1]  # the discriminator's tag repeats the key it was chosen by
    path = ".".join(loc) or "(top level)"
    line = None
    for n in range(len(loc), 0, -1):
        line = lines.get(".".join(loc[:n]))
        if line:
            break
    where = f"{path} (line {line})" if line else path
    kind = err["type"]
    if kind == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        hint = f"; allowed here: {', '.join(allowed)}" if allowed else ""
        return f"{where}: unknown key{hint}"
    if kind == "missing":
        return f"{where}: required, missing"
    msg = str(err["msg"])
    msg = msg.removeprefix("Value error, ")
    if kind in ("enum", "literal_error"):
        msg = msg.replace("Input should be", "use")
    msg = msg.replace("Input should be", "must be")
    value = err.get("input")
    # Never echo a mapping (the error is about the whole block) or anything near a secret.
    if isinstance(value, Mapping) or loc[:1] == ["redis"]:
        return f"{where}: {msg}"
    return f"{where}: {msg} (got {_short(value)})"


def _is_union_tag(part: Any) -> bool:
    # pydantic names the union member it tried ("ArchiveCode"); users never wrote that.
    return isinstance(part, str) and part[:1].isupper()


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _allowed_keys(loc: list[str]) -> list[str]:
    model: Any = JobSpec
    if loc[:1] == ["code"]:
        if len(loc) == 1:
            return list(_KINDS)
        model = _KINDS.get(loc[1])
        loc = loc[1:]
    mapping_key = False
    for part in loc:
        if mapping_key:  # a user-chosen key of a mapping (a zone name), not a field
            mapping_key = False
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = _model_of(field.annotation)
        mapping_key = getattr(field.annotation, "__origin__", None) is dict
    return list(getattr(model, "model_fields", {}))


def _model_of(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


@dataclass(frozen=True)
class WindowCheck:
    """Whether one emergency checkpoint fits a cloud's notice window."""

    cloud: str
    window_s: float
    write_s: float
    fits: bool

    def describe(self, size_gb: float, gbps: float) -> str:
        spare = self.window_s - DRAIN_OVERHEAD_S - self.write_s
        verdict = (
            f"fits, {spare:.0f} s to spare"
            if self.fits
            else f"does NOT fit: {-spare:.0f} s short; write faster (more aggregate bandwidth), "
            "shard the checkpoint smaller, or drop this cloud"
        )
        return (
            f"{self.cloud}: {size_gb:.3g} GB at {gbps:g} GB/s takes {self.write_s:.1f} s of the "
            f"{self.window_s:.0f} s notice window (less {DRAIN_OVERHEAD_S:.0f} s to commit and "
            f"leave): {verdict}"
        )


def check_notice_windows(spec: JobSpec) -> list[WindowCheck]:
    """For each allowed cloud, whether an emergency checkpoint of the job's estimated size
    fits the notice window at the volume's aggregate write bandwidth. Empty when the spec
    gives no size (``checkpoint.size_gb`` or ``checkpoint.params``)."""
    size = spec.checkpoint.estimated_gb
    if size is None:
        return []
    write_s = size / spec.checkpoint.volume.write_gbps
    return [
        WindowCheck(cloud, window, write_s, write_s + DRAIN_OVERHEAD_S <= window)
        for cloud, window in spec.notice_windows.items()
    ]


__all__ = [
    "NOTICE_WINDOW_S",
    "JobSpec",
    "LoadedSpec",
    "Placement",
    "SpecError",
    "SpotPolicy",
    "WindowCheck",
    "check_notice_windows",
    "load_spec",
    "parse_count",
    "parse_spec",
]

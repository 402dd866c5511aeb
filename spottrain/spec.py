"""The job spec: one YAML file that says everything about a job, validated at the edge.

Shared by the controller (which plans and launches from it) and the CLI (``spottrain
validate``); it imports no cloud SDK and no torch. Parsing is strict: an unknown key or a bad
value fails with the key's path, the line in the file, and what is allowed.

The reference for every field is the README's "Job spec" section; each model below carries
the same words in its field descriptions.
"""

from __future__ import annotations

import math
import os
import re
import shlex
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal, Self

import yaml
from pydantic import (
    AfterValidator,
    AllowInfNan,
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
# Before the write can start: the agent's watchers poll the metadata every 2 s (a notice is
# seen up to that late, and GCP's 30 s run from the notice, not from when it is seen), rank 0
# polls Redis for the checkpoint request every 0.2 s, and the ranks agree on the save step
# at agreement steps, about every 0.2 s of steps (at least one step, at most 64): a request
# is acted on within two agreements (agent/sdk.py; tests/unit/test_spec.py checks these
# against the agent's defaults).
NOTICE_DETECT_S = 2.0
REQUEST_POLL_S = 0.2
AGREE_INTERVAL_S = 0.2
MAX_AGREE_EVERY = 64

_DIGEST_IMAGE_RE = re.compile(r"^[a-z0-9][a-z0-9._/:-]*@sha256:[0-9a-f]{64}\Z")
_COMMIT_RE = re.compile(r"^([0-9a-f]{40}|[0-9a-f]{64})\Z")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMbBtT]?)\s*\Z")
_STORE_RE = re.compile(r"^(s3://|gs://|file://)[^\s]+\Z")
# The cloud whose VMs can read each object-store scheme (file:// is a path on the VM).
_STORE_CLOUD = {"s3://": "aws", "gs://": "gcp"}
# user:password@ (or token@) in any URL: shown as ***@ wherever an error quotes a URL.
_USERINFO_RE = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/?#@\s]*@")

# Bounds of the spec file itself (see the README's "Job spec"): a job spec is a few hundred
# values, so anything past these is a mistake or an attack on the parser (a billion-laughs
# alias bomb, a binary file, a stream that never ends), refused before it costs memory.
MAX_SPEC_BYTES = 1 << 20
MAX_SPEC_VALUES = 100_000
MAX_SPEC_DEPTH = 32
# What EC2 takes as a KMS key: a key id, an alias, or the ARN of either.
_KMS_KEY_RE = re.compile(
    r"^(arn:aws[a-z-]*:kms:[a-z0-9-]+:\d{12}:(key/[0-9a-f-]{36}|alias/[\w/-]+)"
    r"|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|alias/[\w/-]+)\Z"
)
GCP_SCOPE_PREFIX = "https://www.googleapis.com/auth/"
# A name in the cloud's secret store: an AWS Secrets Manager name or ARN, a GCP Secret
# Manager name or projects/P/secrets/NAME (also what the local cloud's secrets folder holds).
_SECRET_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9/_+=.@:-]{0,511}\Z")
# Name parts that mark an environment variable as a credential (HF_TOKEN, WANDB_API_KEY,
# AWS_SECRET_ACCESS_KEY): its value belongs in train.secret_env, not in the boot script.
_SECRET_ENV_PARTS = re.compile(
    r"(^|_)(TOKEN|PASSWORD|PASSWD|SECRET|APIKEY|API_KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIALS?)(_|\Z)"
)
SECRET_STORE_HINT = (
    "an AWS Secrets Manager id or a GCP Secret Manager name (on the local cloud: a file of "
    "that name in $SPOTTRAIN_HOME/secrets, mode 0600)"
)


def check_secret_name(v: str) -> str:
    """A secret store name, or ValueError saying what one looks like."""
    if not _SECRET_NAME_RE.match(v):
        raise ValueError(
            "a secret name is letters, digits and / _ + = . @ : - (up to 512): " + SECRET_STORE_HINT
        )
    return v


def _url_credentials(repo: str) -> str | None:
    """What kind of credential a clone URL embeds, if any (never the credential itself)."""
    scheme, sep, rest = repo.partition("://")
    if not sep:
        return None  # scp-like git@host:path: a user name for SSH, whose key is the secret
    userinfo, at, _ = rest.partition("/")[0].rpartition("@")
    if not at:
        return None
    if ":" in userinfo:
        return "a user name and password or token"
    if scheme.lower() in ("http", "https"):
        # Over HTTPS a bare user part is how tokens are usually given (https://TOKEN@host/).
        return "a token or user name"
    return None


def _check_secret_names(v: Mapping[str, str]) -> None:
    for name, secret in v.items():
        if not _ENV_NAME_RE.match(name):
            raise ValueError(f"{name!r} is not an environment variable name")
        if name.startswith("SPOTTRAIN_"):
            raise ValueError(f"{name}: SPOTTRAIN_* variables are set by spottrain itself")
        try:
            check_secret_name(secret)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None


class SpecError(ValueError):
    """A job spec that cannot be used. ``problems`` lists one line per bad key."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"{source}: the job spec is not valid:\n{lines}")


class _Model(BaseModel):
    # Frozen: a parsed spec is a value the controller hands around, never edits. No .inf or
    # .nan in any number: the planner's arithmetic would carry them into every decision.
    model_config = ConfigDict(
        extra="forbid", frozen=True, str_strip_whitespace=True, allow_inf_nan=False
    )


def _amount(high: float) -> str:
    return f"{high:,.0f}" if high == int(high) else f"{high:g}"


def within(high: float, unit: str, *, low: float = 0.0, low_allowed: bool = False) -> Any:
    """The validator of a float field that must be finite and within ``(low, high]``
    (``[low, high]`` with ``low_allowed``); use it as
    ``Annotated[float, AllowInfNan(True), within(...)]``. ``high`` is past any real setting
    of what the field measures: a larger value (``1e308``) is a typo or an attack, and would
    overflow the arithmetic that plans with it. The error states the whole range and unit."""

    def check(v: float) -> float:
        above = v >= low if low_allowed else v > low
        if not (math.isfinite(v) and above and v <= high):
            least = f"from {low:g}" if low_allowed else f"above {low:g}"
            raise ValueError(f"use a number {least} up to {_amount(high)} {unit}")
        return v

    return AfterValidator(check)


def _env_name(v: str) -> str:
    # Never quote the value: a password pasted where a variable name belongs must not be
    # printed back.
    if not _ENV_NAME_RE.match(v):
        raise ValueError(
            "not an environment variable name (letters, digits and _, not starting with a "
            "digit): give the variable's name, never its value"
        )
    return v


# The name of an environment variable.
EnvName = Annotated[str, AfterValidator(_env_name)]

# Bounded numbers. AllowInfNan(True) lets .inf reach ``within``, whose error states the range,
# instead of pydantic's bare "must be a finite number".
USD_PER_HOUR = Annotated[float, AllowInfNan(True), within(1_000, "USD per VM-hour")]
USD = Annotated[float, AllowInfNan(True), within(100_000_000, "USD")]
MINUTES = Annotated[float, AllowInfNan(True), within(10_080, "minutes (a week)")]
GB_PER_S = Annotated[float, AllowInfNan(True), within(10_000, "GB/s")]
GB = Annotated[float, AllowInfNan(True), within(1_000_000, "GB")]
BYTES_PER_PARAM = Annotated[float, AllowInfNan(True), within(64, "bytes per parameter")]
SECONDS_AFTER_START = Annotated[
    float, AllowInfNan(True), within(31_536_000, "seconds (a year)", low_allowed=True)
]
PER_NODE_HOUR = Annotated[
    float, AllowInfNan(True), within(3_600, "per node-hour", low_allowed=True)
]
# Parameters a checkpoint may hold: far past any model trained (about 2T).
MAX_PARAMS = 1e15


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
    repo: str = Field(description="clone URL (no credentials in it: use token_secret)")
    commit: str = Field(description="the full commit hash (40 or 64 hex characters)")
    subdir: str = ""
    token_secret: str | None = Field(
        None,
        description="the cloud secret holding an HTTPS access token for a private repo, "
        "fetched at boot and given to git through GIT_ASKPASS (" + SECRET_STORE_HINT + ")",
    )
    token_user: str = Field(
        "x-access-token",
        description="the user name git sends with the token (GitHub ignores it; GitLab "
        "takes any; Bitbucket wants x-token-auth)",
    )

    @field_validator("repo")
    @classmethod
    def _no_credentials(cls, v: str) -> str:
        kind = _url_credentials(v)
        if kind:
            # Never echo the URL: whatever precedes the '@' is probably a credential.
            raise ValueError(
                f"the clone URL embeds {kind} (it has '@' before the host): anyone who can "
                "describe a VM would read it in the boot script; remove it and name a secret "
                "with code.git.token_secret (" + SECRET_STORE_HINT + ")"
            )
        return v

    @field_validator("token_secret")
    @classmethod
    def _secret_name(cls, v: str | None) -> str | None:
        return None if v is None else check_secret_name(v)

    @field_validator("token_user")
    @classmethod
    def _user(cls, v: str) -> str:
        if not re.match(r"^[A-Za-z0-9._-]{1,64}\Z", v):
            raise ValueError("a git user name is letters, digits, . _ - (up to 64)")
        return v

    @model_validator(mode="after")
    def _token_over_https(self) -> Self:
        if self.token_secret and not self.repo.lower().startswith("https://"):
            raise ValueError(
                "token_secret works with an https:// clone URL only (SSH clones use the VM's "
                "SSH key)"
            )
        return self

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
    env: dict[EnvName, str] = Field(default_factory=dict)
    secret_env: dict[str, str] = Field(
        default_factory=dict,
        description="ENV_NAME: secret name; each value is read from the cloud's secret store "
        "at boot into a file only root reads, never into the boot script ("
        + SECRET_STORE_HINT
        + ")",
    )

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
            if name.startswith("SPOTTRAIN_"):
                raise ValueError(f"{name}: SPOTTRAIN_* variables are set by spottrain itself")
            if _SECRET_ENV_PARTS.search(name.upper()):
                # Never echo the value; env is rendered into the boot script in the clear.
                raise ValueError(
                    f"{name} looks like a credential: env values are written into the VMs' "
                    f"boot script, which anyone who can describe a VM reads; put the value in "
                    f"the cloud's secret store and name it in train.secret_env ({name}: "
                    "SECRET_NAME)"
                )
        return v

    @field_validator("secret_env")
    @classmethod
    def _secret_names(cls, v: dict[str, str]) -> dict[str, str]:
        _check_secret_names(v)
        return v

    @model_validator(mode="after")
    def _env_or_secret(self) -> Self:
        both = sorted(set(self.env) & set(self.secret_env))
        if both:
            raise ValueError(f"{', '.join(both)}: set in both env and secret_env; keep one")
        return self


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
    max_price_per_hour: USD_PER_HOUR | None = Field(None, description="USD per VM-hour")
    placement: Placement = Placement.SAME_ZONE
    move_after_minutes: MINUTES = Field(
        10,
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
    fallback_after_minutes: MINUTES = Field(
        30, description="minutes without spot capacity before on-demand"
    )


class BudgetSpec(_Model):
    max_usd: USD = Field(description="the job never spends more than this")


class VolumeSpec(_Model):
    path: str = Field("/mnt/spottrain/ckpt", description="checkpoint directory on every node")
    write_gbps: GB_PER_S = Field(
        description="aggregate write bandwidth of the volume, GB/s (all nodes together)"
    )

    @field_validator("path")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError("give an absolute path (the same on every node)")
        return v


class CheckpointSpec(_Model):
    volume: VolumeSpec
    every_steps: int | None = Field(None, ge=1, le=1_000_000_000)
    every_minutes: MINUTES | None = None
    keep: int = Field(3, ge=1, le=1000)
    size_gb: GB | None = Field(None, description="size of one checkpoint")
    params: str | None = Field(
        None, description="model size ('7B', '350M'); estimates size_gb when it is not given"
    )
    bytes_per_param: BYTES_PER_PARAM = Field(
        12, description="checkpoint bytes per parameter (fp32 weights + Adam: 12)"
    )
    copy_to: str | None = Field(
        None, description="object storage the checkpoints are copied to (s3://, gs://, file://)"
    )
    step_s: float | None = Field(
        None,
        gt=0,
        le=86_400,
        description="seconds one training step takes, for the notice-window check (the "
        "ranks agree on the save step within two agreements of max(0.2 s, one step) each); "
        "unknown: steps of at most 0.2 s are assumed",
    )

    @field_validator("params")
    @classmethod
    def _params(cls, v: str | None) -> str | None:
        if v is not None and parse_count(v) > MAX_PARAMS:
            raise ValueError("use a parameter count up to 1000T (1e15)")
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
    password_env: EnvName = DEFAULT_PASSWORD_ENV
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


class WandbSpec(_Model):
    project: str = Field(min_length=1)
    entity: str | None = None
    mode: Literal["online", "offline", "disabled"] = "online"


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
    capacity: int = Field(ge=0, le=10_000, description="nodes this zone can hold")


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
        self._stores_readable(clouds)
        if self.aws is not None:
            for region in self.aws_regions():
                if region not in self.aws.images:
                    raise ValueError(f"aws.images: no AMI for region {region}")
        return self

    def _stores_readable(self, clouds: Collection[str]) -> None:
        """Every allowed cloud's VMs can read the checkpoint copy and the code archive: a VM
        installs only its own cloud's storage client and holds only its own cloud's
        credentials, so a GCP VM cannot read s3:// (nor an AWS VM gs://), and a job moved
        there would not find its checkpoint or its code."""
        stores = [("checkpoint.copy_to", self.checkpoint.copy_to)]
        if isinstance(self.code, ArchiveCode):
            stores.append(("code.archive.store", self.code.archive.store))
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
    from spottrain.cloud.local.compute import load_trace

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
    """A spec, where it came from (relative paths in it are relative to ``base_dir``), and
    the exact text it was parsed from (what a run records, so it never re-reads the file)."""

    spec: JobSpec
    source: str
    base_dir: Path
    text: str = ""


# libyaml's parser when PyYAML has it (the pure-Python one is ten times slower).
_Loader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def parse_spec(
    text: str, source: str = "<spec>", base_dir: Path | None = None, catalog: Catalog | None = None
) -> LoadedSpec:
    """Parse and validate a spec given as YAML text. The text is parsed once: the values and
    the line of every key come from the same YAML node tree.

    Raises:
        SpecError: malformed YAML, too large or too deeply nested, aliases that expand past
            ``MAX_SPEC_VALUES``, or one line per bad key (path, line, what is allowed).
    """
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError(source, [_too_large(f"{len(text):,} characters")])
    data, node = _load_yaml(text, source)
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
    return LoadedSpec(spec, source, base, text)


def load_spec(path: str | Path, catalog: Catalog | None = None) -> LoadedSpec:
    """Read, parse and validate the spec file at ``path``.

    Raises:
        SpecError: the file cannot be read, is larger than ``MAX_SPEC_BYTES``, is not UTF-8
            text, or the spec is not valid.
    """
    p = Path(path)
    return parse_spec(_read_spec_file(p), str(p), p.resolve().parent, catalog)


def _read_spec_file(p: Path) -> str:
    # Read no more than the cap (plus one byte to see it is past it): the path may name a
    # huge file, a device or a pipe that never ends.
    try:
        with p.open("rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise SpecError(str(p), [f"cannot read the file: {e.strerror or e}"]) from None
    if len(raw) > MAX_SPEC_BYTES:
        # A device or a pipe has no size: say only that it went past the cap.
        what = f"{size:,} bytes" if size > MAX_SPEC_BYTES else f"over {MAX_SPEC_BYTES:,} bytes"
        raise SpecError(str(p), [_too_large(what)])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(
            str(p),
            [
                f"not a text file: byte 0x{raw[e.start]:02x} at offset {e.start} is not UTF-8; "
                "give the job spec's YAML file"
            ],
        ) from None


def _too_large(what: str) -> str:
    return (
        f"the spec is {what}; a job spec may be at most 1 MiB ({MAX_SPEC_BYTES:,} bytes): "
        "is this the right file?"
    )


def _load_yaml(text: str, source: str) -> tuple[Any, yaml.Node | None]:
    """The values of a YAML document and its node tree, from one parse. Refuses, before
    building any value, a tree too deep or one whose aliases expand past
    ``MAX_SPEC_VALUES`` values."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _check_tree(node, source)
        return loader.construct_document(node), node
    except SpecError:
        raise
    except yaml.YAMLError as e:
        raise SpecError(source, [f"not valid YAML: {_yaml_problem(e)}"]) from None
    except (ValueError, TypeError, AttributeError, OverflowError):
        # PyYAML's constructors raise these for a scalar that matches a type's pattern but
        # is not one (2020-13-45) or an explicit tag on the wrong text (!!int abc); their
        # words quote the value, so they are not repeated.
        raise SpecError(
            source,
            [
                "not valid YAML: a value cannot be read as its type: a date that does not "
                "exist (2020-13-45), or a !!int, !!float or !!timestamp tag on other text; "
                "quote the value or fix it"
            ],
        ) from None
    except RecursionError:
        raise SpecError(source, [_too_deep()]) from None
    finally:
        loader.dispose()


def _check_tree(root: yaml.Node, source: str) -> None:
    """Refuse a node tree nested deeper than ``MAX_SPEC_DEPTH``, holding an alias to a node
    that contains it, or counting more than ``MAX_SPEC_VALUES`` values once its aliases are
    expanded (the billion-laughs bomb: 500 bytes that expand to 10^9 values). The count
    visits each distinct node once, so the check costs what the file does."""
    # per node: (values it expands to, its height)
    seen: dict[int, tuple[int, int]] = {}
    open_: set[int] = set()

    def visit(node: yaml.Node, depth: int) -> tuple[int, int]:
        if depth > MAX_SPEC_DEPTH:
            raise SpecError(source, [_too_deep()])
        known = seen.get(id(node))
        if known is not None:
            if depth + known[1] > MAX_SPEC_DEPTH:
                raise SpecError(source, [_too_deep()])
            return known
        if id(node) in open_:
            raise SpecError(
                source,
                [
                    f"not valid YAML for a job spec: an alias (*name) at line {_line(node)} "
                    "refers to a node that contains it"
                ],
            )
        open_.add(id(node))
        children: list[yaml.Node] = []
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        count, height = 1, 0
        for child in children:
            n, h = visit(child, depth + 1)
            count, height = count + n, max(height, h + 1)
            if count > MAX_SPEC_VALUES:
                raise SpecError(
                    source,
                    [
                        f"the spec holds more than {MAX_SPEC_VALUES:,} values once its YAML "
                        "aliases (*name) are expanded; a job spec needs a few hundred: write the "
                        "values out, or drop the aliases"
                    ],
                )
        open_.discard(id(node))
        seen[id(node)] = (count, height)
        return count, height

    visit(root, 1)


def _line(node: yaml.Node) -> int:
    return int(node.start_mark.line) + 1


def _too_deep() -> str:
    return (
        f"the spec is nested more than {MAX_SPEC_DEPTH} levels deep; a job spec needs a few "
        "(see the README's job spec reference)"
    )


def _yaml_problem(e: yaml.YAMLError) -> str:
    # What is wrong and where, never the line itself, nor a quoted token of it (an undefined
    # alias, a tag): a password written unquoted may start with * or !.
    if isinstance(e, yaml.MarkedYAMLError):
        mark = e.problem_mark or e.context_mark
        what = ", ".join(p for p in (e.problem, e.context) if p) or "malformed"
        what = _QUOTED_RE.sub("(hidden)", what)
        if mark is None:
            return what
        return f"{what} (line {mark.line + 1}, column {mark.column + 1})"
    if isinstance(e, yaml.reader.ReaderError):
        char = e.character if isinstance(e.character, int) else ord(e.character)
        return f"{e.reason} (character #x{char:04x} at position {e.position})"
    return type(e).__name__


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
    secret = _is_secret_place(loc)
    # In a secret place, a key the user chose (a variable name) may be a pasted value too:
    # name the fields down to it and give its line.
    path = ".".join(_field_path(loc) if secret else loc) or "(top level)"
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
    if kind == "finite_number":
        msg += _range_of(loc)
    if kind in ("enum", "literal_error"):
        msg = msg.replace("Input should be", "use")
    msg = _redact_userinfo(msg.replace("Input should be", "must be"))
    value = err.get("input")
    if secret:
        # A validator may have quoted the value, or a part of it, in its words: take every
        # quotation and the value itself out of them too.
        msg = _QUOTED_RE.sub("(hidden)", msg)
        for text in sorted(_strings(value), key=len, reverse=True):
            msg = msg.replace(text, "(hidden)")
        return f"{where}: {msg}"
    # Never echo a mapping: the error is about the whole block.
    if isinstance(value, Mapping):
        return f"{where}: {msg}"
    return f"{where}: {msg} (got {_short(value)})"


# Where a value may be, or hold, a secret (a password, a token, a credential in the
# workers' environment): an error there names the key and its line, never what was written.
_SECRET_PLACES = (
    ("redis",),
    ("train", "env"),
    ("train", "secret_env"),
    ("code", "git", "repo"),
)
# A quotation in a message, long enough to hold a secret ('@' is a character, not a value).
_QUOTED_RE = re.compile(r"'[^']{4,}'|\"[^\"]{4,}\"")


def _is_secret_place(loc: list[str]) -> bool:
    return any(tuple(loc[: len(place)]) == place for place in _SECRET_PLACES)


def _field_path(loc: list[str]) -> list[str]:
    """The leading parts of ``loc`` that are fields of the spec, up to the first key the
    user chose (a variable name of ``train.env``, an unknown key)."""
    path: list[str] = []
    for part in loc:
        if part not in _allowed_keys(path):
            break
        path.append(part)
    return path


def _strings(value: Any) -> Iterator[str]:
    """The texts of a value (a mapping's values, not its keys), long enough to replace in a
    message without mangling its words."""
    if isinstance(value, str):
        if len(value) >= 4:
            yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


def _redact_userinfo(text: str) -> str:
    # A clone or storage URL may carry user:token@: keep the URL, drop the credential.
    return _USERINFO_RE.sub(r"\1***@", text)


def _is_union_tag(part: Any) -> bool:
    # pydantic names the union member it tried ("ArchiveCode"); users never wrote that. A
    # user's key (a variable name of train.env) may start with a capital too.
    return isinstance(part, str) and part in _model_names()


def _model_names() -> set[str]:
    names, todo = set(), [_Model]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def _range_of(loc: list[str]) -> str:
    """`` from LOW to HIGH``: the bounds of the number field at ``loc``, when it has both."""
    field = getattr(_model_at(loc[:-1]), "model_fields", {}).get(loc[-1]) if loc else None
    bounds = {
        k: getattr(m, k)
        for m in (field.metadata if field else [])
        for k in ("ge", "le")
        if getattr(m, k, None) is not None
    }
    if len(bounds) < 2:
        return ""
    return f" from {bounds['ge']:,} to {bounds['le']:,}"


def _short(value: Any) -> str:
    text = _redact_userinfo(repr(value))
    return text if len(text) <= 60 else text[:57] + "..."


def _allowed_keys(loc: list[str]) -> list[str]:
    if loc == ["code"]:
        return list(_KINDS)
    return list(getattr(_model_at(loc), "model_fields", {}))


def _model_at(loc: list[str]) -> Any:
    """The model of the block at ``loc``; None where it is no model (a value, a mapping)."""
    model: Any = JobSpec
    if loc[:1] == ["code"]:
        if len(loc) == 1:
            return None
        model = _KINDS.get(loc[1])
        loc = loc[1:]
    mapping_key = False
    for part in loc:
        if mapping_key:  # a user-chosen key of a mapping (a zone name), not a field
            mapping_key = False
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return None
        model = _model_of(field.annotation)
        mapping_key = getattr(field.annotation, "__origin__", None) is dict
    return model


def _model_of(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


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
        return (
            f"{self.cloud}: {size_gb:.3g} GB at {gbps:g} GB/s takes {self.write_s:.1f} s; with "
            f"{self.detect_s:.1f} s to see the notice, {self.agree_s:.1f} s to read the "
            f"request and agree on the step{step} and {DRAIN_OVERHEAD_S:.0f} s to commit and "
            f"leave, {self.needed_s:.1f} s of the {self.window_s:.0f} s notice window: {verdict}"
        )


def check_notice_windows(spec: JobSpec) -> list[WindowCheck]:
    """For each allowed cloud, whether an emergency checkpoint of the job's estimated size
    fits the notice window at the volume's aggregate write bandwidth, after the notice is
    seen and the step agreed. Empty when the spec gives no size (``checkpoint.size_gb`` or
    ``checkpoint.params``)."""
    size = spec.checkpoint.estimated_gb
    if size is None:
        return []
    write_s = size / spec.checkpoint.volume.write_gbps
    agree_s = REQUEST_POLL_S + agreement_lag_s(spec.checkpoint.step_s)
    needed = NOTICE_DETECT_S + agree_s + write_s + DRAIN_OVERHEAD_S
    known = spec.checkpoint.step_s is not None
    return [
        WindowCheck(cloud, window, write_s, needed <= window, NOTICE_DETECT_S, agree_s, known)
        for cloud, window in spec.notice_windows.items()
    ]


__all__ = [
    "AGREE_INTERVAL_S",
    "MAX_AGREE_EVERY",
    "NOTICE_DETECT_S",
    "NOTICE_WINDOW_S",
    "REQUEST_POLL_S",
    "JobSpec",
    "LoadedSpec",
    "Placement",
    "SpecError",
    "SpotPolicy",
    "WindowCheck",
    "agreement_lag_s",
    "check_notice_windows",
    "load_spec",
    "parse_count",
    "parse_spec",
]

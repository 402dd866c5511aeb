"""The spec's sections about the work: ``train`` (with its ``replica`` block), ``nodes``,
``resources``, ``spot``, ``budget``, ``checkpoint``, ``redis``, ``wandb``, ``controller``
and ``logs``."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Literal, Self

from pydantic import Field, field_validator, model_validator

from spottrain.protocol import env as env_names
from spottrain.protocol.env import ENV_PREFIX
from spottrain.redis_conn import DEFAULT_PASSWORD_ENV, RedisConfigError, parse_endpoint

from .command_secrets import find_credential
from .fields import (
    _SECRET_ENV_PARTS,
    _STORE_RE,
    BYTES_PER_PARAM,
    GB,
    GB_PER_S,
    MAX_NODES,
    MAX_PARAMS,
    MINUTES,
    SECRET_STORE_HINT,
    USD,
    USD_PER_HOUR,
    EnvName,
    _check_secret_names,
    _Model,
    parse_count,
)
from .heartbeat import HEARTBEAT_AUTO, HEARTBEAT_DOC, check_heartbeat_timeout
from .relay import RELAY_GROUP_AUTO, RELAY_GROUP_DOC, check_relay_group


class FaultTolerance(StrEnum):
    ELASTIC = "elastic"
    REPLICA = "replica"


class Integration(StrEnum):
    """How the training script meets spottrain (``train.integration``; the agent's and the
    workers' ``SPOTTRAIN_INTEGRATION``)."""

    # spottrain's TrainSession: it answers the agent's checkpoint request through Redis.
    SDK = "sdk"
    # The Hugging Face Trainer with spottrain's callback; Accelerate with spottrain's helper;
    # Lightning with spottrain's callback: each answers the request as the SDK does, in the
    # framework's own checkpoint format.
    HF = "hf"
    ACCELERATE = "accelerate"
    LIGHTNING = "lightning"
    # A torchrun script that imports nothing of ours: nobody answers a request, so on a
    # notice the agent sends SIGTERM at once and the script saves on its own.
    PLAIN = "plain"


INTEGRATION_DOC = (
    "how the script meets spottrain: sdk (the default: it trains with spottrain's "
    "TrainSession), hf (a Hugging Face Trainer with spottrain's callback), accelerate "
    "(Accelerate with spottrain's helper), lightning (PyTorch Lightning with spottrain's "
    "callback): each of these saves on the agent's checkpoint request; plain (a torchrun "
    "script that imports nothing of spottrain's: on a notice its workers get SIGTERM at once "
    "and have the whole window less the agent's notice margin, 5 s, to save on their own)"
)

# Why replica mode runs only the SDK, by integration (the refusal's reason).
_REPLICA_ONLY_SDK = {
    Integration.HF: "the Hugging Face Trainer owns its training loop and process group",
    Integration.ACCELERATE: "Accelerate owns its training loop and process group",
    Integration.LIGHTNING: "Lightning owns its training loop and process group",
    Integration.PLAIN: "a plain script has no step boundary torchft can use",
}


class QuorumKind(StrEnum):
    """Where replica mode's per-step quorum forms (the agent's ``SPOTTRAIN_QUORUM``)."""

    # In the run's Redis (spottrain.quorum): persisted, with an explicit leave; no extra
    # process to run or reach.
    REDIS = "redis"
    # torchft's own lighthouse, run and supervised by the controller (kept for comparison).
    LIGHTHOUSE = "lighthouse"


# train.replica.join_timeout_ms's default: scaled with the fleet (spottrain.spec.replica).
JOIN_TIMEOUT_AUTO: Literal["auto"] = "auto"
# A join timeout at or past the workers' 120 s quorum timeout would fail every changed round.
JOIN_TIMEOUT_MS_RANGE = (50, 60_000)


class ReplicaSpec(_Model):
    """How replica mode groups the nodes: each replica is ``nodes_per_replica`` nodes that
    hold a whole copy of the training state; replicas come and go without stopping the
    others."""

    nodes_per_replica: int = Field(
        1,
        ge=1,
        le=MAX_NODES,
        description="nodes in one replica (it shards the model inside, replicates across)",
    )
    min_replicas: int = Field(
        1,
        ge=1,
        le=MAX_NODES,
        description="fewest whole replicas a step may commit with (the quorum's floor)",
    )
    quorum: QuorumKind = Field(
        QuorumKind.REDIS,
        description="where each step's quorum forms: redis (in the run's Redis, the default) "
        "or lighthouse (torchft's lighthouse, which the controller runs)",
    )
    heartbeat_timeout_s: float | Literal["auto"] = Field(HEARTBEAT_AUTO, description=HEARTBEAT_DOC)
    _heartbeat = field_validator("heartbeat_timeout_s", mode="before")(check_heartbeat_timeout)
    wait_replicas: int = Field(
        0,
        ge=0,
        le=16,
        description="with quorum: redis, the Redis replicas that must hold each formed round "
        "before it is used (Redis WAIT; 0: none): set it with a replicated Redis and "
        "min-replicas-to-write so a failover never hands out a quorum id twice",
    )
    join_timeout_ms: int | Literal["auto"] = Field(
        JOIN_TIMEOUT_AUTO,
        description="with quorum: redis, milliseconds a changed quorum waits for late "
        "replicas before it forms without them; auto (the default) grows with the fleet: "
        "max(250, 2 x replicas x 0.054) ms, Redis's time to serve one round",
    )

    @field_validator("join_timeout_ms", mode="before")
    @classmethod
    def _join_timeout(cls, v: Any) -> Any:
        lo, hi = JOIN_TIMEOUT_MS_RANGE
        if v == JOIN_TIMEOUT_AUTO:
            return v
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"use auto or a whole number of milliseconds from {lo} to {hi}")
        if not lo <= v <= hi:
            raise ValueError(
                f"must be from {lo} to {hi} ms (or auto): below {lo} ms every changed round "
                "forms before its replicas are served; past 60 s it nears the workers' 120 s "
                "quorum timeout"
            )
        return v

    relay_group_size: int | Literal["auto"] = Field(RELAY_GROUP_AUTO, description=RELAY_GROUP_DOC)
    _relay_group = field_validator("relay_group_size", mode="before")(check_relay_group)


class TrainSpec(_Model):
    """What each worker runs (torchrun starts it once per worker)."""

    command: tuple[str, ...] = Field(description="script and arguments (a list, or a string)")
    fault_tolerance: FaultTolerance = Field(
        FaultTolerance.ELASTIC,
        description="elastic: every membership change restarts every worker from the last "
        "checkpoint; replica: replicas leave and join while the others keep training",
    )
    integration: Integration = Field(Integration.SDK, description=INTEGRATION_DOC)
    replica: ReplicaSpec = Field(
        default_factory=ReplicaSpec, description="replica mode's grouping (replica mode only)"
    )
    env: dict[EnvName, str] = Field(default_factory=dict)
    secret_env: dict[str, str] = Field(
        default_factory=dict,
        description="ENV_NAME: secret name; each value is read from the cloud's secret store "
        "at boot into a file only root reads, never into the boot script ("
        + SECRET_STORE_HINT
        + ")",
    )
    not_secrets: tuple[str, ...] = Field(
        (),
        description="arguments of command, or option names (--eval-token-budget), that look "
        "like a credential and are not one",
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
            if name.startswith(ENV_PREFIX):
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
    def _no_credential_in_command(self) -> Self:
        where = find_credential(self.command, self.not_secrets)
        if where is not None:
            # Never echo it: the command travels in the boot script, Redis and process lists.
            raise ValueError(
                f"command: {where} looks like a credential, and the command is written into "
                "every VM's boot script and the run's events: put the value in the cloud's "
                "secret store, name it in train.secret_env (e.g. HF_TOKEN: SECRET_NAME) and "
                "have the script read the variable; if it is no credential, list the option "
                "or the argument in train.not_secrets"
            )
        return self

    @model_validator(mode="after")
    def _env_or_secret(self) -> Self:
        both = sorted(set(self.env) & set(self.secret_env))
        if both:
            raise ValueError(f"{', '.join(both)}: set in both env and secret_env; keep one")
        return self

    @model_validator(mode="after")
    def _replica_runs_the_sdk(self) -> Self:
        if self.fault_tolerance is FaultTolerance.REPLICA and self.integration in _REPLICA_ONLY_SDK:
            raise ValueError(
                f"integration {self.integration.value} cannot run in replica mode: replica "
                "mode drives torchft's manager and its DDP/HSDP wrappers from spottrain's "
                f"TrainSession, and {_REPLICA_ONLY_SDK[self.integration]}: use "
                "fault_tolerance: elastic, or train with the SDK (integration: sdk)"
            )
        return self

    def integration_env(self) -> dict[str, str]:
        """The agent's ``SPOTTRAIN_INTEGRATION`` (for the boot script and the local cloud's
        boot); empty for ``sdk``, the agent's default, so an SDK job's boot is what it was
        before the key existed."""
        if self.integration is Integration.SDK:
            return {}
        return {env_names.ENV_INTEGRATION: self.integration.value}

    @model_validator(mode="after")
    def _replica_only_in_replica_mode(self) -> Self:
        # A replica block that would change nothing is a spec that says one thing and runs
        # another: the job would train elastic while its author expects replicas.
        if self.fault_tolerance is FaultTolerance.ELASTIC and self.replica != ReplicaSpec():
            r = self.replica
            quorum = f", quorum {r.quorum}" if r.quorum is not QuorumKind.REDIS else ""
            quorum += f", wait_replicas {r.wait_replicas}" if r.wait_replicas else ""
            quorum += (
                f", heartbeat_timeout_s {r.heartbeat_timeout_s:g}"
                if r.heartbeat_timeout_s != HEARTBEAT_AUTO
                else ""
            )
            quorum += (
                f", join_timeout_ms {r.join_timeout_ms}"
                if r.join_timeout_ms != JOIN_TIMEOUT_AUTO
                else ""
            )
            quorum += (
                f", relay_group_size {r.relay_group_size}"
                if r.relay_group_size != RELAY_GROUP_AUTO
                else ""
            )
            raise ValueError(
                f"replica (nodes_per_replica {r.nodes_per_replica}, min_replicas "
                f"{r.min_replicas}{quorum}) applies only in replica mode: set fault_tolerance: "
                "replica, or drop the replica block"
            )
        return self


class NodesSpec(_Model):
    """How many VMs, and what each runs."""

    min: int = Field(ge=1, description="fewest nodes training may continue with")
    max: int = Field(ge=1, le=MAX_NODES, description="most nodes the controller runs")
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


class ControllerSpec(_Model):
    """What the fleet does when its controller, or the controller's Redis, is gone, and when
    the controller gives up on VMs that cannot start."""

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
    max_failed_launches: int = Field(
        3,
        ge=1,
        le=1000,
        description="the run stops with an error (its VMs ended, `spottrain up` exits 1 "
        "with the reason) when this many VMs in a row fail before training for the same "
        "reason (their boot failed, their agent failed, or they were not healthy within the "
        "boot timeout) while no node trains; a different reason starts a new count",
    )


# What a node's log shipping defaults to (the agent's flags default to the same numbers).
DEFAULT_LOG_CHUNK_S = 15.0
DEFAULT_LOG_CHUNK_MB = 4.0
DEFAULT_LOG_MAX_MB = 1024.0
DEFAULT_LOG_BACKLOG_MB = 64.0
MIN_LOG_CHUNK_MB = 0.01
MAX_LOG_CHUNK_MB = 256.0
_LOG_TO_FORMS = "s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, file:///DIR or an absolute path"


class LogsSpec(_Model):
    """Where each node's output (agent, torchrun, workers) is shipped, in gzip chunks, so it
    outlives the VM; ``spottrain logs --node N`` reads it back. MB here is 10^6 bytes."""

    to: str | None = Field(
        None,
        description="the store the chunks go to (" + _LOG_TO_FORMS + "); default: "
        "<checkpoint.copy_to>/logs, and no shipping when neither is set",
    )
    chunk_seconds: float = Field(
        DEFAULT_LOG_CHUNK_S,
        ge=1,
        le=3600,
        description="a chunk is cut at most this long after its first line: the output a "
        "VM killed without notice can lose, and one PUT per node per this many seconds",
    )
    chunk_mb: float = Field(
        DEFAULT_LOG_CHUNK_MB,
        ge=MIN_LOG_CHUNK_MB,
        le=MAX_LOG_CHUNK_MB,
        description="uncompressed bytes that cut a chunk sooner",
    )
    max_mb: float = Field(
        DEFAULT_LOG_MAX_MB,
        ge=1,
        le=1_000_000,
        description="most compressed bytes one VM ships; past it a last chunk says shipping "
        "stopped (the VM's own file keeps its newest output)",
    )
    backlog_mb: float = Field(
        DEFAULT_LOG_BACKLOG_MB,
        ge=0.01,
        le=4096,
        description="unshipped bytes a VM holds while uploads fall behind; past it the "
        "oldest are dropped, and the next chunk says how many",
    )

    @field_validator("to")
    @classmethod
    def _store_url(cls, v: str | None) -> str | None:
        if v is not None and not (_STORE_RE.match(v) or (v.startswith("/") and " " not in v)):
            raise ValueError(f"use {_LOG_TO_FORMS}")
        return v

    @model_validator(mode="after")
    def _backlog_holds_a_chunk(self) -> Self:
        if self.backlog_mb < self.chunk_mb:
            raise ValueError(
                f"backlog_mb ({self.backlog_mb:g}) must hold at least one chunk "
                f"(chunk_mb {self.chunk_mb:g}): raise backlog_mb or lower chunk_mb"
            )
        return self

    def agent_env(self) -> dict[str, str]:
        """The agent's settings that differ from its defaults: an agent given none ships to
        ``<SPOTTRAIN_CKPT_COPY_TO>/logs`` with the defaults above, so a fleet whose boot
        script predates ``logs:`` (or a Terraform template) ships the same way."""
        env = {env_names.ENV_LOGS_TO: self.to} if self.to else {}
        for name, value, default in (
            (env_names.ENV_LOGS_CHUNK_S, self.chunk_seconds, DEFAULT_LOG_CHUNK_S),
            (env_names.ENV_LOGS_CHUNK_MB, self.chunk_mb, DEFAULT_LOG_CHUNK_MB),
            (env_names.ENV_LOGS_MAX_MB, self.max_mb, DEFAULT_LOG_MAX_MB),
            (env_names.ENV_LOGS_BACKLOG_MB, self.backlog_mb, DEFAULT_LOG_BACKLOG_MB),
        ):
            if value != default:
                env[name] = f"{value:g}"
        return env

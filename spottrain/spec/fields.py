"""The job spec's building blocks: the base model, bounded numbers, names and their
patterns, and the checks of a secret name and of a clone URL's credentials."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import AfterValidator, AllowInfNan, BaseModel, ConfigDict, field_validator

from spottrain.protocol.env import ENV_PREFIX
from spottrain.safetext import LINE_CONTROLS

_DIGEST_IMAGE_RE = re.compile(r"^[a-z0-9][a-z0-9._/:-]*@sha256:[0-9a-f]{64}\Z")
_COMMIT_RE = re.compile(r"^([0-9a-f]{40}|[0-9a-f]{64})\Z")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMbBtT]?)\s*\Z")
_STORE_RE = re.compile(r"^(s3://|gs://|file://)[^\s]+\Z")


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
        if name.startswith(ENV_PREFIX):
            raise ValueError(f"{name}: SPOTTRAIN_* variables are set by spottrain itself")
        try:
            check_secret_name(secret)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None


def _control_in(v: Any) -> str | None:
    """The first control character in a field's value (its strings, its items, a mapping's
    keys and values; a nested section checks its own)."""
    if isinstance(v, str):
        m = LINE_CONTROLS.search(v)
        return m.group() if m else None
    if isinstance(v, tuple | list):
        return next((c for c in map(_control_in, v) if c), None)
    if isinstance(v, Mapping):
        return next((c for c in map(_control_in, [*v.keys(), *v.values()]) if c), None)
    return None


class _Model(BaseModel):
    # Frozen: a parsed spec is a value the controller hands around, never edits. No .inf or
    # .nan in any number: the planner's arithmetic would carry them into every decision.
    model_config = ConfigDict(
        extra="forbid", frozen=True, str_strip_whitespace=True, allow_inf_nan=False
    )

    @field_validator("*")
    @classmethod
    def _one_line(cls, v: Any) -> Any:
        # A spec's text travels into the VMs' boot script, environment files and systemd
        # unit, none of which carries a newline, a CR or a NUL exactly (a value could end a
        # line there and start another); no field needs a control character.
        c = _control_in(v)
        if c is not None:
            # No quotes in the words: an error in a secret place hides every quotation.
            name = {"\n": "a newline", "\r": "a carriage return", "\0": "a NUL"}.get(c)
            raise ValueError(
                f"holds {name or f'the control character U+{ord(c):04X}'}: write it on one "
                "line without control characters (a VM boot script, environment file or "
                "unit carries none)"
            )
        return v


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
# The most nodes (VMs) any count in a spec may name: nodes.max, a replica's nodes, the
# quorum's floor, a local zone. The design's scale is 12,500 VMs of 8 GPUs (100,000 GPUs);
# this cap lets the same 100,000 GPUs run one per VM, and only catches typos (a stray zero):
# any fleet one run's Redis could serve is below it (at ~4 Redis connections per VM, 100,000
# VMs already need 400,000 clients, six times ElastiCache's maxclients).
MAX_NODES = 100_000


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

"""The one interface every cloud provider implements, and the errors it may raise.

The contract, which the provider contract suite
(``tests/integration/cloud/test_provider_contract.py``) checks for every cloud:

- **Eventually consistent.** ``list`` may lag ``launch`` and ``terminate`` by a few seconds
  (AWS's describe calls do); callers reconcile on their next pass and never assume a single
  call's view is complete.
- **Asynchronous.** ``launch`` returns once the cloud accepted the request, not when the VM
  has booted; ``terminate`` returns once the cloud accepted the deletion.
- **Idempotent by request id.** A ``launch`` repeated with the same ``request_id`` (after a
  timeout, or by a controller restarted between the call and recording its answer) returns
  the instance the first call created and creates nothing new. ``terminate`` of an instance
  that is already gone, or unknown, is not an error.
- **Owned by tags.** Every VM carries the job (run id), the node name and the request id as
  tags (AWS) or labels (GCP); ``list`` finds a job's VMs by those alone, so a controller that
  lost its memory adopts what exists.
- **Consoles are best effort.** ``console_output`` returns the newest part of a VM's
  console (its boot output), up to :data:`CONSOLE_TAIL_BYTES`; it may lag what the VM
  printed by minutes on a real cloud, and is ``""`` while the cloud has none yet and for a
  VM it does not know (gone, or never there). Callers read it for diagnosis only.
- **Typed errors.** Every refusal from a cloud is raised as one of the few
  :class:`ProviderError` subclasses below, carrying the data a planner needs to decide
  (block that zone for a while, give up, retry). Nothing else escapes a provider, except
  ``ValueError`` for a request the caller built wrongly (an offer of another cloud).

Cloud SDKs are imported inside each provider's module, so the core imports without them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, runtime_checkable

# The three tags (AWS) or labels (GCP) that make a VM ours. GCP label keys allow only
# lowercase letters, digits, '-' and '_', so these are written that way for every cloud.
TAG_JOB = "spottrain-job"
TAG_NODE = "spottrain-node"
TAG_REQUEST = "spottrain-request"

CLOUDS = ("aws", "gcp", "local")

# Request ids become tags, labels and (on AWS) ClientTokens, so they obey the strictest rule
# of the three: GCP label values, at most 63 lowercase letters, digits, '-' and '_'.
_REQUEST_ID_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}\Z")
_LABEL_VALUE_RE = re.compile(r"^[a-z0-9_-]{0,63}\Z")

# The most of a VM's console ``console_output`` returns: its end (AWS keeps the newest 64 KB
# of output for ``GetConsoleOutput``; GCE's serial port keeps 1 MB).
CONSOLE_TAIL_BYTES = 64 * 1024


class Market(StrEnum):
    """How a VM is bought."""

    SPOT = "spot"
    ON_DEMAND = "on-demand"


class InstanceState(StrEnum):
    """A VM's state as spottrain sees it, the same words for every cloud."""

    PENDING = "pending"  # accepted, not running yet (booting, provisioning, staging)
    RUNNING = "running"
    STOPPING = "stopping"  # shutting down or being deleted
    TERMINATED = "terminated"  # gone, but the cloud still reports it

    @property
    def alive(self) -> bool:
        """Whether the VM counts towards the fleet (it runs, or soon will)."""
        return self in (InstanceState.PENDING, InstanceState.RUNNING)


@dataclass(frozen=True)
class Offer:
    """One way to buy one VM: where, what, which market, and at what price and risk.

    Attributes:
        cloud: ``aws``, ``gcp`` or ``local``.
        region: the cloud's region (``us-east-1``, ``us-central1``, ``local``).
        zone: the availability zone inside ``region``.
        instance_type: the cloud's name for the VM shape (``p5.48xlarge``, ``a3-highgpu-8g``).
        gpus: GPUs per VM.
        gpu_type: the GPU model (``H100``), so placement can keep a job on one GPU type.
        market: spot or on-demand.
        price_per_hour: USD per VM-hour.
        interruption_risk: the expected share of VMs interrupted within a month, the measure
            AWS's Spot Instance Advisor publishes (0.05 means 5%); 0 for on-demand. It comes
            from the bundled table (see :mod:`spottrain.catalog`) and the controller
            refines it with the preemptions it observes.
        network: ``efa``, ``gpudirect`` or ``""``: the fast fabric the type has, if any.
    """

    cloud: str
    region: str
    zone: str
    instance_type: str
    gpus: int
    gpu_type: str
    market: Market
    price_per_hour: float
    interruption_risk: float
    network: str = ""

    def __post_init__(self) -> None:
        if self.cloud not in CLOUDS:
            raise ValueError(f"offer cloud {self.cloud!r} is not one of {', '.join(CLOUDS)}")
        if self.gpus < 0:
            raise ValueError(f"offer gpus must be >= 0, got {self.gpus}")
        if not self.price_per_hour >= 0:
            raise ValueError(f"offer price_per_hour must be >= 0, got {self.price_per_hour}")
        if not 0 <= self.interruption_risk <= 1:
            raise ValueError(
                f"offer interruption_risk is a share in [0, 1], got {self.interruption_risk}"
            )

    @property
    def key(self) -> tuple[str, str, str, str]:
        """What a capacity error blocks: (cloud, zone, instance type, market)."""
        return (self.cloud, self.zone, self.instance_type, self.market.value)


@dataclass(frozen=True)
class OfferQuery:
    """Which offers a job allows. An empty tuple allows anything."""

    regions: tuple[str, ...] = ()
    zones: tuple[str, ...] = ()
    instance_types: tuple[str, ...] = ()
    markets: tuple[Market, ...] = (Market.SPOT, Market.ON_DEMAND)
    max_price_per_hour: float | None = None
    min_gpus: int = 0

    def allows(self, offer: Offer) -> bool:
        """Whether ``offer`` passes every filter of this query."""
        return (
            (not self.regions or offer.region in self.regions)
            and (not self.zones or offer.zone in self.zones)
            and (not self.instance_types or offer.instance_type in self.instance_types)
            and offer.market in self.markets
            and (self.max_price_per_hour is None or offer.price_per_hour <= self.max_price_per_hour)
            and offer.gpus >= self.min_gpus
        )


def region_of_zone(cloud: str, zone: str) -> str:
    """The region a zone is in: ``us-central1-a`` -> ``us-central1`` on GCP, ``us-east-1a``
    -> ``us-east-1`` on AWS (a zone not ending in a letter is returned as it is)."""
    if cloud == "gcp":
        return zone.rsplit("-", 1)[0]
    return zone[:-1] if zone and zone[-1].isalpha() else zone


def validate_request_id(request_id: str) -> str:
    """Check a launch request id (it becomes a tag, a label and an AWS ClientToken).

    Raises:
        ValueError: not 1-63 lowercase letters, digits, '-' or '_' starting with a letter
            or digit.
    """
    if not _REQUEST_ID_RE.match(request_id):
        raise ValueError(
            f"request id {request_id!r} is not allowed: use 1-63 lowercase letters, digits, "
            "'-' and '_', starting with a letter or digit (it becomes a cloud label)"
        )
    return request_id


@dataclass(frozen=True)
class LaunchRequest:
    """Launch one VM for one node of a job.

    Attributes:
        request_id: the idempotency key; the same id never creates a second VM.
        job: the run id the VM belongs to (its ``spottrain-job`` tag).
        node: the node name the VM will run (its ``spottrain-node`` tag and hostname hint).
        offer: where and what to launch.
        user_data: the boot script (AWS user data, GCP ``startup-script``, the local cloud's
            command line as JSON); rendered by the controller's boot scripts.
        tags: extra tags or labels (values must be valid GCP label values).
    """

    request_id: str
    job: str
    node: str
    offer: Offer
    user_data: str = ""
    tags: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_request_id(self.request_id)
        for what, value in (("job", self.job), ("node", self.node)):
            if not value or not _LABEL_VALUE_RE.match(value):
                raise ValueError(
                    f"launch {what} {value!r} is not allowed: use 1-63 lowercase letters, "
                    "digits, '-' and '_' (it becomes a cloud label)"
                )
        for k, v in self.tags.items():
            if not _LABEL_VALUE_RE.match(k) or not k or not _LABEL_VALUE_RE.match(v):
                raise ValueError(
                    f"tag {k}={v!r} is not allowed: keys and values use lowercase letters, "
                    "digits, '-' and '_' (at most 63), as GCP labels require"
                )

    def all_tags(self) -> dict[str, str]:
        """The tags the VM carries: ours plus the request's extras."""
        return {
            **self.tags,
            TAG_JOB: self.job,
            TAG_NODE: self.node,
            TAG_REQUEST: self.request_id,
        }


@dataclass(frozen=True)
class Instance:
    """A VM as ``list`` reports it.

    Attributes:
        id: the cloud's id (``i-0abc...``, the GCP instance name, the local VM's name).
        state: see :class:`InstanceState`.
        interrupted: the cloud took the VM back (a spot interruption or preemption), as
            opposed to our own ``terminate`` or a crash.
        state_reason: the cloud's words for the last state change, if it gives any.
        launched_at: unix seconds when the cloud accepted the launch, if known.
        address: the private address peers reach the VM at, once it has one.
    """

    id: str
    cloud: str
    region: str
    zone: str
    instance_type: str
    market: Market
    state: InstanceState
    job: str
    node: str
    request_id: str
    interrupted: bool = False
    state_reason: str = ""
    launched_at: float | None = None
    address: str = ""


class ProviderError(Exception):
    """A cloud refused or failed a call. The subclass says what the caller can do."""

    retryable = False

    def __init__(self, cloud: str, message: str) -> None:
        super().__init__(f"{cloud}: {message}")
        self.cloud = cloud
        self.message = message


class CapacityError(ProviderError):
    """No capacity for this type in this zone and market right now: block it for a while
    and try another offer."""

    retryable = True

    def __init__(
        self, cloud: str, zone: str, instance_type: str, market: Market, message: str
    ) -> None:
        super().__init__(cloud, f"no {market} capacity for {instance_type} in {zone}: {message}")
        self.zone = zone
        self.instance_type = instance_type
        self.market = market


class QuotaError(ProviderError):
    """The account's quota (vCPUs, GPUs, spot requests) for this region is used up: nothing
    more launches there until a human raises it."""

    def __init__(self, cloud: str, region: str, message: str) -> None:
        super().__init__(cloud, f"quota exhausted in {region}: {message}")
        self.region = region


class AuthError(ProviderError):
    """Missing or rejected credentials, or no permission for the call."""


class BadRequestError(ProviderError):
    """The cloud rejected the request as malformed or invalid (an unknown instance type, an
    image that does not exist, a setting the type does not allow). Retrying cannot help."""


class TransientError(ProviderError):
    """A timeout, throttling or a server-side error: the same call may succeed later."""

    retryable = True


@runtime_checkable
class Provider(Protocol):
    """One cloud. Implementations: :class:`spottrain.cloud.aws.AwsProvider`,
    :class:`spottrain.cloud.gcp.GcpProvider`, :class:`spottrain.cloud.local.compute.LocalProvider`.
    """

    cloud: str

    def offers(self, query: OfferQuery) -> list[Offer]:
        """The offers this cloud has that ``query`` allows, cheapest first.

        Raises:
            ProviderError: the cloud could not be asked (auth, transient).
        """
        ...

    def launch(self, request: LaunchRequest) -> Instance:
        """Launch one VM, or return the VM an earlier call with this request id launched.

        Raises:
            CapacityError, QuotaError, AuthError, BadRequestError, TransientError.
        """
        ...

    def list(self, job: str) -> list[Instance]:
        """Every VM tagged with run id ``job`` that the cloud still reports, terminated ones
        included (so interruptions can be seen).

        Raises:
            ProviderError: the cloud could not be asked.
        """
        ...

    def terminate(self, instance_ids: Sequence[str]) -> None:
        """Ask the cloud to delete these VMs. Ids already gone or unknown are ignored.

        Raises:
            ProviderError: the cloud refused (auth, transient).
        """
        ...

    def console_output(self, instance_id: str) -> str:
        """The end of a VM's console output (what its boot printed), at most
        :data:`CONSOLE_TAIL_BYTES` of it, as text (undecodable bytes replaced).

        Best effort: a real cloud may show it minutes late (AWS updates it now and then,
        GCE's serial port as it is written); ``""`` when the cloud has none yet, and for an
        instance it does not know (gone, or never there). The text is the VM's: untrusted,
        with whatever control characters it printed.

        Raises:
            ProviderError: the cloud refused (auth, transient).
        """
        ...


def console_tail(raw: bytes) -> str:
    """The end of a console's bytes as ``console_output`` returns it: at most
    :data:`CONSOLE_TAIL_BYTES`, decoded as UTF-8 with undecodable bytes replaced."""
    return raw[-CONSOLE_TAIL_BYTES:].decode("utf-8", errors="replace")


def sort_offers(offers: Sequence[Offer]) -> list[Offer]:
    """Cheapest first; ties broken by risk, then by name, so the order is stable."""
    return sorted(
        offers,
        key=lambda o: (o.price_per_hour, o.interruption_risk, o.cloud, o.zone, o.instance_type),
    )

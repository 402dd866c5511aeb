"""AWS: spot and on-demand GPU VMs on EC2 through boto3.

The module imports without boto3; constructing :class:`AwsProvider` without it raises an
``ImportError`` that says ``pip install 'spottrain[aws]'``.

Choices that hold for every call (the contract itself is in :mod:`spottrain.cloud.base`):

* **Launches are idempotent twice over.** ``launch`` first looks for an instance tagged with
  the request id (in any state: a terminated one means this request already launched and
  lost its VM, and the controller uses a new request id for a replacement), and passes the
  request id as ``ClientToken`` so that EC2 itself returns the first instance when our
  look-up ran before the instance became visible (describe calls lag).
* **Spot is bought one-time, terminate on interruption,** through ``run_instances`` with
  market options. ``max_spot_price=None`` sends no ``MaxPrice``, which EC2 caps at the
  on-demand price. ``create_fleet`` is not used: it needs a launch template per launch
  shape (made, versioned and cleaned up by someone) and reports stockouts inside a
  successful answer; for one VM in one chosen zone it buys nothing ``run_instances`` does
  not, since the planner, not EC2, picks the zone.
* **IMDSv2 is required** with a hop limit of 2, so containers on the VM reach the metadata
  service (the agent's preemption watcher reads it) and nothing can use IMDSv1.
* **EFA types get a cluster placement group** per (job, zone), created on first use, and an
  EFA network interface when a subnet is configured for the zone (an EFA interface needs an
  explicit subnet; without one the VM gets the zone's default subnet and plain networking).
  Types without EFA get neither: a cluster group buys them little bandwidth and narrows
  where spot capacity can be found. Placement groups are left behind when a job ends (an
  empty one costs nothing); ``terraform destroy`` or the console removes them.
* **Private and encrypted by default:** no public IP (set ``public_ip`` to have one) and an
  encrypted root volume (the account's default EBS key unless ``root_volume_kms_key``).
  A private VM reaches Redis, PyPI and S3 only through its subnet's NAT gateway or VPC
  endpoints; the default VPC has neither.
* **Offers are cached per region** for ``offers_ttl_s``: the describe calls behind them are
  slow and rate limited, and prices move on a scale of hours.
* **Errors are classified in one place,** :func:`classify_error`; its table says why each
  code lands where it does.
* ``list`` asks every configured region and fails as a whole if one region cannot be asked:
  a partial view would make the controller relaunch VMs that still exist.
"""

from __future__ import annotations

import builtins
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any, cast

from spottrain.catalog import Catalog, bundled
from spottrain.cloud.aws.errors import NOT_FOUND_CODES, classify_error, error_code
from spottrain.cloud.aws.launch import placement_group_name, run_instances_params, tag_list
from spottrain.cloud.aws.prices import spot_prices, zone_offers
from spottrain.cloud.aws.settings import CLOUD, AwsSettings
from spottrain.cloud.base import (
    TAG_JOB,
    TAG_NODE,
    TAG_REQUEST,
    BadRequestError,
    Instance,
    InstanceState,
    LaunchRequest,
    Market,
    Offer,
    OfferQuery,
    console_tail,
    sort_offers,
)
from spottrain.lazy_import import lazy_import

log = logging.getLogger(__name__)

# EC2 accepts up to 1000 ids per TerminateInstances; stay well under it.
_TERMINATE_BATCH = 500
# What EC2 answers GetConsoleOutput with Latest=True for a type that cannot (not Nitro).
_NO_LATEST_CODES = frozenset({"UnsupportedOperation", "InvalidParameterCombination"})


_STATES = {
    "pending": InstanceState.PENDING,
    "running": InstanceState.RUNNING,
    "shutting-down": InstanceState.STOPPING,
    "stopping": InstanceState.STOPPING,
    "stopped": InstanceState.STOPPING,
    "terminated": InstanceState.TERMINATED,
}
# The state reasons EC2 gives when it takes a spot VM back (terminate or stop behaviour).
INTERRUPTION_CODES = frozenset({"Server.SpotInstanceTermination", "Server.SpotInstanceShutdown"})


class AwsProvider:
    """EC2 behind the :class:`~spottrain.cloud.base.Provider` interface.

    Thread-safe: boto3 clients are, and the caches are guarded by a lock.
    """

    cloud = CLOUD

    def __init__(
        self,
        settings: AwsSettings,
        *,
        session: Any = None,
        catalog: Catalog | None = None,
        endpoint_url: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Build the provider; no call reaches AWS until a method is used.

        Args:
            settings: regions, AMIs, network and pricing choices.
            session: a ``boto3.Session`` (its credentials, profile and event hooks are
                used); None builds one from the environment's credential chain.
            catalog: GPU counts, list prices and interruption bands; the bundled table if
                None.
            endpoint_url: another EC2 endpoint (a VPC endpoint, or moto in tests).
            clock: unix seconds now, for the offer cache.

        Raises:
            ImportError: boto3 is not installed (``pip install 'spottrain[aws]'``).
            ValueError: a region in ``settings`` has no prices in the catalog.
            AuthError: the named AWS profile does not exist.
        """
        boto3 = lazy_import("boto3", needs="the AWS provider needs boto3", extra="aws")
        from botocore.config import Config  # botocore comes with boto3
        from botocore.exceptions import BotoCoreError, ClientError
        from botocore.parsers import ResponseParserError

        self.settings = settings
        self._catalog = catalog or bundled()
        for region in settings.regions:
            self._catalog.region_multiplier(CLOUD, region)
        if session is None:
            try:
                session = boto3.Session()
            except BotoCoreError as e:
                raise classify_error(e, region=settings.regions[0]) from e
        self._session = session
        self._endpoint_url = endpoint_url
        self._clock = clock
        self._client_error: type[Exception] = ClientError
        self._sdk_errors: tuple[type[Exception], ...] = (
            ClientError,
            BotoCoreError,
            ResponseParserError,
        )
        # botocore retries throttling and 5xx a few times itself; beyond that the error
        # goes to the controller, whose next pass is the retry.
        self._config = Config(
            retries={"mode": "standard", "max_attempts": 3},
            connect_timeout=10,
            read_timeout=60,
            user_agent_extra="spottrain",
        )
        self._lock = threading.Lock()
        self._clients: dict[str, Any] = {}
        self._offer_cache: dict[str, tuple[float, builtins.list[Offer]]] = {}
        self._images: dict[str, str] = {}  # region -> root device name of its AMI
        self._placement_groups: set[tuple[str, str]] = set()
        self._regions_by_id: dict[str, str] = {}

    # --- Provider -----------------------------------------------------------------------

    def offers(self, query: OfferQuery) -> builtins.list[Offer]:
        """The offers of the configured regions that ``query`` allows, cheapest first.

        Regions the query names but the settings do not are left out (there is no AMI
        for them).

        Each catalog type is offered in every zone where EC2 lists it, in both markets. The
        GPU count and EFA support come from ``describe_instance_types`` (the catalog only
        fills in when EC2 does not describe a type); spot prices from the spot price history
        (``spot_price_source="api"``) or the catalog.

        Raises:
            AuthError, TransientError: EC2 could not be asked.
        """
        regions = [r for r in self.settings.regions if not query.regions or r in query.regions]
        found: builtins.list[Offer] = []
        for region in regions:
            found.extend(o for o in self._region_offers(region) if query.allows(o))
        return sort_offers(found)

    def launch(self, request: LaunchRequest) -> Instance:
        """Launch one VM for ``request``, or return the one this request id launched before.

        Raises:
            ValueError: the offer is not an AWS offer, or its region is not configured.
            CapacityError, QuotaError, AuthError, BadRequestError, TransientError: see
                :func:`classify_error`.
        """
        offer = request.offer
        if offer.cloud != CLOUD:
            raise ValueError(f"AwsProvider cannot launch a {offer.cloud!r} offer")
        region = offer.region
        if region not in self.settings.regions:
            raise ValueError(
                f"region {region!r} is not in AwsSettings.regions "
                f"({', '.join(self.settings.regions)}): add it, with an AMI in image_ids"
            )
        if offer.instance_type not in self._catalog.types(CLOUD):
            # EC2 answers InvalidParameterValue for a type it does not have (moto does not);
            # a type the catalog does not price is refused the same way, before any call.
            raise BadRequestError(
                CLOUD,
                f"instance type {offer.instance_type!r} is not in the catalog (known: "
                f"{', '.join(sorted(self._catalog.types(CLOUD)))}); add it to a copy of the "
                "catalog and point SPOTTRAIN_CATALOG at it",
            )
        existing = self._find_request(region, request.request_id)
        if existing is not None:
            log.info(
                "aws launch already done: request=%s instance=%s state=%s",
                request.request_id,
                existing.id,
                existing.state,
            )
            return existing
        root_device = self._root_device(region)
        group = ""
        if self.settings.placement_group and offer.network == "efa":
            group = self._ensure_placement_group(region, request.job, offer)
        params = run_instances_params(
            request, self.settings, root_device=root_device, placement_group=group
        )
        with self._errors(
            region, zone=offer.zone, instance_type=offer.instance_type, market=offer.market
        ):
            reply = self._client(region).run_instances(**params)
        raw = cast(dict[str, Any], reply["Instances"][0])
        instance = self._to_instance(region, raw, request.all_tags())
        log.info(
            "aws launched: request=%s job=%s node=%s instance=%s %s %s %s",
            request.request_id,
            request.job,
            request.node,
            instance.id,
            offer.zone,
            offer.instance_type,
            offer.market,
        )
        return instance

    def list(self, job: str) -> builtins.list[Instance]:
        """Every VM tagged with ``job`` in the configured regions, terminated ones included.

        Raises:
            AuthError, TransientError: a region could not be asked (no partial answer).
        """
        found: builtins.list[Instance] = []
        for region in self.settings.regions:
            found.extend(self._describe(region, [{"Name": f"tag:{TAG_JOB}", "Values": [job]}]))
        return found

    def terminate(self, instance_ids: Sequence[str]) -> None:
        """Terminate these VMs; ids already gone, or unknown in every region, are ignored.

        An id this provider has seen (in ``launch`` or ``list``) is terminated in its
        region; any other is tried in each configured region in turn.

        Raises:
            AuthError, TransientError: EC2 refused or could not be reached.
        """
        ids = list(dict.fromkeys(instance_ids))
        with self._lock:
            known = {i: self._regions_by_id.get(i) for i in ids}
        by_region: dict[str, builtins.list[str]] = {}
        unplaced: builtins.list[str] = []
        for i, region in known.items():
            if region is None:
                unplaced.append(i)
            else:
                by_region.setdefault(region, []).append(i)
        for region, group in by_region.items():
            self._terminate_in(region, group)
        for region in self.settings.regions:
            if not unplaced:
                break
            unplaced = self._terminate_in(region, unplaced)
        if unplaced:
            log.info("aws terminate: not found in any region, ignored: %s", ", ".join(unplaced))

    def console_output(self, instance_id: str) -> str:
        """The end of the VM's console output (``GetConsoleOutput``; EC2 sends it base64
        encoded and botocore decodes it, undecodable bytes replaced), or ``""`` while EC2 has
        none yet and for an id no configured region knows.

        ``Latest=True`` asks for the newest output (Nitro types; EC2 otherwise updates it only
        now and then); a type that does not support it (older Xen types) is asked again
        without it.

        Raises:
            AuthError, TransientError: EC2 refused or could not be reached.
        """
        with self._lock:
            known = self._regions_by_id.get(instance_id)
        regions = [known] if known else list(self.settings.regions)
        for region in regions:
            reply = self._console_in(region, instance_id)
            if reply is None:
                continue
            with self._lock:
                self._regions_by_id[instance_id] = region
            return console_tail(str(reply.get("Output") or "").encode())
        return ""

    def _console_in(self, region: str, instance_id: str) -> dict[str, Any] | None:
        """``GetConsoleOutput`` in ``region``; None when the region does not know the id."""
        client = self._client(region)
        for latest in (True, False):
            with self._errors(region):
                try:
                    params: dict[str, Any] = {"InstanceId": instance_id}
                    if latest:
                        params["Latest"] = True
                    return cast(dict[str, Any], client.get_console_output(**params))
                except self._client_error as e:
                    code = error_code(e)
                    if code in NOT_FOUND_CODES:
                        return None
                    if latest and code in _NO_LATEST_CODES:
                        continue
                    raise
        return None

    # --- offers -------------------------------------------------------------------------

    def _region_offers(self, region: str) -> builtins.list[Offer]:
        now = self._clock()
        with self._lock:
            cached = self._offer_cache.get(region)
        if cached is not None and now - cached[0] < self.settings.offers_ttl_s:
            return cached[1]
        offers = self._fetch_offers(region)
        with self._lock:
            self._offer_cache[region] = (now, offers)
        return offers

    def _fetch_offers(self, region: str) -> builtins.list[Offer]:
        known = self._catalog.types(CLOUD)
        client = self._client(region)
        zones: dict[str, set[str]] = {}
        with self._errors(region):
            pages = client.get_paginator("describe_instance_type_offerings").paginate(
                LocationType="availability-zone",
                Filters=[{"Name": "instance-type", "Values": sorted(known)}],
            )
            for page in pages:
                for row in page.get("InstanceTypeOfferings", []):
                    if row["InstanceType"] in known:
                        zones.setdefault(row["InstanceType"], set()).add(row["Location"])
            if not zones:
                return []
            described = client.describe_instance_types(InstanceTypes=sorted(zones))
            spot = (
                spot_prices(client, sorted(zones))
                if self.settings.spot_price_source == "api"
                else {}
            )
        return zone_offers(
            self._catalog, region, zones, described, spot, self.settings.max_spot_price
        )

    # --- launch helpers -----------------------------------------------------------------

    def _find_request(self, region: str, request_id: str) -> Instance | None:
        found = self._describe(region, [{"Name": f"tag:{TAG_REQUEST}", "Values": [request_id]}])
        if not found:
            return None
        # Two VMs for one request id should not happen (ClientToken dedups); if it did,
        # the oldest live one is the answer and the reconcile loop sees the other by its tags.
        found.sort(key=lambda i: (not i.state.alive, i.launched_at or 0.0, i.id))
        return found[0]

    def _root_device(self, region: str) -> str:
        """The AMI's root device name, checking once per region that the AMI exists."""
        with self._lock:
            cached = self._images.get(region)
        if cached is not None:
            return cached
        image = self.settings.image_ids[region]
        client = self._client(region)
        with self._errors(region):
            try:
                images = client.describe_images(ImageIds=[image]).get("Images", [])
            except self._client_error as e:
                if not error_code(e).startswith("InvalidAMIID"):
                    raise
                images = []
        if not images:
            raise BadRequestError(
                CLOUD,
                f"AMI {image} does not exist in {region} or this account cannot use it: set "
                f"AwsSettings.image_ids[{region!r}] to a GPU AMI of {region} (AMI ids differ "
                "per region; e.g. the Deep Learning Base AMI)",
            )
        root = str(images[0].get("RootDeviceName") or "/dev/xvda")
        with self._lock:
            self._images[region] = root
        return root

    def _ensure_placement_group(self, region: str, job: str, offer: Offer) -> str:
        name = placement_group_name(job, offer.zone)
        with self._lock:
            if (region, name) in self._placement_groups:
                return name
        client = self._client(region)
        with self._errors(
            region, zone=offer.zone, instance_type=offer.instance_type, market=offer.market
        ):
            try:
                client.create_placement_group(
                    GroupName=name,
                    Strategy="cluster",
                    TagSpecifications=[
                        {"ResourceType": "placement-group", "Tags": tag_list({TAG_JOB: job})}
                    ],
                )
            except self._client_error as e:
                # Made by an earlier launch, or by this controller before a restart.
                if error_code(e) != "InvalidPlacementGroup.Duplicate":
                    raise
        with self._lock:
            self._placement_groups.add((region, name))
        return name

    # --- list and terminate helpers -----------------------------------------------------

    def _describe(
        self, region: str, filters: builtins.list[dict[str, Any]]
    ) -> builtins.list[Instance]:
        found: builtins.list[Instance] = []
        with self._errors(region):
            pages = (
                self._client(region).get_paginator("describe_instances").paginate(Filters=filters)
            )
            for page in pages:
                for reservation in page.get("Reservations", []):
                    for raw in reservation.get("Instances", []):
                        found.append(self._to_instance(region, raw))
        return found

    def _terminate_in(self, region: str, ids: builtins.list[str]) -> builtins.list[str]:
        """Terminate ``ids`` in ``region``; returns those the region does not know."""
        client = self._client(region)
        missing: builtins.list[str] = []
        for start in range(0, len(ids), _TERMINATE_BATCH):
            batch = ids[start : start + _TERMINATE_BATCH]
            if self._terminate_batch(client, region, batch):
                continue
            if len(batch) == 1:
                missing.extend(batch)
                continue
            # One unknown id fails the whole call, so find out which, one by one.
            for i in batch:
                if not self._terminate_batch(client, region, [i]):
                    missing.append(i)
        with self._lock:
            for i in ids:
                if i not in missing:
                    self._regions_by_id[i] = region
        return missing

    def _terminate_batch(self, client: Any, region: str, ids: builtins.list[str]) -> bool:
        """Terminate ``ids``; False if one of them is unknown here (nothing was done)."""
        with self._errors(region):
            try:
                client.terminate_instances(InstanceIds=ids)
            except self._client_error as e:
                if error_code(e) in NOT_FOUND_CODES:
                    return False
                raise
        log.info("aws terminate: %s in %s", ", ".join(ids), region)
        return True

    # --- plumbing -----------------------------------------------------------------------

    def _client(self, region: str) -> Any:
        with self._lock:
            client = self._clients.get(region)
            if client is None:
                with self._errors(region):
                    client = self._session.client(
                        "ec2",
                        region_name=region,
                        endpoint_url=self._endpoint_url,
                        config=self._config,
                    )
                self._clients[region] = client
            return client

    @contextmanager
    def _errors(
        self,
        region: str,
        *,
        zone: str = "",
        instance_type: str = "",
        market: Market = Market.SPOT,
    ) -> Iterator[None]:
        try:
            yield
        except self._sdk_errors as e:
            raise classify_error(
                e, region=region, zone=zone, instance_type=instance_type, market=market
            ) from e

    def _to_instance(
        self, region: str, raw: Mapping[str, Any], fallback_tags: Mapping[str, str] | None = None
    ) -> Instance:
        tags = dict(fallback_tags or {})
        tags.update({t["Key"]: t["Value"] for t in raw.get("Tags", [])})
        reason = raw.get("StateReason") or {}
        code = str(reason.get("Code", ""))
        launched = raw.get("LaunchTime")
        instance_id = str(raw["InstanceId"])
        with self._lock:
            self._regions_by_id[instance_id] = region
        return Instance(
            id=instance_id,
            cloud=CLOUD,
            region=region,
            zone=str(raw.get("Placement", {}).get("AvailabilityZone", "")),
            instance_type=str(raw.get("InstanceType", "")),
            # EC2 marks spot VMs only; the instance-lifecycle filter is not used (moto lacks
            # it), so the market is read here.
            market=Market.SPOT if raw.get("InstanceLifecycle") == "spot" else Market.ON_DEMAND,
            # A state EC2 adds later counts as not alive: the controller then replaces the VM
            # rather than trusting one it cannot read.
            state=_STATES.get(str(raw.get("State", {}).get("Name", "")), InstanceState.STOPPING),
            job=tags.get(TAG_JOB, ""),
            node=tags.get(TAG_NODE, ""),
            request_id=tags.get(TAG_REQUEST, ""),
            interrupted=code in INTERRUPTION_CODES,
            state_reason=str(reason.get("Message") or code or raw.get("StateTransitionReason", "")),
            launched_at=launched.timestamp() if isinstance(launched, datetime) else None,
            address=str(raw.get("PrivateIpAddress", "")),
        )

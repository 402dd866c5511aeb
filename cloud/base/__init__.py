"""The cloud contract: what every provider implements (:mod:`.provider`: offers, launch
requests, instances, the typed errors) and what a managed group of VMs offers the group
controller (:mod:`.groups`).

The provider names are re-exported here, where every caller has always imported them.
"""

from spottrain.cloud.base.provider import (
    CLOUDS,
    CONSOLE_TAIL_BYTES,
    TAG_JOB,
    TAG_NODE,
    TAG_REQUEST,
    AuthError,
    BadRequestError,
    CapacityError,
    Instance,
    InstanceState,
    LaunchRequest,
    Market,
    Offer,
    OfferQuery,
    Provider,
    ProviderError,
    QuotaError,
    TransientError,
    console_tail,
    region_of_zone,
    sort_offers,
    validate_request_id,
)

__all__ = [
    "CLOUDS",
    "CONSOLE_TAIL_BYTES",
    "TAG_JOB",
    "TAG_NODE",
    "TAG_REQUEST",
    "AuthError",
    "BadRequestError",
    "CapacityError",
    "Instance",
    "InstanceState",
    "LaunchRequest",
    "Market",
    "Offer",
    "OfferQuery",
    "Provider",
    "ProviderError",
    "QuotaError",
    "TransientError",
    "console_tail",
    "region_of_zone",
    "sort_offers",
    "validate_request_id",
]

"""One contract, every cloud: the same suite over the local cloud, AWS (moto in server mode)
and GCP (the real google-cloud-compute client against the HTTP fake of the compute API).

What it holds every provider to is the docstring of :class:`spottrain.cloud.base.Provider`:
offers filtered and cheapest first, launches idempotent by request id, VMs found by their job
tag alone, terminations safe to repeat, a VM's console readable (its end, "" for a VM the
cloud does not know), and every refusal a typed error with its data.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from harnesses.base import ProviderHarness

from spottrain.cloud.base import (
    CONSOLE_TAIL_BYTES,
    TAG_JOB,
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
)
from spottrain.protocol.boot import STAGE_ENV, console_failed, console_stage, parse_console


def _local() -> ProviderHarness:
    from harnesses.local import LocalHarness

    return LocalHarness()


def _aws() -> ProviderHarness:
    from harnesses.aws import AwsHarness

    return AwsHarness()


def _gcp() -> ProviderHarness:
    from harnesses.gcp import GcpHarness

    return GcpHarness()


@pytest.fixture(params=[_local, _aws, _gcp], ids=["local", "aws", "gcp"])
def harness(request: pytest.FixtureRequest) -> Iterator[ProviderHarness]:
    make: Callable[[], ProviderHarness] = request.param
    h = make()
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def job() -> str:
    return f"job-{uuid.uuid4().hex[:8]}"


def _boot(h: ProviderHarness) -> str:
    return str(getattr(h, "boot", "#!/bin/bash\necho contract\n"))


def _spot_offer(h: ProviderHarness, zone: str | None = None) -> Offer:
    offers = h.provider.offers(h.query())
    spot = [o for o in offers if o.market is Market.SPOT and (zone is None or o.zone == zone)]
    assert spot, f"the fake offers no spot capacity for {h.query()}: {offers}"
    return spot[0]


def _request(h: ProviderHarness, job: str, node: str, offer: Offer, rid: str = "") -> LaunchRequest:
    return LaunchRequest(
        request_id=rid or f"r-{uuid.uuid4().hex[:10]}",
        job=job,
        node=node,
        offer=offer,
        user_data=_boot(h),
    )


def _eventually(fn: Callable[[], Any], what: str, timeout: float = 20.0) -> Any:
    """Providers are eventually consistent: poll until ``fn`` returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _by_id(provider: Provider, job: str, instance_id: str) -> Instance | None:
    return next((i for i in provider.list(job) if i.id == instance_id), None)


def test_provider_satisfies_the_protocol(harness: ProviderHarness) -> None:
    assert isinstance(harness.provider, Provider)
    assert harness.provider.cloud in ("local", "aws", "gcp")


def test_offers_are_filtered_and_cheapest_first(harness: ProviderHarness) -> None:
    query = harness.query()
    offers = harness.provider.offers(query)
    assert len({o.zone for o in offers}) >= 2, "the harness must offer at least two zones"
    assert all(query.allows(o) for o in offers)
    prices = [o.price_per_hour for o in offers]
    assert prices == sorted(prices)
    for o in offers:
        assert o.cloud == harness.provider.cloud
        if o.market is Market.ON_DEMAND:
            assert o.interruption_risk == 0
        else:
            assert 0 < o.interruption_risk <= 1
    # Spot is the cheaper market for the same type and zone.
    by_key = {(o.zone, o.instance_type, o.market): o.price_per_hour for o in offers}
    for (zone, itype, market), price in by_key.items():
        if market is Market.SPOT and (zone, itype, Market.ON_DEMAND) in by_key:
            assert price < by_key[(zone, itype, Market.ON_DEMAND)]


def test_offers_honour_market_and_price_filters(harness: ProviderHarness) -> None:
    base = harness.query()
    spot_only = OfferQuery(
        regions=base.regions,
        zones=base.zones,
        instance_types=base.instance_types,
        markets=(Market.SPOT,),
    )
    offers = harness.provider.offers(spot_only)
    assert offers and all(o.market is Market.SPOT for o in offers)
    cheapest = offers[0].price_per_hour
    capped = OfferQuery(
        regions=base.regions,
        instance_types=base.instance_types,
        max_price_per_hour=cheapest,
    )
    assert all(o.price_per_hour <= cheapest for o in harness.provider.offers(capped))


def test_launch_tags_the_vm_and_list_finds_it_by_job(harness: ProviderHarness, job: str) -> None:
    offer = _spot_offer(harness)
    req = _request(harness, job, "node-0", offer)
    inst = harness.provider.launch(req)
    assert inst.job == job and inst.node == "node-0" and inst.request_id == req.request_id
    assert inst.zone == offer.zone and inst.instance_type == offer.instance_type
    assert inst.market is Market.SPOT
    assert inst.state.alive
    listed = _eventually(lambda: _by_id(harness.provider, job, inst.id), "the VM in list()")
    assert listed.node == "node-0" and listed.request_id == req.request_id
    assert listed.market is Market.SPOT and not listed.interrupted
    # Another job's list does not see it.
    assert all(i.id != inst.id for i in harness.provider.list(f"other-{job}"))


def test_launch_is_idempotent_by_request_id(harness: ProviderHarness, job: str) -> None:
    offer = _spot_offer(harness)
    req = _request(harness, job, "node-0", offer)
    first = harness.provider.launch(req)
    _eventually(lambda: _by_id(harness.provider, job, first.id), "the first VM in list()")
    again = harness.provider.launch(req)
    assert again.id == first.id
    ours = [i for i in harness.provider.list(job) if i.request_id == req.request_id]
    assert [i.id for i in ours] == [first.id]


def test_on_demand_launch_is_reported_as_on_demand(harness: ProviderHarness, job: str) -> None:
    offers = harness.provider.offers(harness.query())
    od = next(o for o in offers if o.market is Market.ON_DEMAND)
    inst = harness.provider.launch(_request(harness, job, "node-od", od))
    listed = _eventually(lambda: _by_id(harness.provider, job, inst.id), "the VM in list()")
    assert listed.market is Market.ON_DEMAND


def test_terminate_is_idempotent_and_ignores_unknown_ids(
    harness: ProviderHarness, job: str
) -> None:
    inst = harness.provider.launch(_request(harness, job, "node-0", _spot_offer(harness)))
    _eventually(lambda: _by_id(harness.provider, job, inst.id), "the VM in list()")
    harness.provider.terminate([inst.id])
    harness.provider.terminate([inst.id])

    def gone() -> bool:
        i = _by_id(harness.provider, job, inst.id)
        return i is None or i.state in (InstanceState.TERMINATED, InstanceState.STOPPING)

    _eventually(gone, "the VM to go")
    unknown = {"local": "vm-000000000000", "aws": "i-0123456789abcdef0", "gcp": "st-nobody"}
    harness.provider.terminate([unknown[harness.provider.cloud]])
    final = _by_id(harness.provider, job, inst.id)
    assert final is None or not final.interrupted, "our own terminate is not an interruption"


def test_capacity_error_names_zone_and_type_and_spares_other_zones(
    harness: ProviderHarness, job: str
) -> None:
    offer = _spot_offer(harness)
    harness.inject_capacity_error(offer.zone, offer.instance_type)
    with pytest.raises(CapacityError) as err:
        harness.provider.launch(_request(harness, job, "node-0", offer))
    assert err.value.zone == offer.zone
    assert err.value.instance_type == offer.instance_type
    assert err.value.retryable
    assert not [i for i in harness.provider.list(job) if i.state.alive], "nothing launched"
    other = next(
        o
        for o in harness.provider.offers(harness.query())
        if o.market is Market.SPOT and o.zone != offer.zone
    )
    inst = harness.provider.launch(_request(harness, job, "node-1", other))
    assert inst.zone == other.zone


def test_interruption_is_reported_as_interrupted(harness: ProviderHarness, job: str) -> None:
    inst = harness.provider.launch(_request(harness, job, "node-0", _spot_offer(harness)))
    _eventually(
        lambda: (i := _by_id(harness.provider, job, inst.id)) and i.state is InstanceState.RUNNING,
        "the VM to run",
    )
    harness.interrupt(inst.id)
    seen = _eventually(
        lambda: (i := _by_id(harness.provider, job, inst.id)) and i.interrupted and i,
        "list() to report the interruption",
    )
    assert not seen.state.alive


def test_auth_refusal_is_an_auth_error(harness: ProviderHarness, job: str) -> None:
    offer = _spot_offer(harness)
    harness.inject_auth_error()
    with pytest.raises(AuthError):
        harness.provider.launch(_request(harness, job, "node-0", offer))
    with pytest.raises(AuthError):
        harness.provider.list(job)
    harness.clear_faults()
    assert harness.provider.list(job) == [] or all(
        not i.state.alive for i in harness.provider.list(job)
    )


def test_unknown_instance_type_is_a_bad_request(harness: ProviderHarness, job: str) -> None:
    offer = _spot_offer(harness)
    bogus = Offer(
        cloud=offer.cloud,
        region=offer.region,
        zone=offer.zone,
        instance_type="no-such-type-9000",
        gpus=8,
        gpu_type="H100",
        market=Market.SPOT,
        price_per_hour=1.0,
        interruption_risk=0.1,
    )
    with pytest.raises(BadRequestError):
        harness.provider.launch(_request(harness, job, "node-0", bogus))


def test_launch_of_another_clouds_offer_is_refused(harness: ProviderHarness, job: str) -> None:
    offer = _spot_offer(harness)
    other = "gcp" if offer.cloud != "gcp" else "aws"
    foreign = Offer(
        cloud=other,
        region="r",
        zone="z",
        instance_type="t",
        gpus=8,
        gpu_type="H100",
        market=Market.SPOT,
        price_per_hour=1.0,
        interruption_risk=0.1,
    )
    with pytest.raises(ValueError, match=other):
        harness.provider.launch(_request(harness, job, "node-0", foreign))


def test_list_reports_the_job_tag_on_every_vm(harness: ProviderHarness, job: str) -> None:
    offer = _spot_offer(harness)
    ids = {harness.provider.launch(_request(harness, job, f"node-{n}", offer)).id for n in range(2)}
    listed = _eventually(
        lambda: ids <= {i.id for i in harness.provider.list(job)} and harness.provider.list(job),
        "both VMs in list()",
    )
    assert {i.job for i in listed} == {job}
    assert {i.node for i in listed if i.id in ids} == {"node-0", "node-1"}
    assert TAG_JOB == "spottrain-job"


_UNKNOWN_IDS = {"local": "vm-000000000000", "aws": "i-0123456789abcdef0", "gcp": "st-nobody"}


def test_console_output_ends_with_the_boot_line_the_vm_printed(
    harness: ProviderHarness, job: str
) -> None:
    inst = harness.provider.launch(_request(harness, job, "node-0", _spot_offer(harness)))
    _eventually(lambda: _by_id(harness.provider, job, inst.id), "the VM in list()")
    failed = console_failed("node-0", inst.id, STAGE_ENV, "pip: no matching distribution")
    harness.set_console(inst.id, f"{console_stage('node-0', inst.id, STAGE_ENV)}\n{failed}\n")
    text = _eventually(
        lambda: failed in (seen := harness.provider.console_output(inst.id)) and seen,
        "the console to show the failure line",
    )
    report = parse_console(text, "node-0")
    assert report is not None and report.failed
    assert (report.vm, report.stage, report.reason) == (
        inst.id,
        STAGE_ENV,
        "pip: no matching distribution",
    )


def test_console_output_is_its_end_when_the_console_is_long(
    harness: ProviderHarness, job: str
) -> None:
    inst = harness.provider.launch(_request(harness, job, "node-0", _spot_offer(harness)))
    _eventually(lambda: _by_id(harness.provider, job, inst.id), "the VM in list()")
    filler = "".join(f"kernel: line {i:06d} of a long boot\n" for i in range(8000))
    assert len(filler) > 3 * CONSOLE_TAIL_BYTES
    harness.set_console(inst.id, filler + "the newest line\n")
    text = _eventually(
        lambda: "the newest line" in (seen := harness.provider.console_output(inst.id)) and seen,
        "the console's newest line",
    )
    assert len(text.encode()) <= CONSOLE_TAIL_BYTES
    assert text.rstrip().endswith("the newest line")
    assert "line 000000 " not in text, "the oldest output is left out"


def test_console_output_of_an_unknown_vm_is_empty(harness: ProviderHarness) -> None:
    assert harness.provider.console_output(_UNKNOWN_IDS[harness.provider.cloud]) == ""


def test_console_output_of_a_fresh_vm_is_text_and_a_refusal_is_typed(
    harness: ProviderHarness, job: str
) -> None:
    inst = harness.provider.launch(_request(harness, job, "node-0", _spot_offer(harness)))
    _eventually(lambda: _by_id(harness.provider, job, inst.id), "the VM in list()")
    # Nothing printed yet ("" on the local cloud and GCE, moto's canned boot log on EC2).
    assert isinstance(harness.provider.console_output(inst.id), str)
    harness.inject_auth_error()
    with pytest.raises(AuthError):
        harness.provider.console_output(inst.id)

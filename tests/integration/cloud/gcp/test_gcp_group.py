"""The GCP managed instance group behind the :class:`~spottrain.cloud.base.groups.Group` interface,
with the real ``google-cloud-compute`` REST client against the HTTP fake of the Compute API.

Every test runs with HTTP(S)_PROXY pointing at a dead port and only 127.0.0.1 exempt, so a
call that tried to leave for Google's servers would fail at once instead of passing unseen.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator

import pytest
from fakes.gce import GceFake
from google.auth.credentials import AnonymousCredentials

from spottrain.cloud.base import AuthError, BadRequestError, Market, TransientError
from spottrain.cloud.base.groups import Group, GroupView, MemberState
from spottrain.cloud.gcp.group import TERRAFORM_OUTPUT, GcpMigGroup
from spottrain.cloud.gcp.group_states import member_state
from spottrain.cloud.gcp.settings import AUTH_HINT

ZONE = "us-central1-a"
MACHINE_TYPE = "a2-highgpu-8g"
MEMBER_RE = re.compile(r"^st-fleet-[a-z0-9]{4}\Z")
RESIZE = "instanceGroupManagers.resize"
DELETE = "instanceGroupManagers.deleteInstances"
RECREATE = "instanceGroupManagers.recreateInstances"


@pytest.fixture(autouse=True)
def _no_calls_leave_this_machine(no_egress: None) -> None:
    """No call reaches a real cloud (see the ``no_egress`` fixture)."""


def _start(*, auto_reconcile: bool = True) -> GceFake:
    return GceFake(auto_reconcile=auto_reconcile).start()


def _stop(fake: GceFake) -> None:
    fake.close()
    assert fake.internal_errors == []
    assert set(fake.hosts) <= {f"127.0.0.1:{fake.port}"}


@pytest.fixture
def gce() -> Iterator[GceFake]:
    fake = _start()
    yield fake
    _stop(fake)


@pytest.fixture
def manual() -> Iterator[GceFake]:
    """A fake whose group acts only on ``reconcile_groups()``."""
    fake = _start(auto_reconcile=False)
    yield fake
    _stop(fake)


def _provision(
    fake: GceFake, size: int = 2, *, spot: bool = True, termination_action: str = "STOP"
) -> GcpMigGroup:
    fake.create_group(
        "fleet",
        ZONE,
        machine_type=MACHINE_TYPE,
        target_size=size,
        base_instance_name="st-fleet",
        spot=spot,
        termination_action=termination_action,
    )
    return _adopt(fake)


def _adopt(fake: GceFake, name: str = "fleet") -> GcpMigGroup:
    return GcpMigGroup(
        fake.project,
        ZONE,
        name,
        api_endpoint=fake.url,
        credentials=AnonymousCredentials(),
        request_timeout_s=5.0,
        op_wait_s=5.0,
    )


def _until(
    group: GcpMigGroup, done: Callable[[GroupView], bool], *, fake: GceFake | None = None
) -> GroupView:
    """Describe until ``done`` (each describe reads every VM once, and two reads boot one);
    with a manual fake, let the group act before each look."""
    for _ in range(6):
        if fake is not None:
            fake.reconcile_groups()
        view = group.describe()
        if done(view):
            return view
    raise AssertionError(f"the group never got there: {view}")


def _all_running(size: int) -> Callable[[GroupView], bool]:
    return lambda v: (
        len(v.members) == size and all(m.state is MemberState.RUNNING for m in v.members)
    )


def _states(view: GroupView) -> dict[str, MemberState]:
    return {m.id: m.state for m in view.members}


# describe


def test_describe_reports_target_and_members_with_zone_type_and_spot_market(gce: GceFake) -> None:
    group = _provision(gce)
    assert isinstance(group, Group) and group.cloud == "gcp" and group.name == "fleet"
    first = group.describe()
    assert first.name == "fleet" and first.target == 2 and first.max_size is None
    assert len(first.members) == 2
    assert all(m.state is MemberState.PENDING for m in first.members), first
    view = _until(group, _all_running(2))
    assert [m.id for m in view.members] == sorted(m.id for m in first.members)
    for m in view.members:
        assert MEMBER_RE.match(m.id) and m.node == m.id
        assert (m.zone, m.instance_type, m.market) == (ZONE, MACHINE_TYPE, Market.SPOT)
        assert m.status == "RUNNING" and not m.waiting_on_hook
    assert view.alive == view.members


def test_a_standard_template_is_reported_as_on_demand(gce: GceFake) -> None:
    view = _provision(gce, 1, spot=False).describe()
    assert [m.market for m in view.members] == [Market.ON_DEMAND]


def test_the_template_is_read_once_through_terraforms_unique_link(gce: GceFake) -> None:
    group = _provision(gce)
    for _ in range(3):
        group.describe()
    assert gce.count("instanceTemplates.get") == 1
    assert gce.count("instances.get") == 0, "the shape came from the template, not the VMs"


def test_a_member_whose_template_was_replaced_takes_its_shape_from_its_vm(gce: GceFake) -> None:
    _until(_provision(gce), _all_running(2))
    gce.forget_template("fleet-template")
    view = _adopt(gce).describe()
    assert [(m.instance_type, m.market) for m in view.members] == [(MACHINE_TYPE, Market.SPOT)] * 2
    assert gce.count("instances.get") == 2


@pytest.mark.parametrize(
    ("action", "status", "state"),
    [
        ("NONE", "RUNNING", MemberState.RUNNING),
        ("CREATING", "", MemberState.PENDING),  # a stockout: no VM yet
        ("CREATING", "PROVISIONING", MemberState.PENDING),
        ("NONE", "STAGING", MemberState.PENDING),
        ("RECREATING", "RUNNING", MemberState.PENDING),  # recreateInstances asked
        ("RECREATING", "", MemberState.PENDING),
        ("VERIFYING", "RUNNING", MemberState.PENDING),
        ("DELETING", "RUNNING", MemberState.LEAVING),
        ("ABANDONING", "RUNNING", MemberState.LEAVING),
        ("NONE", "STOPPING", MemberState.LEAVING),  # a preemption under way
        ("RECREATING", "STOPPING", MemberState.LEAVING),
        ("NONE", "TERMINATED", MemberState.GONE),  # preempted, termination action STOP
        ("RECREATING", "TERMINATED", MemberState.GONE),  # being repaired: still lost for now
        ("NONE", "STOPPED", MemberState.GONE),
        ("NONE", "SUSPENDED", MemberState.GONE),
        ("NONE", "", MemberState.GONE),  # preempted, termination action DELETE
        ("DELETING", "TERMINATED", MemberState.LEAVING),
    ],
)
def test_member_state_from_action_and_status(action: str, status: str, state: MemberState) -> None:
    assert member_state(action, status) is state


# set_target


def test_set_target_grows_the_group_and_members_appear(gce: GceFake) -> None:
    group = _provision(gce)
    before = {m.id for m in _until(group, _all_running(2)).members}
    group.set_target(4)
    assert gce.group_calls("fleet").count(RESIZE) == 1
    view = _until(group, _all_running(4))
    assert view.target == 4 and before < {m.id for m in view.members}


def test_set_target_to_the_same_size_makes_no_resize_call(gce: GceFake) -> None:
    group = _provision(gce)
    group.set_target(2)
    assert RESIZE not in gce.group_calls("fleet")
    assert gce.group_calls("fleet") == ["instanceGroupManagers.get"]
    with pytest.raises(ValueError, match=">= 0"):
        group.set_target(-1)


# remove


def test_remove_deletes_exactly_the_named_members_and_lowers_the_target(gce: GceFake) -> None:
    group = _provision(gce, 3)
    a, b, c = (m.id for m in _until(group, _all_running(3)).members)
    group.remove([b], replace=False)
    assert gce.group_calls("fleet").count(DELETE) == 1
    view = group.describe()
    assert view.target == 2 and [m.id for m in view.members] == [a, c]
    assert all(m.state is MemberState.RUNNING for m in view.members)
    assert gce.instance(b) is None and gce.instance(a) is not None


def test_a_member_being_removed_is_leaving(manual: GceFake) -> None:
    group = _provision(manual)
    a, b = (m.id for m in _until(group, _all_running(2), fake=manual).members)
    group.remove([a], replace=False)
    view = group.describe()
    assert view.target == 1
    assert _states(view) == {a: MemberState.LEAVING, b: MemberState.RUNNING}
    assert view.members[0].status == "RUNNING/DELETING"
    manual.reconcile_groups()
    assert [m.id for m in group.describe().members] == [b]


def test_remove_with_replace_keeps_the_target_and_the_group_recreates(gce: GceFake) -> None:
    group = _provision(gce)
    a, b = (m.id for m in _until(group, _all_running(2)).members)
    old_vm = gce.instance(a)
    group.remove([a], replace=True)
    assert gce.group_calls("fleet").count(RECREATE) == 1 and DELETE not in gce.group_calls("fleet")
    view = group.describe()
    assert view.target == 2 and _states(view)[a] is MemberState.PENDING
    assert _states(view)[b] is MemberState.RUNNING
    new_vm = gce.instance(a)
    assert old_vm is not None and new_vm is not None and new_vm["id"] != old_vm["id"]
    assert [m.id for m in _until(group, _all_running(2)).members] == [a, b]


def test_removing_unknown_gone_or_leaving_members_is_harmless(manual: GceFake) -> None:
    group = _provision(manual)
    a, b = (m.id for m in _until(group, _all_running(2), fake=manual).members)
    group.remove([], replace=False)
    group.remove(["st-fleet-none"], replace=False)
    group.remove(["st-fleet-none"], replace=True)
    assert DELETE not in manual.group_calls("fleet") and RECREATE not in manual.group_calls("fleet")
    group.remove([a, a], replace=False)
    group.remove([a], replace=False)  # already leaving
    group.remove([a], replace=True)  # leaving: nothing to recreate
    assert manual.group_calls("fleet").count(DELETE) == 1
    assert RECREATE not in manual.group_calls("fleet")
    manual.reconcile_groups()
    group.remove([a, "st-fleet-none"], replace=False)  # gone now
    view = group.describe()
    assert view.target == 1 and [m.id for m in view.members] == [b]
    assert manual.group_calls("fleet").count(DELETE) == 1


def test_a_member_that_left_between_the_list_and_the_recreate_is_skipped(
    manual: GceFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    group = _provision(manual)
    a, b = (m.id for m in _until(group, _all_running(2), fake=manual).members)
    stale = group._managed()
    group.remove([a], replace=False)
    real = group._managed
    answers = iter([stale])
    monkeypatch.setattr(group, "_managed", lambda: next(answers, None) or real())
    group.remove([a, b], replace=True)
    assert manual.group_calls("fleet").count(RECREATE) == 2, "refused once, then without a"
    assert _states(group.describe()) == {a: MemberState.LEAVING, b: MemberState.PENDING}


def test_a_member_that_left_between_the_list_and_the_delete_lowers_the_target_once(
    manual: GceFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    group = _provision(manual, 3)
    a, b, c = (m.id for m in _until(group, _all_running(3), fake=manual).members)
    stale = group._managed()
    group.remove([a], replace=False)
    monkeypatch.setattr(group, "_managed", lambda: stale)
    group.remove([a, b], replace=False)
    monkeypatch.undo()
    assert manual.group_calls("fleet").count(DELETE) == 2
    view = group.describe()
    assert view.target == 1, "a was counted once"
    assert _states(view) == {a: MemberState.LEAVING, b: MemberState.LEAVING, c: MemberState.RUNNING}


# preemption


@pytest.mark.parametrize("termination_action", ["STOP", "DELETE"])
def test_a_preempted_member_shows_as_gone_then_comes_back(
    manual: GceFake, termination_action: str
) -> None:
    group = _provision(manual, termination_action=termination_action)
    a, b = (m.id for m in _until(group, _all_running(2), fake=manual).members)
    manual.preempt(a)
    view = group.describe()
    assert _states(view) == {a: MemberState.GONE, b: MemberState.RUNNING}
    assert view.target == 2 and [m.id for m in view.alive] == [b]
    manual.reconcile_groups()  # the group repairs it, under the same name
    assert _states(group.describe())[a] is MemberState.PENDING
    assert [m.id for m in _until(group, _all_running(2), fake=manual).members] == [a, b]


def test_a_stockout_member_is_pending_and_says_why(gce: GceFake) -> None:
    group = _provision(gce, 1)
    _until(group, _all_running(1))
    gce.inject_stockout(ZONE, MACHINE_TYPE)
    group.set_target(2)
    view = group.describe()
    (stuck,) = (m for m in view.members if m.state is not MemberState.RUNNING)
    assert stuck.state is MemberState.PENDING
    assert stuck.status == "CREATING (last attempt: ZONE_RESOURCE_POOL_EXHAUSTED)"
    gce.clear_faults()
    _until(group, _all_running(2))


# errors


def test_a_missing_group_is_a_bad_request_that_says_where_to_look(gce: GceFake) -> None:
    group = _adopt(gce, "nope")
    calls: list[Callable[[], object]] = [
        group.describe,
        lambda: group.set_target(1),
        lambda: group.remove(["x"], replace=False),
    ]
    for call in calls:
        with pytest.raises(BadRequestError) as err:
            call()
        message = str(err.value)
        assert "'nope'" in message and ZONE in message and gce.project in message
        assert f"`{TERRAFORM_OUTPUT}`" in message and TERRAFORM_OUTPUT == "spottrain_fleet.group"


def test_auth_errors_are_auth_errors_that_say_how_to_log_in(gce: GceFake) -> None:
    group = _provision(gce)
    gce.inject_auth_error(401)
    with pytest.raises(AuthError) as err:
        group.describe()
    assert AUTH_HINT in str(err.value)
    gce.inject_auth_error(403)
    with pytest.raises(AuthError, match="permission"):
        group.set_target(3)
    with pytest.raises(AuthError):
        group.remove(["x"], replace=True)
    gce.clear_faults()
    assert group.describe().target == 2


@pytest.mark.parametrize("method", ["instanceGroupManagers.listManagedInstances", RESIZE])
def test_a_503_is_a_transient_error_and_not_retried(gce: GceFake, method: str) -> None:
    group = _provision(gce)
    gce.fail_next(1, 503, method=method)
    started = time.monotonic()
    with pytest.raises(TransientError) as err:
        if method == RESIZE:
            group.set_target(3)
        else:
            group.describe()
    assert err.value.retryable and time.monotonic() - started < 5
    assert gce.count(method) == 1
    group.set_target(3)
    assert group.describe().target == 3


def test_release_is_a_no_op_without_calls(gce: GceFake) -> None:
    group = _provision(gce)
    group.release("st-fleet-abcd")
    assert gce.count() == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("X", ZONE, "fleet"), "project"),
        (("spottrain-test", "us-central1", "fleet"), "zone"),
        (("spottrain-test", ZONE, "Fleet"), TERRAFORM_OUTPUT),
    ],
)
def test_bad_names_are_refused_on_construction(args: tuple[str, str, str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        GcpMigGroup(*args)

"""The HTTP fake's managed instance groups (and instance templates), driven by the real
``google-cloud-compute`` client: what :mod:`spottrain.cloud.gcp.group` and its tests lean on."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from fakes.gce import GceFake
from google.api_core import exceptions as api_exc
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1

ZONE = "us-central1-a"
OTHER_ZONE = "us-central1-b"
MACHINE_TYPE = "a2-highgpu-8g"
IMAGE = "projects/debian-cloud/global/images/family/debian-12"
MEMBER_RE = re.compile(r"^fleet-[a-z0-9]{4}\Z")


@pytest.fixture
def gce() -> Iterator[GceFake]:
    with GceFake() as fake:
        yield fake
    assert fake.internal_errors == []


@pytest.fixture
def manual() -> Iterator[GceFake]:
    """A fake whose groups act only when the test says so."""
    with GceFake(auto_reconcile=False) as fake:
        yield fake
    assert fake.internal_errors == []


def _options(fake: GceFake) -> dict[str, Any]:
    return {
        "credentials": AnonymousCredentials(),
        "client_options": ClientOptions(api_endpoint=fake.url),
        "transport": "rest",
    }


def _migs(fake: GceFake) -> compute_v1.InstanceGroupManagersClient:
    return compute_v1.InstanceGroupManagersClient(**_options(fake))


def _properties(**scheduling: Any) -> compute_v1.InstanceProperties:
    spot = {
        "provisioning_model": "SPOT",
        "on_host_maintenance": "TERMINATE",
        "automatic_restart": False,
        "instance_termination_action": "STOP",
    }
    return compute_v1.InstanceProperties(
        machine_type=MACHINE_TYPE,
        labels={"spottrain-job": "job-a"},
        metadata=compute_v1.Metadata(
            items=[compute_v1.Items(key="startup-script", value="echo boot")]
        ),
        scheduling=compute_v1.Scheduling(**{**spot, **scheduling}),
        disks=[
            compute_v1.AttachedDisk(
                boot=True,
                initialize_params=compute_v1.AttachedDiskInitializeParams(
                    source_image=IMAGE, disk_type="pd-balanced"
                ),
            )
        ],
        network_interfaces=[compute_v1.NetworkInterface()],
    )


def _template(fake: GceFake, name: str = "tpl", **scheduling: Any) -> compute_v1.Operation:
    templates = compute_v1.InstanceTemplatesClient(**_options(fake))
    return templates.insert_unary(
        project=fake.project,
        instance_template_resource=compute_v1.InstanceTemplate(
            name=name, properties=_properties(**scheduling)
        ),
    )


def _group(
    fake: GceFake, size: int, *, template: str = "global/instanceTemplates/tpl", **extra: Any
) -> compute_v1.Operation:
    return _migs(fake).insert_unary(
        project=fake.project,
        zone=ZONE,
        instance_group_manager_resource=compute_v1.InstanceGroupManager(
            name="fleet",
            base_instance_name="fleet",
            instance_template=template,
            target_size=size,
            **extra,
        ),
    )


def _listed(fake: GceFake, group: str = "fleet") -> list[compute_v1.ManagedInstance]:
    return list(
        _migs(fake).list_managed_instances(
            project=fake.project, zone=ZONE, instance_group_manager=group, retry=None
        )
    )


def _url(fake: GceFake, name: str, zone: str = ZONE) -> str:
    return f"https://www.googleapis.com/compute/v1/projects/{fake.project}/zones/{zone}/instances/{name}"


def _delete(fake: GceFake, names: list[str], *, skip: bool = False, zone: str = ZONE) -> None:
    _migs(fake).delete_instances_unary(
        project=fake.project,
        zone=ZONE,
        instance_group_manager="fleet",
        instance_group_managers_delete_instances_request_resource=(
            compute_v1.InstanceGroupManagersDeleteInstancesRequest(
                instances=[_url(fake, n, zone) for n in names],
                skip_instances_on_validation_error=skip,
            )
        ),
        retry=None,
    )


def _recreate(fake: GceFake, names: list[str]) -> None:
    _migs(fake).recreate_instances_unary(
        project=fake.project,
        zone=ZONE,
        instance_group_manager="fleet",
        instance_group_managers_recreate_instances_request_resource=(
            compute_v1.InstanceGroupManagersRecreateInstancesRequest(
                instances=[_url(fake, n) for n in names]
            )
        ),
        retry=None,
    )


def _vm_id(fake: GceFake, name: str) -> str:
    vm = fake.instance(name)
    assert vm is not None, name
    return str(vm["id"])


def _running(fake: GceFake) -> list[compute_v1.ManagedInstance]:
    """List until every member runs (two reads boot a VM)."""
    for _ in range(4):
        found = _listed(fake)
        if all(m.instance_status == "RUNNING" and m.current_action == "NONE" for m in found):
            return found
    raise AssertionError(f"members never settled: {found}")


# templates


def test_a_template_insert_is_a_global_operation_and_keeps_the_properties(gce: GceFake) -> None:
    op = _template(gce)
    assert "/global/operations/" in op.self_link and not op.zone
    done = compute_v1.GlobalOperationsClient(**_options(gce)).wait(
        project=gce.project, operation=op.name
    )
    assert done.status == compute_v1.Operation.Status.DONE
    got = compute_v1.InstanceTemplatesClient(**_options(gce)).get(
        project=gce.project, instance_template="tpl"
    )
    assert got.properties.machine_type == MACHINE_TYPE
    assert got.properties.scheduling.provisioning_model == "SPOT"
    assert got.self_link.endswith(f"/projects/{gce.project}/global/instanceTemplates/tpl")


def test_a_template_is_checked_like_an_instance_insert(gce: GceFake) -> None:
    with pytest.raises(api_exc.BadRequest, match=r"properties\.scheduling\.automaticRestart"):
        _template(gce, automatic_restart=True)
    with pytest.raises(api_exc.BadRequest, match="do not support live migration"):
        _template(gce, on_host_maintenance="MIGRATE")
    _template(gce)
    with pytest.raises(api_exc.Conflict):
        _template(gce)
    assert gce.template("tpl") is not None


def test_a_template_machine_type_must_be_a_name_as_the_api_documents(gce: GceFake) -> None:
    templates = compute_v1.InstanceTemplatesClient(**_options(gce))
    props = _properties()
    props.machine_type = f"zones/{ZONE}/machineTypes/{MACHINE_TYPE}"
    with pytest.raises(api_exc.InternalServerError, match="machine type name"):
        templates.insert_unary(
            project=gce.project,
            instance_template_resource=compute_v1.InstanceTemplate(name="t", properties=props),
            retry=None,
        )
    props.machine_type = "n9-huge"
    with pytest.raises(api_exc.BadRequest, match="n9-huge"):
        templates.insert_unary(
            project=gce.project,
            instance_template_resource=compute_v1.InstanceTemplate(name="t", properties=props),
        )


def test_a_group_takes_its_template_by_url_id_or_terraforms_unique_link(gce: GceFake) -> None:
    _template(gce)
    template = gce.template("tpl")
    assert template is not None
    link, uid = template["selfLink"], template["id"]
    with pytest.raises(api_exc.NotFound):
        _group(gce, 1, template=f"{link}?uniqueId=1{uid}")
    _group(gce, 1, template=f"{link}?uniqueId={uid}")
    mig = gce.group("fleet")
    assert mig is not None and mig["instanceTemplate"] == f"{link}?uniqueId={uid}"
    (member,) = _running(gce)
    assert member.version.instance_template == f"{link}?uniqueId={uid}"
    by_id = compute_v1.InstanceTemplatesClient(**_options(gce)).get(
        project=gce.project, instance_template=uid
    )
    assert by_id.name == "tpl"


# groups


def test_a_group_refuses_a_missing_template_a_bad_base_name_and_a_duplicate(gce: GceFake) -> None:
    with pytest.raises(api_exc.NotFound, match="instanceTemplates/tpl"):
        _group(gce, 1)
    _template(gce)
    migs = _migs(gce)
    for base in ("Fleet", "fleet-###", "x" * 59):
        with pytest.raises(api_exc.BadRequest):
            migs.insert_unary(
                project=gce.project,
                zone=ZONE,
                instance_group_manager_resource=compute_v1.InstanceGroupManager(
                    name="fleet",
                    base_instance_name=base,
                    instance_template="global/instanceTemplates/tpl",
                ),
            )
    op = _group(gce, 0)
    assert op.operation_type == "compute.instanceGroupManagers.insert"
    assert op.target_link.endswith(f"/zones/{ZONE}/instanceGroupManagers/fleet")
    with pytest.raises(api_exc.Conflict):
        _group(gce, 0)
    with pytest.raises(api_exc.NotFound, match="instanceGroupManagers/nope"):
        migs.get(project=gce.project, zone=ZONE, instance_group_manager="nope", retry=None)


def test_members_are_created_from_the_template_under_random_names(gce: GceFake) -> None:
    _template(gce)
    _group(gce, 2)
    first = _listed(gce)
    assert len(first) == 2 and all(MEMBER_RE.match(m.name) for m in first)
    assert {m.current_action for m in first} == {"CREATING"}
    assert all(m.instance.endswith(f"/zones/{ZONE}/instances/{m.name}") for m in first)
    running = _running(gce)
    assert [m.name for m in running] == [m.name for m in first], "names are for life"
    vm = gce.instance(first[0].name)
    assert vm is not None and vm["id"] == str(running[0].id)
    assert vm["machineType"].endswith(f"/zones/{ZONE}/machineTypes/{MACHINE_TYPE}")
    assert vm["labels"] == {"spottrain-job": "job-a"}
    assert vm["scheduling"]["provisioningModel"] == "SPOT"
    metadata = {i["key"]: i["value"] for i in vm["metadata"]["items"]}
    assert metadata["startup-script"] == "echo boot"
    assert metadata["created-by"].endswith(f"/zones/{ZONE}/instanceGroupManagers/fleet")
    mig = _migs(gce).get(project=gce.project, zone=ZONE, instance_group_manager="fleet")
    assert mig.target_size == 2 and mig.status.is_stable and mig.current_actions.none == 2
    assert mig.versions[0].instance_template.endswith("/global/instanceTemplates/tpl")


def test_without_auto_reconcile_groups_act_only_when_told(manual: GceFake) -> None:
    _template(manual)
    _group(manual, 2)
    assert _listed(manual) == [] and manual.instances() == []
    manual.reconcile_groups()
    assert len(_listed(manual)) == 2 and len(manual.instances()) == 2


def test_resize_grows_and_shrinks_and_prefers_members_that_do_not_run(manual: GceFake) -> None:
    _template(manual)
    _group(manual, 2)
    manual.reconcile_groups()
    old = {m.name for m in _running(manual)}
    op = _migs(manual).resize_unary(
        project=manual.project, zone=ZONE, instance_group_manager="fleet", size=3
    )
    assert op.operation_type == "compute.instanceGroupManagers.resize" and op.zone.endswith(ZONE)
    manual.reconcile_groups()
    grown = {m.name for m in _listed(manual)}
    assert len(grown) == 3 and old < grown
    _migs(manual).resize_unary(
        project=manual.project, zone=ZONE, instance_group_manager="fleet", size=2
    )
    manual.reconcile_groups()
    assert {m.name for m in _listed(manual)} == old, "the booting member went first"
    with pytest.raises(api_exc.BadRequest):
        _migs(manual).resize_unary(
            project=manual.project, zone=ZONE, instance_group_manager="fleet", size=-1
        )


def test_delete_instances_removes_the_named_members_and_lowers_the_target(
    manual: GceFake,
) -> None:
    _template(manual)
    _group(manual, 3)
    manual.reconcile_groups()
    a, b, c = sorted(m.name for m in _running(manual))
    _delete(manual, [b])
    mig = manual.group("fleet")
    assert mig is not None and mig["targetSize"] == 2
    leaving = {m.name: m for m in _listed(manual)}[b]
    assert leaving.current_action == "DELETING" and leaving.instance_status == "RUNNING"
    manual.reconcile_groups()
    assert sorted(m.name for m in _listed(manual)) == [a, c]
    assert manual.instance(b) is None


def test_delete_instances_refuses_non_members_unless_told_to_skip_them(manual: GceFake) -> None:
    _template(manual)
    _group(manual, 2)
    manual.reconcile_groups()
    a, b = sorted(m.name for m in _running(manual))
    with pytest.raises(api_exc.BadRequest, match="not a member"):
        _delete(manual, [a, "stranger"])
    _delete(manual, [a])
    with pytest.raises(api_exc.BadRequest, match="already being deleted"):
        _delete(manual, [a])
    _delete(manual, [a, "stranger"], skip=True)
    mig = manual.group("fleet")
    assert mig is not None and mig["targetSize"] == 1, "skipped ones lower nothing"
    with pytest.raises(api_exc.BadRequest, match="not in zone"):
        _delete(manual, [b], skip=True, zone=OTHER_ZONE)
    with pytest.raises(api_exc.BadRequest, match="instance URL"):
        _migs(manual).delete_instances_unary(
            project=manual.project,
            zone=ZONE,
            instance_group_manager="fleet",
            instance_group_managers_delete_instances_request_resource=(
                compute_v1.InstanceGroupManagersDeleteInstancesRequest(
                    instances=["not a url"], skip_instances_on_validation_error=True
                )
            ),
        )


def test_recreate_instances_keeps_the_target_and_the_name_with_a_new_vm(
    manual: GceFake,
) -> None:
    _template(manual)
    _group(manual, 2)
    manual.reconcile_groups()
    a, b = sorted(m.name for m in _running(manual))
    old_id = _vm_id(manual, a)
    _recreate(manual, [a])
    assert {m.name: m.current_action for m in _listed(manual)}[a] == "RECREATING"
    manual.reconcile_groups()
    new_vm = manual.instance(a)
    assert new_vm is not None and new_vm["id"] != old_id and new_vm["status"] == "PROVISIONING"
    assert sorted(m.name for m in _running(manual)) == [a, b]
    mig = manual.group("fleet")
    assert mig is not None and mig["targetSize"] == 2
    with pytest.raises(api_exc.BadRequest, match="not a member"):
        _recreate(manual, ["stranger"])


@pytest.mark.parametrize("termination_action", ["STOP", "DELETE"])
def test_a_preempted_member_is_recreated_under_its_name(
    manual: GceFake, termination_action: str
) -> None:
    _template(manual, instance_termination_action=termination_action)
    _group(manual, 2)
    manual.reconcile_groups()
    a, _b = sorted(m.name for m in _running(manual))
    old_id = _vm_id(manual, a)
    manual.preempt(a)
    seen = {m.name: m for m in _listed(manual)}[a]
    assert seen.current_action == "NONE"
    assert seen.instance_status == ("TERMINATED" if termination_action == "STOP" else "")
    manual.reconcile_groups()
    back = {m.name: m for m in _listed(manual)}[a]
    assert back.current_action == "RECREATING" and back.instance_status == "STAGING"
    assert str(back.id) != old_id
    assert {m.name for m in _running(manual)} == {a, _b}


def test_a_member_stopped_behind_the_groups_back_is_recreated(gce: GceFake) -> None:
    _template(gce)
    _group(gce, 1)
    (a,) = (m.name for m in _running(gce))
    old_id = _vm_id(gce, a)
    gce.stop(a)
    back = _listed(gce)
    assert [m.name for m in back] == [a] and str(back[0].id) != old_id
    assert back[0].current_action == "RECREATING"


def test_a_stockout_leaves_the_member_creating_without_a_vm_until_capacity_returns(
    gce: GceFake,
) -> None:
    gce.inject_stockout(ZONE, MACHINE_TYPE)
    _template(gce)
    _group(gce, 1)
    for _ in range(2):  # it keeps trying, and keeps failing
        (member,) = _listed(gce)
        assert member.current_action == "CREATING" and not member.instance_status
        assert not member.id and member.instance.endswith(f"/instances/{member.name}")
        assert [e.code for e in member.last_attempt.errors.errors] == [
            "ZONE_RESOURCE_POOL_EXHAUSTED"
        ]
    assert gce.instances() == []
    gce.clear_faults()
    (back,) = _running(gce)
    assert back.name == member.name and not back.last_attempt.errors.errors


def test_listing_pages_only_for_paginated_groups(gce: GceFake) -> None:
    gce.page_size = 2
    _template(gce)
    _group(gce, 3)
    assert len(_listed(gce)) == 3
    assert gce.group_calls("fleet").count("instanceGroupManagers.listManagedInstances") == 1
    ignored = _migs(gce).list_managed_instances(
        request=compute_v1.ListManagedInstancesInstanceGroupManagersRequest(
            project=gce.project,
            zone=ZONE,
            instance_group_manager="fleet",
            page_token="2",
            max_results=1,
        ),
        retry=None,
    )
    assert len(list(ignored)) == 3, "a PAGELESS group ignores maxResults and pageToken"
    _migs(gce).insert_unary(
        project=gce.project,
        zone=ZONE,
        instance_group_manager_resource=compute_v1.InstanceGroupManager(
            name="paged",
            base_instance_name="paged",
            instance_template="global/instanceTemplates/tpl",
            target_size=3,
            list_managed_instances_results="PAGINATED",
        ),
    )
    assert len(_listed(gce, "paged")) == 3
    assert gce.group_calls("paged").count("instanceGroupManagers.listManagedInstances") == 2


def test_group_calls_are_recorded_in_order_failures_included(gce: GceFake) -> None:
    _template(gce)
    _group(gce, 1)
    gce.fail_next(1, 503, method="instanceGroupManagers.get")
    with pytest.raises(api_exc.ServiceUnavailable):
        _migs(gce).get(project=gce.project, zone=ZONE, instance_group_manager="fleet", retry=None)
    _listed(gce)
    assert gce.group_calls("fleet") == [
        "instanceGroupManagers.insert",
        "instanceGroupManagers.get",
        "instanceGroupManagers.listManagedInstances",
    ]
    assert gce.group_calls("other") == []


def test_create_group_provisions_as_terraform_would(gce: GceFake) -> None:
    mig = gce.create_group("fleet", ZONE, machine_type=MACHINE_TYPE, target_size=1, spot=False)
    assert mig["targetSize"] == 1 and mig["baseInstanceName"] == "fleet"
    template = gce.template("fleet-template")
    assert template is not None
    assert template["properties"]["scheduling"]["provisioningModel"] == "STANDARD"
    (member,) = _running(gce)
    assert MEMBER_RE.match(member.name)
    with pytest.raises(Exception, match="already exists"):
        gce.create_group("fleet", ZONE, machine_type=MACHINE_TYPE)

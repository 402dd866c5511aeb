"""The HTTP fake of the Compute Engine API, driven by the real ``google-cloud-compute`` client:
the parts the provider tests lean on without showing (paging, filters, operations, 404s)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests
from fakes.gce import GceFake
from google.api_core import exceptions as api_exc
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1

ZONE = "us-central1-a"
IMAGE = "projects/debian-cloud/global/images/family/debian-12"


@pytest.fixture
def gce() -> Iterator[GceFake]:
    with GceFake() as fake:
        yield fake
    assert fake.internal_errors == []


def _options(fake: GceFake) -> dict[str, object]:
    return {
        "credentials": AnonymousCredentials(),
        "client_options": ClientOptions(api_endpoint=fake.url),
        "transport": "rest",
    }


def _vm(name: str, job: str = "a", machine_type: str = "g2-standard-96") -> compute_v1.Instance:
    return compute_v1.Instance(
        name=name,
        machine_type=f"zones/{ZONE}/machineTypes/{machine_type}",
        labels={"spottrain-job": job},
        scheduling=compute_v1.Scheduling(on_host_maintenance="TERMINATE"),
        disks=[
            compute_v1.AttachedDisk(
                boot=True,
                initialize_params=compute_v1.AttachedDiskInitializeParams(source_image=IMAGE),
            )
        ],
        network_interfaces=[compute_v1.NetworkInterface()],
    )


def test_an_insert_operation_runs_until_polled_and_the_vm_boots_on_reads(gce: GceFake) -> None:
    instances = compute_v1.InstancesClient(**_options(gce))  # type: ignore[arg-type]
    operations = compute_v1.ZoneOperationsClient(**_options(gce))  # type: ignore[arg-type]
    op = instances.insert_unary(project=gce.project, zone=ZONE, instance_resource=_vm("vm-1"))
    assert op.status == compute_v1.Operation.Status.RUNNING
    assert op.operation_type == "insert" and op.target_link.endswith(
        f"/zones/{ZONE}/instances/vm-1"
    )
    done = operations.wait(project=gce.project, zone=ZONE, operation=op.name)
    assert done.status == compute_v1.Operation.Status.DONE and not done.error.errors
    statuses = [
        instances.get(project=gce.project, zone=ZONE, instance="vm-1").status for _ in range(3)
    ]
    assert statuses == ["STAGING", "RUNNING", "RUNNING"]
    vm = instances.get(project=gce.project, zone=ZONE, instance="vm-1")
    assert vm.zone.endswith(f"/zones/{ZONE}") and vm.id == int(done.target_id)
    assert vm.scheduling.automatic_restart and vm.scheduling.provisioning_model == "STANDARD"
    assert vm.network_interfaces[0].network_i_p.startswith("10.128.")


def test_a_duplicate_name_is_409_already_exists(gce: GceFake) -> None:
    instances = compute_v1.InstancesClient(**_options(gce))  # type: ignore[arg-type]
    instances.insert_unary(project=gce.project, zone=ZONE, instance_resource=_vm("vm-1"))
    with pytest.raises(api_exc.Conflict, match="already exists") as err:
        instances.insert_unary(project=gce.project, zone=ZONE, instance_resource=_vm("vm-1"))
    assert err.value.errors[0]["reason"] == "alreadyExists"


def test_unknown_zone_project_machine_type_and_instance_are_not_found(gce: GceFake) -> None:
    instances = compute_v1.InstancesClient(**_options(gce))  # type: ignore[arg-type]
    with pytest.raises(api_exc.NotFound, match="zones/mars-1a"):
        instances.get(project=gce.project, zone="mars-1a", instance="x", retry=None)
    with pytest.raises(api_exc.NotFound, match="projects/other-project"):
        instances.get(project="other-project", zone=ZONE, instance="x", retry=None)
    with pytest.raises(api_exc.NotFound, match="machineTypes/n9-huge"):
        instances.insert_unary(
            project=gce.project, zone=ZONE, instance_resource=_vm("vm-1", machine_type="n9-huge")
        )
    with pytest.raises(api_exc.NotFound):
        instances.delete_unary(project=gce.project, zone=ZONE, instance="nobody")


def test_zone_list_filters_by_label_and_pages(gce: GceFake) -> None:
    gce.page_size = 2
    instances = compute_v1.InstancesClient(**_options(gce))  # type: ignore[arg-type]
    for n in range(5):
        instances.insert_unary(
            project=gce.project, zone=ZONE, instance_resource=_vm(f"vm-{n}", "a" if n else "b")
        )
    pages = instances.list(
        request=compute_v1.ListInstancesRequest(
            project=gce.project, zone=ZONE, filter='labels.spottrain-job = "a"'
        )
    )
    assert sorted(vm.name for vm in pages) == ["vm-1", "vm-2", "vm-3", "vm-4"]
    both = instances.list(
        request=compute_v1.ListInstancesRequest(
            project=gce.project,
            zone=ZONE,
            filter='(labels.spottrain-job != "a") (name = "vm-0")',
        )
    )
    assert [vm.name for vm in both] == ["vm-0"]
    assert gce.count("instances.list") == 3, "two pages, then one"


def test_aggregated_list_marks_empty_zones_and_finds_machine_types(gce: GceFake) -> None:
    machine_types = compute_v1.MachineTypesClient(**_options(gce))  # type: ignore[arg-type]
    scopes = dict(
        machine_types.aggregated_list(
            request=compute_v1.AggregatedListMachineTypesRequest(
                project=gce.project, filter='name = "a2-ultragpu-8g"'
            )
        )
    )
    with_type = {k for k, v in scopes.items() if v.machine_types}
    assert f"zones/{ZONE}" in with_type
    assert "zones/us-west1-a" not in with_type, "the catalog has no a2-ultragpu-8g there"
    assert scopes["zones/us-west1-a"].warning.code == "NO_RESULTS_ON_PAGE"
    a2 = machine_types.get(project=gce.project, zone=ZONE, machine_type="a2-highgpu-8g")
    assert a2.accelerators[0].guest_accelerator_count == 8


def test_preemption_is_recorded_as_a_zone_operation(gce: GceFake) -> None:
    instances = compute_v1.InstancesClient(**_options(gce))  # type: ignore[arg-type]
    operations = compute_v1.ZoneOperationsClient(**_options(gce))  # type: ignore[arg-type]
    instances.insert_unary(project=gce.project, zone=ZONE, instance_resource=_vm("vm-1"))
    gce.preempt("vm-1")
    preempted = list(
        operations.list(
            request=compute_v1.ListZoneOperationsRequest(
                project=gce.project,
                zone=ZONE,
                filter='operationType = "compute.instances.preempted"',
            )
        )
    )
    assert [op.target_link.rsplit("/", 1)[-1] for op in preempted] == ["vm-1"]
    assert instances.get(project=gce.project, zone=ZONE, instance="vm-1").status == "TERMINATED"


def test_unknown_query_parameters_and_paths_are_refused(gce: GceFake) -> None:
    base = f"{gce.url}/compute/v1/projects/{gce.project}"
    assert requests.get(f"{base}/zones/{ZONE}/instances?orderBy=name", timeout=5).status_code == 400
    assert requests.get(f"{base}/zones/{ZONE}/disks", timeout=5).status_code == 404
    bad = requests.get(f"{base}/zones/{ZONE}/instances?filter=name%20eq%20x.*", timeout=5)
    assert bad.status_code == 400 and "filter" in bad.json()["error"]["message"]


def test_serial_port_output_keeps_the_apis_byte_positions(gce: GceFake) -> None:
    instances = compute_v1.InstancesClient(**_options(gce))  # type: ignore[arg-type]
    instances.insert_unary(project=gce.project, zone=ZONE, instance_resource=_vm("vm-1"))

    def read(start: int, port: int = 1) -> compute_v1.SerialPortOutput:
        request = compute_v1.GetSerialPortOutputInstanceRequest(
            project=gce.project, zone=ZONE, instance="vm-1", port=port, start=start
        )
        return instances.get_serial_port_output(request=request)

    assert (read(0).contents, read(0).next_) == ("", 0)
    gce.set_console("vm-1", "first\nsecond\n")
    whole = read(0)
    assert (whole.contents, whole.start, whole.next_) == ("first\nsecond\n", 0, 13)
    assert (read(6).contents, read(6).start) == ("second\n", 6)
    assert (read(-7).contents, read(-7).start) == ("second\n", 6)
    assert read(13).contents == "" and read(0, port=2).contents == ""
    # Only the newest 1 MB is kept: an older start is moved to the oldest byte kept.
    gce.set_console("vm-1", "x" * (1 << 20) + "tail\n")
    kept = read(0)
    assert kept.start == 5 and kept.contents.endswith("tail\n") and kept.next_ == (1 << 20) + 5


def test_serial_port_output_comes_from_the_console_source_and_404s_for_no_vm(
    gce: GceFake,
) -> None:
    instances = compute_v1.InstancesClient(**_options(gce))  # type: ignore[arg-type]
    instances.insert_unary(project=gce.project, zone=ZONE, instance_resource=_vm("vm-1"))
    gce.console_source = lambda name: f"booted {name}\n"
    request = compute_v1.GetSerialPortOutputInstanceRequest(
        project=gce.project, zone=ZONE, instance="vm-1", port=1
    )
    assert instances.get_serial_port_output(request=request).contents == "booted vm-1\n"
    missing = compute_v1.GetSerialPortOutputInstanceRequest(
        project=gce.project, zone=ZONE, instance="vm-2", port=1
    )
    with pytest.raises(api_exc.NotFound):
        instances.get_serial_port_output(request=missing)

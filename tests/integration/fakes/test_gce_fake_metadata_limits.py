"""The GCE fake refuses metadata as Compute Engine does, driven by the real
``google-cloud-compute`` client: a value over 256 KiB or all keys and values together over
512 KiB is answered 413 ``fieldSizeTooLarge``, naming the field, and creates nothing; a
startup-script of exactly 256 KiB boots."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fakes.gce import GceFake
from google.api_core import exceptions as api_exc
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1

ZONE = "us-central1-a"
IMAGE = "projects/debian-cloud/global/images/family/debian-12"
MACHINE_TYPE = "g2-standard-96"
VALUE_LIMIT = 262144
TOTAL_LIMIT = 524288
# A GPU type (the catalog's), which may not live-migrate.
_GPU_SCHEDULING = compute_v1.Scheduling(on_host_maintenance="TERMINATE")


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


def _metadata(items: dict[str, str]) -> compute_v1.Metadata:
    return compute_v1.Metadata(items=[compute_v1.Items(key=k, value=v) for k, v in items.items()])


def _properties(items: dict[str, str]) -> compute_v1.InstanceProperties:
    return compute_v1.InstanceProperties(
        machine_type=MACHINE_TYPE,
        metadata=_metadata(items),
        scheduling=_GPU_SCHEDULING,
        disks=[
            compute_v1.AttachedDisk(
                boot=True,
                initialize_params=compute_v1.AttachedDiskInitializeParams(source_image=IMAGE),
            )
        ],
        network_interfaces=[compute_v1.NetworkInterface()],
    )


def _insert(fake: GceFake, name: str, items: dict[str, str]) -> compute_v1.Operation:
    vm = compute_v1.Instance(
        name=name,
        machine_type=f"zones/{ZONE}/machineTypes/{MACHINE_TYPE}",
        metadata=_metadata(items),
        scheduling=_GPU_SCHEDULING,
        disks=[
            compute_v1.AttachedDisk(
                boot=True,
                initialize_params=compute_v1.AttachedDiskInitializeParams(source_image=IMAGE),
            )
        ],
        network_interfaces=[compute_v1.NetworkInterface()],
    )
    client = compute_v1.InstancesClient(**_options(fake))  # type: ignore[arg-type]
    return client.insert_unary(project=fake.project, zone=ZONE, instance_resource=vm)


def _template(fake: GceFake, name: str, items: dict[str, str]) -> compute_v1.Operation:
    client = compute_v1.InstanceTemplatesClient(**_options(fake))  # type: ignore[arg-type]
    return client.insert_unary(
        project=fake.project,
        instance_template_resource=compute_v1.InstanceTemplate(
            name=name, properties=_properties(items)
        ),
    )


def test_a_startup_script_of_exactly_256_kib_boots_intact(gce: GceFake) -> None:
    script = "#!/bin/bash\n" + "x" * (VALUE_LIMIT - 12)
    assert len(script) == VALUE_LIMIT
    _insert(gce, "vm-1", {"spottrain-boot": "1", "startup-script": script})
    got = compute_v1.InstancesClient(**_options(gce)).get(  # type: ignore[arg-type]
        project=gce.project, zone=ZONE, instance="vm-1"
    )
    values = {i.key: i.value for i in got.metadata.items}
    assert values["startup-script"] == script


def test_one_character_more_is_refused_413_naming_the_item_and_nothing_is_created(
    gce: GceFake,
) -> None:
    script = "y" * (VALUE_LIMIT + 1)
    with pytest.raises(api_exc.GoogleAPICallError) as err:
        _insert(gce, "vm-1", {"spottrain-boot": "1", "startup-script": script})
    assert err.value.code == 413
    assert err.value.message.endswith(
        ": Value for field 'resource.metadata.items[1].value' is too large: "
        f"maximum size {VALUE_LIMIT} character(s); actual size {VALUE_LIMIT + 1}."
    )
    assert err.value.errors[0]["reason"] == "fieldSizeTooLarge"
    assert gce.instance("vm-1") is None and gce.instances() == []


def test_a_template_is_held_to_the_same_limit_under_its_properties(gce: GceFake) -> None:
    _template(gce, "fits", {"startup-script": "z" * VALUE_LIMIT})
    with pytest.raises(api_exc.GoogleAPICallError) as err:
        _template(gce, "too-big", {"startup-script": "z" * (VALUE_LIMIT + 7)})
    assert err.value.code == 413
    assert "'resource.properties.metadata.items[0].value' is too large" in err.value.message
    assert gce.template("fits") is not None and gce.template("too-big") is None


def test_all_keys_and_values_together_may_reach_512_kib_and_no_more(gce: GceFake) -> None:
    # Two values at the limit leave room for nothing else: keys count towards the total.
    fits = {"a": "v" * (VALUE_LIMIT - 1), "b": "v" * (TOTAL_LIMIT - VALUE_LIMIT - 2)}
    assert sum(len(k) + len(v) for k, v in fits.items()) == TOTAL_LIMIT - 1
    _insert(gce, "vm-1", {**fits, "c": ""})  # exactly 512 KiB
    over = {**fits, "cc": ""}
    with pytest.raises(api_exc.GoogleAPICallError) as err:
        _insert(gce, "vm-2", over)
    assert err.value.code == 413
    assert err.value.message.endswith(
        ": Value for field 'resource.metadata' is too large: "
        f"maximum size {TOTAL_LIMIT} character(s); actual size {TOTAL_LIMIT + 1}."
    )
    with pytest.raises(api_exc.GoogleAPICallError, match=r"'resource\.properties\.metadata'"):
        _template(gce, "tpl", over)
    assert [vm["name"] for vm in gce.instances()] == ["vm-1"]


def test_sizes_are_counted_in_utf8_bytes_as_the_reference_states_them(gce: GceFake) -> None:
    two_byte = "\u00e9" * (VALUE_LIMIT // 2)  # 131072 characters, 262144 bytes
    _insert(gce, "vm-1", {"startup-script": two_byte})
    with pytest.raises(api_exc.GoogleAPICallError, match=f"actual size {VALUE_LIMIT + 1}"):
        _insert(gce, "vm-2", {"startup-script": two_byte + "!"})

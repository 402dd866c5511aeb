"""What the API refuses in an instance insert or an instance template's properties."""

from __future__ import annotations

import re
from typing import Any

from .common import API, MACHINE_TYPE_RE, ApiError, check_name, invalid, not_found
from .state import GceState

_LABEL_KEY_RE = re.compile(r"^[a-z][a-z0-9_-]{0,62}\Z")
_LABEL_VALUE_RE = re.compile(r"^[a-z0-9_-]{0,63}\Z")
_METADATA_KEY_RE = re.compile(r"^[a-zA-Z0-9_-]{1,128}\Z")
_IMAGE_RE = re.compile(
    r"^(https://www\.googleapis\.com/compute/v1/)?(projects/[a-z0-9.:-]+/)?global/images/"
    r"(family/)?[a-z]([-a-z0-9]*[a-z0-9])?\Z"
)
_GPU_FAMILIES = ("a2-", "a3-", "a4-", "g2-")
# Compute Engine's metadata limits: 256 KiB a value, 512 KiB for all keys and values together
# (the Metadata resource's reference). Sizes are counted in UTF-8 bytes, as the reference
# states them; the API's refusal words them in "character(s)", which is the same for ASCII.
_METADATA_VALUE_LIMIT = 256 * 1024
_METADATA_TOTAL_LIMIT = 512 * 1024


class ValidationMixin(GceState):
    def _validate_insert(self, zone: str, body: dict[str, Any]) -> str:
        check_name(body.get("name", ""))
        return self._validate_properties(body, zone, "resource")

    def _validate_properties(self, body: dict[str, Any], zone: str | None, at: str) -> str:
        """What an instance insert (in ``zone``) and an instance template's properties (``zone``
        None, fields under ``resource.properties``) must both satisfy; the machine type."""
        machine_type = self._check_machine_type(body, zone, at)
        _check_scheduling(body, machine_type, at)
        _check_network(body, machine_type, at)
        _check_labels_and_metadata(body, at)
        self._check_boot_disk(body, at)
        return machine_type

    def _check_machine_type(self, body: dict[str, Any], zone: str | None, at: str) -> str:
        mt = MACHINE_TYPE_RE.match(body.get("machineType", ""))
        if mt is None or not body.get("machineType"):
            raise ApiError(400, f"Invalid value for field '{at}.machineType': ''.", "invalid")
        machine_type = mt["type"]
        if zone is None:
            if machine_type != body["machineType"]:
                # As InstanceProperties.machineType documents it: a URL there is answered
                # INTERNAL_ERROR, which a client takes for a transient fault.
                raise ApiError(
                    500,
                    f"Internal error. Invalid value for field '{at}.machineType': "
                    f"'{body['machineType']}'. Instance templates take a machine type name.",
                    "INTERNAL_ERROR",
                )
            if not any(machine_type in types for types in self._machine_types.values()):
                raise invalid(
                    f"{at}.machineType",
                    machine_type,
                    f"Machine type with name '{machine_type}' does not exist.",
                )
        else:
            if mt["zone"] not in (None, zone):
                raise invalid(
                    f"{at}.machineType",
                    body["machineType"],
                    f"Machine type must be in zone {zone}.",
                )
            if machine_type not in self._machine_types[zone]:
                raise not_found(f"projects/{self.project}/zones/{zone}/machineTypes/{machine_type}")
        return machine_type

    def _check_boot_disk(self, body: dict[str, Any], at: str) -> None:
        boot = [d for d in body.get("disks", []) if d.get("boot")]
        if len(boot) != 1:
            raise ApiError(400, "Exactly one boot disk is required.", "invalid")
        params = boot[0].get("initializeParams", {})
        image = params.get("sourceImage", "")
        if not image and not boot[0].get("source"):
            raise ApiError(400, "The boot disk needs a sourceImage or a source.", "required")
        if image and not _IMAGE_RE.match(image):
            raise invalid(f"{at}.disks[0].initializeParams.sourceImage", image, "")
        if image in self._unknown_images:
            raise not_found(image.removeprefix(API + "/"))
        if "diskSizeGb" in params and int(params["diskSizeGb"]) < 10:
            raise invalid(f"{at}.disks[0].initializeParams.diskSizeGb", params["diskSizeGb"], "")


def _check_scheduling(body: dict[str, Any], machine_type: str, at: str) -> None:
    scheduling = body.get("scheduling", {})
    maintenance = scheduling.get("onHostMaintenance", "MIGRATE")
    gpus = machine_type.startswith(_GPU_FAMILIES) or bool(body.get("guestAccelerators"))
    if gpus and maintenance != "TERMINATE":
        raise ApiError(
            400,
            "Instances with guest accelerators do not support live migration.",
            "badRequest",
        )
    if machine_type.startswith(_GPU_FAMILIES) and body.get("guestAccelerators"):
        raise invalid(
            f"{at}.guestAccelerators",
            body["guestAccelerators"],
            f"Machine type {machine_type} comes with its accelerators attached; "
            "guestAccelerators must be empty.",
        )
    model = scheduling.get("provisioningModel", "STANDARD")
    if model not in ("STANDARD", "SPOT"):
        raise invalid(f"{at}.scheduling.provisioningModel", model, "")
    action = scheduling.get("instanceTerminationAction")
    if action not in (None, "STOP", "DELETE"):
        raise invalid(f"{at}.scheduling.instanceTerminationAction", action, "")
    if model == "SPOT":
        if maintenance != "TERMINATE":
            raise invalid(
                f"{at}.scheduling.onHostMaintenance",
                maintenance,
                "Spot VMs must have onHostMaintenance set to TERMINATE.",
            )
        if scheduling.get("automaticRestart", True):
            raise invalid(
                f"{at}.scheduling.automaticRestart",
                "true",
                "Spot VMs must have automaticRestart set to false.",
            )
    if "maxRunDuration" in scheduling and action is None:
        raise invalid(
            f"{at}.scheduling.instanceTerminationAction",
            "",
            "maxRunDuration requires an instanceTerminationAction.",
        )


def _check_network(body: dict[str, Any], machine_type: str, at: str) -> None:
    nics = body.get("networkInterfaces") or []
    if not nics:
        raise ApiError(400, "At least one network interface is required.", "required")
    if machine_type.startswith("a3-") and nics[0].get("nicType") != "GVNIC":
        raise invalid(
            f"{at}.networkInterfaces[0].nicType",
            nics[0].get("nicType", ""),
            f"Machine type {machine_type} requires the GVNIC network interface.",
        )


def _check_labels_and_metadata(body: dict[str, Any], at: str) -> None:
    labels = body.get("labels", {})
    if len(labels) > 64:
        raise invalid(f"{at}.labels", len(labels), "At most 64 labels.")
    for key, value in labels.items():
        if not _LABEL_KEY_RE.match(key):
            raise invalid(f"{at}.labels.{key}", key, "Label keys must match [a-z][a-z0-9_-]{0,62}.")
        if not isinstance(value, str) or not _LABEL_VALUE_RE.match(value):
            raise invalid(f"{at}.labels.{key}", value, "Label values must match [a-z0-9_-]{0,63}.")
    items = body.get("metadata", {}).get("items", [])
    for item in items:
        if not _METADATA_KEY_RE.match(item.get("key", "")):
            raise invalid(f"{at}.metadata.items.key", item.get("key", ""), "")
    total = 0
    for n, item in enumerate(items):
        size = _size(item.get("value", ""))
        if size > _METADATA_VALUE_LIMIT:
            raise _too_large(f"{at}.metadata.items[{n}].value", _METADATA_VALUE_LIMIT, size)
        total += _size(item.get("key", "")) + size
    if total > _METADATA_TOTAL_LIMIT:
        raise _too_large(f"{at}.metadata", _METADATA_TOTAL_LIMIT, total)


def _size(text: str) -> int:
    return len(text.encode("utf-8"))


def _too_large(field_name: str, limit: int, size: int) -> ApiError:
    """The API's refusal of an oversized field: HTTP 413 with reason ``fieldSizeTooLarge``
    (as ``googleapi: Error 413: Value for field 'resource.properties.metadata.items[27].value'
    is too large: maximum size 262144 character(s); actual size 277764., fieldSizeTooLarge``
    reads when a client prints it)."""
    return ApiError(
        413,
        f"Value for field '{field_name}' is too large: maximum size {limit} character(s); "
        f"actual size {size}.",
        "fieldSizeTooLarge",
    )

"""Preempted VMs on Compute Engine: the ``compute.instances.preempted`` operations that name
them, and what a VM looks like once preempted."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from spottrain.cloud.base.provider import Instance, InstanceState
from spottrain.cloud.gcp.api import _last
from spottrain.cloud.gcp.errors import CallTarget
from spottrain.cloud.gcp.settings import PREEMPTED_OPERATION


@dataclass
class Preemptions:
    """VMs named by ``compute.instances.preempted`` operations, by (zone, numeric id), or by
    (zone, name) for operations that carry no id."""

    ids: set[tuple[str, int]] = field(default_factory=set)
    names: set[tuple[str, str]] = field(default_factory=set)

    def names_vm(self, zone: str, name: str, instance_id: int) -> bool:
        # The numeric id tells a VM from an earlier one that had the same name.
        return (zone, instance_id) in self.ids or (zone, name) in self.names


def preempted_in(
    project: str,
    zones: Iterable[str],
    operations: Any,
    list_all: Callable[[CallTarget, Callable[..., Any], Any], list[Any]],
) -> Preemptions:
    """The VMs that ``compute.instances.preempted`` operations in these zones name (Compute
    Engine marks a preempted VM only by that operation), asked with ``operations`` (a zone
    operations client) through ``list_all``."""
    from google.cloud import compute_v1

    found = Preemptions()
    for zone in zones:
        target = CallTarget(zone=zone)
        request = compute_v1.ListZoneOperationsRequest(
            project=project,
            zone=zone,
            filter=f'operationType = "{PREEMPTED_OPERATION}"',
        )
        for op in list_all(target, operations.list, request):
            if op.operation_type != PREEMPTED_OPERATION:
                continue
            if op.target_id:
                found.ids.add((zone, op.target_id))
            elif op.target_link:
                found.names.add((zone, _last(op.target_link)))
    return found


def interrupted(inst: Instance, state: InstanceState) -> Instance:
    """``inst`` as preemption left it."""
    return replace(
        inst,
        state=state,
        interrupted=True,
        state_reason=f"preempted by Compute Engine ({PREEMPTED_OPERATION})",
    )

"""Completing an Auto Scaling termination lifecycle action once the emergency checkpoint has
committed (VMs of a ``terraform/aws`` fleet).

The group's termination hook holds a VM that is being removed in ``Terminating:Wait``; the
instance metadata then says ``Terminated`` (the agent's ``scale-in`` notice) and the agent
drains. Completing the action tells the group it may terminate the VM now instead of waiting
for the hook's heartbeat timeout. It is completed only after the drain, so never before the
checkpoint commits (or its deadline passed): completing earlier would let the VM die mid-save.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from spottrain.cloud.base import region_of_zone
from spottrain.cloud.this_vm import ThisVmError
from spottrain.cloud.this_vm.aws import AwsThisVm

log = logging.getLogger(__name__)

ATTEMPTS = 3


@dataclass(frozen=True)
class AsgHook:
    """Which group and hook hold this VM.

    Attributes:
        group: The Auto Scaling group's name.
        hook: The termination lifecycle hook's name.
        instance_id: This VM.
        region: The group's region.
    """

    group: str
    hook: str
    instance_id: str
    region: str


def hook_region(zone: str) -> str:
    """``us-east-1a`` -> ``us-east-1`` (``AWS_REGION`` wins when set)."""
    env = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    return env or region_of_zone("aws", zone)


def complete(
    hook: AsgHook,
    *,
    vm: AwsThisVm | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> str | None:
    """Complete the lifecycle action with ``CONTINUE`` through this VM's own identity
    (:class:`~spottrain.cloud.this_vm.aws.AwsThisVm`). Returns None when done (or when no
    action was pending: the group moved on, or the controller completed it), else what went
    wrong after :data:`ATTEMPTS` tries; the hook's heartbeat timeout then ends the wait.
    """
    vm = vm or AwsThisVm()
    problem = ""
    for attempt in range(ATTEMPTS):
        try:
            vm.complete_lifecycle_action(
                group=hook.group, hook=hook.hook, instance_id=hook.instance_id, region=hook.region
            )
            return None
        except ThisVmError as e:
            problem = str(e)
            log.warning("complete_lifecycle_action failed (try %d): %s", attempt + 1, problem)
            sleep(1.0 * (attempt + 1))
    return problem

"""An AWS Auto Scaling group (``terraform/aws``) behind the
:class:`~spottrain.cloud.base.groups.Group` interface.

The group is created with scale-in protection on, so it never picks a victim itself; the
controller removes a member by name with ``TerminateInstanceInAutoScalingGroup``. A
termination lifecycle hook then holds the member in ``Terminating:Wait`` until its agent,
which sees the ``Terminated`` target lifecycle state in the instance metadata, has committed
its emergency checkpoint and completes the action (or the controller does, for a member
whose agent is gone).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from spottrain.cloud.aws.errors import classify_error, error_code
from spottrain.cloud.aws.settings import CLOUD
from spottrain.cloud.base import TAG_JOB, BadRequestError, Market, ProviderError
from spottrain.cloud.base.groups import GroupView, Member, MemberState
from spottrain.lazy_import import lazy_import

log = logging.getLogger(__name__)

_STATES = {
    "Pending": MemberState.PENDING,
    "Pending:Wait": MemberState.PENDING,
    "Pending:Proceed": MemberState.PENDING,
    "InService": MemberState.RUNNING,
    "Terminating": MemberState.LEAVING,
    "Terminating:Wait": MemberState.LEAVING,
    "Terminating:Proceed": MemberState.LEAVING,
    "Detaching": MemberState.LEAVING,
    "EnteringStandby": MemberState.LEAVING,
    "Standby": MemberState.LEAVING,
    "Terminated": MemberState.GONE,
    "Detached": MemberState.GONE,
}
# Answers that mean "already done": the member left the group, or no hook holds it.
_GONE_MARKERS = ("not found", "no managed instance", "no active lifecycle action")


class AwsAsgGroup:
    """One Auto Scaling group.

    Args:
        region: The group's region.
        name: The group's name (Terraform output ``spottrain_fleet.group``).
        run_id: The run; members must carry it as their ``spottrain-job`` tag.
        lifecycle_hook: The termination hook's name, or None when the group has none.
        session: A ``boto3.Session``; None uses the environment's credential chain.
        endpoint_url: Another endpoint for both Auto Scaling and EC2 (moto in tests).
    """

    cloud = CLOUD

    def __init__(
        self,
        region: str,
        name: str,
        run_id: str,
        *,
        lifecycle_hook: str | None = None,
        session: Any = None,
        endpoint_url: str | None = None,
    ) -> None:
        boto3 = lazy_import("boto3", needs="the AWS group needs boto3", extra="aws")
        from botocore.config import Config  # botocore comes with boto3

        self.region = region
        self.name = name
        self.run_id = run_id
        self.lifecycle_hook = lifecycle_hook
        with self._errors():
            session = session or boto3.Session()
            config = Config(retries={"mode": "standard", "max_attempts": 3}, read_timeout=60)
            self._asg = session.client(
                "autoscaling", region_name=region, endpoint_url=endpoint_url, config=config
            )
            self._ec2 = session.client(
                "ec2", region_name=region, endpoint_url=endpoint_url, config=config
            )

    @contextmanager
    def _errors(self, service: str = "Auto Scaling") -> Iterator[None]:
        try:
            yield
        except ProviderError:
            raise
        except Exception as e:
            raise classify_error(e, region=self.region, service=service) from e

    def _group(self) -> dict[str, Any]:
        with self._errors():
            found = self._asg.describe_auto_scaling_groups(AutoScalingGroupNames=[self.name])
        groups = found.get("AutoScalingGroups", [])
        if not groups:
            raise BadRequestError(
                CLOUD,
                f"no Auto Scaling group {self.name!r} in {self.region}: set fleet.group to the "
                "Terraform output spottrain_fleet.group (and fleet.region to its region)",
            )
        return dict(groups[0])

    def _details(self, ids: list[str]) -> dict[str, dict[str, Any]]:
        """Type, market and job tag of each instance, from EC2."""
        if not ids:
            return {}
        out: dict[str, dict[str, Any]] = {}
        with self._errors("EC2"):
            pages = self._ec2.get_paginator("describe_instances").paginate(InstanceIds=ids)
            for page in pages:
                for res in page.get("Reservations", []):
                    for inst in res.get("Instances", []):
                        out[inst["InstanceId"]] = inst
        return out

    def describe(self) -> GroupView:
        g = self._group()
        listed = g.get("Instances", [])
        details = self._details([i["InstanceId"] for i in listed])
        members = []
        foreign = []
        for i in listed:
            iid = i["InstanceId"]
            d = details.get(iid, {})
            tags = {t["Key"]: t["Value"] for t in d.get("Tags", [])}
            if d and tags.get(TAG_JOB) != self.run_id:
                foreign.append(f"{iid} ({TAG_JOB}={tags.get(TAG_JOB, 'missing')})")
                continue
            lifecycle = str(i.get("LifecycleState", ""))
            state = _STATES.get(lifecycle, MemberState.PENDING)
            ec2_state = str(d.get("State", {}).get("Name", ""))
            if ec2_state in ("shutting-down", "terminated", "stopping", "stopped"):
                # EC2 knows first: the group notices a reclaimed VM up to a minute later.
                state, lifecycle = MemberState.GONE, f"{lifecycle} (EC2: {ec2_state})"
            members.append(
                Member(
                    id=iid,
                    zone=str(i.get("AvailabilityZone", "")),
                    instance_type=str(i.get("InstanceType") or d.get("InstanceType", "")),
                    state=state,
                    status=lifecycle,
                    market=Market.SPOT
                    if d.get("InstanceLifecycle") == "spot" or not d
                    else Market.ON_DEMAND,
                    waiting_on_hook=lifecycle.startswith("Terminating:Wait"),
                )
            )
        if foreign and not members:
            raise BadRequestError(
                CLOUD,
                f"group {self.name!r} holds VMs of another job: {', '.join(foreign[:3])}; "
                f"its VMs must carry {TAG_JOB}={self.run_id} (the module's run_id variable)",
            )
        return GroupView(
            name=self.name,
            target=int(g.get("DesiredCapacity", 0)),
            members=tuple(members),
            max_size=int(g["MaxSize"]) if "MaxSize" in g else None,
        )

    def set_target(self, size: int) -> None:
        g = self._group()
        if int(g.get("DesiredCapacity", 0)) == size:
            return
        if size > int(g.get("MaxSize", size)):
            raise BadRequestError(
                CLOUD,
                f"group {self.name!r} may hold at most {g['MaxSize']} VMs, asked for {size}: "
                "raise the module's max_size variable or lower the job's node count",
            )
        with self._errors():
            self._asg.set_desired_capacity(
                AutoScalingGroupName=self.name, DesiredCapacity=size, HonorCooldown=False
            )
        log.info("aws group %s: desired capacity %d", self.name, size)

    def remove(self, ids: Sequence[str], *, replace: bool) -> None:
        for iid in ids:
            try:
                with self._errors():
                    self._asg.terminate_instance_in_auto_scaling_group(
                        InstanceId=iid, ShouldDecrementDesiredCapacity=not replace
                    )
            except BadRequestError as e:
                if not _already_done(e):
                    raise
            log.info("aws group %s: removed %s (replace=%s)", self.name, iid, replace)

    def release(self, member_id: str) -> None:
        if not self.lifecycle_hook:
            return
        try:
            with self._errors():
                self._asg.complete_lifecycle_action(
                    LifecycleHookName=self.lifecycle_hook,
                    AutoScalingGroupName=self.name,
                    InstanceId=member_id,
                    LifecycleActionResult="CONTINUE",
                )
        except BadRequestError as e:
            if not _already_done(e):
                raise


def _already_done(e: BadRequestError) -> bool:
    """The member already left the group, or no hook holds it any more."""
    cause = e.__cause__
    if cause is None or error_code(cause) != "ValidationError":
        return False
    return any(m in str(e).lower() for m in _GONE_MARKERS)

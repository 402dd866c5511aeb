"""An Auto Scaling group in moto, built the way ``terraform/aws`` builds it, with the
termination lifecycle hook behaviour moto lacks.

moto 5.2 stores lifecycle hooks but never applies them: ``TerminateInstanceInAutoScalingGroup``
terminates at once, and ``CompleteLifecycleAction`` is not implemented (the server answers
that it does not know the action). :func:`install_hooks` fills the gap for the moto accounts
of :class:`AsgFleet` harnesses only, as the Auto Scaling documentation describes it:

- removing a member of a group with an ``EC2_INSTANCE_TERMINATING`` hook puts it in
  ``Terminating:Wait`` and lowers the desired capacity at once when asked to; the VM runs on;
- ``CompleteLifecycleAction`` on a waiting member terminates it; a member removed without
  decrementing the desired capacity is then replaced; on a member no hook holds it answers
  ``ValidationError: No active Lifecycle Action found``;
- every call of either is recorded with its time, so tests can order them against a
  checkpoint's commit.

The hook's heartbeat timeout (the wait ending by itself) is not modelled: tests complete or
release every held member explicitly. moto also launches a mixed-instances group's spot share
without marking it spot; real EC2 reports ``InstanceLifecycle: spot``, so the emulation marks
the instances of an all-spot group that way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import boto3
from moto.autoscaling import models as asg_models
from moto.autoscaling.exceptions import ValidationError
from moto.autoscaling.responses import AutoScalingResponse
from moto.backends import get_backend
from moto.core.responses import EmptyResult

from spottrain.cloud.aws.group import AwsAsgGroup
from spottrain.cloud.base import TAG_JOB

from .aws import AwsHarness

TERMINATING = "autoscaling:EC2_INSTANCE_TERMINATING"
WAIT = "Terminating:Wait"


@dataclass(frozen=True)
class TerminateCall:
    instance_id: str
    decrement: bool
    at: float


@dataclass(frozen=True)
class Completion:
    instance_id: str
    hook: str
    result: str
    at: float


@dataclass
class _Account:
    held: dict[str, TerminateCall] = field(default_factory=dict)
    terminations: list[TerminateCall] = field(default_factory=list)
    completions: list[Completion] = field(default_factory=list)
    on_hold: list[Callable[[str], None]] = field(default_factory=list)


_LOCK = threading.RLock()
_ACCOUNTS: dict[str, _Account] = {}
_installed = False


def _terminating_hooks(backend: Any, group_name: str) -> list[Any]:
    return [
        h
        for h in backend.lifecycle_hooks.values()
        if h.auto_scaling_group_name == group_name and h.lifecycle_transition == TERMINATING
    ]


def install_hooks() -> None:
    """Patch moto's Auto Scaling (once per process) with the hook behaviour above, for the
    accounts registered by :class:`AsgFleet` only."""
    global _installed
    with _LOCK:
        if _installed:
            return
        original_terminate = asg_models.AutoScalingBackend.terminate_instance
        original_replace = asg_models.FakeAutoScalingGroup.replace_autoscaling_group_instances

        def terminate_instance(self: Any, instance_id: str, should_decrement: bool) -> Any:
            acct = _ACCOUNTS.get(self.account_id)
            state = next(
                (
                    s
                    for g in self.autoscaling_groups.values()
                    for s in g.instance_states
                    if s.instance.id == instance_id
                ),
                None,
            )
            if acct is None:
                return original_terminate(self, instance_id, should_decrement)
            if state is None:
                # What Auto Scaling answers (moto fails with a server error instead).
                raise ValidationError(
                    f"Instance Id not found - No managed instance found for instance ID: "
                    f"{instance_id}"
                )
            group = state.instance.autoscaling_group
            if not _terminating_hooks(self, group.name):
                return original_terminate(self, instance_id, should_decrement)
            call = TerminateCall(instance_id, should_decrement, time.time())
            with _LOCK:
                acct.terminations.append(call)
                already = instance_id in acct.held
                if not already:
                    acct.held[instance_id] = call
                    state.lifecycle_state = WAIT
                    if should_decrement:
                        group.desired_capacity -= 1
                callbacks = list(acct.on_hold)
            if not already:
                for cb in callbacks:
                    cb(instance_id)
            return asg_models.TerminateInstanceActivity(state.instance, group.desired_capacity)

        def replace_instances(self: Any, count_needed: int, propagated_tags: Any) -> None:
            before = {s.instance.id for s in self.instance_states}
            original_replace(self, count_needed, propagated_tags)
            if self.autoscaling_backend.account_id not in _ACCOUNTS:
                return
            dist = (self.mixed_instances_policy or {}).get("InstancesDistribution", {})
            all_spot = self.mixed_instances_policy and (
                int(dist.get("OnDemandBaseCapacity", 0)) == 0
                and int(dist.get("OnDemandPercentageAboveBaseCapacity", 100)) == 0
            )
            if all_spot:
                for s in self.instance_states:
                    if s.instance.id not in before:
                        s.instance.lifecycle = "spot"

        def complete_lifecycle_action(self: Any) -> Any:
            backend = self.autoscaling_backend
            acct = _ACCOUNTS.get(backend.account_id)
            iid = self._get_param("InstanceId")
            hook = self._get_param("LifecycleHookName")
            result = self._get_param("LifecycleActionResult")
            with _LOCK:
                held = acct.held.pop(iid, None) if acct else None
                if held is None:
                    raise ValidationError(
                        f"No active Lifecycle Action found with instance ID {iid}"
                    )
                acct.completions.append(Completion(iid, hook, result, time.time()))  # type: ignore[union-attr]
            group_name = self._get_param("AutoScalingGroupName")
            group = backend.autoscaling_groups[group_name]
            group.instance_states = [s for s in group.instance_states if s.instance.id != iid]
            backend.ec2_backend.terminate_instances([iid])
            if not held.decrement:
                group.set_desired_capacity(group.desired_capacity)
            return EmptyResult()

        asg_models.AutoScalingBackend.terminate_instance = terminate_instance  # type: ignore[method-assign]
        asg_models.FakeAutoScalingGroup.replace_autoscaling_group_instances = replace_instances  # type: ignore[method-assign]
        AutoScalingResponse.complete_lifecycle_action = complete_lifecycle_action  # type: ignore[attr-defined]
        _installed = True


class AsgFleet:
    """What ``terraform/aws`` creates, in moto: a launch template with IMDSv2 required, an
    all-spot mixed-instances group over every default subnet with scale-in protection on,
    the job tag propagated at launch, and a termination lifecycle hook.

    Args:
        aws: The moto harness (its account and server).
        run_id: The job tag's value.
        size: The group's initial desired capacity.
        max_size: The group's cap.
        hook: Whether the group has the termination hook.
    """

    def __init__(
        self,
        aws: AwsHarness,
        run_id: str,
        *,
        size: int = 2,
        max_size: int = 6,
        hook: bool = True,
    ) -> None:
        install_hooks()
        self.aws = aws
        self.run_id = run_id
        self.name = f"spottrain-{run_id}"
        self.hook_name = f"{self.name}-drain" if hook else None
        with _LOCK:
            self._acct = _ACCOUNTS.setdefault(aws.account_id, _Account())
        self.session = self.new_session()
        self.client = self.session.client(
            "autoscaling", region_name=aws.region, endpoint_url=aws.endpoint_url
        )
        ec2 = aws.admin()
        template = ec2.create_launch_template(
            LaunchTemplateName=self.name,
            LaunchTemplateData={
                "ImageId": aws.settings.image_ids[aws.region],
                "InstanceType": aws.instance_type,
                "MetadataOptions": {"HttpTokens": "required", "HttpPutResponseHopLimit": 2},
            },
        )["LaunchTemplate"]
        self.client.create_auto_scaling_group(
            AutoScalingGroupName=self.name,
            MinSize=0,
            MaxSize=max_size,
            DesiredCapacity=size,
            VPCZoneIdentifier=",".join(aws.settings.subnet_ids.values()),
            NewInstancesProtectedFromScaleIn=True,
            MixedInstancesPolicy={
                "LaunchTemplate": {
                    "LaunchTemplateSpecification": {
                        "LaunchTemplateId": template["LaunchTemplateId"],
                        "Version": "$Latest",
                    },
                    "Overrides": [{"InstanceType": aws.instance_type}],
                },
                "InstancesDistribution": {
                    "OnDemandBaseCapacity": 0,
                    "OnDemandPercentageAboveBaseCapacity": 0,
                    "SpotAllocationStrategy": "price-capacity-optimized",
                },
            },
            Tags=[{"Key": TAG_JOB, "Value": run_id, "PropagateAtLaunch": True}],
        )
        if self.hook_name:
            self.client.put_lifecycle_hook(
                LifecycleHookName=self.hook_name,
                AutoScalingGroupName=self.name,
                LifecycleTransition=TERMINATING,
                HeartbeatTimeout=600,
                DefaultResult="CONTINUE",
            )

    def new_session(self) -> boto3.Session:
        """A session on the harness's account that reaches Auto Scaling too."""
        session = self.aws.new_session()
        session.events.register("before-send.autoscaling", self.aws._route)
        return session

    def process_env(self) -> dict[str, str]:
        """Environment for another process (an agent, a controller) to reach this group as
        boto3 does on a VM: an IAM user's access key in this harness's moto account (moto maps
        the key to the account) and the endpoint in ``AWS_ENDPOINT_URL``."""
        session = self.new_session()
        session.events.register("before-send.iam", self.aws._route)
        iam = session.client("iam", region_name=self.aws.region, endpoint_url=self.aws.endpoint_url)
        user = f"agent-{self.run_id}"
        iam.create_user(UserName=user)
        key = iam.create_access_key(UserName=user)["AccessKey"]
        return {
            "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
            "AWS_ENDPOINT_URL": self.aws.endpoint_url,
            "AWS_REGION": self.aws.region,
            "AWS_DEFAULT_REGION": self.aws.region,
        }

    def group(self) -> AwsAsgGroup:
        """The controller's view of this group (a new client, as a controller builds one)."""
        return AwsAsgGroup(
            self.aws.region,
            self.name,
            self.run_id,
            lifecycle_hook=self.hook_name,
            session=self.new_session(),
            endpoint_url=self.aws.endpoint_url,
        )

    # --- what moto holds ------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        groups = self.client.describe_auto_scaling_groups(AutoScalingGroupNames=[self.name])
        return dict(groups["AutoScalingGroups"][0])

    @property
    def desired(self) -> int:
        return int(self.describe()["DesiredCapacity"])

    def states(self) -> dict[str, str]:
        """Lifecycle state of every member, by instance id."""
        return {i["InstanceId"]: i["LifecycleState"] for i in self.describe()["Instances"]}

    def in_service(self) -> list[str]:
        return sorted(i for i, s in self.states().items() if s == "InService")

    def ec2_state(self, instance_id: str) -> str:
        backend = get_backend("ec2")[self.aws.account_id][self.aws.region]
        return str(backend.get_instance(instance_id).state)

    @property
    def terminations(self) -> list[TerminateCall]:
        with _LOCK:
            return list(self._acct.terminations)

    @property
    def completions(self) -> list[Completion]:
        with _LOCK:
            return list(self._acct.completions)

    @property
    def held(self) -> list[str]:
        with _LOCK:
            return sorted(self._acct.held)

    def interrupt(self, instance_id: str) -> None:
        """EC2 reclaims a member: the VM terminates, and the group, seeing it gone,
        launches another (moto's EC2 does not tell its Auto Scaling; real AWS does)."""
        self.aws.interrupt(instance_id)
        get_backend("autoscaling")[self.aws.account_id][self.aws.region].notify_terminate_instances(
            [instance_id]
        )

    def on_hold(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(instance_id)`` when a member starts waiting on the hook (the test
        turns it into the ``Terminated`` target lifecycle state of that VM's metadata)."""
        with _LOCK:
            self._acct.on_hold.append(callback)

    def close(self) -> None:
        with _LOCK:
            _ACCOUNTS.pop(self.aws.account_id, None)
        get_backend("autoscaling").pop(self.aws.account_id, None)

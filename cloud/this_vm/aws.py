"""This EC2 VM: its id and region from IMDSv2, ``ec2:TerminateInstances`` on itself and
``autoscaling:CompleteLifecycleAction`` for it, with the instance profile's credentials.

The instance profile needs, for the dead man's switch (the ``terraform/aws`` agent role has
it)::

    {"Effect": "Allow", "Action": "ec2:TerminateInstances",
     "Resource": "arn:aws:ec2:*:*:instance/*",
     "Condition": {"StringEquals": {"aws:ResourceTag/spottrain-job": "<run id>"}}}

Its blast radius: code on a VM of the run may terminate that run's VMs, no other. Without it
the call is refused and the agent powers the VM off instead (launched with
``InstanceInitiatedShutdownBehavior=terminate``, the VM then terminates too, unless the agent
runs in a container that cannot power off its host).
"""

from __future__ import annotations

import os
from typing import Any

from . import TIMEOUT_S, ThisVmError, http_call

ENDPOINT_ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
DEFAULT_ENDPOINT = "http://169.254.169.254"
TOKEN_PATH = "/latest/api/token"
ID_PATH = "/latest/meta-data/instance-id"
REGION_PATH = "/latest/meta-data/placement/region"
PERMISSION_FIX = (
    "grant this VM's instance profile ec2:TerminateInstances on the run's VMs (the "
    "README's \"Dead man's switch\" has the policy)"
)


class AwsThisVm:
    """This EC2 VM.

    Args:
        metadata_endpoint: IMDS's URL; default ``$AWS_EC2_METADATA_SERVICE_ENDPOINT``, else
            ``http://169.254.169.254``.
        session: the boto3 session (default: a new one, which finds the instance profile's
            credentials through IMDS and honours ``AWS_ENDPOINT_URL_EC2``).
        endpoint_url: the API's URL, when not AWS's own (tests).
        timeout_s: each request's socket timeout.
    """

    def __init__(
        self,
        *,
        metadata_endpoint: str | None = None,
        session: Any = None,
        endpoint_url: str | None = None,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        base = metadata_endpoint or os.environ.get(ENDPOINT_ENV) or DEFAULT_ENDPOINT
        self.metadata = base.rstrip("/")
        self.session = session
        self.endpoint_url = endpoint_url
        self.timeout_s = timeout_s

    def identity(self) -> tuple[str, str]:
        """This VM's instance id and region, from IMDSv2.

        Raises:
            ThisVmError: IMDS did not answer them.
        """
        status, token = http_call(
            "PUT",
            self.metadata + TOKEN_PATH,
            {"X-aws-ec2-metadata-token-ttl-seconds": "60"},
            proxy=False,
            timeout=self.timeout_s,
        )
        if status != 200 or not token:
            raise ThisVmError(
                f"IMDSv2 at {self.metadata} gave no token (HTTP {status}): is this an EC2 VM "
                "with the metadata service on?"
            )
        header = {"X-aws-ec2-metadata-token": token.decode(errors="replace").strip()}
        found = []
        for path in (ID_PATH, REGION_PATH):
            status, body = http_call(
                "GET", self.metadata + path, header, proxy=False, timeout=self.timeout_s
            )
            value = body.decode(errors="replace").strip()
            if status != 200 or not value:
                raise ThisVmError(f"IMDSv2 answered HTTP {status} for {path}: not an EC2 VM?")
            found.append(value)
        return found[0], found[1]

    def _client(self, service: str, region: str) -> Any:
        try:
            if self.session is None:
                import boto3

                self.session = boto3.Session()
            from botocore.config import Config

            config = Config(
                connect_timeout=self.timeout_s,
                read_timeout=self.timeout_s,
                retries={"max_attempts": 3, "mode": "standard"},
            )
            return self.session.client(
                service, region_name=region, endpoint_url=self.endpoint_url, config=config
            )
        except ImportError:
            raise ThisVmError(
                "boto3 is not installed in the agent's environment: install spottrain[aws] "
                "(in the job's image, for a code.image job)"
            ) from None
        except Exception as exc:
            raise ThisVmError(
                f"cannot build an {service} client: {type(exc).__name__}: {exc}"
            ) from None

    def end(self) -> str:
        """Terminate this VM (``ec2:TerminateInstances`` on its own id).

        Raises:
            ThisVmError: no id from IMDS, no boto3, or EC2 refused (the message names the
                permission to grant).
        """
        instance_id, region = self.identity()
        client = self._client("ec2", region)
        try:
            client.terminate_instances(InstanceIds=[instance_id])
        except Exception as exc:
            raise ThisVmError(_refusal("ec2:TerminateInstances", instance_id, exc)) from None
        return f"ec2:TerminateInstances {instance_id} in {region}"

    def complete_lifecycle_action(
        self, *, group: str, hook: str, instance_id: str, region: str
    ) -> None:
        """Complete the termination lifecycle action that holds this VM, with ``CONTINUE``.
        Done, too, when no action is pending (the group moved on, or the controller
        completed it).

        Raises:
            ThisVmError: no boto3, or Auto Scaling refused or could not be reached.
        """
        from spottrain.cloud.aws.errors import lifecycle_action_gone

        client = self._client("autoscaling", region)
        try:
            client.complete_lifecycle_action(
                LifecycleHookName=hook,
                AutoScalingGroupName=group,
                InstanceId=instance_id,
                LifecycleActionResult="CONTINUE",
            )
        except Exception as exc:
            if lifecycle_action_gone(exc):
                return
            raise ThisVmError(
                _refusal("autoscaling:CompleteLifecycleAction", instance_id, exc)
            ) from None


def _refusal(action: str, instance_id: str, exc: Exception) -> str:
    from spottrain.cloud.aws.errors import error_code

    code = error_code(exc)
    said = f"{type(exc).__name__}: {exc}"
    if code in ("UnauthorizedOperation", "AccessDenied", "AccessDeniedException"):
        fix = PERMISSION_FIX if action.startswith("ec2:") else f"grant the profile {action}"
        return f"{action} on {instance_id} refused ({code}); {fix}"
    return f"{action} on {instance_id} failed: {said}"

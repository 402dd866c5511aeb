"""The AWS provider over moto's EC2, served on 127.0.0.1, with the faults a test can cause.

moto runs in server mode (``ThreadedMotoServer``) so that tests which start controller
processes can point them at the same fake EC2. Its state still lives in this process, which
is how :meth:`AwsHarness.interrupt` marks a VM as taken back by EC2.

Isolation: every harness gets its own moto account (the ``x-moto-account-id`` header, added to
every request), so harnesses alive at the same time, or one after another in a test session,
never see each other's VMs, AMIs or subnets. Nothing reaches real AWS: every session here has
fake credentials, every client is pointed at the server, and a hook refuses any request whose
URL is not the server's.

Faults are botocore event hooks registered on the harness's boto3 session *before* any
client exists (a client copies its session's hooks when it is created), and they read the
harness's fault state on every call, so faults can be switched on and off at any time.

moto 5.2 gaps filled here: ``CreatePlacementGroup`` and ``DescribePlacementGroups`` are not
implemented (the server answers 500), so the harness answers them itself from
:attr:`AwsHarness.placement_groups`. moto answers ``GetConsoleOutput`` with one canned text
for every VM; the harness answers it itself for a VM given a console with
:meth:`AwsHarness.set_console`. moto also records neither ``Placement.GroupName`` nor an
EFA ``InterfaceType``; :attr:`AwsHarness.calls` keeps every call's parameters so tests can
check what was asked for.
"""

from __future__ import annotations

import base64
import copy
import logging
import secrets
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import boto3
from botocore.awsrequest import AWSResponse
from botocore.exceptions import ClientError
from moto.backends import get_backend
from moto.ec2.models.instances import StateReason
from moto.server import ThreadedMotoServer

from spottrain.catalog import Catalog
from spottrain.cloud.aws import AwsProvider, AwsSettings
from spottrain.cloud.base import Market, OfferQuery, Provider

REGION = "us-east-1"
# moto lists p4d.24xlarge in us-east-1a to 1d, with its real GPU count (8) and EFA support.
INSTANCE_TYPE = "p4d.24xlarge"
FAKE_CREDENTIALS = {
    "aws_access_key_id": "testing",
    "aws_secret_access_key": "testing",
    "aws_session_token": "testing",
}
SPOT_INTERRUPTION = "Server.SpotInstanceTermination"


@dataclass(frozen=True)
class Call:
    """One EC2 call as the client made it: operation, region, and the API parameters."""

    operation: str
    region: str
    params: dict[str, Any]


def client_error(code: str, message: str, operation: str, status: int = 400) -> ClientError:
    """A ``ClientError`` as botocore raises it for an EC2 error answer."""
    return ClientError(
        {
            "Error": {"Code": code, "Message": message},
            "ResponseMetadata": {"HTTPStatusCode": status},
        },
        operation,
    )


class AwsHarness:
    """An :class:`AwsProvider` against a private moto EC2 server (see the module docstring).

    Attributes:
        provider: the provider under test, with :attr:`settings`.
        settings: a GPU AMI, the default subnet of every zone and the default security group,
            all in :data:`REGION`.
        session: the boto3 session every provider here uses (fake credentials, fault hooks).
        endpoint_url: the moto server.
        account_id: this harness's moto account.
        calls: every EC2 call made through :attr:`session`, oldest first.
        placement_groups: the placement groups created, by name (moto lacks them).
    """

    def __init__(self, *, region: str = REGION, instance_type: str = INSTANCE_TYPE) -> None:
        # Werkzeug logs every request of the server at INFO; that is noise in test output.
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        self.region = region
        self.instance_type = instance_type
        self.account_id = f"{secrets.randbelow(10**12):012d}"
        self.calls: list[Call] = []
        self.placement_groups: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._auth_fault = False
        self._capacity_faults: set[tuple[str, str]] = set()
        self._errors: dict[str, tuple[str, str, int]] = {}
        self._admins: dict[str, Any] = {}
        self._consoles: dict[str, str] = {}
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint_url = f"http://{host}:{port}"
        try:
            self.session = self.new_session()
            admin = self.admin(region)
            image = admin.register_image(
                Name="spottrain-test-gpu",
                Description="stands in for a GPU AMI (Deep Learning Base AMI)",
                Architecture="x86_64",
                RootDeviceName="/dev/sda1",
                BlockDeviceMappings=[{"DeviceName": "/dev/sda1", "Ebs": {"VolumeSize": 100}}],
                VirtualizationType="hvm",
            )["ImageId"]
            subnets = admin.describe_subnets(
                Filters=[{"Name": "default-for-az", "Values": ["true"]}]
            )["Subnets"]
            group = admin.describe_security_groups(GroupNames=["default"])["SecurityGroups"][0]
            self.settings = AwsSettings(
                regions=[region],
                image_ids={region: image},
                subnet_ids={s["AvailabilityZone"]: s["SubnetId"] for s in subnets},
                security_group_ids=[group["GroupId"]],
            )
            self.provider: Provider = self.new_provider()
        except BaseException:
            self.close()
            raise

    # --- ProviderHarness -----------------------------------------------------------------

    def query(self) -> OfferQuery:
        """One 8-GPU type in the four zones moto offers it in, spot and on-demand."""
        return OfferQuery(
            regions=(self.region,),
            instance_types=(self.instance_type,),
            markets=(Market.SPOT, Market.ON_DEMAND),
        )

    def inject_capacity_error(self, zone: str, instance_type: str) -> None:
        """Launches of ``instance_type`` in ``zone`` fail with InsufficientInstanceCapacity."""
        with self._lock:
            self._capacity_faults.add((zone, instance_type))

    def inject_auth_error(self) -> None:
        """Every call fails with AuthFailure, as with revoked credentials."""
        with self._lock:
            self._auth_fault = True

    def inject_error(
        self, operation: str, code: str, message: str = "injected", status: int = 400
    ) -> None:
        """Every call of ``operation`` (``RunInstances``) fails with this EC2 error code."""
        with self._lock:
            self._errors[operation] = (code, message, status)

    def clear_faults(self) -> None:
        """Undo every injected fault."""
        with self._lock:
            self._auth_fault = False
            self._capacity_faults.clear()
            self._errors.clear()

    def interrupt(self, instance_id: str) -> None:
        """EC2 takes the spot VM back: terminated, with the spot interruption reason.

        Raises:
            KeyError: no VM with that id in this harness's account.
        """
        backends = get_backend("ec2")[self.account_id]
        for region in self.settings.regions:
            backend = backends[region]
            if instance_id not in {i.id for i in backend.all_instances()}:
                continue
            instance = backend.get_instance(instance_id)
            backend.terminate_instances([instance_id])
            # What EC2 reports for a VM it reclaimed, in place of moto's "user initiated".
            instance.state_reason = StateReason(
                f"{SPOT_INTERRUPTION}: Spot instance termination", SPOT_INTERRUPTION
            )
            instance._reason = "Service initiated"
            _keep_deleted_nics(instance)
            return
        raise KeyError(f"no instance {instance_id} in moto account {self.account_id}")

    def set_console(self, instance_id: str, text: str) -> None:
        """``GetConsoleOutput`` of ``instance_id`` answers ``text`` (base64, as EC2 does)
        instead of moto's canned boot log."""
        with self._lock:
            self._consoles[instance_id] = text

    def close(self) -> None:
        """Stop the server and drop this account's state."""
        self._server.stop()
        for service in ("ec2", "iam"):
            get_backend(service).pop(self.account_id, None)

    # --- more levers for the AWS tests ----------------------------------------------------

    def new_session(self, *, faults: bool = True) -> boto3.Session:
        """A boto3 session on this harness's account, with the fault hooks unless not wanted."""
        session = boto3.Session(region_name=self.region, **FAKE_CREDENTIALS)
        session.events.register("before-send.ec2", self._route)
        if faults:
            session.events.register("before-parameter-build.ec2", self._before_call)
            session.events.register(
                "before-call.ec2.CreatePlacementGroup", self._create_placement_group
            )
            session.events.register(
                "before-call.ec2.DescribePlacementGroups", self._describe_placement_groups
            )
            session.events.register("after-call.ec2.TerminateInstances", self._after_terminate)
            session.events.register("before-call.ec2.GetConsoleOutput", self._console_output)
        return session

    def new_provider(
        self,
        *,
        session: boto3.Session | None = None,
        catalog: Catalog | None = None,
        clock: Callable[[], float] | None = None,
        **changes: Any,
    ) -> AwsProvider:
        """Another provider on this fake EC2 (a restarted controller), with settings changes."""
        kwargs: dict[str, Any] = {} if clock is None else {"clock": clock}
        return AwsProvider(
            replace(self.settings, **changes),
            session=session or self.session,
            catalog=catalog,
            endpoint_url=self.endpoint_url,
            **kwargs,
        )

    def admin(self, region: str | None = None) -> Any:
        """An EC2 client that bypasses faults and call records, to look at what moto holds."""
        region = region or self.region
        with self._lock:
            client = self._admins.get(region)
        if client is None:
            client = self.new_session(faults=False).client(
                "ec2", region_name=region, endpoint_url=self.endpoint_url
            )
            with self._lock:
                self._admins[region] = client
        return client

    def forget_calls(self) -> None:
        """Empty :attr:`calls`."""
        with self._lock:
            self.calls.clear()

    def calls_of(self, operation: str) -> list[Call]:
        """The recorded calls of one operation."""
        with self._lock:
            return [c for c in self.calls if c.operation == operation]

    # --- hooks ---------------------------------------------------------------------------

    def _route(self, request: Any, **_: Any) -> None:
        if not str(request.url).startswith(self.endpoint_url):
            raise RuntimeError(f"a test request escaped moto: {request.url}")
        request.headers["x-moto-account-id"] = self.account_id

    def _before_call(
        self, params: Mapping[str, Any], model: Any, context: Mapping[str, Any], **_: Any
    ) -> None:
        operation = str(model.name)
        with self._lock:
            self.calls.append(
                Call(operation, str(context.get("client_region", "")), copy.deepcopy(dict(params)))
            )
            if self._auth_fault:
                raise client_error(
                    "AuthFailure",
                    "AWS was not able to validate the provided access credentials",
                    operation,
                    401,
                )
            injected = self._errors.get(operation)
            if injected is not None:
                raise client_error(injected[0], injected[1], operation, injected[2])
            if operation == "RunInstances":
                where = (
                    params.get("Placement", {}).get("AvailabilityZone", ""),
                    params.get("InstanceType", ""),
                )
                if where in self._capacity_faults:
                    raise client_error(
                        "InsufficientInstanceCapacity",
                        f"We currently do not have sufficient {where[1]} capacity in the "
                        f"Availability Zone you requested ({where[0]}).",
                        operation,
                        500,
                    )

    def _after_terminate(
        self, parsed: Mapping[str, Any], context: Mapping[str, Any], **_: Any
    ) -> None:
        backend = get_backend("ec2")[self.account_id][str(context.get("client_region", ""))]
        for row in parsed.get("TerminatingInstances", []):
            _keep_deleted_nics(backend.get_instance(row["InstanceId"]))

    def _create_placement_group(self, params: Mapping[str, Any], **_: Any) -> tuple[Any, Any]:
        name = _query_param(params, "GroupName")
        with self._lock:
            if name in self.placement_groups:
                return _answer(
                    400,
                    {
                        "Error": {
                            "Code": "InvalidPlacementGroup.Duplicate",
                            "Message": f"The Placement Group '{name}' already exists.",
                        }
                    },
                )
            group = {
                "GroupName": name,
                "Strategy": _query_param(params, "Strategy"),
                "State": "available",
            }
            self.placement_groups[name] = group
        return _answer(200, {"PlacementGroup": group})

    def _describe_placement_groups(self, **_: Any) -> tuple[Any, Any]:
        with self._lock:
            return _answer(200, {"PlacementGroups": list(self.placement_groups.values())})

    def _console_output(self, params: Mapping[str, Any], **_: Any) -> tuple[Any, Any] | None:
        instance_id = _query_param(params, "InstanceId")
        with self._lock:
            text = self._consoles.get(instance_id)
        if text is None:
            return None  # moto answers (its canned text, or InvalidInstanceID.NotFound)
        return _answer(
            200,
            {
                "InstanceId": instance_id,
                "Output": base64.b64encode(text.encode()).decode(),
            },
        )


def _keep_deleted_nics(instance: Any) -> None:
    """Work around moto deleting a terminated VM's network interfaces again on every later
    TerminateInstances (which then fails with InvalidNetworkInterfaceID.NotFound; EC2 itself
    accepts terminating a terminated VM)."""
    for nic in instance.nics.values():
        nic.delete_on_termination = False


def _query_param(request_dict: Mapping[str, Any], name: str) -> str:
    """A parameter of a serialised EC2 (query protocol) request."""
    return str(request_dict.get("body", {}).get(name, ""))


def _answer(status: int, parsed: dict[str, Any]) -> tuple[AWSResponse, dict[str, Any]]:
    """A reply botocore takes from a ``before-call`` hook instead of sending the request."""
    parsed.setdefault("ResponseMetadata", {})["HTTPStatusCode"] = status
    return AWSResponse("http://moto.invalid/", status, {}, None), parsed

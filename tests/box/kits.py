"""A whole "cloud in a box" per cloud: the fakes, the hypervisor over them, a real Redis with a
password, the package index, and what the controller's process needs to reach them.

:class:`AwsKit` is moto (EC2, S3, Secrets Manager, IAM) behind the EC2 front (user data over
16 KB refused, the console served, IAM denials, the account set on every request).
:class:`GcpKit` is the GCE fake, the GCS fake, the Secret Manager fake, Google's token
endpoint (the controller's credentials: a service-account key file) and a git server. Each
gives the spec's cloud section (``aws:``/``gcp:``, with the box's endpoints), the job's
store, and :meth:`Kit.controller_env`: the environment of a ``spottrain`` command run in the
box's switch namespace, where every address is ``10.77.0.1:<port>``, as for the VMs.

Nothing leaves the box: the controller's pip sees only the box's index (no pip configuration
of this machine: ``PIP_CONFIG_FILE=/dev/null``), its clouds only the fakes.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fakes.gce import GceFake
from fakes.gcs_server import GcsServer
from fakes.git_http import GitHttpServer
from fakes.google_oauth import GoogleOAuthFake
from fakes.secret_manager import SecretManagerFake

from spottrain.controller.run.embedded_redis import RedisServer

from .ec2_front import Ec2Front
from .hypervisor import AwsCloud, GceCloud, Hypervisor
from .network import GATEWAY
from .tls import BoxCa

REGION = "us-east-1"
# The regions a box's AWS offers VMs in (each with the box's image): an image that cannot
# boot is blocked region by region before the run gives up.
REGIONS = ("us-east-1", "us-west-2", "eu-west-1")
GCP_REGION = "us-central1"
PROFILE = "spottrain-agent"
REDIS_SECRET = "box-redis-password"
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Kit:
    """What both clouds' kits share: the hypervisor, Redis, the index, a home."""

    workdir: Path
    index_port: int
    hypervisor: Hypervisor | None = None
    redis: RedisServer | None = None
    password: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    # Bucket names are one namespace across moto's accounts (as across AWS's): a kit's own.
    bucket: str = field(default_factory=lambda: f"spottrain-box-{secrets.token_hex(4)}")
    _closers: list[Any] = field(default_factory=list)

    @property
    def box(self) -> Hypervisor:
        assert self.hypervisor is not None
        return self.hypervisor

    def _common(self) -> None:
        self.redis = RedisServer(password=self.password).start()
        self._closers.append(self.redis)
        self.redis_url = f"redis://{self.box.expose(self.redis.port)}/0"
        self.index_url = f"http://{self.box.expose(self.index_port)}/simple"

    def client(self) -> Any:
        assert self.redis is not None
        return self.redis.client(decode_responses=True)

    def base_env(self, home: Path) -> dict[str, str]:
        keep = {"LANG", "LC_ALL", "TERM", "TMPDIR"}
        env = {k: v for k, v in os.environ.items() if k in keep}
        env.update(
            {
                "PATH": f"{Path(sys.executable).parent}:/usr/sbin:/usr/bin:/sbin:/bin",
                "HOME": str(home),
                "SPOTTRAIN_HOME": str(home),
                "PYTHONUNBUFFERED": "1",
                "PIP_CONFIG_FILE": os.devnull,  # this machine's pip configuration stays out
                "SPOTTRAIN_REDIS_PASSWORD": self.password,
            }
        )
        return env

    def close(self) -> None:
        if self.hypervisor is not None:
            self.hypervisor.close()
        for c in reversed(self._closers):
            with contextlib.suppress(Exception):
                c.close()


class AwsKit(Kit):
    """AWS in a box (see the module docstring)."""

    cloud = "aws"

    def start(self, **hypervisor: Any) -> AwsKit:
        self.account_id = f"{secrets.randbelow(10**12):012d}"
        self.front = Ec2Front(account_id=self.account_id).start()
        self._closers.append(self.front)
        self.hypervisor = Hypervisor(
            AwsCloud(self.account_id, REGIONS), self.workdir / "box", **hypervisor
        ).start()
        self.front.console_source = self.box.console
        self._common()
        self.api = "http://" + self.box.expose(self.front.port)
        admin = self.admin
        self.images = {
            region: admin("ec2", region).register_image(
                Name="box-debian-12",
                Description="the box's image: the host's /usr, a fresh /etc",
                Architecture="x86_64",
                RootDeviceName="/dev/sda1",
                BlockDeviceMappings=[{"DeviceName": "/dev/sda1", "Ebs": {"VolumeSize": 100}}],
                VirtualizationType="hvm",
            )["ImageId"]
            for region in REGIONS
        }
        admin("iam").create_role(RoleName=PROFILE, AssumeRolePolicyDocument="{}")
        admin("iam").create_instance_profile(InstanceProfileName=PROFILE)
        admin("iam").add_role_to_instance_profile(InstanceProfileName=PROFILE, RoleName=PROFILE)
        admin("s3").create_bucket(Bucket=self.bucket)
        admin("secretsmanager").create_secret(Name=REDIS_SECRET, SecretString=self.password)
        return self

    def admin(self, service: str, region: str = REGION) -> Any:
        import boto3

        return boto3.client(
            service,
            endpoint_url=self.front.url,
            region_name=region,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def section(self) -> dict[str, Any]:
        return {
            "images": dict(self.images),
            "instance_profile": PROFILE,
            "placement_group": False,
            "endpoints": {"s3": self.api, "secretsmanager": self.api},
        }

    def store(self, run: str) -> str:
        return f"s3://{self.bucket}/{run}"

    def controller_env(self, home: Path) -> dict[str, str]:
        return {
            **self.base_env(home),
            "AWS_ENDPOINT_URL": self.api,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": REGION,
        }


class GcpKit(Kit):
    """GCP in a box (see the module docstring)."""

    cloud = "gcp"

    def start(self, **hypervisor: Any) -> GcpKit:
        self.gce = GceFake().start()
        self.gcs = GcsServer().start()
        self.oauth = GoogleOAuthFake().start()
        self.secrets = SecretManagerFake(self.gce.project).start()
        self.ca = BoxCa.create()
        tls = self.ca.server_context(self.workdir / "tls", GATEWAY)
        self.git = GitHttpServer(tls=tls)
        self.git.start()
        self._closers += [self.gce, self.gcs, self.oauth, self.secrets, self.git]
        self.hypervisor = Hypervisor(
            GceCloud(self.gce), self.workdir / "box", ca_pem=self.ca.cert_pem, **hypervisor
        ).start()
        self.gce.console_source = self.box.console
        self._common()
        self.compute = "http://" + self.box.expose(self.gce.port)
        self.storage = "http://" + self.box.expose(self.gcs.port)
        self.secretmanager = "http://" + self.box.expose(self.secrets.port)
        self.token_uri = "http://" + self.box.expose(self.oauth.port) + "/token"
        self.git_url = "https://" + self.box.expose(self.git.port)
        self.gcs.create_bucket(self.bucket)
        self.secrets.add(REDIS_SECRET, self.password)
        key = self.oauth.add_service_account(project_id=self.gce.project)
        key["token_uri"] = self.token_uri
        self.key_file = self.workdir / "controller-key.json"
        self.key_file.write_text(json.dumps(key))
        self.key_file.chmod(0o600)
        return self

    def section(self) -> dict[str, Any]:
        return {
            "project": self.gce.project,
            "image": "projects/debian-cloud/global/images/family/debian-12",
            "service_account": f"spottrain-agent@{self.gce.project}.iam.gserviceaccount.com",
            "endpoints": {
                "compute": self.compute,
                "storage": self.storage,
                "secretmanager": self.secretmanager,
            },
        }

    def store(self, run: str) -> str:
        return f"gs://{self.bucket}/{run}"

    def git_repo(self, name: str, files: dict[str, str], token: str) -> tuple[str, str]:
        """A private repository on the box's git server: its URL as the box sees it, and
        its commit."""
        url, commit = self.git.create_repo(name, files, private=True, token=token)
        return url.replace(self.git.url, self.git_url), commit

    def controller_env(self, home: Path) -> dict[str, str]:
        return {
            **self.base_env(home),
            "GOOGLE_APPLICATION_CREDENTIALS": str(self.key_file),
            "API_ENDPOINT_OVERRIDE": self.storage,
        }


@contextlib.contextmanager
def kit(cloud: str, workdir: Path, index_port: int, **hypervisor: Any) -> Iterator[Kit]:
    k: Kit = AwsKit(workdir, index_port) if cloud == "aws" else GcpKit(workdir, index_port)
    try:
        yield k.start(**hypervisor)  # type: ignore[attr-defined]
    finally:
        k.close()

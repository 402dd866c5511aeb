"""This Compute Engine VM: ``instances.delete`` on itself through the Compute REST API, with
its service account's token from the metadata server (plain HTTP: no client library needed).

It needs, on the VM's service account, the IAM permission ``compute.instances.delete`` on
this VM, and an access scope that covers Compute (``cloud-platform``, the controller's
default ``gcp.scopes``, or ``compute``). No predefined role holds that permission alone
(``roles/compute.instanceAdmin.v1`` holds far more): grant a custom role with only
``compute.instances.delete``. IAM conditions cannot test a VM's labels, so its blast radius
is every VM the binding's resource (project, or a condition on ``resource.name``, e.g. the
prefix ``projects/P/zones/Z/instances/st-`` of the controller's VMs) reaches: code on the VM
could delete those too. Without it the call is refused (403) and the agent powers the VM off
instead: a stopped GCP VM bills no machine or GPU, only its disks, until ``spottrain down``.
"""

from __future__ import annotations

import json
import os
from urllib.parse import quote

from . import TIMEOUT_S, ThisVmError, http_call

HOST_ENV = "GCE_METADATA_HOST"
DEFAULT_HOST = "metadata.google.internal"
# gcloud's own override of the Compute API's address (``https://HOST/compute/v1/``).
API_ENV = "CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE"
DEFAULT_API = "https://compute.googleapis.com/compute/v1/"
FLAVOR = {"Metadata-Flavor": "Google"}
PERMISSION_FIX = (
    "grant this VM's service account compute.instances.delete on itself (a custom role) "
    "and the cloud-platform or compute scope (the README's \"Dead man's switch\" says how)"
)


class GcpThisVm:
    """This Compute Engine VM.

    Args:
        metadata_host: ``host[:port]`` of the metadata server; default ``$GCE_METADATA_HOST``,
            else ``metadata.google.internal``.
        api_endpoint: the Compute API's base (``https://HOST/compute/v1/``); default
            ``$CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE``, else Google's.
        timeout_s: each request's socket timeout.
    """

    def __init__(
        self,
        *,
        metadata_host: str | None = None,
        api_endpoint: str | None = None,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        host = metadata_host or os.environ.get(HOST_ENV) or DEFAULT_HOST
        self.metadata = "http://" + host.removeprefix("http://").rstrip("/")
        self.api = (api_endpoint or os.environ.get(API_ENV) or DEFAULT_API).rstrip("/")
        self.timeout_s = timeout_s

    def meta(self, path: str) -> str:
        """One value of the metadata server (``instance/name``, ...).

        Raises:
            ThisVmError: not answered, or not by the metadata server.
        """
        url = f"{self.metadata}/computeMetadata/v1/{path}"
        status, body = http_call("GET", url, FLAVOR, proxy=False, timeout=self.timeout_s)
        value = body.decode(errors="replace").strip()
        if status != 200 or not value:
            missing = path.startswith("instance/service-accounts/") and status == 404
            why = "the VM has no service account" if missing else "not a Compute Engine VM?"
            raise ThisVmError(f"the metadata server answered HTTP {status} for {path}: {why}")
        return value

    def identity(self) -> tuple[str, str, str]:
        """This VM's project, zone and name.

        Raises:
            ThisVmError: the metadata server did not answer them.
        """
        zone = self.meta("instance/zone").rsplit("/", 1)[-1]  # projects/NUMBER/zones/ZONE
        return self.meta("project/project-id"), zone, self.meta("instance/name")

    def token(self) -> str:
        """The service account's access token.

        Raises:
            ThisVmError: no service account, or a token the metadata server garbled.
        """
        raw = self.meta("instance/service-accounts/default/token")
        try:
            token = json.loads(raw)["access_token"]
        except (ValueError, KeyError, TypeError):
            raise ThisVmError("the metadata server's token answer holds no access_token") from None
        if not isinstance(token, str) or not token:
            raise ThisVmError("the metadata server's token answer holds no access_token")
        return token

    def end(self) -> str:
        """Delete this VM (``instances.delete`` on itself); the deletion goes on after the
        call returns, and shuts the VM down.

        Raises:
            ThisVmError: no identity or token from the metadata server, or the API refused
                (the message names the permission to grant).
        """
        project, zone, name = self.identity()
        headers = {"Authorization": f"Bearer {self.token()}"}
        url = f"{self.api}/projects/{quote(project)}/zones/{quote(zone)}/instances/{quote(name)}"
        status, body = http_call("DELETE", url, headers, proxy=True, timeout=self.timeout_s)
        if status == 200:
            return f"compute.instances.delete {zone}/{name}"
        said = _api_message(body)
        if status in (401, 403):
            raise ThisVmError(
                f"instances.delete on {zone}/{name} refused (HTTP {status}: {said}); "
                + PERMISSION_FIX
            )
        raise ThisVmError(f"instances.delete on {zone}/{name} failed: HTTP {status}: {said}")


def _api_message(body: bytes) -> str:
    """The ``error.message`` of a Google API error answer, else its first bytes."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body[:200].decode(errors="replace").strip() or "no message"
    return str(message)

"""This VM, as its own agent sees it: end it through its cloud's API with the VM's own
identity, and (AWS) complete its Auto Scaling lifecycle action.

Beside object storage (:mod:`spottrain.cloud.storage`), this is the only part of the clouds
the agent uses. Every call runs on the VM it names, with the identity its metadata server
gives (AWS: the instance profile through IMDSv2; GCP: the service account's token), so it
needs no settings from the controller. One module per cloud, the SDK (boto3) imported
inside; GCP uses the Compute REST API directly, so an image without ``google-cloud-compute``
still reaches it.

* :mod:`.aws`: ``ec2:TerminateInstances`` on its own instance id (read from IMDSv2), and
  ``autoscaling:CompleteLifecycleAction``;
* :mod:`.gcp`: ``instances.delete`` on itself (project, zone and name from the metadata
  server, the token of its service account);
* :mod:`.local`: the local cloud's VM process is told to end (SIGUSR2, a shutdown from
  inside).
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Mapping
from http.client import HTTPException
from typing import Protocol

TIMEOUT_S = 10.0
# Metadata and API answers here are small; a misrouted request must not flood the agent.
MAX_BODY = 256 * 1024


class ThisVmError(Exception):
    """This VM could not be ended (or its lifecycle action completed) through its cloud's
    API; the message names the cause and the fix, in one line."""


class ThisVm(Protocol):
    """The VM this process runs on.

    ``end`` asks the cloud to end the VM for good (AWS: terminated; GCP: deleted, its
    auto-delete disks with it), which stops the VM's billing where a power-off may not. It
    returns once the cloud accepted the request; the VM then shuts down (its agent gets the
    usual SIGTERM). Calling it again is harmless.
    """

    def end(self) -> str:
        """End this VM.

        Returns:
            What was asked of the cloud, one line (for the event stream).

        Raises:
            ThisVmError: the VM's identity could not be read, the cloud refused (no
                permission, the SDK missing), or could not be reached.
        """
        ...


def this_vm(cloud: str, *, metadata_endpoint: str | None = None) -> ThisVm:
    """The VM this process runs on, in ``cloud``.

    Args:
        cloud: ``aws``, ``gcp`` or ``local``.
        metadata_endpoint: the metadata server, when not the cloud's own (AWS: a URL; GCP:
            ``host[:port]``).

    Raises:
        ValueError: an unknown cloud.
    """
    if cloud == "aws":
        from .aws import AwsThisVm

        return AwsThisVm(metadata_endpoint=metadata_endpoint)
    if cloud == "gcp":
        from .gcp import GcpThisVm

        return GcpThisVm(metadata_host=metadata_endpoint)
    if cloud == "local":
        from .local import LocalThisVm

        return LocalThisVm()
    raise ValueError(f"cloud {cloud!r} is not one of aws, gcp, local")


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_DEFAULT = urllib.request.build_opener()


def http_call(
    method: str,
    url: str,
    headers: Mapping[str, str] | None = None,
    *,
    proxy: bool,
    timeout: float = TIMEOUT_S,
) -> tuple[int, bytes]:
    """One request; an error status is an answer, not an exception.

    Args:
        proxy: whether ``HTTPS_PROXY`` and friends apply; never for a metadata server, which
            is link-local (a proxy would answer for its own VM, or not at all).

    Raises:
        ThisVmError: the request failed (refused, timed out, dropped).
    """
    req = urllib.request.Request(url, method=method, headers=dict(headers or {}))
    opener = _DEFAULT if proxy else _NO_PROXY
    try:
        try:
            with opener.open(req, timeout=timeout) as resp:
                return int(resp.status), resp.read(MAX_BODY)
        except urllib.error.HTTPError as exc:
            try:
                return exc.code, exc.read(MAX_BODY)
            finally:
                exc.close()
    except (OSError, ValueError, HTTPException) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise ThisVmError(f"{method} {url} failed: {reason}") from None

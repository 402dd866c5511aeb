"""GCP Secret Manager as a VM reads it at boot: the one shell command boot scripts use."""

from __future__ import annotations

import shlex


def secret_read_command(secret: str) -> str:
    """A shell command that prints the latest version of ``secret`` on stdout.

    It runs on the VM with gcloud and the VM's service account, which needs
    ``secretmanager.versions.access`` on these secrets only.
    """
    return f"gcloud secrets versions access latest --secret={shlex.quote(secret)}"

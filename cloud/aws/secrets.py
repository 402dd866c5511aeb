"""AWS Secrets Manager as a VM reads it at boot: the one shell command boot scripts use."""

from __future__ import annotations

import shlex


def secret_read_command(secret: str) -> str:
    """A shell command that prints ``secret`` (a Secrets Manager id or ARN) on stdout.

    It runs on the VM with the AWS CLI and the instance profile, which needs
    ``secretsmanager:GetSecretValue`` on these secrets only.
    """
    return (
        f"aws secretsmanager get-secret-value --secret-id {shlex.quote(secret)} "
        "--query SecretString --output text"
    )

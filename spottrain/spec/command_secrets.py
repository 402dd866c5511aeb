"""Credentials written into ``train.command``: refused, since the command travels in the clear.

The training command is in every VM's boot script (which anyone allowed to describe a VM
reads), in the agent's ``torchrun-started`` event in Redis, and in process listings. An
argument is taken for a credential when:

- it is the value of an option whose name has a credential's part (``--hf-token X``,
  ``--api-key=X``, ``--password X``; the parts of :data:`CREDENTIAL_NAME_PARTS`), unless the
  name ends in a part that says the option names where a credential is rather than holding it
  (``--token-file``, ``--password-env``: :data:`REFERENCE_SUFFIXES`);
- it has the shape of a well-known token (:data:`TOKEN_SHAPES`: Hugging Face, GitHub, GitLab,
  AWS access key ids, OpenAI, Slack, Google API keys, a PEM private key);
- it is a URL with a user name and password or token before its host.

A false positive is accepted by listing the option's name (``--eval-token-budget``) or the
argument itself in ``train.not_secrets``. Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence

CREDENTIAL_NAME_PARTS = (
    "TOKEN",
    "PASSWORD",
    "PASSWD",
    "SECRET",
    "APIKEY",
    "API_KEY",
    "ACCESS_KEY",
    "PRIVATE_KEY",
    "CREDENTIAL",
    "CREDENTIALS",
)
REFERENCE_SUFFIXES = ("FILE", "PATH", "DIR", "ENV", "VAR", "NAME", "ID", "ARN", "SECRET_NAME")
_NAME_PART = re.compile(r"(^|_)(" + "|".join(CREDENTIAL_NAME_PARTS) + r")(_|\Z)")
TOKEN_SHAPES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("a Hugging Face token", re.compile(r"\bhf_[A-Za-z0-9]{30,}")),
    ("a GitHub token", re.compile(r"\b(gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{40,})")),
    ("a GitLab token", re.compile(r"\bglpat-[A-Za-z0-9_-]{20,}")),
    ("an AWS access key id", re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b")),
    ("an OpenAI key", re.compile(r"\bsk-[A-Za-z0-9_-]{20,}")),
    ("a Slack token", re.compile(r"\bxox[abprs]-[A-Za-z0-9-]{10,}")),
    ("a Google API key", re.compile(r"\bAIza[0-9A-Za-z_-]{35}")),
    ("a private key", re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----")),
)
_URL_USERINFO = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://([^/@\s]+)@")


def _option_name(arg: str) -> str:
    """``--hf-token=x`` -> ``HF_TOKEN``; empty for an argument that is not an option."""
    if not arg.startswith("-") or arg in ("-", "--"):
        return ""
    return arg.lstrip("-").split("=", 1)[0].replace("-", "_").upper()


def _holds_credential(name: str) -> bool:
    if not _NAME_PART.search(name):
        return False
    return not any(name == s or name.endswith("_" + s) for s in REFERENCE_SUFFIXES)


def find_credential(command: Sequence[str], accepted: Collection[str] = ()) -> str | None:
    """Where ``command`` holds something that looks like a credential, in words that never
    repeat it (``"argument 3, the value of --hf-token"``); None when nothing does. An
    argument, or an option's name (as written, without ``=value``), in ``accepted`` is
    taken as not a credential."""
    for i, arg in enumerate(command):
        if arg in accepted:
            continue
        flag = arg.split("=", 1)[0]
        name = _option_name(arg)
        if name and flag not in accepted and _holds_credential(name):
            if "=" in arg:
                return f"argument {i}, the value of {flag}"
            value = command[i + 1] if i + 1 < len(command) else "-"
            if not value.startswith("-") and value not in accepted:
                return f"argument {i + 1}, the value of {flag}"
        for what, shape in TOKEN_SHAPES:
            if shape.search(arg):
                return f"argument {i}, which has the shape of {what}"
        if _URL_USERINFO.match(arg):
            return f"argument {i}, a URL with credentials before its host"
    return None

"""How a VM's boot reports itself: its stages, its record in Redis, its console lines.

A VM on AWS or GCP boots in named stages (:data:`STAGES`, run in that order by the boot script
of ``controller/run/boot.py``). The boot's loader (``spottrain.cloud.vmboot``, stdlib only:
it runs before spottrain is installed) reports each stage, and the failure of one, in two
places:

- **Redis**, once it can reach it (after ``read the Redis password``): the node's boot hash
  (``RunKeys.boot(node)``, fields :data:`FIELDS`) and a ``boot`` event in the run's stream.
- **The console**, always: one line per stage and, on a failure, the line the controller
  finds when it reads the VM's console output (AWS ``GetConsoleOutput``, GCE serial port 1)
  for a VM that never reached Redis::

      spottrain-boot: n3 i-0abc: stage 'install the environment'
      spottrain-boot: n3 i-0abc: failed in 'install the environment': pip: no matching ...
      spottrain-boot: n3 i-0abc: booted

Both carry the same one-line reason, redacted of the secrets the VM knows and with its
control characters escaped. The controller reads either into a :class:`BootReport`.

This is a format between releases (a fleet's VMs and its controller may differ): never
rename a stage or a field. Pure: no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

STAGE_IMAGE = "check the image"
STAGE_FETCH = "fetch the boot files"
STAGE_PASSWORD = "read the Redis password"
STAGE_USER = "create the worker user"
STAGE_ENV = "install the environment"
STAGE_CODE = "fetch the code"
STAGE_SECRETS = "read the job secrets"
STAGE_VOLUME = "check the checkpoint volume"
STAGE_AGENT = "start the agent"

STAGES = (
    STAGE_IMAGE,
    STAGE_FETCH,
    STAGE_PASSWORD,
    STAGE_USER,
    STAGE_ENV,
    STAGE_CODE,
    STAGE_SECRETS,
    STAGE_VOLUME,
    STAGE_AGENT,
)

# A failure in these stages is the machine image's (no python3, one too old, no venv module):
# every VM of that image fails the same way, so the controller blocks the offer before it
# counts the failure against the run (an AMI is per region, so another region may work).
IMAGE_STAGES = frozenset({STAGE_IMAGE})

CONSOLE_TAG = "spottrain-boot:"
# Stage names hold no quote: the console lines quote them with ''.
FIELDS = ("vm", "stage", "state", "reason", "at", "source")

# Where a VM's boot notes every secret value it read (the Redis password, the git token, the
# job's secret_env, pip's credentials), one base64 line each, root-only on the tmpfs /run:
# the boot and then the agent keep those values out of what they print or ship.
REDACT_FILE = "/run/spottrain/redact"


def parse_redact_lines(text: str) -> list[str]:
    """The secret values of a redact file's text (a line that is not base64 of UTF-8, from
    a write cut short, is skipped)."""
    import base64
    import binascii

    out = []
    for line in text.splitlines():
        try:
            value = base64.b64decode(line.strip(), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            continue
        if value:
            out.append(value)
    return out


# An image job's secret variables (train.secret_env) on its VM: root-only, one JSON object a
# line ({"name": VAR, "value": ...}), written by the boot's loader and read by the agent in
# the container (the host's /etc/spottrain is mounted there read-only). JSON, not an env
# file: a value arrives exact whatever it holds, and nothing here is parsed as shell.
SECRET_ENV_FILE = "/etc/spottrain/secret-env.jsonl"


class SecretEnvError(ValueError):
    """A secret variables file that cannot be read as one: the message names the file and
    the line, never a value."""


def parse_secret_env(text: str, source: str = SECRET_ENV_FILE) -> dict[str, str]:
    """The variables of a secret variables file's text (:data:`SECRET_ENV_FILE`).

    Raises:
        SecretEnvError: a line is not ``{"name": NAME, "value": VALUE}`` with a variable's
            name, or a value holds a NUL (no process environment carries one).
    """
    import json
    import re

    out: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except ValueError:
            d = None
        name = d.get("name") if isinstance(d, dict) else None
        value = d.get("value") if isinstance(d, dict) else None
        if not (
            isinstance(name, str)
            and isinstance(value, str)
            and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name)
            and "\0" not in value
        ):
            raise SecretEnvError(
                f'{source}:{n}: not a secret variable\'s line ({{"name": VAR, "value": '
                "...}}): the VM's boot writes this file; boot a new VM"
            )
        out[name] = value
    return out


class BootState(StrEnum):
    """Where a VM's boot is: a value of the boot hash's ``state`` field."""

    BOOTING = "booting"  # a stage is running
    FAILED = "failed"  # a stage exited non-zero; the boot script stopped
    BOOTED = "booted"  # the agent's unit started; the agent reports from here on


class BootSource(StrEnum):
    """Who wrote a boot record: the VM itself, or the controller from its console."""

    VM = "vm"
    CONSOLE = "console"


@dataclass(frozen=True)
class BootReport:
    """One VM's boot as last reported."""

    node: str
    vm: str
    stage: str
    state: BootState
    reason: str = ""
    at: float = 0.0
    source: BootSource = BootSource.VM

    @property
    def failed(self) -> bool:
        return self.state is BootState.FAILED

    def line(self) -> str:
        """What ``status``, the live view and ``logs --node`` say of a failed boot."""
        if not self.failed:
            return f"{self.node}: booting: {self.stage}"
        why = f": {self.reason}" if self.reason else ""
        return f"{self.node}: boot failed in '{self.stage}'{why}"

    def fields(self) -> dict[str, str]:
        """The boot hash's fields."""
        return {
            "vm": self.vm,
            "stage": self.stage,
            "state": self.state.value,
            "reason": self.reason,
            "at": f"{self.at:.3f}",
            "source": self.source.value,
        }


def report_from_fields(node: str, fields: dict[str, str]) -> BootReport | None:
    """The report a boot hash holds, or None when it is empty or not one (an unknown state:
    written by something else, ignored rather than trusted)."""
    try:
        state = BootState(fields.get("state", ""))
        source = BootSource(fields.get("source") or BootSource.VM)
        at = float(fields.get("at") or 0.0)
    except ValueError:
        return None
    return BootReport(
        node=node,
        vm=fields.get("vm", ""),
        stage=fields.get("stage", ""),
        state=state,
        reason=fields.get("reason", ""),
        at=at,
        source=source,
    )


def console_stage(node: str, vm: str, stage: str) -> str:
    return f"{CONSOLE_TAG} {node} {vm}: stage '{stage}'"


def console_failed(node: str, vm: str, stage: str, reason: str) -> str:
    return f"{CONSOLE_TAG} {node} {vm}: failed in '{stage}': {reason}"


def console_booted(node: str, vm: str) -> str:
    return f"{CONSOLE_TAG} {node} {vm}: booted"


_CONSOLE_RE = re.compile(
    r"^" + re.escape(CONSOLE_TAG) + r" (?P<node>[A-Za-z0-9_.-]+) (?P<vm>[A-Za-z0-9_.-]+): "
    r"(?:stage '(?P<stage>[^']*)'|failed in '(?P<failed>[^']*)'(?:: (?P<reason>.*))?|"
    r"(?P<booted>booted))\s*$"
)


def parse_console(text: str, node: str, at: float = 0.0) -> BootReport | None:
    """The last boot report of ``node`` in a VM's console output (a boot that ran again, as
    GCP runs its startup script at every start, reports its newest run), or None when the
    console holds none of its lines. Lines of other nodes (a reused disk) are ignored."""
    last: BootReport | None = None
    for raw in text.splitlines():
        m = _CONSOLE_RE.match(raw.strip())
        if m is None or m["node"] != node:
            continue
        if m["booted"]:
            last = BootReport(
                node, m["vm"], STAGE_AGENT, BootState.BOOTED, "", at, BootSource.CONSOLE
            )
        elif m["failed"] is not None:
            last = BootReport(
                node,
                m["vm"],
                m["failed"],
                BootState.FAILED,
                m["reason"] or "",
                at,
                BootSource.CONSOLE,
            )
        else:
            last = BootReport(
                node, m["vm"], m["stage"] or "", BootState.BOOTING, "", at, BootSource.CONSOLE
            )
    return last


_VARIABLE = re.compile(
    r"\b(?:i-[0-9a-f]{8,17}|[0-9a-f]{12,}|\d+(?:\.\d+){3}(?::\d+)?|\d{3,})\b", re.IGNORECASE
)


def reason_key(stage: str, reason: str) -> str:
    """What makes two failures "the same reason": the stage and the reason with what differs
    from VM to VM (instance ids, addresses, long numbers and hashes) blanked out."""
    return f"{stage}: {_VARIABLE.sub('#', reason.strip().lower())}"


def last_console_line(text: str, limit: int = 200) -> str:
    """The last non-empty line of a console output (for a VM that never said why), cut to
    ``limit`` characters."""
    for raw in reversed(text.splitlines()):
        line = raw.strip()
        if line:
            return line if len(line) <= limit else line[: limit - 1] + "…"
    return ""

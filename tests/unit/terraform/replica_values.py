"""What the Terraform modules' replica-mode locals evaluate to, for the tests that render the
boot templates without a Terraform binary.

The values come from the modules' own expressions as python-hcl2 keeps them (text): each
local has one fixed shape, checked here, so a changed expression fails its test instead of
being guessed at. Only the lighthouse address (written only with ``replica_quorum =
"lighthouse"``) is Terraform's to compute (the controller VM's private address on AWS, its
reserved internal address on GCP); the caller gives it.
"""

from __future__ import annotations

import math
import re
from typing import Any

REPLICA = '${var.fault_tolerance == "replica"}'
LIGHTHOUSE = '${local.replica && var.replica_quorum == "lighthouse"}'
# The agent's SPOTTRAIN_INTEGRATION line: none for "sdk", the agent's default.
INTEGRATION_LINE = (
    '${var.integration == "sdk" ? "" : "SPOTTRAIN_INTEGRATION=\\"${var.integration}\\"\\n"}'
)
REQUIREMENT = '${local.replica ? " \'spottrain[replica]==${var.spottrain_version}\'" : ""}'
# The framework's extra for train.integration: hf, accelerate, lightning (none for the rest).
INTEGRATION_REQUIREMENT = (
    '${contains(["hf", "accelerate", "lightning"], var.integration) ? '
    '" \'spottrain[${var.integration}]==${var.spottrain_version}\'" : ""}'
)
FRAMEWORK_INTEGRATIONS = ("hf", "accelerate", "lightning")
_ENV_LINES = re.compile(
    r'^\$\{local\.replica \? join\("", \[for line in concat\(\[(?P<items>.*)\], '
    r"local\.lighthouse \? \[(?P<lighthouse>.*)\] : \[\], "
    r"local\.lighthouse \? \[\] : \[(?P<redis>.*)\]\) : "
    r'"\$\{line\}\\n"\]\) : ""\}$',
    re.S,
)
# The Redis quorum's join timeout, "auto" resolved as the spec does; NODES is each module's
# nodes_max variable.
JOIN_TIMEOUT = (
    '${var.replica_join_timeout_ms == "auto" ? min(60000, max(250, ceil(2 * floor(var.NODES '
    "/ var.nodes_per_replica) * 54 / 1000))) : tonumber(var.replica_join_timeout_ms)}"
)
# The Redis quorum's heartbeat timeout in s, "auto" resolved as the spec does.
HEARTBEAT_TIMEOUT = (
    '${var.replica_heartbeat_timeout_s == "auto" ? min(300, max(1, ceil(2 * floor(var.NODES / '
    "var.nodes_per_replica) * 5 * 28 / 350000) / 2)) : tonumber(var.replica_heartbeat_timeout_s)}"
)
# Replicas per quorum relay, "auto" resolved as the spec does.
RELAY_GROUP = (
    '${var.replica_relay_group_size == "auto" ? (floor(var.NODES / var.nodes_per_replica) >= '
    "1000 ? 100 : 0) : tonumber(var.replica_relay_group_size)}"
)
NODES_MAX = ("nodes_max", "nnodes_max")
_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')
_REF = re.compile(r"\$\{(var|local)\.([A-Za-z_][A-Za-z0-9_]*)\}")
# Where each module's lighthouse address comes from.
LIGHTHOUSE_ADDRESS = {
    "aws": "aws_instance.controller[0].private_ip",
    "gcp": "google_compute_address.controller[0].address",
}


def env_line_templates(locals_: dict[str, Any], lighthouse: bool | None = None) -> list[str]:
    """The lines of ``local.replica_env_lines``, unescaped, with their references in place:
    every replica run's, then the lighthouse quorum's own (``lighthouse`` True) or the Redis
    quorum's (False); None: all of them."""
    m = _ENV_LINES.match(str(locals_["replica_env_lines"]))
    assert m, f"local.replica_env_lines changed shape: {locals_['replica_env_lines']}"
    groups = {None: ["items", "lighthouse", "redis"], True: ["items", "lighthouse"]}.get(
        lighthouse, ["items", "redis"]
    )
    return [s.replace('\\"', '"') for g in groups for s in _STRING.findall(m[g])]


def replica_values(
    locals_: dict[str, Any], inputs: dict[str, Any], lighthouse: str
) -> dict[str, str]:
    """``replica_env_lines``, ``replica_requirement``, ``integration_env_line`` and
    ``integration_requirement`` as Terraform would evaluate them for ``inputs`` (variable
    values), with ``lighthouse`` as ``local.lighthouse_address``."""
    out = {
        **_replica_values(locals_, inputs, lighthouse),
        "integration_env_line": integration_env_line(locals_, inputs),
    }
    if "integration_requirement" in locals_:  # a module that installs no framework has none
        out["integration_requirement"] = integration_requirement(locals_, inputs)
    return out


def integration_requirement(locals_: dict[str, Any], inputs: dict[str, Any]) -> str:
    """``local.integration_requirement`` as Terraform evaluates it for ``inputs``."""
    expr = locals_["integration_requirement"]
    assert expr == INTEGRATION_REQUIREMENT, expr
    value = str(inputs.get("integration", "sdk"))
    if value not in FRAMEWORK_INTEGRATIONS:
        return ""
    return f" 'spottrain[{value}]=={inputs['spottrain_version']}'"


def integration_env_line(locals_: dict[str, Any], inputs: dict[str, Any]) -> str:
    """``local.integration_env_line`` as Terraform evaluates it for ``inputs``."""
    assert locals_["integration_env_line"] == INTEGRATION_LINE, locals_["integration_env_line"]
    value = str(inputs.get("integration", "sdk"))
    return "" if value == "sdk" else f'SPOTTRAIN_INTEGRATION="{value}"\n'


def _replica_values(
    locals_: dict[str, Any], inputs: dict[str, Any], lighthouse: str
) -> dict[str, str]:
    assert locals_["replica"] == REPLICA, locals_["replica"]
    assert locals_["lighthouse"] == LIGHTHOUSE, locals_["lighthouse"]
    assert locals_["replica_requirement"] == REQUIREMENT, locals_["replica_requirement"]
    if inputs["fault_tolerance"] != "replica":
        return {"replica_env_lines": "", "replica_requirement": ""}

    def ref(m: re.Match[str]) -> str:
        kind, name = m.groups()
        if kind == "local" and name == "replica_join_timeout_ms":
            return str(join_timeout_ms(locals_, inputs))
        if kind == "local" and name == "replica_heartbeat_timeout_s":
            return f"{heartbeat_timeout_s(locals_, inputs):g}"  # Terraform's 1, 2.5
        if kind == "local" and name == "replica_relay_group_size":
            return str(relay_group_size(locals_, inputs))
        if kind == "local":
            assert name == "lighthouse_address", f"cannot evaluate local.{name}"
            return lighthouse
        return str(inputs[name])

    templates = env_line_templates(locals_, inputs["replica_quorum"] == "lighthouse")
    lines = [_REF.sub(ref, t) + "\n" for t in templates]
    return {
        "replica_env_lines": "".join(lines),
        "replica_requirement": f" 'spottrain[replica]=={inputs['spottrain_version']}'",
    }


def join_timeout_ms(locals_: dict[str, Any], inputs: dict[str, Any]) -> int:
    """``local.replica_join_timeout_ms`` as Terraform evaluates it for ``inputs``."""
    expr = str(locals_["replica_join_timeout_ms"])
    nodes = [n for n in NODES_MAX if expr == JOIN_TIMEOUT.replace("NODES", n)]
    assert nodes, f"local.replica_join_timeout_ms changed shape: {expr}"
    raw = str(inputs["replica_join_timeout_ms"])
    if raw != "auto":
        return int(raw)
    replicas = math.floor(int(inputs[nodes[0]]) / int(inputs["nodes_per_replica"]))
    return min(60000, max(250, math.ceil(2 * replicas * 54 / 1000)))


def heartbeat_timeout_s(locals_: dict[str, Any], inputs: dict[str, Any]) -> float:
    """``local.replica_heartbeat_timeout_s`` as Terraform evaluates it for ``inputs``."""
    expr = str(locals_["replica_heartbeat_timeout_s"])
    nodes = [n for n in NODES_MAX if expr == HEARTBEAT_TIMEOUT.replace("NODES", n)]
    assert nodes, f"local.replica_heartbeat_timeout_s changed shape: {expr}"
    raw = str(inputs.get("replica_heartbeat_timeout_s", "auto"))
    if raw != "auto":
        return float(raw)
    replicas = math.floor(int(inputs[nodes[0]]) / int(inputs["nodes_per_replica"]))
    return min(300, max(1, math.ceil(2 * replicas * 5 * 28 / 350000) / 2))


def relay_group_size(locals_: dict[str, Any], inputs: dict[str, Any]) -> int:
    """``local.replica_relay_group_size`` as Terraform evaluates it for ``inputs``."""
    expr = str(locals_["replica_relay_group_size"])
    nodes = [n for n in NODES_MAX if expr == RELAY_GROUP.replace("NODES", n)]
    assert nodes, f"local.replica_relay_group_size changed shape: {expr}"
    raw = str(inputs.get("replica_relay_group_size", "auto"))
    if raw != "auto":
        return int(raw)
    replicas = math.floor(int(inputs[nodes[0]]) / int(inputs["nodes_per_replica"]))
    return 100 if replicas >= 1000 else 0

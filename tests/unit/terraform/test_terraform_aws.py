"""The AWS fleet module (``terraform/aws``), checked without a Terraform binary.

The ``.tf`` files are parsed with python-hcl2 (``tests/terraform_hcl.py``); the boot template
is rendered the way ``templatefile`` renders it, run through ``bash -n``, and the part that
writes the agent's environment file is run for real in a temporary directory, so the real
``spottrain-agent`` parser reads back what a VM would start with.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import uuid
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import boto3
import hcl2
import pytest
from fakes.git_http import GitHttpServer
from fakes.metadata_server import MetadataServer
from moto.server import ThreadedMotoServer
from replica_values import replica_values
from secret_boot import (
    evaluate,
    refusal,
    run_part,
    section,
    shell_function,
    variable_blocks,
)
from terraform_hcl import (
    TERRAFORM,
    Module,
    block_text,
    clean,
    load_module,
    render_template,
    template_names,
    terraform_console,
)

from spottrain import __version__
from spottrain.agent import cli as agent_cli
from spottrain.cloud.base import TAG_JOB
from spottrain.controller.cli import main as spottrain_cli
from spottrain.controller.run.boot import parse_env_file, worker_user_lines
from spottrain.protocol.boot import parse_redact_lines
from spottrain.spec import FleetSpec

AWS = TERRAFORM / "aws"
BOOT = "boot.sh.tftpl"
INTERNET = {"0.0.0.0/0", "::/0"}

# What instance metadata answers on a VM, for the parts of the script that read it.
IMDS = {
    "INSTANCE_ID": "i-0abc123def4567890",
    "ZONE": "us-east-1a",
    "INSTANCE_TYPE": "p5.48xlarge",
    "LOCAL_IPV4": "10.0.12.34",
}
# Every character a shell, systemd or Terraform could trip on.
HOSTILE_COMMAND = [
    "train.py",
    "--name",
    'gpt 7b\'s "best"',
    "--note",
    "$HOME `touch pwned` $(touch pwned) ${PATH} \\ back\\slash",
    "--glob",
    "*.json;echo pwned|cat&",
    "--empty",
    "",
    "--percent",
    "%{ if x }%%",
]
VARIABLES = {
    "run_id": "gpt-7b-20250701",
    "spottrain_version": __version__,
    "nodes_min": "2",
    "nodes_max": "8",
    "nproc_per_node": "8",
    "gpus_per_node": "8",
    "code_archive_url": "s3://acme-spottrain/ckpt/code/" + "ab" * 32 + ".tar.gz",
    "code_archive_sha256": "ab" * 32,
    "git_repo": "",
    "git_commit": "",
    "git_token_secret_arn": "",
    "git_token_user": "x-access-token",
    "env_lock": "",
    "redis_password_secret_arn": (
        "arn:aws:secretsmanager:us-east-1:123456789012:secret:spottrain/redis-AbCdEf"
    ),
    # Replica mode's variables at their defaults: these tests render elastic mode
    # (test_terraform_replica.py renders replica mode).
    "fault_tolerance": "elastic",
    "nodes_per_replica": "1",
    "min_replicas": "1",
    "replica_quorum": "redis",
    "lighthouse_port": "29510",
    "manager_port": "29512",
    "replica_wait_replicas": "0",
    "replica_heartbeat_timeout_s": "auto",
    "replica_join_timeout_ms": "auto",
    "replica_relay_group_size": "auto",
    # train.integration at its default (test_terraform_integration.py renders the others).
    "integration": "sdk",
}
# The controller VM's private address, as AWS would give it.
CONTROLLER_IP = "10.0.3.21"
SECRET_PASSWORD_FILE = "/etc/spottrain/redis-password"


@pytest.fixture(scope="module")
def mod() -> Module:
    return load_module(AWS)


# --- reading HCL -----------------------------------------------------------------------------


def _plain(v: Any) -> Any:
    """hcl2's value without its ``__comments__`` entries."""
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items() if k != "__comments__"}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


def _locals(mod: Module) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for block in mod.blocks("locals"):
        for name, value in _plain(block).items():
            assert name not in found, f"local {name!r} is defined twice"
            found[name] = value
    return found


def _ref(expr: Any) -> str:
    """The inside of a whole-value interpolation ``${...}``, else the value as text."""
    s = str(expr)
    if s.startswith("${") and s.endswith("}"):
        return s[2:-1].strip()
    return s


def _hcl_unescape(s: str) -> str:
    """An HCL string literal's escapes (as hcl2 keeps them in expressions) undone."""
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "r": "\r", "t": "\t"}.get(m[1], m[1]), s)


def _regexes(condition: str) -> list[str]:
    """The patterns of ``regex("...", ...)`` calls in a condition, unescaped."""
    return [_hcl_unescape(p) for p in re.findall(r'regex\("((?:[^"\\]|\\.)*)"', condition)]


def _resolve(expr: str, variables: dict[str, str], locals_: dict[str, Any]) -> str:
    """A string whose interpolations are only ``var.X`` and ``local.Y`` references, with
    each replaced by its value (locals resolved the same way). Anything else is an error:
    the test must not guess what Terraform would compute."""

    def one(m: re.Match[str]) -> str:
        ref = m[1].strip()
        if ref.startswith("var.") and ref[4:] in variables:
            return variables[ref[4:]]
        if ref.startswith("local.") and isinstance(locals_.get(ref[6:]), str):
            return _resolve(locals_[ref[6:]], variables, locals_)
        raise AssertionError(f"cannot resolve ${{{ref}}} in {expr!r}")

    return re.sub(r"\$\{([^{}]+)\}", one, str(expr))


def _dynamic(block: dict[str, Any], name: str) -> dict[str, Any]:
    """The body of ``dynamic "<name>"`` in a block."""
    for d in block.get("dynamic", []):
        if name in d:
            return d[name]
    raise AssertionError(f"no dynamic {name!r} block")


def _validations(mod: Module, name: str) -> list[dict[str, Any]]:
    return _plain(mod.variables.get(name, {}).get("validation", []))


def test_the_controller_reads_the_console_of_this_runs_vms_only(mod: Module) -> None:
    """A VM that never came up healthy: the controller reads its console for the boot's
    failure line (GetConsoleOutput), of no VM but this run's."""
    doc = mod.resources("aws_iam_policy_document", kind="data")["controller"]
    by_sid = {st["sid"]: st for st in _statements(_plain(doc))}
    console = by_sid["ReadTheConsoleOfThisRunsVMs"]
    assert console["actions"] == ["ec2:GetConsoleOutput"]
    assert console["condition"][0]["variable"] == "aws:ResourceTag/spottrain-job"
    assert [_ref(v) for v in console["condition"][0]["values"]] == ["var.run_id"]


# --- the boot script -------------------------------------------------------------------------


def _train_command_env(command: list[str]) -> str:
    """What ``local.train_command_env`` computes (the expressions are pinned by
    :func:`test_train_command_quoting_matches_its_mirror`)."""
    shell = " ".join("'" + a.replace("'", "'\\''") + "'" for a in command)
    return shell.replace("\\", "\\\\").replace('"', '\\"')


def _secret_env_table(secret_env_arns: dict[str, str]) -> str:
    """What ``local.secret_env_table`` computes (Terraform walks a map in key order; the
    expression is pinned by :func:`test_secret_env_table_matches_its_mirror`)."""
    return "".join(f"{name} {arn}\n" for name, arn in sorted(secret_env_arns.items()))


def _boot_values(mod: Module, **overrides: Any) -> dict[str, str]:
    """Values for every placeholder of the boot template: the templatefile map's own
    expressions where they only name variables and locals, realistic values for what AWS
    computes (the region, the file system, the ElastiCache endpoint)."""
    variables = {**VARIABLES, **{k: v for k, v in overrides.items() if k in VARIABLES}}
    locals_ = _locals(mod)
    computed = {
        "region": "us-east-1",
        "redis_url": "rediss://master.spottrain-1a2b3c.abcdef.use1.cache.amazonaws.com:6379",
        "redis_password_file": SECRET_PASSWORD_FILE
        if variables["redis_password_secret_arn"]
        else "",
        "checkpoint_fs_type": "lustre",
        "checkpoint_fs_source": "fs-0123456789abcdef0.fsx.us-east-1.amazonaws.com@tcp:/abcdefgh",
        "checkpoint_fs_options": "defaults,relatime,flock,_netdev",
        "checkpoint_copy_to": "s3://acme-spottrain/ckpt",
        "train_command": _train_command_env(overrides.get("command", HOSTILE_COMMAND)),
        "secret_env_table": _secret_env_table(overrides.get("secret_env_arns", {})),
        **replica_values(locals_, variables, f"{CONTROLLER_IP}:{variables['lighthouse_port']}"),
    }
    computed.update({k: v for k, v in overrides.items() if k in computed})
    values = {}
    for name, expr in locals_["boot_template_values"].items():
        values[name] = computed[name] if name in computed else _resolve(expr, variables, locals_)
    return values


def _render(mod: Module, **overrides: Any) -> str:
    return render_template(mod.texts[BOOT], _boot_values(mod, **overrides))


def _write_agent_env(script: str, tmp_path: Path) -> Path:
    """Run the part of the boot script that writes the agent's environment file, with its
    path moved into ``tmp_path`` and this VM's identity as the metadata service gave it."""
    start = script.index("umask 077\ncat >/etc/spottrain/agent.env")
    end = script.index("umask 022\n", start) + len("umask 022\n")
    target = tmp_path / "agent.env"
    fragment = script[start:end].replace("/etc/spottrain/agent.env", str(target))
    subprocess.run(
        ["bash", "-euo", "pipefail", "-c", fragment],
        env={**IMDS, "PATH": os.environ["PATH"], "HOME": str(tmp_path)},
        cwd=tmp_path,
        check=True,
    )
    assert not (tmp_path / "pwned").exists(), "the environment file ran part of a value"
    return target


def _agent_args(env: dict[str, str], argv: list[str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """Parse a ``spottrain-agent`` command line as the systemd unit starts it: every
    setting the flags leave out comes from the environment file."""
    agent_cli.build_parser()  # fills RUN_ENV_VARS
    for name in agent_cli.RUN_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return agent_cli.build_parser().parse_args(argv)


def _packaged_unit() -> str:
    return (resources.files("spottrain.agent.systemd") / "spottrain-agent.service").read_text()


# --- variables -------------------------------------------------------------------------------


def test_every_variable_is_declared_and_used(mod: Module) -> None:
    declared, used = set(mod.variables), mod.used_variables()
    assert used - declared == set(), f"used but not declared: {sorted(used - declared)}"
    assert declared - used == set(), f"declared but never used: {sorted(declared - used)}"


def test_boot_template_placeholders_are_the_templatefile_values(mod: Module) -> None:
    values = _locals(mod)["boot_template_values"]
    placeholders = template_names(mod.texts[BOOT])
    assert placeholders == set(values), (
        f"placeholders without a value: {sorted(placeholders - set(values))}; "
        f"values no placeholder uses: {sorted(set(values) - placeholders)}"
    )
    # Terraform would refuse anything else after a ${ (the helper only sees names).
    for inner in re.findall(r"(?<!\$)\$\{([^}]*)\}", mod.texts[BOOT]):
        assert re.fullmatch(r"[a-z_][a-z0-9_]*", inner), f"not a plain placeholder: ${{{inner}}}"
    calls = re.findall(r"templatefile\(([^,]+),\s*([^)]+)\)", mod.text())
    assert calls == [('"${path.module}/boot.sh.tftpl"', "local.boot_template_values")]
    user_data = mod.resources("aws_launch_template")["fleet"]["user_data"]
    assert _ref(_locals(mod)["boot_script"]) == (
        'templatefile("${path.module}/boot.sh.tftpl", local.boot_template_values)'
    )
    # Gzipped only with an env_lock (tests/unit/controller/test_boot_env_lock.py checks it fits).
    assert _ref(user_data) == (
        'var.env_lock == "" ? base64encode(local.boot_script) : base64gzip(local.boot_script)'
    )


def test_every_variable_has_a_type_and_a_description(mod: Module) -> None:
    for name, body in mod.variables.items():
        assert body.get("type"), f"variable {name} has no type"
        assert len(str(body.get("description", ""))) > 20, f"variable {name} has no description"


def test_inputs_that_can_be_wrong_are_validated(mod: Module) -> None:
    (run_id,) = [p for v in _validations(mod, "run_id") for p in _regexes(v["condition"])]
    assert run_id == "^[a-z0-9][a-z0-9-]{0,62}$"
    for good in ("gpt-7b-20250701", "a", "0" + "x" * 62):
        assert re.fullmatch(run_id, good)
    for bad in ("", "-gpt", "GPT", "gpt_7b", "x" * 64, "gpt 7b"):
        assert not re.fullmatch(run_id, bad), bad

    fs = " ".join(v["condition"] for v in _validations(mod, "checkpoint_filesystem"))
    assert '"fsx-lustre"' in fs and '"efs"' in fs and "contains(" in fs

    cidrs = " ".join(v["condition"] for v in _validations(mod, "controller_cidrs"))
    assert re.search(r'!\s*endswith\(\s*c\s*,\s*"/0"\s*\)', cidrs), (
        "controller_cidrs must refuse /0"
    )

    heartbeat = " ".join(v["condition"] for v in _validations(mod, "lifecycle_heartbeat_timeout_s"))
    (minimum,) = re.findall(r"var\.lifecycle_heartbeat_timeout_s\s*>=\s*(\d+)", heartbeat)
    assert int(minimum) >= 180, "the hook must hold a VM long enough for an emergency checkpoint"
    assert mod.variables["lifecycle_heartbeat_timeout_s"]["default"] >= int(minimum)

    for name in (
        "instance_types",
        "subnet_ids",
        "ami_id",
        "redis_url",
        "redis_port",
        "spottrain_version",
        "nodes_min",
        "nodes_max",
        "train_command",
        "git_commit",
        "code_archive_sha256",
        "fsx_storage_capacity_gib",
        "checkpoint_copy_to",
    ):
        assert _validations(mod, name), f"variable {name} has no validation"


def test_redis_url_can_never_carry_a_password(mod: Module) -> None:
    (pattern,) = [p for v in _validations(mod, "redis_url") for p in _regexes(v["condition"])]
    for good in ("redis://10.0.0.5:6379", "rediss://master.x.use1.cache.amazonaws.com:6380/0"):
        assert re.fullmatch(pattern, good), good
    for bad in (
        "rediss://:hunter2@redis:6379",
        "redis://user:pw@redis",
        "http://redis",
        "redis://a b",
    ):
        assert not re.fullmatch(pattern, bad), bad
    assert "sensitive" not in mod.outputs["redis_url"]


def test_instance_types_default_to_one_family_of_8_gpu_efa_types(mod: Module) -> None:
    catalog = json.loads((resources.files("spottrain") / "data" / "catalog.json").read_text())[
        "aws"
    ]["instance_types"]
    default = mod.variables["instance_types"]["default"]
    assert default, "instance_types needs a non-empty default"
    assert len({t.split(".")[0] for t in default}) == 1
    for t in default:
        assert catalog[t]["gpus"] == 8 and catalog[t]["network"] == "efa", t
    conditions = " ".join(v["condition"] for v in _validations(mod, "instance_types"))
    assert "length(var.instance_types) > 0" in conditions


def test_spottrain_version_default_is_this_release(mod: Module) -> None:
    assert mod.variables["spottrain_version"]["default"] == __version__
    (pattern,) = [
        p for v in _validations(mod, "spottrain_version") for p in _regexes(v["condition"])
    ]
    assert re.fullmatch(pattern, __version__)
    for loose in (">=0.1", "0.1.*", "latest", "0.1.0; rm -rf /", "0.1.0'"):
        assert not re.fullmatch(pattern, loose), loose


def test_aws_provider_and_terraform_are_pinned(mod: Module) -> None:
    (terraform,) = mod.blocks("terraform")
    assert re.search(r">=\s*1\.\d+", terraform["required_version"])
    (providers,) = terraform["required_providers"]
    aws = providers["aws"]
    assert aws["source"] == "hashicorp/aws"
    assert re.fullmatch(r"~>\s*\d+\.\d+", aws["version"]), aws["version"]


# --- the launch template and the group -------------------------------------------------------


def test_launch_template_requires_imdsv2_reachable_from_containers(mod: Module) -> None:
    lt = mod.resources("aws_launch_template")["fleet"]
    (meta,) = lt["metadata_options"]
    assert meta["http_tokens"] == "required"
    assert meta["http_endpoint"] == "enabled"
    assert int(meta["http_put_response_hop_limit"]) >= 2
    assert meta["instance_metadata_tags"] == "enabled"
    assert _ref(lt["image_id"]) == "var.ami_id"
    assert _ref(lt["iam_instance_profile"][0]["arn"]) == "aws_iam_instance_profile.agent.arn"
    (ebs,) = lt["block_device_mappings"][0]["ebs"]
    assert _ref(ebs["volume_size"]) == "var.root_volume_size_gb"
    assert ebs["encrypted"] is True
    assert "instance_market_options" not in lt, "the group's policy decides spot, not the template"


def test_launch_template_gives_efa_interfaces_on_every_card(mod: Module) -> None:
    nics = _dynamic(mod.resources("aws_launch_template")["fleet"], "network_interfaces")
    assert "var.efa_interface_count" in nics["for_each"] and "var.efa_enabled" in nics["for_each"]
    (content,) = nics["content"]
    assert _ref(content["interface_type"]) == 'var.efa_enabled ? "efa" : null'
    assert _ref(content["network_card_index"]) == "network_interfaces.value"
    assert _ref(content["device_index"]) == "network_interfaces.value == 0 ? 0 : 1"
    assert [_ref(g) for g in content["security_groups"]] == ["aws_security_group.fleet.id"]


def test_group_is_all_spot_protected_and_sized_by_the_controller(mod: Module) -> None:
    asg = _plain(mod.resources("aws_autoscaling_group")["fleet"])
    (policy,) = asg["mixed_instances_policy"]
    (dist,) = policy["instances_distribution"]
    assert dist["on_demand_base_capacity"] == 0
    assert dist["on_demand_percentage_above_base_capacity"] == 0
    assert dist["spot_allocation_strategy"] == "price-capacity-optimized"
    override = _dynamic(policy["launch_template"][0], "override")
    assert _ref(override["for_each"]) == "var.instance_types"
    assert asg["protect_from_scale_in"] is True
    assert asg["min_size"] == 0
    assert _ref(asg["max_size"]) == "var.nodes_max"
    assert _ref(asg["vpc_zone_identifier"]) == "var.subnet_ids"
    assert _ref(asg["capacity_rebalance"]) == "var.capacity_rebalance"
    assert _ref(asg["wait_for_capacity_timeout"]) == "0", "spot capacity must not fail an apply"
    (lifecycle,) = asg["lifecycle"]
    assert [_ref(x) for x in lifecycle["ignore_changes"]] == ["desired_capacity"]


def test_group_name_is_computed_without_a_cycle(mod: Module) -> None:
    """The user data names the group, so the name must not come from the group itself."""
    locals_ = _locals(mod)
    asg = mod.resources("aws_autoscaling_group")["fleet"]
    assert _ref(asg["name"]) == "local.asg_name"
    values = locals_["boot_template_values"]
    assert _ref(values["asg_name"]) == "local.asg_name"
    assert _ref(values["lifecycle_hook_name"]) == "local.lifecycle_hook_name"
    hook = mod.resources("aws_autoscaling_lifecycle_hook")["drain"]
    assert _ref(hook["name"]) == "local.lifecycle_hook_name"
    for name in ("asg_name", "lifecycle_hook_name", "name"):
        assert "aws_" not in str(locals_[name]), f"local.{name} must not read a resource"
    names = {"run_id": VARIABLES["run_id"]}
    assert _resolve(locals_["asg_name"], names, locals_) == "spottrain-gpt-7b-20250701"


def test_vms_carry_the_job_tag_the_controller_adopts_them_by(mod: Module) -> None:
    asg = mod.resources("aws_autoscaling_group")["fleet"]
    tags = {t["key"]: t for t in asg["tag"]}
    assert _ref(tags[TAG_JOB]["value"]) == "var.run_id"
    assert tags[TAG_JOB]["propagate_at_launch"] is True
    assert tags["spottrain-managed-by"]["value"] == "terraform"
    assert tags["spottrain-managed-by"]["propagate_at_launch"] is True
    # Every other resource (launch template tag specifications, volumes, interfaces) takes
    # local.tags, which carries the job tag too.
    assert _ref(_locals(mod)["tags"]) == (
        f'merge(var.tags, {{"{TAG_JOB}" = var.run_id, "spottrain-managed-by" = "terraform"}})'
    )
    lt = _plain(mod.resources("aws_launch_template")["fleet"])
    specs = _dynamic(lt, "tag_specifications")
    assert "instance" in specs["for_each"]
    assert "local.tags" in specs["content"][0]["tags"]


def test_termination_hook_waits_for_the_emergency_checkpoint(mod: Module) -> None:
    (hook,) = mod.resources("aws_autoscaling_lifecycle_hook").values()
    assert hook["lifecycle_transition"] == "autoscaling:EC2_INSTANCE_TERMINATING"
    assert hook["default_result"] == "CONTINUE"
    assert _ref(hook["heartbeat_timeout"]) == "var.lifecycle_heartbeat_timeout_s"
    assert _ref(hook["autoscaling_group_name"]) == "aws_autoscaling_group.fleet.name"


def test_placement_group_is_a_cluster_and_optional(mod: Module) -> None:
    pg = mod.resources("aws_placement_group")["fleet"]
    assert pg["strategy"] == "cluster"
    assert _ref(pg["count"]) == "var.cluster_placement_group ? 1 : 0"
    assert mod.variables["cluster_placement_group"]["default"] is True


# --- security groups -------------------------------------------------------------------------


def _port_range(rule: dict[str, Any], redis_port: int) -> tuple[int, int]:
    """The ports a rule opens; ``var.redis_port`` read as its default, all for ``-1``."""
    protocol = str(rule.get("ip_protocol", rule.get("protocol", "tcp")))
    if protocol in ("-1", "all"):
        return (0, 65535)

    def port(v: Any) -> int:
        if isinstance(v, int):
            return v
        if _ref(v) == "var.redis_port":
            return redis_port
        return int(_ref(v)) if _ref(v).isdigit() else -1  # unknown: checked below

    lo, hi = port(rule.get("from_port", 0)), port(rule.get("to_port", 65535))
    assert lo >= 0 and hi >= 0, f"a rule's ports must be literal or var.redis_port: {rule}"
    return (lo, hi)


def _ingress_rules(mod: Module) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = []
    for sg in mod.resources("aws_security_group").values():
        rules.extend(sg.get("ingress", []))
    for r in mod.resources("aws_security_group_rule").values():
        if r.get("type") == "ingress":
            rules.append(r)
    rules.extend(mod.resources("aws_vpc_security_group_ingress_rule").values())
    return rules


def _opens_redis_to_internet(rule: dict[str, Any], redis_port: int) -> bool:
    cidrs = set()
    for key in ("cidr_ipv4", "cidr_ipv6", "cidr_blocks", "ipv6_cidr_blocks"):
        v = rule.get(key)
        cidrs.update(v if isinstance(v, list) else [v] if v else [])
    if not cidrs & INTERNET:
        return False
    lo, hi = _port_range(rule, redis_port)
    return lo <= redis_port <= hi


def test_no_rule_opens_redis_to_the_internet(mod: Module) -> None:
    redis_port = mod.variables["redis_port"]["default"]
    rules = _ingress_rules(mod)
    assert rules, "no ingress rule found: the parse is broken"
    assert _opens_redis_to_internet(
        {"ip_protocol": "tcp", "from_port": 6000, "to_port": 7000, "cidr_ipv4": "0.0.0.0/0"},
        redis_port,
    ), "the check itself must flag a port range containing Redis"
    assert _opens_redis_to_internet({"ip_protocol": "-1", "cidr_ipv6": "::/0"}, redis_port)
    for rule in rules:
        assert not _opens_redis_to_internet(rule, redis_port), rule
        # Any address-based ingress reads only the validated controller_cidrs.
        if rule.get("cidr_ipv4") or rule.get("cidr_blocks"):
            assert _ref(rule.get("for_each", "")) == "toset(var.controller_cidrs)", rule


def test_redis_port_opens_only_to_the_fleet_and_the_controller(mod: Module) -> None:
    rules = mod.resources("aws_vpc_security_group_ingress_rule")
    redis = {n: r for n, r in rules.items() if _ref(r.get("from_port", "")) == "var.redis_port"}
    assert set(redis) == {
        "redis_from_fleet",
        "redis_from_controller_vm",
        "redis_from_controller_groups",
        "redis_from_controller_cidrs",
    }
    sources = {
        n: _ref(r.get("referenced_security_group_id") or r.get("cidr_ipv4"))
        for n, r in redis.items()
    }
    assert sources["redis_from_fleet"] == "aws_security_group.fleet.id"
    assert sources["redis_from_controller_cidrs"] == "each.value"
    for r in redis.values():
        assert _ref(r["security_group_id"]) == "aws_security_group.redis.id"
        assert _ref(r["to_port"]) == "var.redis_port"
    cache = mod.resources("aws_elasticache_replication_group")["redis"]
    assert [_ref(g) for g in cache["security_group_ids"]] == ["aws_security_group.redis.id"]
    assert cache["transit_encryption_enabled"] is True


def test_elasticache_has_a_replica_in_another_zone_and_fails_over(mod: Module) -> None:
    cache = mod.resources("aws_elasticache_replication_group")["redis"]
    assert cache["automatic_failover_enabled"] is True
    assert cache["multi_az_enabled"] is True
    assert _ref(cache["num_cache_clusters"]) == "var.elasticache_num_nodes"
    (nodes,) = [v["condition"] for v in _validations(mod, "elasticache_num_nodes")]
    assert "var.elasticache_num_nodes >= 2" in nodes
    zones = " ".join(p["condition"] for p in _plain(cache["lifecycle"][0]["precondition"]))
    assert "data.aws_subnet.redis" in zones and ">= 2" in zones
    group = mod.resources("aws_elasticache_subnet_group")["redis"]
    assert _ref(group["subnet_ids"]) == "local.redis_subnet_ids"


@pytest.mark.skipif(shutil.which("terraform") is None, reason="no terraform binary here")
@pytest.mark.parametrize(("nodes", "accepted"), [(1, False), (2, True), (6, True), (7, False)])
def test_terraform_refuses_an_elasticache_without_a_replica(
    mod: Module, nodes: int, accepted: bool
) -> None:
    variable = block_text(mod.texts["variables.tf"], 'variable "elasticache_num_nodes"')
    out = terraform_console(
        variable, "var.elasticache_num_nodes", {"elasticache_num_nodes": str(nodes)}
    )
    refused = "Error: Invalid value for variable" in out.stderr
    assert refused is not accepted, out.stderr
    if accepted:
        assert out.stdout.strip() == str(nodes)
    else:
        assert "from 2 to 6: one node has no replica" in " ".join(out.stderr.split())


def test_fleet_members_reach_each_other_on_every_port(mod: Module) -> None:
    rule = mod.resources("aws_vpc_security_group_ingress_rule")["fleet_from_fleet"]
    assert rule["ip_protocol"] == "-1"
    assert _ref(rule["security_group_id"]) == _ref(rule["referenced_security_group_id"])
    assert _ref(rule["security_group_id"]) == "aws_security_group.fleet.id"


# --- IAM -------------------------------------------------------------------------------------


def _statements(doc: dict[str, Any]) -> list[dict[str, Any]]:
    found = list(doc.get("statement", []))
    for d in doc.get("dynamic", []):
        if "statement" in d:
            found.extend(d["statement"]["content"])
    return found


def test_iam_grants_named_actions_only(mod: Module) -> None:
    docs = mod.resources("aws_iam_policy_document", kind="data")
    assert {"agent", "controller"} <= set(docs)
    for name, doc in docs.items():
        for st in _statements(_plain(doc)):
            actions = st["actions"]
            assert isinstance(actions, list) and actions, f"{name}: actions must be a list"
            for action in actions:
                assert "*" not in action, f"{name}: wildcard action {action}"
                assert not action.startswith("iam:"), f"{name}: {action}"
            if _ref(st.get("resources", "")) == '["*"]' or st.get("resources") == ["*"]:
                assert all(a.split(":")[1].startswith("Describe") for a in actions), st


def test_agent_role_completes_the_hook_on_its_own_group_only(mod: Module) -> None:
    agent = _statements(_plain(mod.resources("aws_iam_policy_document", kind="data")["agent"]))
    by_sid = {st["sid"]: st for st in agent}
    hook = by_sid["DrainThroughTheLifecycleHook"]
    assert "autoscaling:CompleteLifecycleAction" in hook["actions"]
    assert [_ref(r) for r in hook["resources"]] == ["local.asg_arn"]
    assert "autoScalingGroupName/${local.asg_name}" in _locals(mod)["asg_arn"]
    secret = by_sid["ReadTheRedisPassword"]
    assert secret["actions"] == ["secretsmanager:GetSecretValue"]
    assert [_ref(r) for r in secret["resources"]] == ["statement.value"]
    doc = _plain(mod.resources("aws_iam_policy_document", kind="data")["agent"])
    (secret_block,) = [
        d["statement"]
        for d in doc["dynamic"]
        if d["statement"]["content"][0]["sid"] == "ReadTheRedisPassword"
    ]
    assert _ref(secret_block["for_each"]) == (
        'var.redis_password_secret_arn == "" ? [] : [var.redis_password_secret_arn]'
    )
    ec2 = {a for st in agent for a in st["actions"] if a.startswith("ec2:")}
    assert ec2 == {"ec2:TerminateInstances"}, "the agent's one EC2 call: ending its own VM"
    end = by_sid["EndItselfAmongThisRunsVMs"]
    assert end["condition"][0]["variable"] == "aws:ResourceTag/spottrain-job"
    assert [_ref(v) for v in end["condition"][0]["values"]] == ["var.run_id"]
    copy = by_sid["CopyThisRunsCheckpoints"]
    assert "var.run_id" in _locals(mod)["copy_run_objects"]
    assert [_ref(r) for r in copy["resources"]] == ["statement.value"]


# --- the boot script -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {
            "code_archive_url": "",
            "code_archive_sha256": "",
            "git_repo": "https://github.com/acme/gpt-train.git",
            "git_commit": "3f2a9c1d4b5e6f708192a3b4c5d6e7f8091a2b3c",
            "redis_password_secret_arn": "",
            "checkpoint_fs_type": "nfs4",
            "checkpoint_fs_source": "fs-0123456789abcdef0.efs.us-east-1.amazonaws.com:/",
            "checkpoint_copy_to": "",
        },
    ],
    ids=["archive-lustre-secret", "git-efs-no-secret"],
)
def test_rendered_boot_script_is_valid_bash(mod: Module, overrides: dict[str, str]) -> None:
    script = _render(mod, **overrides)
    assert script.startswith("#!/bin/bash\n") and "set -euo pipefail\n" in script
    assert "exec >>/var/log/spottrain-boot.log 2>&1\n" in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_train_command_quoting_matches_its_mirror(mod: Module) -> None:
    """The test's ``_train_command_env`` is only worth what its sameness with the HCL."""
    locals_ = _locals(mod)
    assert _hcl_unescape(_ref(locals_["train_command_shell"])) == (
        """join(" ", [for a in var.train_command : "'${replace(a, "'", "'\\''")}'"])"""
    )
    assert _ref(locals_["train_command_env"]) == (
        r'replace(replace(local.train_command_shell, "\\", "\\\\"), "\"", "\\\"")'
    )


def test_agent_env_holds_only_what_the_agent_reads(mod: Module, tmp_path: Path) -> None:
    env_file = _write_agent_env(_render(mod), tmp_path)
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    env = parse_env_file(env_file.read_text())
    agent_cli.build_parser()  # RUN_ENV_VARS is filled while the parser is built
    assert set(env) - agent_cli.RUN_ENV_VARS == set(), "variables spottrain-agent never reads"
    assert {"SPOTTRAIN_ASG_NAME", "SPOTTRAIN_ASG_LIFECYCLE_HOOK"} <= set(env)


def test_agent_starts_with_the_rendered_settings(
    mod: Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = _boot_values(mod)
    script = render_template(mod.texts[BOOT], values)
    env = parse_env_file(_write_agent_env(script, tmp_path).read_text())
    # The packaged unit's ExecStart, which the script installs, plus any agent command line
    # of the script itself.
    command_lines = [
        line.split("=", 1)[1]
        for line in _packaged_unit().splitlines() + script.splitlines()
        if line.startswith("ExecStart=") and line != "ExecStart="
    ]
    agent_call = re.compile(r"spottrain-agent((?: +(?:run|leave|notify|watch)\b).*)$")
    command_lines += [
        m[1]
        for line in script.splitlines()
        if not line.lstrip().startswith("#") and (m := agent_call.search(line))
    ]
    assert command_lines, "no spottrain-agent command line found"
    run_id = VARIABLES["run_id"]
    for line in command_lines:
        argv = shlex.split(line)
        if argv[0].endswith("spottrain-agent"):
            argv = argv[1:]
        args = _agent_args(env, argv, monkeypatch)
        assert args.command == "run"
        assert args.redis == values["redis_url"]
        assert (args.run_id, args.node_id, args.cloud) == (run_id, IMDS["INSTANCE_ID"], "aws")
        assert (args.zone, args.instance_type) == (IMDS["ZONE"], IMDS["INSTANCE_TYPE"])
        assert args.address == IMDS["LOCAL_IPV4"]
        assert (args.nnodes, args.nproc_per_node, args.expect_gpus) == ("2:8", 8, 8)
        assert args.ckpt_dir == f"/mnt/spottrain/{run_id}"
        assert args.ckpt_copy_to == "s3://acme-spottrain/ckpt"
        assert args.password_file == SECRET_PASSWORD_FILE
        assert (args.asg_name, args.asg_lifecycle_hook) == (
            f"spottrain-{run_id}",
            f"spottrain-{run_id}-drain",
        )
    # What the workers get is exactly the list Terraform was given.
    assert shlex.split(env["SPOTTRAIN_TRAIN_CMD"]) == HOSTILE_COMMAND


def test_no_password_means_no_password_file(
    mod: Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = _render(mod, redis_password_secret_arn="")
    env = parse_env_file(_write_agent_env(script, tmp_path).read_text())
    assert env["SPOTTRAIN_REDIS_PASSWORD_FILE"] == ""
    assert _agent_args(env, ["run"], monkeypatch).password_file == ""
    assert _ref(_locals(mod)["redis_password_file"]) == (
        'var.redis_password_secret_arn == "" ? "" : "/etc/spottrain/redis-password"'
    )


def test_boot_installs_the_pinned_agent(mod: Module) -> None:
    script = _render(mod)
    (requirement,) = re.findall(r"pip\"? install -q '(spottrain\[[^']*)'", script)
    assert requirement == f"spottrain[agent,aws]=={VARIABLES['spottrain_version']}"
    values = _locals(mod)["boot_template_values"]
    assert _ref(values["spottrain_version"]) == "var.spottrain_version"
    assert "VENV=/opt/spottrain/venv" in script


def test_boot_fetches_the_password_and_never_carries_it(mod: Module) -> None:
    script = _render(mod)
    arn = VARIABLES["redis_password_secret_arn"]
    assert f"REDIS_PASSWORD_SECRET='{arn}'" in script
    fetch = script.index("secretsmanager get-secret-value")
    assert script.rfind("umask 077", 0, fetch) > script.rfind("umask 022", 0, fetch)
    assert "/etc/spottrain/redis-password" in script[fetch:]
    assert '--secret-id "$REDIS_PASSWORD_SECRET"' in script


def test_boot_reads_its_identity_through_imdsv2(mod: Module) -> None:
    script = _render(mod)
    token = script.index("-X PUT http://169.254.169.254/latest/api/token")
    for path in ("instance-id", "placement/availability-zone", "instance-type", "local-ipv4"):
        assert script.index(f"$(imds {path})") > token
    assert "X-aws-ec2-metadata-token: $imds_token" in script


def test_boot_mounts_the_volume_before_creating_the_run_directory(mod: Module) -> None:
    values = _boot_values(mod)
    script = render_template(mod.texts[BOOT], values)
    fstab = f"{values['checkpoint_fs_source']} /mnt/spottrain {values['checkpoint_fs_type']} "
    assert fstab in script
    must_be_mounted = script.index('mountpoint -q "$VOLUME" || fail')
    assert script.index(f'install -d -m 0755 "$VOLUME/{VARIABLES["run_id"]}"') > must_be_mounted
    assert "RequiresMountsFor=/mnt/spottrain" in _packaged_unit()
    fs = _locals(mod)["checkpoint_fs"]
    assert "flock" in str(fs) and "nfsvers=4.1" in str(fs)


def test_boot_fetches_the_pinned_code(mod: Module) -> None:
    archive = _render(mod)
    assert (
        '"$VENV/bin/python" -m spottrain.cloud.code_archive fetch \\\n'
        '    "$CODE_ARCHIVE_URL" "$CODE_ARCHIVE_SHA256" "$JOB_DIR"'
    ) in archive
    assert f"CODE_ARCHIVE_SHA256='{VARIABLES['code_archive_sha256']}'" in archive
    # code_archive fetch refuses an existing directory that holds something else.
    assert "$JOB_DIR" not in archive.split("# --- the job's pinned code")[0].replace(
        "JOB_DIR=/opt/job", ""
    )
    assert 'test "$(git -C "$JOB_DIR" rev-parse HEAD)" = "$GIT_COMMIT"' in archive
    (lt,) = mod.resources("aws_launch_template").values()
    conditions = " ".join(p["condition"] for p in _plain(lt["lifecycle"][0]["precondition"]))
    assert '(var.code_archive_url != "") != (var.git_repo != "")' in conditions


def test_boot_installs_the_packaged_unit_with_the_job_directory(mod: Module) -> None:
    script = _render(mod)
    assert "resources.files('spottrain.agent.systemd') / 'spottrain-agent.service'" in script
    assert "open('/etc/systemd/system/spottrain-agent.service', 'w')" in script
    assert "[Service]\nWorkingDirectory=/opt/job\nUNIT\n" in script
    assert script.rstrip().splitlines()[-2] == "systemctl enable --now spottrain-agent.service"
    assert _packaged_unit().count("EnvironmentFile=/etc/spottrain/agent.env") == 1


def test_boot_creates_the_workers_user_before_the_agent_starts(mod: Module) -> None:
    # The same lines as the controller's own VMs (tests/integration/agent/test_worker_user.py runs
    # them): a fixed uid, as the shared checkpoint volume needs.
    script = _render(mod)
    assert worker_user_lines() in script
    assert script.index(worker_user_lines()) < script.index("systemctl enable --now")


# --- the job's secrets: train.secret_env and a private repository's token -------------------

# What Secrets Manager holds: shell, systemd and JSON trip-wires in one line each.
SECRET_VALUES = {
    "HF_TOKEN": 'hf_"quoted" \\back$lash `id` $(id) ${PATH} value',
    "WANDB_API_KEY": "0123456789abcdef0123456789abcdef",
}
GIT_TOKEN = "ghp_s3cr3tT0kenThatMustNeverLeak"
ARN = "arn:aws:secretsmanager:us-east-1:123456789012:secret:{}-AbCdEf"
SECRET_ARNS = {"HF_TOKEN": ARN.format("spottrain/hf"), "WANDB_API_KEY": ARN.format("wandb")}
SECRET_ENV_LOOP = 'read_secret secret-env "$name" "$arn" /etc/spottrain/agent.env'
REGION = "us-east-1"
ROLE = "spottrain-agent"


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def aws_md() -> Iterator[MetadataServer]:
    """IMDSv2 as a VM of the fleet sees it: its instance role's credentials, which the
    boot's loader signs its Secrets Manager calls with."""
    with MetadataServer() as md:
        meta = "/latest/meta-data/"
        md.set_aws_value(meta + "placement/region", REGION)
        md.set_aws_value(meta + "iam/security-credentials/", ROLE)
        creds = {
            "Code": "Success",
            "AccessKeyId": "ASIAEXAMPLE",
            "SecretAccessKey": "s3cr3t",
            "Token": "session-token",
            "Expiration": "2099-01-01T00:00:00Z",
        }
        md.set_aws_value(meta + f"iam/security-credentials/{ROLE}", json.dumps(creds))
        yield md


def _put_secret(moto_url: str, name: str, value: str) -> str:
    """A Secrets Manager secret holding ``value``; its ARN (with AWS's suffix)."""
    client = boto3.client(
        "secretsmanager",
        endpoint_url=moto_url,
        region_name=REGION,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    reply = client.create_secret(Name=f"{name}-{uuid.uuid4().hex[:8]}", SecretString=value)
    return str(reply["ARN"])


def _run_boot_part(
    script: str, part: str, tmp_path: Path, moto_url: str, md: MetadataServer, **env: str
) -> subprocess.CompletedProcess[str]:
    """``part`` of the rendered script, run after its ``fail`` and the loader's settings and
    ``read_secret`` (the secrets section), against moto and the metadata fake."""
    secrets = section(script, "# --- secrets: read by the installed spottrain", "# --- the shared")
    conf = {
        "cloud": "aws",
        "endpoints": {"secretsmanager": moto_url},
        "redact_file": str(tmp_path / "redact"),
    }
    env = {"AWS_EC2_METADATA_SERVICE_ENDPOINT": md.url, **env}
    return run_part(shell_function(script, "fail") + secrets + part, tmp_path, conf=conf, env=env)


def _arn_patterns(mod: Module) -> list[str]:
    patterns = [
        p
        for name in ("secret_env_arns", "git_token_secret_arn")
        for v in _validations(mod, name)
        for p in _regexes(v["condition"])
        if p.startswith("^arn:")
    ]
    assert len(patterns) == 2, "secret_env_arns and git_token_secret_arn check their ARNs"
    return patterns


def test_secret_env_table_matches_its_mirror(mod: Module) -> None:
    """The test's ``_secret_env_table`` is only worth what its sameness with the HCL."""
    assert _ref(_locals(mod).get("secret_env_table", "")) == (
        'join("", [for name, arn in var.secret_env_arns : "${name} ${arn}\\n"])'
    )
    assert _ref(_locals(mod)["boot_template_values"]["secret_env_table"]) == (
        "local.secret_env_table"
    )
    if shutil.which("terraform"):  # and what Terraform makes of it, in key order
        text = variable_blocks(mod.texts["variables.tf"], "secret_env_arns")
        text += f"locals {{\n  t = {_ref(_locals(mod)['secret_env_table'])}\n}}\n"
        arns = {"WANDB_API_KEY": ARN.format("w"), "HF_TOKEN": ARN.format("h"), "A": ARN.format("a")}
        hcl = "{" + ", ".join(f'"{k}" = "{v}"' for k, v in arns.items()) + "}"
        assert evaluate(text, "local.t", {"secret_env_arns": hcl}) == _secret_env_table(arns)


def test_boot_names_each_secret_variable_and_reads_it_after_writing_the_agents_env(
    mod: Module,
) -> None:
    script = _render(mod, secret_env_arns=SECRET_ARNS)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    table = "".join(f"{name} {arn}\n" for name, arn in sorted(SECRET_ARNS.items()))
    assert f"done <<'SECRETS'\n{table}SECRETS\n" in script, "the boot names no secret of the job"
    loop = script.index(SECRET_ENV_LOOP)
    # After the file is written (which truncates it), before the agent starts.
    assert script.index("cat >>/etc/spottrain/agent.env <<ENV\n") < loop
    assert "cat >/etc/spottrain/agent.env" not in script[loop:]
    assert loop < script.index("systemctl enable --now spottrain-agent.service")
    # With the same loader the controller's own VMs read secrets with.
    read = shell_function(script, "read_secret")
    assert (
        '"$VENV/bin/python" -m spottrain.cloud.vmboot.loader /etc/spottrain/loader.json "$@"'
        in read
    )
    # Without secrets the table is empty, and the loop reads nothing.
    assert "done <<'SECRETS'\nSECRETS\n" in _render(mod)


def test_secret_variables_reach_the_agents_env_root_only_and_no_command_line(
    mod: Module, tmp_path: Path, moto_url: str, aws_md: MetadataServer
) -> None:
    arns = {n: _put_secret(moto_url, f"spottrain/{n.lower()}", v) for n, v in SECRET_VALUES.items()}
    for arn in arns.values():  # moto's ARNs are what the module's variable accepts
        assert any(re.fullmatch(p, arn) for p in _arn_patterns(mod)), arn
    script = _render(mod, secret_env_arns=arns)
    part = section(script, "umask 077\ncat >/etc/spottrain/agent.env", "# --- the packaged")
    done = _run_boot_part(script, part, tmp_path, moto_url, aws_md, **IMDS)
    assert done.returncode == 0, done.stderr
    env_file = tmp_path / "etc" / "agent.env"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    env = parse_env_file(env_file.read_text())
    assert {k: env[k] for k in SECRET_VALUES} == SECRET_VALUES
    agent_cli.build_parser()  # fills RUN_ENV_VARS
    assert set(env) - agent_cli.RUN_ENV_VARS == set(SECRET_VALUES)
    # bash's trace shows every command with its arguments: the loader got names only.
    loader = f"-m spottrain.cloud.vmboot.loader {tmp_path}/etc/loader.json"
    for name, arn in arns.items():
        assert f"{loader} secret-env {name} {arn} {env_file}\n" in done.stderr
    for value in SECRET_VALUES.values():
        assert value not in done.stderr and value not in script
    # Noted for the agent's log shipping, which redacts them.
    assert set(SECRET_VALUES.values()) <= set(parse_redact_lines((tmp_path / "redact").read_text()))


def test_a_private_repository_is_fetched_with_its_token_through_askpass_only(
    mod: Module, tmp_path: Path, moto_url: str, aws_md: MetadataServer
) -> None:
    with GitHttpServer(tmp_path / "git") as git:
        url, commit = git.create_repo(
            "acme/private-train",
            {"train.py": "print('hi')\n"},
            private=True,
            token=GIT_TOKEN,
            user="x-access-token",
        )
        arn = _put_secret(moto_url, "spottrain/git-token", GIT_TOKEN)
        code = {"code_archive_url": "", "code_archive_sha256": "", "git_repo": url}
        script = _render(mod, **code, git_commit=commit, git_token_secret_arn=arn)
        part = section(script, "# --- the job's pinned code", 'install_job_requirements "$JOB_DIR')
        job = tmp_path / "job"
        done = _run_boot_part(script, part, tmp_path, moto_url, aws_md, JOB_DIR=str(job))
        assert done.returncode == 0, done.stderr
        assert git.internal_errors == []
        assert git.count("acme/private-train", status=401) >= 1, "the repository is private"
        assert git.users and set(git.users) == {"x-access-token"}
    head = subprocess.run(["git", "-C", job, "rev-parse", "HEAD"], capture_output=True, text=True)
    assert head.stdout.strip() == commit and (job / "train.py").exists()
    # The token was in a root-only file only while git fetched.
    assert not (tmp_path / "etc" / "git-token").exists()
    assert not (tmp_path / "etc" / "git-askpass").exists()
    assert GIT_TOKEN not in done.stderr and GIT_TOKEN not in script
    assert f"loader.json secret {arn} {tmp_path}/etc/git-token" in done.stderr
    assert "( umask 077; cat >/etc/spottrain/git-askpass <<'SH'" in script
    assert "chmod 0700 /etc/spottrain/git-askpass" in script


def test_a_refused_token_stops_the_boot_and_leaves_no_token_behind(
    mod: Module, tmp_path: Path, moto_url: str, aws_md: MetadataServer
) -> None:
    with GitHttpServer(tmp_path / "git") as git:
        url, commit = git.create_repo(
            "acme/private-train", {"train.py": "1\n"}, private=True, token=GIT_TOKEN
        )
        arn = _put_secret(moto_url, "spottrain/stale-token", "ghp_revokedLongAgo")
        code = {"code_archive_url": "", "code_archive_sha256": "", "git_repo": url}
        script = _render(mod, **code, git_commit=commit, git_token_secret_arn=arn)
        part = section(script, "# --- the job's pinned code", 'install_job_requirements "$JOB_DIR')
        done = _run_boot_part(
            script, part, tmp_path, moto_url, aws_md, JOB_DIR=str(tmp_path / "job")
        )
    assert done.returncode == 1
    assert f"spottrain: git could not fetch {commit} from {url} with the token of {arn}" in (
        done.stderr
    )
    assert not (tmp_path / "etc" / "git-token").exists()
    assert not (tmp_path / "etc" / "git-askpass").exists()


def test_agent_role_reads_exactly_the_jobs_secrets(mod: Module) -> None:
    docs = mod.resources("aws_iam_policy_document", kind="data")
    blocks = {
        d["statement"]["content"][0]["sid"]: d["statement"]
        for d in _plain(docs["agent"])["dynamic"]
        if "statement" in d
    }
    assert "ReadTheJobsSecrets" in blocks, "the agents' role may not read the job's secrets"
    block = blocks["ReadTheJobsSecrets"]
    assert _ref(block["for_each"]) == (
        "length(local.job_secret_arns) == 0 ? [] : [local.job_secret_arns]"
    )
    (content,) = block["content"]
    assert content["actions"] == ["secretsmanager:GetSecretValue"]
    assert _ref(content["resources"]) == "statement.value"
    assert _ref(_locals(mod)["job_secret_arns"]) == (
        "distinct(concat(values(var.secret_env_arns), "
        'var.git_token_secret_arn == "" ? [] : [var.git_token_secret_arn]))'
    )
    # The controller VM's role reads the Redis password only.
    controller = {st["sid"] for st in _statements(_plain(docs["controller"]))}
    assert "ReadTheJobsSecrets" not in controller


@pytest.mark.skipif(shutil.which("terraform") is None, reason="no terraform binary here")
@pytest.mark.parametrize(
    ("secret_env", "token", "expected"),
    [
        ({}, "", []),
        ({"HF_TOKEN": SECRET_ARNS["HF_TOKEN"]}, "", [SECRET_ARNS["HF_TOKEN"]]),
        (SECRET_ARNS, ARN.format("gh"), [*SECRET_ARNS.values(), ARN.format("gh")]),
        (
            {"A": ARN.format("same"), "B": ARN.format("same")},
            ARN.format("same"),
            [ARN.format("same")],
        ),
    ],
)
def test_terraform_grants_the_agents_exactly_the_configured_secrets(
    mod: Module, secret_env: dict[str, str], token: str, expected: list[str]
) -> None:
    """The agent policy's statement, evaluated by Terraform from the module's own
    expressions: no statement without secrets, else one on exactly those ARNs."""
    doc = _plain(mod.resources("aws_iam_policy_document", kind="data")["agent"])
    blocks = [
        d["statement"]
        for d in doc["dynamic"]
        if d["statement"]["content"][0]["sid"] == "ReadTheJobsSecrets"
    ]
    assert len(blocks) == 1, "no statement lets the agents read the job's secrets"
    (block,) = blocks
    text = variable_blocks(mod.texts["variables.tf"], "secret_env_arns", "git_token_secret_arn")
    text += (
        f"locals {{\n  job_secret_arns = {_ref(_locals(mod)['job_secret_arns'])}\n"
        f"  statements = {_ref(block['for_each'])}\n}}\n"
    )
    variables = {
        "secret_env_arns": "{" + ", ".join(f'"{k}" = "{v}"' for k, v in secret_env.items()) + "}",
        "git_token_secret_arn": token,
    }
    got = evaluate(text, "local.statements", variables)
    assert [sorted(arns) for arns in got] == ([sorted(expected)] if expected else [])


def test_a_git_token_needs_an_https_repository(mod: Module) -> None:
    lt = mod.resources("aws_launch_template")["fleet"]
    conditions = [p["condition"] for p in _plain(lt["lifecycle"][0]["precondition"])]
    assert '${var.git_token_secret_arn == "" || startswith(var.git_repo, "https://")}' in conditions


def test_a_boot_script_over_aws_user_data_limit_is_refused_at_plan(mod: Module) -> None:
    """Each secret variable adds a line to the (not gzipped, without env_lock) user data,
    which AWS caps at 16 KB: a handful fit, enough of them are refused at plan."""
    lt = mod.resources("aws_launch_template")["fleet"]
    conditions = [p["condition"] for p in _plain(lt["lifecycle"][0]["precondition"])]
    assert '${var.env_lock != "" || length(local.boot_script) <= 16384}' in conditions
    few = {f"SECRET_{i}": ARN.format(f"spottrain/s{i}") for i in range(8)}
    many = {f"SECRET_{i}": ARN.format(f"spottrain/job-secret-{i}") for i in range(60)}
    assert len(_render(mod, secret_env_arns=few)) <= 16384 < len(_render(mod, secret_env_arns=many))


def test_secret_variables_refuse_bad_names_and_arns(mod: Module) -> None:
    """The validations, read from the module and run here (the regexes are RE2's and
    Python's alike); tests below run them in Terraform itself where it is installed."""
    names = " ".join(v["condition"] for v in _validations(mod, "secret_env_arns"))
    assert 'startswith(name, "SPOTTRAIN_")' in names, "SPOTTRAIN_* must be refused"
    (name_re,) = [p for p in _regexes(names) if not p.startswith("^arn:")]
    for good in ("HF_TOKEN", "_x", "wandb_api_key2"):
        assert re.search(name_re, good), good
    for bad in ("1HF", "HF-TOKEN", "HF TOKEN", "", "A=B"):
        assert not re.search(name_re, bad), bad
    for pattern in _arn_patterns(mod):
        for good in (
            ARN.format("spottrain/hf"),
            ARN.format("a.b@c+d=e_f").replace(":aws:", ":aws-us-gov:"),
        ):
            assert re.search(pattern, good), good
        for bad in (
            "spottrain/hf",
            ARN.format("spottrain/hf").removesuffix("-AbCdEf"),
            ARN.format("x' ; rm -rf /; '"),
            ARN.format("x").replace("secretsmanager", "ssm"),
        ):
            assert not re.search(pattern, bad), bad
    (user_re,) = [p for v in _validations(mod, "git_token_user") for p in _regexes(v["condition"])]
    assert re.search(user_re, "x-token-auth") and not re.search(user_re, "x access")


@pytest.mark.skipif(shutil.which("terraform") is None, reason="no terraform binary here")
@pytest.mark.parametrize(
    ("variable", "value", "error"),
    [
        ("secret_env_arns", '{"1HF" = "%s"}', "each key must be an environment variable name"),
        ("secret_env_arns", '{"HF-TOKEN" = "%s"}', "each key must be an environment variable name"),
        (
            "secret_env_arns",
            '{"SPOTTRAIN_REDIS_PASSWORD_FILE" = "%s"}',
            "SPOTTRAIN_* variables are set by spottrain itself",
        ),
        ("secret_env_arns", '{"HF_TOKEN" = "spottrain/hf"}', "with the 6-character suffix"),
        ("secret_env_arns", '{"HF_TOKEN" = "%s"}', ""),
        ("git_token_secret_arn", "spottrain/gh", "with the 6-character suffix"),
        ("git_token_secret_arn", "%s", ""),
        ("git_token_secret_arn", "", ""),
        ("git_token_user", "x access", "git_token_user must be 1-64"),
        ("git_token_user", "x-token-auth", ""),
    ],
)
def test_terraform_refuses_bad_secret_variables_with_the_fix(
    mod: Module, variable: str, value: str, error: str
) -> None:
    text = variable_blocks(mod.texts["variables.tf"], variable)
    said = refusal(text, variable, value.replace("%s", ARN.format("hf")))
    if error:
        assert f"{error}" in said
    else:
        assert said == ""


# --- the controller VM -----------------------------------------------------------------------


def test_controller_runs_real_spottrain_commands(mod: Module) -> None:
    user_data = str(_locals(mod)["controller_user_data"])
    assert "pip install -q 'spottrain[aws]==${var.spottrain_version}'" in user_data
    (up,) = re.findall(r"^\s*ExecStart=/opt/spottrain/venv/bin/spottrain (.*)$", user_data, re.M)
    args = spottrain_cli.build_parser().parse_args(shlex.split(up))
    assert (args.command, args.spec, args.detach) == ("up", "/etc/spottrain/job.yaml", True)
    spec = str(_locals(mod)["controller_job_spec"]).replace(" ", "")
    assert "merge(yamldecode(var.controller_job_spec_yaml),{fleet=local.spottrain_fleet})" in spec
    instance = mod.resources("aws_instance")["controller"]
    assert _ref(instance["instance_type"]) == "var.controller_instance_type"
    assert instance["metadata_options"][0]["http_tokens"] == "required"
    assert mod.variables["controller_instance_type"]["default"] == "t3.small"


# --- outputs and the example -----------------------------------------------------------------


def test_outputs_give_the_job_spec_its_fleet_section(mod: Module) -> None:
    outputs = mod.outputs
    for name in (
        "asg_name",
        "lifecycle_hook_name",
        "security_group_id",
        "placement_group_name",
        "checkpoint_filesystem_id",
        "checkpoint_filesystem_dns_name",
        "checkpoint_filesystem_mount_name",
        "redis_url",
        "controller_private_ip",
        "region",
        "spottrain_fleet",
    ):
        assert name in outputs, f"output {name} is missing"
        assert outputs[name].get("description"), f"output {name} has no description"
    assert _ref(outputs["spottrain_fleet"]["value"]) == "local.spottrain_fleet"
    fleet = _locals(mod)["spottrain_fleet"]
    assert set(fleet) == {"managed_by", "cloud", "region", "group", "lifecycle_hook", "run_id"}
    assert (fleet["managed_by"], fleet["cloud"]) == ("terraform", "aws")
    assert _ref(fleet["group"]) == "local.asg_name"
    assert _ref(fleet["lifecycle_hook"]) == "local.lifecycle_hook_name"
    assert _ref(fleet["run_id"]) == "var.run_id"
    assert _ref(fleet["region"]) == "local.region"
    # What the job spec's fleet: section accepts, filled as a plan in us-east-1 would be.
    region = {"region": "us-east-1"}
    resolved = {k: _resolve(v, VARIABLES, {**_locals(mod), **region}) for k, v in fleet.items()}
    spec = FleetSpec(**resolved)
    assert (spec.group, spec.lifecycle_hook) == (
        f"spottrain-{VARIABLES['run_id']}",
        f"spottrain-{VARIABLES['run_id']}-drain",
    )


def test_example_tfvars_sets_declared_variables_and_every_required_one(mod: Module) -> None:
    with (AWS / "example.tfvars").open() as f:
        example = clean(hcl2.load(f))
    example = {k: v for k, v in _plain(example).items()}
    declared = mod.variables
    assert set(example) - set(declared) == set(), "example.tfvars sets undeclared variables"
    required = {n for n, body in declared.items() if "default" not in body}
    assert required - set(example) == set(), "example.tfvars misses required variables"
    for name in ("run_id", "ami_id", "spottrain_version"):
        (pattern,) = [p for v in _validations(mod, name) for p in _regexes(v["condition"])]
        assert re.fullmatch(pattern, example[name]), name
    assert not any(c.endswith("/0") for c in example.get("controller_cidrs", []))

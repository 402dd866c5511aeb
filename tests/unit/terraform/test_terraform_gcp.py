"""terraform/gcp without a Terraform binary: the module is parsed with python-hcl2 and its
startup scripts are rendered the way ``templatefile`` would, then checked with ``bash -n``,
run in part, and read back with the real ``spottrain-agent`` and ``spottrain`` parsers."""

from __future__ import annotations

import base64
import json
import re
import shlex
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hcl2
import pytest
import yaml
from fakes.git_http import GitHttpServer
from fakes.metadata_server import MetadataServer
from fakes.secret_manager import SecretManagerFake
from replica_values import replica_values
from secret_boot import (
    evaluate,
    refusal,
    run_part,
    section,
    shell_function,
    variable_blocks,
)
from spec_samples import COMMIT, VALID, spec_with
from terraform_hcl import (
    TERRAFORM,
    Module,
    clean,
    load_module,
    render_template,
    template_names,
    terraform_console,
)

from spottrain.agent import cli as agent_cli
from spottrain.cloud.base import TAG_JOB
from spottrain.cloud.storage import parse_store_url
from spottrain.controller.cli import main as spottrain_cli
from spottrain.controller.run.boot import _unit_lines, parse_env_file, worker_user_lines
from spottrain.protocol.boot import parse_redact_lines
from spottrain.spec import parse_spec

MODULE_DIR = TERRAFORM / "gcp"
GPU_TYPES = {
    "a3-highgpu-8g",
    "a3-megagpu-8g",
    "a3-ultragpu-8g",
    "a2-highgpu-8g",
    "a2-ultragpu-8g",
    "a2-megagpu-16g",
}
# Every shell metacharacter a training argument could carry to the env file and the shell.
HOSTILE_CMD = [
    "train.py",
    "--name",
    "gpt 1.3b",
    "--note",
    'it\'s "quoted" $HOME ${USER} `id` $(id) \\ back;rm -rf / & | > < * ? ~ # !',
    "--empty-looking=''",
]
# Where a test stands in for what only a real apply knows.
FILESTORE_IP = "10.20.0.2"
CONTROLLER_ADDRESS = "10.128.0.2"  # the controller VM's reserved internal address
NODE = {  # what the metadata server tells a node about itself
    "NODE_NAME": "spottrain-gpt-1b3-2025-07-x7k2",
    "ZONE": "us-central1-a",
    "MACHINE_TYPE": "a3-highgpu-8g",
    "ADDRESS": "10.128.0.7",
}

_TF_REF = re.compile(r"\$\{(var|local)\.([A-Za-z_][A-Za-z0-9_]*)\}")
_TEMPLATEFILE = re.compile(
    r'templatefile\("\$\{path\.module\}/([A-Za-z0-9_.-]+\.tftpl)",\s*(local\.\w+|\{[^}]*\})\)'
)


@pytest.fixture(scope="module")
def mod() -> Module:
    return load_module(MODULE_DIR)


def _locals(mod: Module) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for block in mod.blocks("locals"):
        for k, v in block.items():
            if k != "__comments__":
                assert k not in out, f"local.{k} is defined twice"
                out[k] = v
    return out


def _tfvars(path: Path = MODULE_DIR / "example.tfvars") -> dict[str, Any]:
    with path.open() as fh:
        data: dict[str, Any] = clean(hcl2.load(fh))
    data.pop("__comments__", None)
    return data


def _inputs(mod: Module, **overrides: Any) -> dict[str, Any]:
    """The module's input values: variable defaults, then example.tfvars, then overrides."""
    values = {k: v["default"] for k, v in mod.variables.items() if "default" in v}
    return values | _tfvars() | overrides


def _resolve(mod: Module, text: str, inputs: dict[str, Any], known: dict[str, Any]) -> str:
    """Evaluate a string that only interpolates ``var.X`` and ``local.Y`` (recursively), as
    Terraform would; ``known`` gives the locals that are real expressions (functions,
    conditionals, resource attributes)."""
    local = _locals(mod)

    def sub(m: re.Match[str]) -> str:
        kind, name = m.groups()
        if kind == "var":
            return str(inputs[name])
        if name in known:
            return str(known[name])
        return _resolve(mod, local[name], inputs, known)

    assert "${" not in _TF_REF.sub("", text), f"the test cannot evaluate {text!r}"
    return _TF_REF.sub(sub, text)


def _shell_join(mod: Module, args: list[str]) -> str:
    """local.train_cmd_shell, evaluated as Terraform would: the module's own safe-character
    pattern, and its quoting of the rest."""
    expr = _locals(mod)["train_cmd_shell"]
    safe = re.search(r'can\(regex\("([^"]+)", a\)\)', expr)
    assert safe, f"local.train_cmd_shell changed shape: {expr}"
    assert """replace(a, "'", "'\\"'\\"'")""" in expr, expr
    pattern = json.loads(f'"{safe.group(1)}"')
    return " ".join(
        a if re.search(pattern, a) else "'" + a.replace("'", "'\"'\"'") + "'" for a in args
    )


def _env_value(mod: Module, value: str) -> str:
    """local.train_cmd_env: escaped for a double-quoted systemd EnvironmentFile value."""
    expr = _locals(mod)["train_cmd_env"]
    assert expr == r'${replace(replace(local.train_cmd_shell, "\\", "\\\\"), "\"", "\\\"")}'
    return value.replace("\\", "\\\\").replace('"', '\\"')


def _secret_env_table(secret_env: dict[str, str]) -> str:
    """What ``local.secret_env_table`` computes (Terraform walks a map in key order; the
    expression is pinned by :func:`test_secret_env_table_matches_its_mirror`)."""
    return "".join(f"{name} {secret}\n" for name, secret in sorted(secret_env.items()))


def _template_calls(mod: Module) -> list[tuple[str, set[str]]]:
    """(template file, keys of the variables map) of every templatefile() in the module."""
    calls = []
    local = _locals(mod)
    for name, text in mod.texts.items():
        if not name.endswith(".tf"):
            continue
        for m in _TEMPLATEFILE.finditer(text):
            arg = m.group(2)
            if arg.startswith("local."):
                keys = set(local[arg.removeprefix("local.")])
            else:
                keys = set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*=", arg))
            calls.append((m.group(1), keys))
    return calls


def _render_startup(mod: Module, **overrides: Any) -> tuple[str, dict[str, Any]]:
    """startup.sh.tftpl rendered with the module's own startup_vars, evaluated for
    example.tfvars plus ``overrides``."""
    inputs = _inputs(mod, **overrides)
    local = _locals(mod)
    gpus = local["gpus_by_machine_type"][inputs["machine_type"]]
    if inputs["code_archive_url"]:
        sub, sub_vars = "code_archive.sh.tftpl", local["code_archive_vars"]
        known: dict[str, Any] = {}
    else:
        sub, sub_vars = "code_git.sh.tftpl", local["code_git_vars"]
        subdir = inputs["git_subdir"]
        known = {"git_workdir": f"/opt/job/{subdir}" if subdir else "/opt/job"}
    code_values = {
        k: known[k] if k in known else _resolve(mod, v, inputs, {}) for k, v in sub_vars.items()
    }
    known = {
        "filestore_ip": FILESTORE_IP,
        "code_fetch": render_template(mod.texts[sub], code_values),
        "expect_gpus": gpus,
        "nproc_per_node": inputs["nproc_per_node"] or gpus,
        "train_cmd_env": _env_value(mod, _shell_join(mod, inputs["train_command"])),
        "secret_env_table": _secret_env_table(inputs.get("secret_env", {})),
        **replica_values(local, inputs, f"{CONTROLLER_ADDRESS}:{inputs['lighthouse_port']}"),
    }
    values = {k: _resolve(mod, v, inputs, known) for k, v in local["startup_vars"].items()}
    return render_template(mod.texts["startup.sh.tftpl"], values), inputs


def _bash_n(script: str) -> None:
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def _written_env(script: str, tmp_path: Path, secret: str) -> dict[str, str]:
    """Run the script's agent.env block as the VM would, with this node's identity, and read
    back the file it writes."""
    start = script.index("# BEGIN agent.env")
    block = script[start : script.index("# END agent.env", start)]
    env_file = tmp_path / "agent.env"
    shell_vars = {
        **NODE,
        "ENV_TMP": str(env_file),
        "PASSWORD_FILE": "/etc/spottrain/redis-password",
        "REDIS_PASSWORD_SECRET": secret,
    }
    prelude = "".join(f"{k}={shlex.quote(v)}\n" for k, v in shell_vars.items())
    subprocess.run(["bash", "-c", "set -euo pipefail\n" + prelude + block], check=True, text=True)
    return parse_env_file(env_file.read_text())


def _is_validated(var: dict[str, Any]) -> bool:
    return bool(var.get("validation"))


# -- variables and templates ---------------------------------------------------------------


def test_every_variable_is_declared_and_used(mod: Module) -> None:
    declared, used = set(mod.variables), mod.used_variables()
    assert used - declared == set(), f"used but not declared: {sorted(used - declared)}"
    assert declared - used == set(), f"declared but never used: {sorted(declared - used)}"


def test_template_placeholders_are_the_templatefile_keys(mod: Module) -> None:
    calls = _template_calls(mod)
    assert {t for t, _ in calls} == {p.name for p in MODULE_DIR.glob("*.tftpl")}, (
        "every template is rendered by a templatefile() call the test can read"
    )
    for template, keys in calls:
        names = template_names(mod.texts[template])
        assert names == keys, (
            f"{template}: placeholders without a value {sorted(names - keys)}, "
            f"values without a placeholder {sorted(keys - names)}"
        )


def test_every_variable_has_a_type_and_a_description(mod: Module) -> None:
    for name, var in mod.variables.items():
        assert var.get("type"), f"variable {name} has no type"
        assert len(var.get("description", "")) > 20, f"variable {name} has no real description"


def test_values_that_can_be_wrong_are_validated(mod: Module) -> None:
    must = {
        "run_id",
        "machine_type",
        "termination_action",
        "controller_cidrs",
        "filestore_tier",
        "filestore_capacity_gb",
        "redis_url",
        "redis_port",
        "project",
        "zone",
        "spottrain_version",
        "train_command",
        "git_commit",
        "code_archive_sha256",
    }
    missing = {n for n in must if not _is_validated(mod.variables[n])}
    assert not missing, f"no validation for {sorted(missing)}"
    machine = " ".join(v["condition"] for v in mod.variables["machine_type"]["validation"])
    assert set(re.findall(r'"(a[23]-[a-z]+-\d+g)"', machine)) == GPU_TYPES
    tier = " ".join(v["condition"] for v in mod.variables["filestore_tier"]["validation"])
    assert set(re.findall(r'"([A-Z_]+)"', tier)) == {"BASIC_SSD", "ZONAL", "HIGH_SCALE_SSD"}
    run_id = " ".join(v["condition"] for v in mod.variables["run_id"]["validation"])
    assert "^[a-z0-9][a-z0-9-]{0,62}$" in run_id


def test_provider_is_pinned(mod: Module) -> None:
    (terraform,) = mod.blocks("terraform")
    assert re.match(r"^(>=|~>|=)\s*\d", terraform["required_version"])
    providers = terraform["required_providers"][0]
    assert providers["google"]["source"] == "hashicorp/google"
    for name, spec in providers.items():
        if name != "__comments__":
            assert re.match(r"^(~>|=|>=\s*\S+,\s*<)\s*\d", spec["version"]), (
                f"provider {name} is not pinned: {spec.get('version')!r}"
            )


# -- the spot VMs ----------------------------------------------------------------------------


def test_instance_template_makes_spot_vms_labelled_for_adoption(mod: Module) -> None:
    tpl = mod.resources("google_compute_instance_template")["fleet"]
    (sched,) = tpl["scheduling"]
    assert sched["provisioning_model"] == "SPOT"
    assert sched["preemptible"] is True
    assert sched["automatic_restart"] is False
    assert sched["on_host_maintenance"] == "TERMINATE"
    assert sched["instance_termination_action"] == "${var.termination_action}"
    action = mod.variables["termination_action"]
    assert action["default"] == "STOP"
    cond = " ".join(v["condition"] for v in action["validation"])
    assert set(re.findall(r'"([A-Z]+)"', cond)) == {"STOP", "DELETE"}

    assert tpl["machine_type"] == "${var.machine_type}"
    assert "guest_accelerator" not in tpl, "A3/A2 types come with their GPUs attached"
    assert tpl["labels"] == "${local.labels}"
    local = _locals(mod)
    assert local["labels"] == "${merge(var.labels, local.own_labels)}", (
        "the module's own labels must win over the extra ones"
    )
    assert local["own_labels"] == {TAG_JOB: "${var.run_id}", "spottrain-managed-by": "terraform"}
    assert tpl["metadata"]["startup-script"] == (
        '${templatefile("${path.module}/startup.sh.tftpl", local.startup_vars)}'
    )


def test_controller_vm_is_not_labelled_as_a_node(mod: Module) -> None:
    vm = mod.resources("google_compute_instance")["controller"]
    assert vm["labels"] == "${local.controller_labels}"
    local = _locals(mod)
    own = local["controller_own_labels"]
    assert TAG_JOB not in own and TAG_JOB not in local["controller_labels"]
    (sched,) = vm["scheduling"]
    assert sched["provisioning_model"] == "STANDARD", "the controller must not be preempted"


def test_instance_group_leaves_its_size_to_the_controller(mod: Module) -> None:
    (mig_name,) = mod.resources("google_compute_instance_group_manager")
    mig = mod.resources("google_compute_instance_group_manager")[mig_name]
    assert mig["name"] == "${local.name}" and _locals(mod)["name"] == "spottrain-${var.run_id}"
    assert mig["target_size"] == "${var.initial_size}"
    (lifecycle,) = mig["lifecycle"]
    assert "target_size" in lifecycle["ignore_changes"]
    (version,) = mig["version"]
    assert version["instance_template"].startswith("${google_compute_instance_template.fleet.")
    (policy,) = mig["update_policy"]
    assert policy["type"] == "OPPORTUNISTIC", "a new template must not replace training nodes"
    assert mig.get("wait_for_instances") is False
    assert not mod.resource_types() & {
        "google_compute_autoscaler",
        "google_compute_region_autoscaler",
    }
    assert "auto_healing_policies" not in mig


# -- network ---------------------------------------------------------------------------------


def _opens(allow: dict[str, Any], port: int) -> bool:
    """Whether one allow block admits TCP ``port`` (or everything)."""
    if allow["protocol"] in ("all", "tcp") and not allow.get("ports"):
        return True
    for p in allow.get("ports", []):
        if "var.redis_port" in p or p == str(port):
            return True
        lo, _, hi = p.partition("-")
        if hi and lo.isdigit() and hi.isdigit() and int(lo) <= port <= int(hi):
            return True
    return False


def test_no_firewall_rule_opens_redis_or_everything_to_the_internet(mod: Module) -> None:
    rules = mod.resources("google_compute_firewall")
    assert rules, "the module has firewall rules"
    redis_port = mod.variables["redis_port"]["default"]
    for name, rule in rules.items():
        ranges = rule.get("source_ranges", [])
        text = json.dumps(ranges)
        # A range given by a variable is only as safe as that variable's validation.
        for var in re.findall(r"var\.(\w+)", text):
            conds = " ".join(v["condition"] for v in mod.variables[var].get("validation", []))
            assert "0.0.0.0/0" in conds and "::/0" in conds, (
                f"firewall {name}: source range var.{var} is not validated against 0.0.0.0/0"
            )
        if "0.0.0.0/0" in text or "::/0" in text:
            for allow in rule["allow"]:
                assert not _opens(allow, redis_port), f"firewall {name} opens Redis to everyone"
                assert allow["protocol"] != "all", f"firewall {name} opens everything"
    internal = rules["fleet_internal"]
    assert "source_ranges" not in internal, "all-ports traffic comes from fleet members only"
    assert internal["source_tags"] == internal["target_tags"] == ["${local.fleet_tag}"]
    redis = rules["redis"]
    assert redis["allow"] == [{"protocol": "tcp", "ports": ["${tostring(var.redis_port)}"]}]
    assert redis["source_ranges"] == "${var.controller_cidrs}"


def test_opens_helper_sees_what_it_must() -> None:
    assert _opens({"protocol": "all"}, 6379)
    assert _opens({"protocol": "tcp"}, 6379)
    assert _opens({"protocol": "tcp", "ports": ["6000-7000"]}, 6379)
    assert _opens({"protocol": "tcp", "ports": ["${tostring(var.redis_port)}"]}, 6379)
    assert not _opens({"protocol": "tcp", "ports": ["22"]}, 6379)


def test_filestore_is_zonal_and_exported_to_the_fleet_only(mod: Module) -> None:
    fs = mod.resources("google_filestore_instance")["ckpt"]
    assert fs["location"] == "${var.zone}" and fs["tier"] == "${var.filestore_tier}"
    (net,) = fs["networks"]
    assert net["network"] == "${var.network}"
    (share,) = fs["file_shares"]
    assert share["capacity_gb"] == "${var.filestore_capacity_gb}"
    (export,) = share["nfs_export_options"]
    assert export["ip_ranges"] == ["${data.google_compute_subnetwork.fleet.ip_cidr_range}"]
    fstab = _locals(mod)["nfs_fstab_entry"]
    assert " ${local.volume_root} nfs " in fstab and _locals(mod)["volume_root"] == "/mnt/spottrain"


def test_service_account_grants_are_scoped(mod: Module) -> None:
    project_roles = {r["role"] for r in mod.resources("google_project_iam_member").values()} | set(
        re.findall(r'"(roles/[\w.]+)"', mod.texts["iam.tf"])
    )
    assert "roles/owner" not in project_roles and "roles/editor" not in project_roles
    fleet_project = mod.resources("google_project_iam_member")["fleet_log_writer"]
    assert fleet_project["role"] == "roles/logging.logWriter"
    secret = mod.resources("google_secret_manager_secret_iam_member")["fleet_redis_password"]
    assert secret["secret_id"] == "${var.redis_password_secret}"
    assert secret["count"] == '${var.redis_password_secret != "" ? 1 : 0}'
    copy = mod.resources("google_storage_bucket_iam_member")["fleet_ckpt_copy"]
    assert copy["role"] == "roles/storage.objectAdmin" and copy["bucket"] == "${local.copy_bucket}"


def test_copy_bucket_grant_is_limited_to_the_runs_prefix(mod: Module) -> None:
    copy = mod.resources("google_storage_bucket_iam_member")["fleet_ckpt_copy"]
    (condition,) = copy["condition"]
    expression = condition["expression"]
    # Objects by name, under the run's prefix only; a list only when it asks for that prefix.
    objects = (
        'resource.name.startsWith(\\"projects/_/buckets/${local.copy_bucket}/objects/'
        '${local.copy_run_prefix}\\")'
    )
    listing = (
        'api.getAttribute(\\"storage.googleapis.com/objectListPrefix\\", \\"\\").startsWith('
        '\\"${local.copy_run_prefix}\\")'
    )
    assert expression == f"{objects} || {listing}"


def _eval_locals(mod: Module, names: list[str], variables: dict[str, str]) -> dict[str, str]:
    """The module's own expressions for ``names``, evaluated by a real Terraform in a
    scratch module that declares only ``variables``."""
    locals_ = _locals(mod)
    body = "".join(f'variable "{k}" {{\n  type = string\n}}\n' for k in variables)
    body += "locals {\n" + "".join(f"  {n} = {locals_[n][2:-1]}\n" for n in names) + "}\n"
    got = {}
    for n in names:
        out = terraform_console(body, f"local.{n}", variables)
        assert out.returncode == 0 and "Error" not in out.stderr, out.stderr
        got[n] = json.loads(out.stdout.strip())
    return got


@pytest.mark.skipif(shutil.which("terraform") is None, reason="no terraform binary here")
@pytest.mark.parametrize(
    ("copy_to", "prefix"),
    [
        ("gs://acme-ckpt", "r-1/"),
        ("gs://acme-ckpt/", "r-1/"),
        ("gs://acme-ckpt/teams/nlp", "teams/nlp/r-1/"),
        ("gs://acme-ckpt/teams/nlp/", "teams/nlp/r-1/"),
    ],
)
def test_the_granted_prefix_is_where_the_agent_writes(
    mod: Module, copy_to: str, prefix: str
) -> None:
    got = _eval_locals(
        mod,
        ["copy_bucket", "copy_path", "copy_run_prefix"],
        {"checkpoint_copy_to": copy_to, "run_id": "r-1"},
    )
    assert got["copy_bucket"] == "acme-ckpt"
    assert got["copy_run_prefix"] == prefix
    # The agent's own object names: the store's path, then the run id (agent/checkpoint/copy.py).
    store = parse_store_url(copy_to)
    agent_prefix = "/".join(p for p in (store.path, "r-1") if p) + "/"
    assert (store.bucket, agent_prefix) == (got["copy_bucket"], got["copy_run_prefix"])


# -- the startup scripts ---------------------------------------------------------------------


@pytest.mark.parametrize("code", ["git", "archive"])
def test_startup_script_is_valid_bash(mod: Module, code: str) -> None:
    overrides: dict[str, Any] = {"train_command": HOSTILE_CMD}
    if code == "archive":
        overrides |= {
            "git_repo": "",
            "git_commit": "",
            "code_archive_url": "gs://acme-spottrain/gpt-1b3/code/" + "ab" * 32 + ".tar.gz",
            "code_archive_sha256": "ab" * 32,
        }
    script, _ = _render_startup(mod, **overrides)
    _bash_n(script)
    assert script.startswith("#!/bin/bash\n") and "\nset -euo pipefail\n" in script
    assert "exec >>/var/log/spottrain-boot.log 2>&1" in script
    if code == "archive":
        assert (
            "-m spottrain.cloud.code_archive fetch "
            f"'{overrides['code_archive_url']}' {'ab' * 32} /opt/job" in script
        )
    else:
        example = _tfvars()
        assert f"fetch -q --depth 1 '{example['git_repo']}' {example['git_commit']}\n" in script
        assert f'rev-parse HEAD)" = {example["git_commit"]} ||' in script


def test_agent_env_holds_only_what_the_agent_reads(
    mod: Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script, inputs = _render_startup(mod, train_command=HOSTILE_CMD)
    secret = inputs["redis_password_secret"]
    env = _written_env(script, tmp_path, secret)
    agent_cli.build_parser()  # fills RUN_ENV_VARS with every variable `run` reads
    assert set(env) <= agent_cli.RUN_ENV_VARS, (
        f"variables the agent never reads: {sorted(set(env) - agent_cli.RUN_ENV_VARS)}"
    )
    assert "SPOTTRAIN_REDIS_PASSWORD_FILE" in env
    assert "SPOTTRAIN_REDIS_PASSWORD_FILE" not in _written_env(script, tmp_path, "")

    for name in agent_cli.RUN_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    args = agent_cli.build_parser().parse_args(["run"])
    assert (args.redis, args.run_id, args.cloud) == (inputs["redis_url"], inputs["run_id"], "gcp")
    assert (args.node_id, args.zone, args.instance_type, args.address) == (
        NODE["NODE_NAME"],
        NODE["ZONE"],
        NODE["MACHINE_TYPE"],
        NODE["ADDRESS"],
    )
    assert args.nnodes == f"{inputs['nnodes_min']}:{inputs['nnodes_max']}"
    assert (args.nproc_per_node, args.expect_gpus) == (8, 8)
    assert args.ckpt_dir == f"/mnt/spottrain/{inputs['run_id']}"
    assert args.ckpt_copy_to == inputs["checkpoint_copy_to"]
    assert args.password_file == "/etc/spottrain/redis-password"
    # The training command survives Terraform, the env file and the agent's shlex.split.
    assert shlex.split(env["SPOTTRAIN_TRAIN_CMD"]) == HOSTILE_CMD
    assert _shell_join(mod, HOSTILE_CMD) == shlex.join(HOSTILE_CMD)


def test_agent_command_lines_in_the_script_parse(mod: Module) -> None:
    script, _ = _render_startup(mod, train_command=HOSTILE_CMD)
    lines = [
        ln
        for ln in script.splitlines()
        if not ln.lstrip().startswith("#") and re.search(r"spottrain-agent\s+\w", ln)
    ]
    for line in lines:
        argv = shlex.split(line[line.index("spottrain-agent") :])[1:]
        agent_cli.build_parser().parse_args(argv)


def test_startup_script_pins_spottrain_and_installs_the_packaged_unit(mod: Module) -> None:
    assert _locals(mod)["startup_vars"]["spottrain_requirement"] == (
        "spottrain[agent,gcp]==${var.spottrain_version}"
    )
    script, inputs = _render_startup(mod, spottrain_version="9.8.7")
    assert "/bin/pip\" install -q 'spottrain[agent,gcp]==9.8.7'\n" in script
    # The same unit and drop-in the controller's own VMs get (bootstrap.py).
    spec = parse_spec(
        yaml.safe_dump(
            spec_with(
                VALID, "code", {"git": {"repo": "https://github.com/acme/t", "commit": COMMIT}}
            )
        )
    ).spec
    ckpt_dir = re.search(r'^SPOTTRAIN_CKPT_DIR="([^"]*)"$', script, re.M)
    assert ckpt_dir is not None
    unit = _unit_lines(spec, ckpt_dir.group(1))
    assert unit[: unit.index("systemctl daemon-reload\n")] in script
    assert "systemctl enable --now spottrain-agent.service" in script
    assert f"{FILESTORE_IP}:/{inputs['filestore_share_name']} /mnt/spottrain nfs " in script, (
        "the share is mounted at /mnt/spottrain, which the agent's unit requires"
    )
    assert "gcloud secrets versions access latest --secret=" in script
    assert "-H 'Metadata-Flavor: Google'" in script


def test_startup_script_creates_the_workers_user_before_the_agent_starts(mod: Module) -> None:
    # The same lines as the controller's own VMs (tests/integration/agent/test_worker_user.py runs
    # them): a fixed uid, as the shared checkpoint volume needs.
    script, _ = _render_startup(mod)
    assert worker_user_lines() in script
    assert script.index(worker_user_lines()) < script.index("systemctl enable --now")


def test_controller_script_runs_real_spottrain_commands(mod: Module) -> None:
    inputs = _inputs(mod)
    spec_text = "name: gpt-1b3\nfleet: {managed_by: terraform, cloud: gcp}\n"
    known = {"job_spec_b64": base64.b64encode(spec_text.encode()).decode()}
    controller_vars = _locals(mod)["controller_vars"]
    assert controller_vars["job_spec_b64"] == "${base64encode(var.controller_job_spec)}"
    values = {
        k: known[k] if k in known else _resolve(mod, v, inputs, {})
        for k, v in controller_vars.items()
    }
    assert values["spottrain_requirement"] == f"spottrain[gcp]=={inputs['spottrain_version']}"
    script = render_template(mod.texts["controller.sh.tftpl"], values)
    _bash_n(script)
    commands = re.findall(r"/opt/spottrain/venv/bin/spottrain (.+)$", script, re.M)
    assert {c.split()[0] for c in commands} == {"up", "resume"}
    for command in commands:
        spottrain_cli.build_parser().parse_args(shlex.split(command))


# -- the job's secrets: train.secret_env and a private repository's token -------------------

# What Secret Manager holds: shell, systemd and JSON trip-wires in one line each.
SECRET_VALUES = {
    "HF_TOKEN": 'hf_"quoted" \\back$lash `id` $(id) ${PATH} value',
    "WANDB_API_KEY": "0123456789abcdef0123456789abcdef",
}
SECRET_IDS = {"HF_TOKEN": "gpt-hf-token", "WANDB_API_KEY": "gpt-wandb-key"}
GIT_TOKEN = "ghp_s3cr3tT0kenThatMustNeverLeak"
SECRET_ENV_LOOP = 'read_secret secret-env "$name" "$secret" "$ENV_TMP"'
MD = "/computeMetadata/v1/"


@pytest.fixture
def gcp_vm() -> Iterator[tuple[MetadataServer, SecretManagerFake]]:
    """A node's metadata server (its service account's token, its project) and the
    project's Secret Manager."""
    with MetadataServer() as md, SecretManagerFake() as sm:
        md.set_gcp(MD + "project/project-id", sm.project)
        token = {"access_token": "ya29.node-token", "expires_in": 3599, "token_type": "Bearer"}
        md.set_gcp(MD + "instance/service-accounts/default/token", json.dumps(token), json=True)
        yield md, sm


def _run_startup_part(
    script: str, part: str, tmp_path: Path, vm: tuple[MetadataServer, SecretManagerFake], **env: str
) -> subprocess.CompletedProcess[str]:
    """``part`` of the rendered script, run after its ``die``, the loader's settings and
    ``read_secret``, against the metadata and Secret Manager fakes."""
    md, sm = vm
    secrets = section(script, "# Secrets, read by the installed spottrain", "# The checkpoint")
    conf = {
        "cloud": "gcp",
        "endpoints": {"secretmanager": sm.url},
        "redact_file": str(tmp_path / "redact"),
    }
    return run_part(
        shell_function(script, "die") + secrets + part,
        tmp_path,
        conf=conf,
        env={"GCE_METADATA_HOST": md.host, **env},
        moved={"/opt/job": tmp_path / "job"},
    )


def _secret_validations(mod: Module, name: str) -> str:
    return " ".join(v["condition"] for v in mod.variables.get(name, {}).get("validation", []))


def test_secret_env_table_matches_its_mirror(mod: Module) -> None:
    """The test's ``_secret_env_table`` is only worth what its sameness with the HCL."""
    assert _locals(mod).get("secret_env_table") == (
        '${join("", [for name, secret in var.secret_env : "${name} ${secret}\\n"])}'
    )
    assert _locals(mod)["startup_vars"]["secret_env_table"] == "${local.secret_env_table}"
    if shutil.which("terraform"):  # and what Terraform makes of it, in key order
        text = variable_blocks(mod.texts["variables.tf"], "secret_env")
        text += f"locals {{\n  t = {_locals(mod)['secret_env_table'][2:-1]}\n}}\n"
        ids = {"WANDB_API_KEY": "w", "HF_TOKEN": "h", "A": "a"}
        hcl = "{" + ", ".join(f'"{k}" = "{v}"' for k, v in ids.items()) + "}"
        assert evaluate(text, "local.t", {"secret_env": hcl}) == _secret_env_table(ids)


def test_startup_names_each_secret_variable_and_reads_it_into_the_new_env_file(
    mod: Module,
) -> None:
    script, _ = _render_startup(mod, secret_env=SECRET_IDS)
    _bash_n(script)
    table = "".join(f"{name} {sid}\n" for name, sid in sorted(SECRET_IDS.items()))
    assert f"done <<'SECRETS'\n{table}SECRETS\n" in script, "the script names no secret of the job"
    loop = script.index(SECRET_ENV_LOOP)
    # Into the file this boot writes, before it is compared with the last boot's: a rotated
    # secret restarts the agent with the new value.
    assert script.index("# END agent.env") < loop < script.index('cmp -s "$ENV_TMP" "$AGENT_ENV"')
    read = shell_function(script, "read_secret")
    assert (
        '"$VENV/bin/python" -m spottrain.cloud.vmboot.loader /etc/spottrain/loader.json "$@"'
        in read
    )
    assert script.index("read_secret() {") < script.index("# The job's code")
    # Without secrets the table is empty, and the loop reads nothing.
    assert "done <<'SECRETS'\nSECRETS\n" in _render_startup(mod, secret_env={})[0]


def test_secret_variables_reach_the_agents_env_root_only_and_no_command_line(
    mod: Module, tmp_path: Path, gcp_vm: tuple[MetadataServer, SecretManagerFake]
) -> None:
    _, sm = gcp_vm
    for name, value in SECRET_VALUES.items():
        sm.add(SECRET_IDS[name], value)
    script, inputs = _render_startup(mod, secret_env=SECRET_IDS)
    part = section(script, "# BEGIN agent.env", "ENV_CHANGED=1")
    env_file = tmp_path / "agent.env"
    shell = {
        **NODE,
        "ENV_TMP": str(env_file),
        "PASSWORD_FILE": "/etc/spottrain/redis-password",
        "REDIS_PASSWORD_SECRET": inputs["redis_password_secret"],
    }
    done = _run_startup_part(script, part, tmp_path, gcp_vm, **shell)
    assert done.returncode == 0, done.stderr
    assert sm.internal_errors == []
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    env = parse_env_file(env_file.read_text())
    assert {k: env[k] for k in SECRET_VALUES} == SECRET_VALUES
    agent_cli.build_parser()  # fills RUN_ENV_VARS
    assert set(env) - agent_cli.RUN_ENV_VARS == set(SECRET_VALUES)
    # bash's trace shows every command with its arguments: the loader got names only.
    for name, sid in SECRET_IDS.items():
        assert f"loader.json secret-env {name} {sid} {env_file}" in done.stderr
    for value in SECRET_VALUES.values():
        assert value not in done.stderr and value not in script
    assert set(SECRET_VALUES.values()) <= set(parse_redact_lines((tmp_path / "redact").read_text()))


def test_a_private_repository_is_fetched_with_its_token_through_askpass_only(
    mod: Module, tmp_path: Path, gcp_vm: tuple[MetadataServer, SecretManagerFake]
) -> None:
    _, sm = gcp_vm
    sm.add("gpt-git-token", GIT_TOKEN)
    with GitHttpServer(tmp_path / "git") as git:
        url, commit = git.create_repo(
            "acme/private-train",
            {"train.py": "print('hi')\n"},
            private=True,
            token=GIT_TOKEN,
            user="x-token-auth",
        )
        script, _ = _render_startup(
            mod,
            git_repo=url,
            git_commit=commit,
            git_token_secret="gpt-git-token",
            git_token_user="x-token-auth",
        )
        part = section(script, "# The job's code: the pinned commit", "install_job_requirements '")
        done = _run_startup_part(script, part, tmp_path, gcp_vm)
        assert done.returncode == 0, done.stderr
        assert git.internal_errors == []
        assert git.count("acme/private-train", status=401) >= 1, "the repository is private"
        assert git.users and set(git.users) == {"x-token-auth"}
    job = tmp_path / "job"
    head = subprocess.run(["git", "-C", job, "rev-parse", "HEAD"], capture_output=True, text=True)
    assert head.stdout.strip() == commit and (job / "train.py").exists()
    assert not (tmp_path / "etc" / "git-token").exists()
    assert not (tmp_path / "etc" / "git-askpass").exists()
    assert GIT_TOKEN not in done.stderr and GIT_TOKEN not in script
    assert f"loader.json secret gpt-git-token {tmp_path}/etc/git-token" in done.stderr
    assert "( umask 077; cat >/etc/spottrain/git-askpass <<'SH'" in script
    assert "chmod 0700 /etc/spottrain/git-askpass" in script


def test_a_refused_token_stops_the_boot_and_leaves_no_token_behind(
    mod: Module, tmp_path: Path, gcp_vm: tuple[MetadataServer, SecretManagerFake]
) -> None:
    _, sm = gcp_vm
    sm.add("gpt-git-token", "ghp_revokedLongAgo")
    with GitHttpServer(tmp_path / "git") as git:
        url, commit = git.create_repo(
            "acme/private-train", {"train.py": "1\n"}, private=True, token=GIT_TOKEN
        )
        script, _ = _render_startup(
            mod, git_repo=url, git_commit=commit, git_token_secret="gpt-git-token"
        )
        part = section(script, "# The job's code: the pinned commit", "install_job_requirements '")
        done = _run_startup_part(script, part, tmp_path, gcp_vm)
    assert done.returncode == 1
    assert (
        f"spottrain: git could not fetch {commit} from {url} with the token of gpt-git-token"
        in done.stderr
    )
    assert not (tmp_path / "etc" / "git-token").exists()
    assert not (tmp_path / "etc" / "git-askpass").exists()


def test_nodes_read_exactly_the_jobs_secrets(mod: Module) -> None:
    grants = mod.resources("google_secret_manager_secret_iam_member")
    assert "fleet_job_secrets" in grants, "the nodes may not read the job's secrets"
    grant = grants["fleet_job_secrets"]
    assert grant["for_each"] == "${local.job_secrets}"
    assert grant["secret_id"] == "${each.value}" and grant["project"] == "${var.project}"
    assert grant["role"] == "roles/secretmanager.secretAccessor"
    assert grant["member"] == "serviceAccount:${google_service_account.fleet.email}"
    assert _locals(mod)["job_secrets"] == (
        "${setsubtract(toset(concat(values(var.secret_env), "
        'var.git_token_secret == "" ? [] : [var.git_token_secret])), '
        "toset([var.redis_password_secret]))}"
    )
    # Secret Manager needs the cloud-platform scope; the group waits for the grants.
    assert (
        'var.redis_password_secret != "" || length(local.job_secrets) > 0 ? '
        '["https://www.googleapis.com/auth/cloud-platform"] : []' in _locals(mod)["fleet_scopes"]
    )
    mig = mod.resources("google_compute_instance_group_manager")["fleet"]
    assert "${google_secret_manager_secret_iam_member.fleet_job_secrets}" in mig["depends_on"]
    # The controller VM reads the Redis password only.
    assert all("controller" not in n for n in grants if n != "controller_redis_password")


@pytest.mark.skipif(shutil.which("terraform") is None, reason="no terraform binary here")
@pytest.mark.parametrize(
    ("secret_env", "token", "redis", "expected"),
    [
        ({}, "", "", []),
        ({}, "", "spottrain-redis-password", []),
        (SECRET_IDS, "gpt-git-token", "", [*SECRET_IDS.values(), "gpt-git-token"]),
        # The Redis password's binding is its own resource: never managed twice.
        ({"A": "same", "B": "same"}, "redis", "redis", ["same"]),
    ],
)
def test_terraform_grants_the_nodes_exactly_the_configured_secrets(
    mod: Module, secret_env: dict[str, str], token: str, redis: str, expected: list[str]
) -> None:
    names = ("secret_env", "git_token_secret", "redis_password_secret")
    text = variable_blocks(mod.texts["variables.tf"], *names)
    text += f"locals {{\n  job_secrets = {_locals(mod)['job_secrets'][2:-1]}\n}}\n"
    variables = {
        "secret_env": "{" + ", ".join(f'"{k}" = "{v}"' for k, v in secret_env.items()) + "}",
        "git_token_secret": token,
        "redis_password_secret": redis,
    }
    assert sorted(evaluate(text, "local.job_secrets", variables)) == sorted(expected)


def test_a_git_token_needs_an_https_repository(mod: Module) -> None:
    tpl = mod.resources("google_compute_instance_template")["fleet"]
    conditions = [p["condition"] for p in tpl["lifecycle"][0]["precondition"]]
    assert '${var.git_token_secret == "" || startswith(var.git_repo, "https://")}' in conditions


def test_secret_variables_refuse_bad_names_and_ids(mod: Module) -> None:
    """The validations, read from the module and run here (the regexes are RE2's and
    Python's alike); the test below runs them in Terraform itself where it is installed."""
    names = _secret_validations(mod, "secret_env")
    assert 'startswith(name, "SPOTTRAIN_")' in names, "SPOTTRAIN_* must be refused"
    patterns = [json.loads(f'"{p}"') for p in re.findall(r'regex\("((?:[^"\\]|\\.)+)"', names)]
    token = _secret_validations(mod, "git_token_secret")
    patterns += [json.loads(f'"{p}"') for p in re.findall(r'regex\("((?:[^"\\]|\\.)+)"', token)]
    assert len(patterns) == 3, "secret_env checks names and ids; git_token_secret its id"
    name_re, *id_res = patterns
    for good in ("HF_TOKEN", "_x", "wandb_api_key2"):
        assert re.search(name_re, good), good
    for bad in ("1HF", "HF-TOKEN", "HF TOKEN", "", "A=B"):
        assert not re.search(name_re, bad), bad
    for id_re in id_res:
        assert re.search(id_re, "gpt-hf_token")
        for bad in ("projects/p/secrets/s", "s/versions/1", "x' ; rm -rf /; '", ""):
            assert not re.search(id_re, bad), bad


@pytest.mark.skipif(shutil.which("terraform") is None, reason="no terraform binary here")
@pytest.mark.parametrize(
    ("variable", "value", "error"),
    [
        ("secret_env", '{"1HF" = "hf"}', "each key must be an environment variable name"),
        ("secret_env", '{"HF-TOKEN" = "hf"}', "each key must be an environment variable name"),
        ("secret_env", '{"SPOTTRAIN_RUN_ID" = "hf"}', "SPOTTRAIN_* variables are set by spottrain"),
        ("secret_env", '{"HF_TOKEN" = "projects/p/secrets/hf"}', "not a path or a version"),
        ("secret_env", '{"HF_TOKEN" = "gpt-hf-token"}', ""),
        ("git_token_secret", "gh/token", "not a path or a version"),
        ("git_token_secret", "gpt-git-token", ""),
        ("git_token_user", "x access", "git_token_user: 1-64"),
        ("git_token_user", "x-token-auth", ""),
    ],
)
def test_terraform_refuses_bad_secret_variables_with_the_fix(
    mod: Module, variable: str, value: str, error: str
) -> None:
    said = refusal(variable_blocks(mod.texts["variables.tf"], variable), variable, value)
    if error:
        assert error in said
    else:
        assert said == ""


# -- outputs and the example -----------------------------------------------------------------


def test_outputs_describe_the_fleet_for_adoption(mod: Module) -> None:
    outputs = mod.outputs
    fleet = outputs["spottrain_fleet"]["value"]
    assert set(fleet) == {"managed_by", "cloud", "project", "zone", "group", "run_id"}
    assert (fleet["managed_by"], fleet["cloud"]) == ("terraform", "gcp")
    assert fleet["group"] == "${google_compute_instance_group_manager.fleet.name}"
    assert fleet["run_id"] == "${var.run_id}"
    for name in (
        "group_name",
        "zone",
        "project",
        "filestore_ip",
        "filestore_share",
        "firewall_names",
        "controller_internal_ip",
    ):
        assert name in outputs, f"no output {name}"
        assert outputs[name].get("description"), f"output {name} has no description"


def test_example_tfvars_sets_declared_variables_with_valid_values(mod: Module) -> None:
    example = _tfvars()
    declared = mod.variables
    assert set(example) <= set(declared), f"undeclared: {sorted(set(example) - set(declared))}"
    required = {n for n, v in declared.items() if "default" not in v}
    assert required <= set(example), f"required but not set: {sorted(required - set(example))}"
    assert example["machine_type"] in GPU_TYPES
    # Every regex validation of a variable the example sets accepts the example's value.
    for name, value in example.items():
        for v in declared[name].get("validation", []):
            for neg, pattern in re.findall(
                rf'(!?)can\(regex\("((?:[^"\\]|\\.)+)", var\.{name}\)\)', v["condition"]
            ):
                if isinstance(value, str) and not neg:
                    assert re.search(json.loads(f'"{pattern}"'), value), (
                        f"example.tfvars: {name} = {value!r} fails {pattern}"
                    )


def test_readme_documents_every_variable_and_the_fleet_section(mod: Module) -> None:
    readme = (MODULE_DIR / "README.md").read_text()
    table = {n for row in re.findall(r"^\| (`[^|]+`) \|", readme, re.M) for n in row.split("`")}
    missing = set(mod.variables) - table
    assert not missing, f"README.md's variables table lacks {sorted(missing)}"
    assert "fleet:" in readme and "managed_by: terraform" in readme


def test_fleet_output_and_readme_example_are_valid_fleet_sections(mod: Module) -> None:
    from spottrain import spec as spec_module

    fleet_spec = getattr(spec_module, "FleetSpec", None)
    if fleet_spec is None:
        pytest.skip("this tree's job spec has no fleet: section yet")
    inputs = _inputs(mod)
    mig = mod.resources("google_compute_instance_group_manager")["fleet"]
    group = _resolve(mod, mig["name"], inputs, {})
    output = {
        k: group if k == "group" else _resolve(mod, v, inputs, {})
        for k, v in mod.outputs["spottrain_fleet"]["value"].items()
    }
    fleet_spec(**output)
    readme = (MODULE_DIR / "README.md").read_text()
    (block,) = re.findall(r"```yaml\n(fleet:\n.*?)```", readme, re.S)
    fleet_spec(**yaml.safe_load(block)["fleet"])

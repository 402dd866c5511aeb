"""``integration`` (the spec's ``train.integration``, issue 27) in both Terraform modules,
without a Terraform binary: the variable and its values, the agent's environment file a VM
writes (rendered and run for real, then read as systemd would and by the agent's parser),
an SDK fleet's boot left byte for byte as it was, replica mode refusing the rest, the
framework's extra every VM installs, and (with a ``terraform`` binary) an ``env_lock`` made
for another integration refused."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import test_terraform_aws as aws_t
import test_terraform_gcp as gcp_t
from packaging.requirements import Requirement
from secret_boot import evaluate, variable_blocks
from terraform_hcl import TERRAFORM, Module, load_module

from spottrain.agent import cli as agent_cli
from spottrain.controller.run.boot import parse_env_file
from spottrain.protocol.env import ENV_INTEGRATION
from spottrain.spec import FRAMEWORK_EXTRAS, FRAMEWORK_PACKAGES

CLOUDS = ["aws", "gcp"]
VALUES = ("sdk", "hf", "accelerate", "lightning", "plain")


@pytest.fixture(scope="module", params=CLOUDS)
def cloud(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def mods() -> dict[str, Module]:
    return {c: load_module(TERRAFORM / c) for c in CLOUDS}


def _boot(mod: Module, cloud: str, tmp_path: Path, **variables: Any) -> tuple[str, dict[str, str]]:
    """The rendered boot script and the agent's environment file it writes."""
    if cloud == "aws":
        script = aws_t._render(mod, **variables)
        return script, parse_env_file(aws_t._write_agent_env(script, tmp_path).read_text())
    script, _ = gcp_t._render_startup(mod, **variables)
    return script, gcp_t._written_env(script, tmp_path, "")


def test_the_variable_takes_the_specs_values_and_defaults_to_the_sdk(
    mods: dict[str, Module], cloud: str
) -> None:
    variable = mods[cloud].variables["integration"]
    assert variable["default"] == "sdk"
    (check,) = variable["validation"]
    for value in VALUES:
        assert f'"{value}"' in check["condition"]
    assert "lightning" in check["error_message"]


def test_a_plain_fleets_agent_gets_its_integration(
    mods: dict[str, Module], cloud: str, tmp_path: Path
) -> None:
    for value in VALUES[1:]:
        _, env = _boot(mods[cloud], cloud, tmp_path, integration=value)
        assert env[ENV_INTEGRATION] == value
    agent_cli.build_parser()  # registers the variables `run` reads
    assert ENV_INTEGRATION in agent_cli.RUN_ENV_VARS


def test_an_sdk_fleets_boot_is_unchanged(
    mods: dict[str, Module], cloud: str, tmp_path: Path
) -> None:
    script, env = _boot(mods[cloud], cloud, tmp_path, integration="sdk")
    assert ENV_INTEGRATION not in env
    assert "SPOTTRAIN_INTEGRATION" not in script
    plain, _ = _boot(mods[cloud], cloud, tmp_path, integration="plain")
    assert plain.replace('SPOTTRAIN_INTEGRATION="plain"\n', "") == script


def _index_install(script: str) -> list[Requirement]:
    """The requirements of the boot's one `pip install` of spottrain from the index (the
    path without an env_lock)."""
    (line,) = [ln for ln in script.splitlines() if re.search(r"pip\"? install -q 'spottrain\[", ln)]
    return [Requirement(a) for a in shlex.split(line.split("install -q", 1)[1])]


def _version(mods: dict[str, Module], cloud: str) -> str:
    if cloud == "aws":
        return str(aws_t.VARIABLES["spottrain_version"])
    return str(gcp_t._inputs(mods[cloud])["spottrain_version"])


def test_a_framework_integration_installs_its_extra_at_the_pinned_release(
    mods: dict[str, Module], cloud: str, tmp_path: Path
) -> None:
    assert set(FRAMEWORK_EXTRAS.values()) == {"hf", "accelerate", "lightning"}
    sdk, _ = _boot(mods[cloud], cloud, tmp_path, integration="sdk")
    for value in VALUES:
        script, _ = _boot(mods[cloud], cloud, tmp_path, integration=value)
        subprocess.run(["bash", "-n"], input=script, text=True, check=True)
        reqs = _index_install(script)
        assert {r.name for r in reqs} == {"spottrain"}
        assert {str(r.specifier) for r in reqs} == {f"=={_version(mods, cloud)}"}
        framework = [value] if value in FRAMEWORK_EXTRAS.values() else []
        assert set().union(*(r.extras for r in reqs)) == {"agent", cloud, *framework}
        # Nothing else of the boot changes: the requirement and the agent's line only.
        extra = f" 'spottrain[{value}]=={_version(mods, cloud)}'" if framework else ""
        line = f'SPOTTRAIN_INTEGRATION="{value}"\n' if value != "sdk" else ""
        assert script.replace(extra, "", 1).replace(line, "", 1) == sdk


def _env_lock_condition(mod: Module) -> str:
    """The fleet's precondition on env_lock and train.integration, as written."""
    found = re.findall(r"condition\s+= (var\.env_lock == \"\" \|\| .*)\n", mod.texts["fleet.tf"])
    assert len(found) == 1, "the fleet checks no env_lock against the integration"
    return str(found[0])


def _lock(*names: str) -> str:
    head = "# spottrain environment lock\n# requires: spottrain[agent,aws,hf]==0.1.0\n"
    return head + "".join(f"{n}==1.0 --hash=sha256:{'ab' * 32}\n" for n in names)


@pytest.mark.skipif(shutil.which("terraform") is None, reason="no terraform binary here")
def test_an_env_lock_without_the_integrations_framework_is_refused(
    mods: dict[str, Module], cloud: str
) -> None:
    mod = mods[cloud]
    scratch = variable_blocks(mod.texts["variables.tf"], "integration", "env_lock")
    cond = _env_lock_condition(mod)
    # The module's table of each extra's packages is spottrain's own.
    (table,) = re.findall(r"lookup\((\{.*?\}), var\.integration", cond)
    assert evaluate(scratch, table, {}) == {k: list(v) for k, v in FRAMEWORK_PACKAGES.items()}
    hf = _lock("spottrain", "torch", "transformers", "accelerate")
    lightning = _lock("spottrain", "torch", "lightning")
    cases = [
        ("hf", "", True),  # no lock: the VMs install the extra from the index
        ("hf", hf, True),
        ("hf", lightning, False),  # a lightning job's lock reused for an hf job
        ("hf", _lock("spottrain", "torch", "accelerate", "transformers-stream"), False),
        ("lightning", lightning, True),
        ("lightning", hf, False),
        ("accelerate", hf, True),
        ("sdk", lightning, True),
        ("plain", _lock("spottrain", "torch"), True),
    ]
    for integration, lock, accepted in cases:
        got = evaluate(scratch, cond, {"integration": integration, "env_lock": lock})
        assert got is accepted, (integration, lock)
    message = re.findall(r'error_message = "(env_lock is not a lock .*)"\n', mod.texts["fleet.tf"])
    assert message and f"spottrain lock JOB.yaml --cloud {cloud} -o FILE" in message[0]

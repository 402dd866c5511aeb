"""``integration`` (the spec's ``train.integration``, issue 27) in both Terraform modules,
without a Terraform binary: the variable and its values, the agent's environment file a VM
writes (rendered and run for real, then read as systemd would and by the agent's parser),
an SDK fleet's boot left byte for byte as it was, and replica mode refusing the rest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import test_terraform_aws as aws_t
import test_terraform_gcp as gcp_t
from terraform_hcl import TERRAFORM, Module, load_module

from spottrain.agent import cli as agent_cli
from spottrain.controller.run.boot import parse_env_file
from spottrain.protocol.env import ENV_INTEGRATION

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

"""Secrets a VM needs at boot (a private repo's token, ``train.secret_env``) come from the
cloud's secret store, never from the spec or the boot script: the spec refuses credentials in
a clone URL and credential-looking ``train.env`` names, and the boot script fetches them into
root-only files at boot, through the boot's loader (tests/integration/cloud/test_vmboot.py
runs it against the clouds' fakes)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from boot_text import agent_env_of, whole_boot
from spec_samples import COMMIT, LOCAL, VALID, spec_with

from spottrain.cloud.vmboot.fetch import BootError
from spottrain.cloud.vmboot.loader import write_env_line
from spottrain.controller.run.boot import (
    BOOT_CONF,
    GIT_ASKPASS_PATH,
    GIT_TOKEN_PATH,
    JOB_ENV_PATH,
    LOADER_PATH,
    NodeIdentity,
    parse_env_file,
    render_local_boot,
)
from spottrain.protocol.boot import SECRET_ENV_FILE
from spottrain.spec import ImageCode, JobSpec, SpecError, parse_spec

AWS = NodeIdentity("gpt-small-1795000000", "node-3", "aws", "us-east-1a", "p4d.24xlarge")
GCP = NodeIdentity("gpt-small-1795000000", "node-3", "gcp", "us-central1-a", "a2-highgpu-8g")
REDIS = "rediss://redis.internal:6380"
REPO = "https://github.com/acme/private-train"
TOKEN = "ghp_s3cr3tT0kenThatMustNeverLeak"
# What the stand-in secret store holds: quotes, a backslash, spaces and a dollar sign.
VALUES = {"hf/token": 'hf_"quoted" \\back$lash value', "wandb-key": "0123456789abcdef"}
LOADER = f"python3 {LOADER_PATH} {BOOT_CONF}"


def _spec(data: dict[str, Any]) -> JobSpec:
    return parse_spec(yaml.safe_dump(data)).spec


def _problems(data: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as err:
        parse_spec(yaml.safe_dump(data))
    return err.value.problems


def _secret_spec(code: dict[str, Any] | None = None) -> JobSpec:
    data = spec_with(
        VALID, "train.secret_env", {"HF_TOKEN": "hf/token", "WANDB_API_KEY": "wandb-key"}
    )
    return _spec(spec_with(data, "code", code) if code else data)


def _git_spec() -> JobSpec:
    return _secret_spec({"git": {"repo": REPO, "commit": COMMIT, "token_secret": "gh/deploy"}})


@pytest.mark.parametrize(
    "repo",
    [
        f"https://acme-bot:{TOKEN}@github.com/acme/t.git",
        f"https://{TOKEN}@github.com/acme/t.git",
        f"HTTP://x:{TOKEN}@git.internal/t",
        f"ssh://git:{TOKEN}@github.com/acme/t.git",
    ],
)
def test_a_clone_url_with_credentials_is_refused_without_echoing_them(repo: str) -> None:
    problems = _problems(spec_with(VALID, "code", {"git": {"repo": repo, "commit": COMMIT}}))
    assert len(problems) == 1 and problems[0].startswith("code.git.repo")
    assert "token_secret" in problems[0] and "Secrets Manager" in problems[0]
    assert TOKEN not in problems[0]


@pytest.mark.parametrize(
    "repo", [REPO, "git@github.com:acme/t.git", "ssh://git@github.com/acme/t.git"]
)
def test_a_clone_url_without_credentials_is_accepted(repo: str) -> None:
    spec = _spec(spec_with(VALID, "code", {"git": {"repo": repo, "commit": COMMIT}}))
    assert spec.code.git.repo == repo  # type: ignore[union-attr]


def test_a_token_secret_needs_an_https_clone_url() -> None:
    code = {"git": {"repo": "git@github.com:acme/t.git", "commit": COMMIT, "token_secret": "t"}}
    (problem,) = _problems(spec_with(VALID, "code", code))
    assert "https://" in problem and "token_secret" in problem


@pytest.mark.parametrize(
    "name", ["HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD", "token"]
)
def test_a_credential_in_train_env_is_refused_with_the_secret_env_form(name: str) -> None:
    (problem,) = _problems(spec_with(VALID, "train.env", {name: TOKEN}))
    assert problem.startswith("train.env") and name in problem
    assert f"train.secret_env ({name}: SECRET_NAME)" in problem
    assert TOKEN not in problem


def test_ordinary_variables_that_mention_tokens_stay_in_train_env() -> None:
    env = {"TOKENIZERS_PARALLELISM": "false", "MAX_TOKENS": "2048", "NCCL_DEBUG": "WARN"}
    assert _spec(spec_with(VALID, "train.env", env)).train.env == env


@pytest.mark.parametrize(
    ("secret_env", "expected"),
    [
        ({"not a name": "s"}, "is not an environment variable name"),
        ({"SPOTTRAIN_RUN_ID": "s"}, "SPOTTRAIN_* variables are set by spottrain"),
        ({"HF_TOKEN": "has spaces"}, "HF_TOKEN: a secret name is"),
        ({"HF_TOKEN": ""}, "HF_TOKEN: a secret name is"),
    ],
)
def test_bad_secret_env_entries_are_refused(secret_env: dict[str, str], expected: str) -> None:
    (problem,) = _problems(spec_with(VALID, "train.secret_env", secret_env))
    assert problem.startswith("train.secret_env") and expected in problem


def test_a_variable_in_both_env_and_secret_env_is_refused() -> None:
    data = spec_with(
        spec_with(VALID, "train.env", {"HF_HOME": "/x"}), "train.secret_env", {"HF_HOME": "h"}
    )
    (problem,) = _problems(data)
    assert "HF_HOME" in problem and "both env and secret_env" in problem


@pytest.mark.parametrize("node", [AWS, GCP])
def test_boot_scripts_fetch_secrets_at_boot_and_stay_valid_bash(node: NodeIdentity) -> None:
    for spec in (_secret_spec(), _git_spec()):
        script = whole_boot(spec, node, REDIS, password_secret="spottrain/redis")
        subprocess.run(["bash", "-n"], input=script, text=True, check=True)
        # The loader reads each secret with the VM's own identity, into the env file; an
        # image job's into the secret variables file its agent reads in the container.
        image = isinstance(spec.code, ImageCode)
        for var, secret in (("HF_TOKEN", "hf/token"), ("WANDB_API_KEY", "wandb-key")):
            line = f"{LOADER} secret-env {var} {secret} {JOB_ENV_PATH}"
            if image:
                line = f"{LOADER} secret-env-json {var} {secret} {SECRET_ENV_FILE}"
            assert line in script
        assert f"{LOADER} secret spottrain/redis /etc/spottrain/redis-password" in script
        env = agent_env_of(script)
        assert "HF_TOKEN" not in env and "WANDB_API_KEY" not in env
        assert "aws secretsmanager" not in script and "gcloud" not in script
    git = whole_boot(_git_spec(), node, REDIS)
    assert f"  {LOADER} secret gh/deploy {GIT_TOKEN_PATH}\n" in git
    fetch_line = next(line for line in git.splitlines() if " fetch -q --depth 1 " in line)
    assert fetch_line.lstrip().startswith(f"GIT_ASKPASS={GIT_ASKPASS_PATH} GIT_TERMINAL_PROMPT=0")
    assert f" {REPO} {COMMIT}" in fetch_line


def test_secret_env_lands_in_the_agents_env_files_only_root_reads(tmp_path: Path) -> None:
    env_file, docker = tmp_path / "job.env", tmp_path / "agent.docker.env"
    env_file.write_text('SPOTTRAIN_RUN_ID="r"\n')
    for var, secret in (("HF_TOKEN", "hf/token"), ("WANDB_API_KEY", "wandb-key")):
        write_env_line(var, secret, VALUES[secret], [str(env_file), str(docker)])
    assert stat.S_IMODE(docker.stat().st_mode) == 0o600
    parsed = parse_env_file(env_file.read_text())
    assert (parsed["HF_TOKEN"], parsed["WANDB_API_KEY"]) == (VALUES["hf/token"], "0123456789abcdef")
    assert parsed["SPOTTRAIN_RUN_ID"] == "r"
    # docker's env file takes values literally.
    assert f"HF_TOKEN={VALUES['hf/token']}" in docker.read_text().splitlines()


def test_a_secret_holding_a_newline_stops_the_boot(tmp_path: Path) -> None:
    env_file = tmp_path / "job.env"
    with pytest.raises(BootError) as err:
        write_env_line("HF_TOKEN", "hf/token", "line one\nline two", [str(env_file)])
    assert "holds a newline" in str(err.value) and "line one" not in str(err.value)
    assert not env_file.exists()


def test_git_gets_the_token_from_the_askpass_helper_not_its_command_line(tmp_path: Path) -> None:
    """The boot's askpass helper answers git's prompts (git itself asks it, through
    ``git credential fill``), then the token and the helper are gone."""
    script = whole_boot(_git_spec(), AWS, REDIS)
    assert TOKEN not in script
    start = f"  ( umask 077; cat > {GIT_ASKPASS_PATH}"
    part = script[script.index(start) : script.index("  GIT_ASKPASS=")]
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "git-token").write_text(TOKEN)
    subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + part.replace("/etc/spottrain", str(etc))],
        check=True,
        capture_output=True,
    )
    askpass = etc / "git-askpass"
    assert stat.S_IMODE(askpass.stat().st_mode) == 0o700
    askpass.write_text(askpass.read_text().replace("/etc/spottrain", str(etc)))
    env = {**os.environ, "GIT_ASKPASS": str(askpass), "GIT_TERMINAL_PROMPT": "0"}
    filled = subprocess.run(
        ["git", "credential", "fill"],
        input="protocol=https\nhost=github.com\npath=acme/private-train\n\n",
        env={**env, "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert f"username=x-access-token\npassword={TOKEN}\n" in filled.stdout
    after = script[script.index("  GIT_ASKPASS=") :].split("\n")[1]
    assert after == f"  rm -f {GIT_TOKEN_PATH} {GIT_ASKPASS_PATH}"


def test_local_boot_reads_secret_env_from_files_into_the_agents_environment(
    tmp_path: Path,
) -> None:
    secret = tmp_path / "hf-token"
    secret.write_text(VALUES["hf/token"] + "\n")
    spec = _spec(spec_with(LOCAL, "train.secret_env", {"HF_TOKEN": "hf-token"}))
    node = NodeIdentity("tiny-1", "n1", "local", "local-a", "local-cpu")
    boot = json.loads(
        render_local_boot(
            spec,
            node,
            "redis://127.0.0.1:1/0",
            workdir=tmp_path / "w",
            secret_files={"HF_TOKEN": str(secret)},
        )
    )
    assert VALUES["hf/token"] not in json.dumps(boot)
    # Run the boot command up to the agent: the variable is there, with its exact value.
    command = boot["argv"][2].rsplit(" && exec ", 1)[0] + ' && printf %s "$HF_TOKEN"'
    out = subprocess.run(
        ["bash", "-c", command], env={**os.environ, **boot["env"]}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == VALUES["hf/token"]

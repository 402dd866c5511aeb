"""Boot scripts: what a new VM runs must be valid bash, start the agent with settings the real
``spottrain-agent`` parser accepts, and carry no secret."""

from __future__ import annotations

import json
import shlex
import subprocess
from importlib.resources import files
from typing import Any

import pytest
import yaml
from boot_text import agent_env_of, whole_boot
from spec_samples import COMMIT, LOCAL, VALID, spec_with

from spottrain.agent.cli import RUN_ENV_VARS, build_parser
from spottrain.controller.run.boot import (
    BOOT_CONF,
    DOCKER_ENV_PATH,
    LOADER_PATH,
    POWEROFF_DIR,
    POWEROFF_REQUEST,
    POWEROFF_UNIT,
    CodeRef,
    NodeIdentity,
    parse_env_file,
    render_env_file,
    render_local_boot,
    run_ckpt_dir,
    worker_user_lines,
)
from spottrain.protocol.boot import SECRET_ENV_FILE, STAGES
from spottrain.protocol.env import ENV_POWEROFF_REQUEST, ENV_SECRET_ENV_FILE
from spottrain.spec import JobSpec, parse_spec

NODE = NodeIdentity("gpt-small-1795000000", "node-3", "aws", "us-east-1a", "p4d.24xlarge")
REDIS = "rediss://redis.internal:6380"


def _spec(data: dict[str, Any]) -> JobSpec:
    return parse_spec(yaml.safe_dump(data)).spec


def _agent_args(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """Parse ``spottrain-agent run`` the way the systemd unit starts it: no flags, every
    setting from the environment."""
    for name in RUN_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return build_parser().parse_args(["run"])


def test_boot_script_is_valid_bash() -> None:
    for code in (
        VALID["code"],
        {"git": {"repo": "https://github.com/acme/t", "commit": COMMIT}},
        {"archive": {"path": "."}},
    ):
        script = whole_boot(
            _spec(spec_with(VALID, "code", code)),
            NODE,
            REDIS,
            code=CodeRef("s3://acme/code/" + "ab" * 32 + ".tar.gz", "ab" * 32),
            password_secret="spottrain/redis",
        )
        subprocess.run(["bash", "-n"], input=script, text=True, check=True)
        job = script[script.index("# spottrain 0.1.0: the boot of run") :]
        for stage in STAGES[2:]:
            # No secret variables here; an image holds its code, pulled as the environment.
            if stage != "read the job secrets" and not (
                "image" in code and stage == "fetch the code"
            ):
                assert f"spottrain_stage '{stage}'" in job, stage
        subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_agent_env_is_accepted_by_the_real_agent_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec(spec_with(VALID, "train.env", {"NCCL_DEBUG": "WARN"}))
    env = agent_env_of(whole_boot(spec, NODE, REDIS, password_secret="s"))
    build_parser()  # registers the variables `run` reads
    agent_vars = {k for k in env if k.startswith("SPOTTRAIN_")}
    assert agent_vars <= RUN_ENV_VARS, (
        f"variables the agent never reads: {agent_vars - RUN_ENV_VARS}"
    )
    assert env["NCCL_DEBUG"] == "WARN"
    args = _agent_args(env, monkeypatch)
    assert (args.redis, args.run_id, args.node_id) == (REDIS, NODE.run_id, "node-3")
    assert (args.cloud, args.zone, args.instance_type) == ("aws", "us-east-1a", "p4d.24xlarge")
    assert (args.nnodes, args.nproc_per_node, args.expect_gpus) == ("2:4", 8, 8)
    assert args.ckpt_dir == f"/mnt/spottrain/ckpt/{NODE.run_id}"  # each run its own directory
    assert args.password_file == "/etc/spottrain/redis-password"
    assert shlex.split(env["SPOTTRAIN_TRAIN_CMD"]) == list(spec.train.command)


def test_env_file_round_trips_quotes_backslashes_and_spaces() -> None:
    env = {"A": 'say "hi"', "B": "back\\slash", "C": "two  spaces", "D": ""}
    assert parse_env_file(render_env_file(env)) == env
    with pytest.raises(ValueError, match="cannot hold a newline"):
        render_env_file({"A": "x\ny"})


def test_training_command_with_quotes_survives_the_env_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    command = ["train.py", "--name", "gpt 1.3b", "--note", 'say "hi"']
    spec = _spec(spec_with(VALID, "train.command", command))
    env = agent_env_of(whole_boot(spec, NODE, REDIS))
    assert shlex.split(env["SPOTTRAIN_TRAIN_CMD"]) == command


def test_boot_script_carries_no_password_and_fetches_it_from_the_secret_store() -> None:
    read = f"python3 {LOADER_PATH} {BOOT_CONF} secret"
    aws = whole_boot(_spec(VALID), NODE, REDIS, password_secret="spottrain/redis")
    assert f"{read} spottrain/redis /etc/spottrain/redis-password\n" in aws
    gcp_node = NodeIdentity(NODE.run_id, "node-3", "gcp", "us-central1-a", "a2-highgpu-8g")
    gcp = whole_boot(_spec(VALID), gcp_node, REDIS, password_secret="redis-pw")
    assert f"{read} redis-pw /etc/spottrain/redis-password\n" in gcp
    assert '"cloud": "gcp"' in gcp
    no_auth = whole_boot(_spec(VALID), NODE, REDIS)
    assert "SPOTTRAIN_REDIS_PASSWORD_FILE" not in no_auth and "redis-password" not in no_auth


def test_image_code_runs_the_agent_in_the_pinned_image() -> None:
    script = whole_boot(_spec(VALID), NODE, REDIS)
    image = VALID["code"]["image"]
    assert f"docker pull {image}" in script
    exec_start = next(
        line for line in script.splitlines() if line.startswith("ExecStart=/usr/bin/docker ")
    )
    assert "--init" in exec_start and exec_start.endswith(f"{image} spottrain-agent run")
    # The agent in the container ships the host file the packaged unit appends its output
    # to: mounted at the same path, with the unit's path and cap passed through.
    unit = files("spottrain.agent.systemd") / "spottrain-agent.service"
    unit_env = dict(
        line.removeprefix("Environment=").split("=", 1)
        for line in unit.read_text().splitlines()
        if line.startswith("Environment=SPOTTRAIN_LOGS_FILE")
    )
    log_file = unit_env["SPOTTRAIN_LOGS_FILE"]
    words = shlex.split(exec_start.removeprefix("ExecStart="))
    assert f"{log_file}:{log_file}" in words
    for name in unit_env:
        assert words[words.index(name) - 1] == "-e"
    # docker takes --env-file values literally: that file has no quotes.
    assert "SPOTTRAIN_NNODES=2:4\n" in script


def test_git_code_checks_out_and_verifies_the_pinned_commit() -> None:
    spec = _spec(spec_with(VALID, "code", {"git": {"repo": "https://x/y", "commit": COMMIT}}))
    script = whole_boot(spec, NODE, REDIS)
    assert f"fetch -q --depth 1 https://x/y {COMMIT}" in script
    assert f'test "$(git -C /opt/job rev-parse HEAD)" = {COMMIT}' in script
    assert "WorkingDirectory=/opt/job" in script


def test_archive_code_needs_its_upload_first() -> None:
    spec = _spec(spec_with(VALID, "code", {"archive": {"path": "."}}))
    with pytest.raises(ValueError, match="after the upload"):
        whole_boot(spec, NODE, REDIS, code=None)
    sha = "cd" * 32
    script = whole_boot(spec, NODE, REDIS, code=CodeRef(f"s3://b/code/{sha}.tar.gz", sha))
    fetch = f"-m spottrain.cloud.code_archive fetch s3://b/code/{sha}.tar.gz {sha} /opt/job"
    assert fetch in script
    # The fetch refuses a directory that exists without its marker: nothing makes it first.
    assert "mkdir -p /opt/job" not in script[: script.index(fetch)]


def test_the_unit_makes_the_runs_checkpoint_directory_once_the_volume_is_mounted() -> None:
    script = whole_boot(_spec(VALID), NODE, REDIS)
    drop_in = script[script.index("job.conf <<'UNIT'") :]
    ckpt = run_ckpt_dir(_spec(VALID), NODE)
    assert f"ExecStartPre=/bin/mkdir -p {ckpt}\n" in drop_in


def test_boot_creates_the_workers_user_before_the_agent_starts() -> None:
    # tests/integration/agent/test_worker_user.py runs these lines in a throwaway namespace.
    script = whole_boot(_spec(VALID), NODE, REDIS)
    assert script.index(worker_user_lines()) < script.index("systemctl enable --now")


def test_a_volume_outside_mnt_spottrain_is_required_by_the_unit() -> None:
    spec = _spec(spec_with(VALID, "checkpoint.volume.path", "/fsx/ckpt"))
    assert "RequiresMountsFor=/fsx/ckpt" in whole_boot(spec, NODE, REDIS)


def test_boot_scripts_are_only_for_real_clouds() -> None:
    local = NodeIdentity("r-1795000000", "n0", "local", "local-a", "local-cpu")
    with pytest.raises(ValueError, match="not 'local'"):
        whole_boot(_spec(VALID), local, REDIS)


def test_local_boot_runs_the_agent_with_the_same_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = _spec(LOCAL)
    node = NodeIdentity("tiny-1795000000", "n0", "local", "local-a", "local-cpu")
    boot = json.loads(render_local_boot(spec, node, "redis://127.0.0.1:7000", workdir="/w"))
    assert boot["argv"][:2] == ["bash", "-c"]
    steps = boot["argv"][2].split(" && ")
    assert steps[:3] == ["mkdir -p /tmp/ckpt/tiny-1795000000/local-a", "mkdir -p /w", "cd /w"]
    agent = shlex.split(steps[3])
    assert agent[0] == "exec" and agent[2:5] == ["-m", "spottrain.agent.cli", "run"]
    args = build_parser().parse_args(agent[4:])
    assert args.no_health_check  # a CPU job has no GPUs to check
    assert args.sigterm_grace == 30.0  # the local cloud's notice window
    parsed = _agent_args(boot["env"], monkeypatch)
    assert (parsed.run_id, parsed.node_id, parsed.cloud) == ("tiny-1795000000", "n0", "local")
    assert parsed.nproc_per_node == 2
    # Each local zone has a volume of its own, as zonal file systems do.
    assert parsed.ckpt_dir == "/tmp/ckpt/tiny-1795000000/local-a"


def test_local_boot_fetches_the_code_archive_then_execs_the_agent() -> None:
    spec = _spec(LOCAL)
    node = NodeIdentity("tiny-1795000000", "n0", "local", "local-a", "local-cpu")
    sha = "ef" * 32
    code = CodeRef(f"file:///store/code/{sha}.tar.gz", sha)
    boot = json.loads(render_local_boot(spec, node, "redis://h:1", workdir="/w/n0", code=code))
    assert boot["argv"][:2] == ["bash", "-c"]
    script = boot["argv"][2]
    assert (
        f"-m spottrain.cloud.code_archive fetch file:///store/code/{sha}.tar.gz {sha} /w/n0"
        in script
    )
    assert "&& cd /w/n0 && exec " in script and script.endswith("--sigterm-grace=30")
    assert script.startswith("mkdir -p /tmp/ckpt/tiny-1795000000/local-a && ")


def _heredoc(script: str, start: str) -> str:
    """The text a boot's here-document gives the command line starting with ``start``."""
    lines = script.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(start))
    delimiter = lines[at].rsplit("<<", 1)[1].strip("'")
    end = lines.index(delimiter, at + 1)
    return "\n".join(lines[at + 1 : end]) + "\n"


def test_an_image_jobs_secrets_stay_out_of_docker_and_its_agent_can_power_off_the_host() -> None:
    """docker's --env-file shows in `docker inspect`: an image job's secret variables are
    not in it (the agent reads them from the root-only file the loader writes, mounted with
    /etc/spottrain), only where to read them; and the agent, which cannot power off the host
    from its container, asks through a folder of the host's a path unit watches."""
    secrets = {"HF_TOKEN": "hf/token", "WANDB_API_KEY": "wandb-key"}
    script = whole_boot(_spec(spec_with(VALID, "train.secret_env", secrets)), NODE, REDIS)
    docker_env = _heredoc(script, f"( umask 077; cat > {DOCKER_ENV_PATH}")
    names = {line.split("=", 1)[0] for line in docker_env.splitlines()}
    assert not names & set(secrets)
    assert f"{ENV_SECRET_ENV_FILE}={SECRET_ENV_FILE}" in docker_env.splitlines()
    assert f"{ENV_POWEROFF_REQUEST}={POWEROFF_REQUEST}" in docker_env.splitlines()
    loads = [line for line in script.splitlines() if " secret-env" in line]
    assert len(loads) == 2 and all(DOCKER_ENV_PATH not in line for line in loads)
    assert all(shlex.split(x)[-1] == SECRET_ENV_FILE for x in loads)
    exec_start = next(
        line for line in script.splitlines() if line.startswith("ExecStart=/usr/bin/docker ")
    )
    assert f"-v {POWEROFF_DIR}:{POWEROFF_DIR} " in exec_start
    assert "-v /run/spottrain:/run/spottrain:ro " in exec_start  # what to redact
    path_unit = _heredoc(script, f"cat > {POWEROFF_UNIT}.path")
    assert f"PathExists={POWEROFF_REQUEST}" in path_unit.splitlines()
    service = _heredoc(script, f"cat > {POWEROFF_UNIT}.service")
    assert "ExecStart=/usr/bin/systemctl poweroff --no-block" in service.splitlines()
    assert "systemctl enable --now spottrain-poweroff.path" in script.splitlines()
    # A job that is not an image's has neither: its agent runs on the host.
    plain = whole_boot(
        _spec(spec_with(VALID, "code", {"git": {"repo": "https://x/y.git", "commit": COMMIT}})),
        NODE,
        REDIS,
    )
    assert POWEROFF_DIR not in plain and ENV_SECRET_ENV_FILE not in plain

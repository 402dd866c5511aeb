"""What a replica-mode job's VMs boot with (issue 15): the mode's settings in the agent's
environment, torchft in what pip installs and in the run's lock; and an elastic job's boot,
which replica mode must leave exactly as it was."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from boot_text import agent_env_of, whole_boot
from spec_samples import LOCAL, VALID, spec_with

from spottrain import __version__
from spottrain.agent.cli import RUN_ENV_VARS, build_parser
from spottrain.controller.run.boot import (
    CodeRef,
    NodeIdentity,
    agent_env,
    render_local_boot,
)
from spottrain.controller.run.env_lock import (
    ResolveError,
    agent_requirement,
    capture_locks,
    read_lock_file,
    spec_agent_requirement,
)
from spottrain.controller.run.wheel import SelfWheel
from spottrain.envlock import LockedPackage, make_lock
from spottrain.protocol import env as env_names
from spottrain.spec import JobSpec, parse_spec

NODE = NodeIdentity("gpt-small-1795000000", "node-3", "aws", "us-east-1a", "p4d.24xlarge")
GCP_NODE = NodeIdentity("gpt-small-1795000000", "node-4", "gcp", "us-central1-a", "a2-highgpu-8g")
REDIS = "rediss://redis.internal:6380"
SHA = "ab" * 32
REPLICA_VARS = {
    env_names.ENV_FAULT_TOLERANCE,
    env_names.ENV_NODES_PER_REPLICA,
    env_names.ENV_MIN_REPLICAS,
    env_names.ENV_QUORUM,
}
# Every variable an elastic job's agent got before replica mode existed (VALID, with a
# password and a checkpoint copy): replica mode adds none of its own to them.
ELASTIC_AGENT_VARS = {
    "SPOTTRAIN_REDIS",
    "SPOTTRAIN_RUN_ID",
    "SPOTTRAIN_NODE_ID",
    "SPOTTRAIN_CLOUD",
    "SPOTTRAIN_ZONE",
    "SPOTTRAIN_INSTANCE_TYPE",
    "SPOTTRAIN_NNODES",
    "SPOTTRAIN_NPROC_PER_NODE",
    "SPOTTRAIN_EXPECT_GPUS",
    "SPOTTRAIN_CKPT_DIR",
    "SPOTTRAIN_TRAIN_CMD",
    "SPOTTRAIN_ORPHAN_TIMEOUT",
    "SPOTTRAIN_REDIS_PASSWORD_FILE",
    "SPOTTRAIN_CKPT_COPY_TO",
}


def _spec(data: dict[str, Any]) -> JobSpec:
    return parse_spec(yaml.safe_dump(data)).spec


def _replica_spec(base: dict[str, Any] = VALID, **replica: int) -> JobSpec:
    data = spec_with(base, "train.fault_tolerance", "replica")
    return _spec(spec_with(data, "train.replica", replica) if replica else data)


def _archive(spec: JobSpec, node: NodeIdentity = NODE, lock: str | None = None) -> str:
    return whole_boot(
        spec,
        node,
        REDIS,
        code=CodeRef(f"s3://b/code/{SHA}.tar.gz", SHA),
        password_secret="spottrain/redis",
        lock=lock,
    )


def test_a_replica_jobs_agent_gets_the_mode_the_replica_size_and_the_quorum_floor() -> None:
    spec = _replica_spec(spec_with(VALID, "nodes", {"min": 4, "max": 8}), nodes_per_replica=2)
    script = whole_boot(spec, NODE, REDIS, password_secret="spottrain/redis")
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    env = agent_env_of(script)
    assert {k: env[k] for k in REPLICA_VARS} == {
        "SPOTTRAIN_FAULT_TOLERANCE": "replica",
        "SPOTTRAIN_NODES_PER_REPLICA": "2",
        "SPOTTRAIN_MIN_REPLICAS": "1",
        "SPOTTRAIN_QUORUM": "redis",
    }
    # The lighthouse's address moves when it restarts: agents read it from the run's Redis.
    assert env_names.ENV_LIGHTHOUSE not in env
    # Everything else is an elastic job's: the same settings, read by the same agent flags.
    elastic = agent_env_of(
        whole_boot(
            _spec(spec_with(VALID, "nodes", {"min": 4, "max": 8})),
            NODE,
            REDIS,
            password_secret="spottrain/redis",
        )
    )
    assert {k: v for k, v in env.items() if k not in REPLICA_VARS} == elastic
    build_parser()  # registers the variables `run` reads
    assert {k for k in env if k.startswith("SPOTTRAIN_")} <= RUN_ENV_VARS


def test_an_elastic_jobs_agent_settings_are_unchanged() -> None:
    spec = _spec(VALID)
    env = agent_env(spec, NODE, REDIS, password_file="/p")
    assert {k for k in env if k.startswith("SPOTTRAIN_")} == ELASTIC_AGENT_VARS
    # Saying elastic out loud (or giving train.replica's defaults) renders the same bytes.
    explicit = spec_with(VALID, "train.fault_tolerance", "elastic")
    explicit = spec_with(explicit, "train.replica", {"nodes_per_replica": 1, "min_replicas": 1})
    for node in (NODE, GCP_NODE):
        assert _archive(_spec(explicit), node) == _archive(spec, node)


def test_the_local_clouds_agent_gets_the_same_replica_settings() -> None:
    spec = _replica_spec(spec_with(LOCAL, "nodes", {"min": 2, "max": 4, "gpus": 0}), min_replicas=2)
    node = NodeIdentity("tiny-1795000000", "n0", "local", "local-a", "local-cpu")
    boot = json.loads(render_local_boot(spec, node, "redis://127.0.0.1:7000", workdir="/w"))
    assert boot["env"][env_names.ENV_FAULT_TOLERANCE] == "replica"
    assert boot["env"][env_names.ENV_NODES_PER_REPLICA] == "1"
    assert boot["env"][env_names.ENV_MIN_REPLICAS] == "2"
    assert boot["env"][env_names.ENV_QUORUM] == "redis"
    assert env_names.ENV_QUORUM_RELAY_GROUP not in boot["env"]  # auto: none at 4 replicas
    relayed = _replica_spec(
        spec_with(LOCAL, "nodes", {"min": 2, "max": 4, "gpus": 0}), relay_group_size=2
    )
    boot = json.loads(render_local_boot(relayed, node, "redis://127.0.0.1:7000", workdir="/w"))
    assert boot["env"][env_names.ENV_QUORUM_RELAY_GROUP] == "2"
    elastic = json.loads(
        render_local_boot(_spec(LOCAL), node, "redis://127.0.0.1:7000", workdir="/w")
    )
    assert not REPLICA_VARS & set(elastic["env"])


def test_a_replica_jobs_vms_install_torchft_and_an_elastic_jobs_do_not(tmp_path: Path) -> None:
    v = __version__
    assert agent_requirement("aws") == f"spottrain[agent,aws]=={v}"
    assert agent_requirement("gcp", replica=True) == f"spottrain[agent,gcp,replica]=={v}"
    assert spec_agent_requirement(_spec(VALID), "aws") == f"spottrain[agent,aws]=={v}"
    replica = spec_with(VALID, "code", {"archive": {"path": "."}})
    spec = _replica_spec(replica)
    assert spec_agent_requirement(spec, "gcp") == f"spottrain[agent,gcp,replica]=={v}"
    # The run resolves its lock with this controller's own wheel, given to pip by its path.
    wheel = _wheel(tmp_path, "ef" * 32)
    assert spec_agent_requirement(spec, "aws", wheel) == (
        f"spottrain[agent,aws,replica] @ {wheel.file_url}"
    )
    elastic = _spec(spec_with(VALID, "code", {"archive": {"path": "."}}))
    assert spec_agent_requirement(elastic, "gcp", wheel) == (
        f"spottrain[agent,gcp] @ {wheel.file_url}"
    )


def _wheel(tmp_path: Path, sha: str) -> SelfWheel:
    path = tmp_path / f"spottrain-{__version__}-py3-none-any.whl"
    path.write_bytes(b"")
    return SelfWheel(path, sha, __version__, "test")


def _lock_file(tmp_path: Path, names: list[str]) -> Path:
    packages = [
        LockedPackage(n, __version__ if n == "spottrain" else "0.2.0", (f"sha256:{'cd' * 32}",))
        for n in names
    ]
    path = tmp_path / f"{'-'.join(names)}.lock"
    path.write_text(make_lock(packages, target="python 3.11 cp manylinux_2_28_x86_64").text())
    return path


def test_a_given_lock_without_torchft_is_refused_for_a_replica_job(tmp_path: Path) -> None:
    without = _lock_file(tmp_path, ["spottrain", "torch"])
    with_torchft = _lock_file(tmp_path, ["spottrain", "torch", "torchft", "grpcio"])
    no_grpc = _lock_file(tmp_path, ["spottrain", "torch", "torchft"])
    # An elastic job takes either.
    assert read_lock_file(without, "aws").versions()["torch"] == "0.2.0"
    with pytest.raises(ResolveError) as err:
        read_lock_file(without, "aws", replica=True)
    assert str(err.value) == (
        f"--env-lock aws={without}: the lock holds no torchft or grpcio, which replica mode "
        "(train.fault_tolerance: replica) needs on every VM: make it again from the replica "
        f"job's spec: spottrain lock JOB.yaml --cloud aws -o {without}"
    )
    # grpcio: the agent serves its workers the Redis quorum through it.
    with pytest.raises(ResolveError, match="holds no grpcio, which"):
        read_lock_file(no_grpc, "aws", replica=True)
    assert "torchft" in read_lock_file(with_torchft, "aws", replica=True).versions()
    # The run's lock capture applies it for a replica spec, and only for one.
    aws_only = spec_with(VALID, "code", {"archive": {"path": "."}})
    aws_only = spec_with(aws_only, "resources", {"clouds": ["aws"], "regions": ["us-east-1"]})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    wheel = _wheel(tmp_path, "cd" * 32)  # the wheel the locks pin
    with pytest.raises(ResolveError, match="holds no torchft"):
        capture_locks(_replica_spec(aws_only), tmp_path, run_dir, wheel, {"aws": without})
    got = capture_locks(_replica_spec(aws_only), tmp_path, run_dir, wheel, {"aws": with_torchft})
    assert got["aws"]["packages"] == 4
    assert (run_dir / "env-aws.lock").read_text() == with_torchft.read_text()
    elastic = capture_locks(_spec(aws_only), tmp_path, run_dir, wheel, {"aws": without})
    assert elastic["aws"]["packages"] == 2


def test_validate_prints_the_replica_line_and_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from spottrain.controller.cli.validate import validate

    data = spec_with(
        spec_with(LOCAL, "train.fault_tolerance", "replica"),
        "train.replica",
        {"nodes_per_replica": 2, "min_replicas": 2, "quorum": "lighthouse"},
    )
    data = spec_with(data, "nodes", {"min": 4, "max": 8, "gpus": 0})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    args = argparse.Namespace(spec=str(path), json=False, check_clouds=False)
    assert validate(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2] == (
        "  fault tolerance replica: 2 node(s) per replica, 2-4 replicas, a step commits with "
        "at least 2 replica(s), its quorum from torchft's lighthouse, which the controller "
        "runs; the local VMs run in this venv, which needs spottrain[replica] (torchft)"
    )
    assert validate(argparse.Namespace(spec=str(path), json=True, check_clouds=False)) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["fault_tolerance"] == "replica"
    assert result["replica"] == {
        "nodes_per_replica": 2,
        "min_replicas": 2,
        "replicas_min": 2,
        "replicas_max": 4,
        "quorum": "lighthouse",
    }
    path.write_text(yaml.safe_dump(LOCAL))
    assert validate(argparse.Namespace(spec=str(path), json=True, check_clouds=False)) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["fault_tolerance"], result["replica"]) == ("elastic", None)
    # An elastic job's lines are what they were: no replica line.
    assert validate(argparse.Namespace(spec=str(path), json=False, check_clouds=False)) == 0
    assert "fault tolerance" not in capsys.readouterr().out

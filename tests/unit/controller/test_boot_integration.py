"""``train.integration`` reaches every agent (issue 27): the AWS and GCP boot scripts' env
file and the local cloud's boot carry ``SPOTTRAIN_INTEGRATION`` for a job that is not on the
SDK, the agent reads it as ``--integration``'s default, and an SDK job's boot stays byte for
byte what it was before the key existed."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import yaml
from boot_text import agent_env_of, whole_boot
from spec_samples import LOCAL, VALID, spec_with

from spottrain.agent.cli import RUN_ENV_VARS, build_parser
from spottrain.controller.run.boot import CodeRef, NodeIdentity, render_local_boot
from spottrain.spec import JobSpec, parse_spec

NODE = NodeIdentity("gpt-small-1795000000", "node-3", "aws", "us-east-1a", "p4d.24xlarge")
GCP_NODE = NodeIdentity("gpt-small-1795000000", "node-4", "gcp", "us-central1-a", "a2-highgpu-8g")
LOCAL_NODE = NodeIdentity("tiny-1795000000", "n0", "local", "local-a", "local-cpu")
REDIS = "rediss://redis.internal:6380"
SHA = "ab" * 32
VAR = "SPOTTRAIN_INTEGRATION"


def _spec(data: dict[str, Any]) -> JobSpec:
    return parse_spec(yaml.safe_dump(data)).spec


def _boot(spec: JobSpec, node: NodeIdentity) -> str:
    return whole_boot(
        spec,
        node,
        REDIS,
        code=CodeRef(f"s3://b/code/{SHA}.tar.gz", SHA),
        password_secret="spottrain/redis",
    )


def test_the_aws_and_gcp_boot_scripts_give_the_agent_the_integration() -> None:
    for node in (NODE, GCP_NODE):
        for value in ("plain", "hf", "accelerate", "lightning"):
            script = _boot(_spec(spec_with(VALID, "train.integration", value)), node)
            subprocess.run(["bash", "-n"], input=script, text=True, check=True)
            env = agent_env_of(script)
            assert env.get(VAR) == value, (node.cloud, value)
            # Nothing else changes: the same settings, read by the same agent flags.
            sdk = agent_env_of(_boot(_spec(VALID), node))
            assert {k: v for k, v in env.items() if k != VAR} == sdk
    build_parser()  # registers the variables `run` reads
    assert VAR in RUN_ENV_VARS


def test_an_sdk_jobs_boot_is_unchanged_by_the_key() -> None:
    for node in (NODE, GCP_NODE):
        explicit = _boot(_spec(spec_with(VALID, "train.integration", "sdk")), node)
        assert explicit == _boot(_spec(VALID), node)
        assert VAR not in agent_env_of(explicit)


def test_the_local_clouds_agent_gets_the_integration() -> None:
    plain = _spec(spec_with(LOCAL, "train.integration", "plain"))
    boot = json.loads(render_local_boot(plain, LOCAL_NODE, "redis://127.0.0.1:7000", workdir="/w"))
    assert boot["env"].get(VAR) == "plain"
    sdk = json.loads(
        render_local_boot(_spec(LOCAL), LOCAL_NODE, "redis://127.0.0.1:7000", workdir="/w")
    )
    assert VAR not in sdk["env"]


def test_the_agent_reads_the_integration_from_its_environment(monkeypatch: Any) -> None:
    monkeypatch.setenv(VAR, "plain")
    args = build_parser().parse_args(["run", "--redis=r:1", "--run-id=r"])
    assert getattr(args, "integration", None) == "plain"
    monkeypatch.delenv(VAR)
    args = build_parser().parse_args(["run", "--redis=r:1", "--run-id=r"])
    assert getattr(args, "integration", None) == "sdk"

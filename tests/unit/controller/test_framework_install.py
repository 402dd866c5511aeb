"""The framework a job's integration trains with, through the commands (issue 27): the
requirement every VM installs carries the integration's extra, ``up`` refuses a given lock
made for another integration's job, ``validate`` prints what the nodes install, and
``validate`` and ``up`` refuse a local job whose framework in this venv (where the local
cloud's VMs run) is outside its extra's range, before anything starts. Only the commands'
and the run's public names: the decisions' own tests are in test_env_lock_frameworks.py."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from spec_samples import LOCAL, VALID, spec_with
from wheelhouse import build_wheel, framework_requires, sha256_of

from spottrain import __version__
from spottrain.controller.run.env_lock import ResolveError, capture_locks, spec_agent_requirement
from spottrain.controller.run.wheel import SelfWheel
from spottrain.envlock import LockedPackage, make_lock
from spottrain.spec import JobSpec, parse_spec

V = __version__


def _spec(base: dict[str, Any], integration: str, **paths: Any) -> JobSpec:
    data = spec_with(base, "train.integration", integration)
    for path, value in paths.items():
        data = spec_with(data, path, value)
    return parse_spec(yaml.safe_dump(data)).spec


def framework_wheel(tmp_path: Path) -> SelfWheel:
    """A spottrain wheel whose METADATA holds pyproject's framework extras."""
    extras = ("hf", "accelerate", "lightning")
    path = build_wheel(tmp_path / "own", "spottrain", V, framework_requires(), extras)
    return SelfWheel(path, sha256_of(path), V, "the test")


def lock_file(tmp_path: Path, spottrain_sha256: str, versions: dict[str, str]) -> Path:
    """A lock of spottrain (pinned by ``spottrain_sha256``) and ``versions``."""
    packages = [LockedPackage("spottrain", V, (f"sha256:{spottrain_sha256}",))]
    packages += [LockedPackage(n, v, (f"sha256:{'cd' * 32}",)) for n, v in versions.items()]
    path = tmp_path / f"{'-'.join(versions) or 'bare'}.lock"
    path.write_text(make_lock(packages, target="python 3.11 cp manylinux_2_28_x86_64").text())
    return path


def test_each_integrations_vms_install_its_frameworks_extra() -> None:
    archive = {"archive": {"path": "."}}
    for integration, extras in [
        ("hf", "agent,aws,hf"),
        ("accelerate", "agent,aws,accelerate"),
        ("lightning", "agent,aws,lightning"),
        ("sdk", "agent,aws"),
        ("plain", "agent,aws"),
    ]:
        spec = _spec(VALID, integration, code=archive)
        assert spec_agent_requirement(spec, "aws") == f"spottrain[{extras}]=={V}", integration


def test_up_refuses_a_given_lock_made_for_another_integrations_job(tmp_path: Path) -> None:
    wheel = framework_wheel(tmp_path)
    hf = lock_file(
        tmp_path,
        wheel.sha256,
        {"torch": "2.13.0", "transformers": "5.18.0", "accelerate": "1.15.0"},
    )
    lightning = lock_file(tmp_path, wheel.sha256, {"torch": "2.13.0", "lightning": "2.6.6"})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    aws = {"clouds": ["aws"], "regions": ["us-east-1"]}
    archive = {"archive": {"path": "."}}
    hf_job = _spec(VALID, "hf", code=archive, resources=aws)
    with pytest.raises(ResolveError) as err:
        capture_locks(hf_job, tmp_path, run_dir, wheel, {"aws": lightning})
    assert str(err.value) == (
        f"--env-lock aws={lightning}: the lock holds no transformers or accelerate, which "
        "train.integration: hf needs on every VM: make it again from this job's spec: "
        f"spottrain lock JOB.yaml --cloud aws -o {lightning}"
    )
    assert capture_locks(hf_job, tmp_path, run_dir, wheel, {"aws": hf})["aws"]["packages"] == 4
    # Only a job whose integration needs a framework asks for one.
    for other in ("sdk", "plain"):
        job = _spec(VALID, other, code=archive, resources=aws)
        assert capture_locks(job, tmp_path, run_dir, wheel, {"aws": lightning})["aws"]


def test_validate_prints_what_the_nodes_install(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from spottrain.controller.cli.validate import validate

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec_with(LOCAL, "train.integration", "hf")))
    assert validate(argparse.Namespace(spec=str(path), json=False, check_clouds=False)) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[3] == (
        "  framework transformers and accelerate: the local VMs run in this venv, which needs "
        "spottrain[hf] (transformers<5.19,>=5.18, accelerate<1.16,>=1.15)"
    )
    assert validate(argparse.Namespace(spec=str(path), json=True, check_clouds=False)) == 0
    assert json.loads(capsys.readouterr().out)["framework"] == {
        "extra": "hf",
        "requires": ["transformers<5.19,>=5.18", "accelerate<1.16,>=1.15"],
    }
    path.write_text(yaml.safe_dump(LOCAL))
    assert validate(argparse.Namespace(spec=str(path), json=False, check_clouds=False)) == 0
    assert "framework" not in capsys.readouterr().out


def _fake_dist(site: Path, name: str, version: str) -> None:
    """A distribution's metadata alone (no code): what importlib.metadata reads."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_validate_and_up_refuse_a_local_job_whose_framework_is_outside_its_range(
    tmp_path: Path,
) -> None:
    site = tmp_path / "site"
    _fake_dist(site, "transformers", "4.46.0")  # found before the venv's own 5.18
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec_with(LOCAL, "train.integration", "hf")))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
        "SPOTTRAIN_HOME": str(tmp_path / "home"),
    }
    cli = [sys.executable, "-m", "spottrain.controller.cli"]
    done = subprocess.run(
        [*cli, "validate", str(path)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    want = (
        "train.integration: hf needs transformers<5.19,>=5.18 (spottrain[hf]: the versions its "
        f"integration is tested with), and this venv ({sys.prefix}, where the local cloud's "
        "VMs run) has transformers 4.46.0: install the range with pip install 'spottrain[hf]'"
    )
    assert done.stderr.splitlines()[-1] == f"  {want}"
    up = subprocess.run(
        [*cli, "up", str(path), "--detach"], env=env, capture_output=True, text=True, timeout=120
    )
    assert up.returncode == 1 and want in up.stderr, up.stderr
    assert not (tmp_path / "home" / "runs").exists()  # nothing started

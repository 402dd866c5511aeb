"""The framework a job's integration trains with, the controller's decisions (issue 27): the
requirement every VM installs carries the integration's extra, a given lock made for another
integration is refused with what it lacks, the ranges come from the very wheel the run ships,
and this venv (where the local cloud's VMs run) is checked without importing the framework.
tests/unit/controller/test_framework_install.py drives the same through the commands."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from spec_samples import LOCAL, VALID, spec_with
from test_framework_install import framework_wheel, lock_file
from wheelhouse import framework_requires

from spottrain import __version__
from spottrain.controller.cli.lock import framework_note
from spottrain.controller.run.env_lock import (
    ResolveError,
    agent_requirement,
    local_framework_problem,
    read_lock_file,
    wheel_requires,
)
from spottrain.controller.run.wheel import SelfWheel
from spottrain.spec import JobSpec, parse_spec

V = __version__


def _spec(base: dict[str, Any], integration: str, **paths: Any) -> JobSpec:
    data = spec_with(base, "train.integration", integration)
    for path, value in paths.items():
        data = spec_with(data, path, value)
    return parse_spec(yaml.safe_dump(data)).spec


@pytest.fixture
def wheel(tmp_path: Path) -> SelfWheel:
    return framework_wheel(tmp_path)


def _lock(tmp_path: Path, wheel: SelfWheel, **versions: str) -> Path:
    return lock_file(tmp_path, wheel.sha256, versions)


def test_the_vms_requirement_carries_the_integrations_extra() -> None:
    assert agent_requirement("aws", framework="hf") == f"spottrain[agent,aws,hf]=={V}"
    assert agent_requirement("gcp", framework="lightning") == f"spottrain[agent,gcp,lightning]=={V}"


def test_the_ranges_come_from_the_shipped_wheel(wheel: SelfWheel, tmp_path: Path) -> None:
    requires = wheel_requires(wheel)
    assert 'transformers>=5.18,<5.19; extra == "hf"' in requires
    assert 'lightning>=2.6.6,<2.7; extra == "lightning"' in requires
    broken = SelfWheel(tmp_path / "none.whl", "00" * 32, V, "nowhere")
    with pytest.raises(ResolveError, match=r"cannot read spottrain-.*METADATA in .*none\.whl"):
        wheel_requires(broken)


def test_a_given_lock_made_for_another_integration_is_refused(
    wheel: SelfWheel, tmp_path: Path
) -> None:
    hf = _lock(tmp_path, wheel, torch="2.13.0", transformers="5.18.0", accelerate="1.15.0")
    lightning = _lock(tmp_path, wheel, torch="2.13.0", lightning="2.6.6")
    assert read_lock_file(hf, "aws", framework="hf", wheel=wheel).versions()["transformers"]
    with pytest.raises(ResolveError) as err:
        read_lock_file(lightning, "aws", framework="hf", wheel=wheel)
    assert str(err.value) == (
        f"--env-lock aws={lightning}: the lock holds no transformers or accelerate, which "
        "train.integration: hf needs on every VM: make it again from this job's spec: "
        f"spottrain lock JOB.yaml --cloud aws -o {lightning}"
    )
    # In the lock, but outside the range of the wheel this run ships.
    newer = _lock(tmp_path, wheel, transformers="5.20.0", accelerate="1.15.0")
    with pytest.raises(ResolveError, match=r"holds transformers 5\.20\.0, outside spottrain\[hf\]"):
        read_lock_file(newer, "gcp", framework="hf", wheel=wheel)


def test_a_local_job_in_this_venv_is_checked_against_its_extras_range() -> None:
    requires = framework_requires()
    # This venv holds the frameworks the tests run on.
    for integration in ("hf", "accelerate", "lightning", "sdk", "plain"):
        assert local_framework_problem(_spec(LOCAL, integration), requires) is None
    narrow = [r.replace(">=5.18", ">=5.18.99") for r in requires]
    problem = local_framework_problem(_spec(LOCAL, "hf"), narrow)
    assert problem is not None and "transformers<5.19,>=5.18.99" in problem
    assert f"this venv ({sys.prefix}, where the local cloud's VMs run) has" in problem
    # A job with no local VM is not this venv's.
    assert local_framework_problem(_spec(VALID, "hf"), narrow) is None


def test_the_lock_commands_summary_names_the_integrations_framework() -> None:
    versions = {"transformers": "5.18.0", "accelerate": "1.15.0", "torch": "2.13.0"}
    hf = _spec(VALID, "hf", code={"archive": {"path": "."}})
    assert framework_note(hf, versions) == (
        "; train.integration hf: transformers 5.18.0, accelerate 1.15.0"
    )
    assert framework_note(_spec(VALID, "sdk"), versions) == ""

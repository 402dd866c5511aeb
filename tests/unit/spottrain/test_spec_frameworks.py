"""The framework a job's integration needs on every node (issue 27): which extra each
``train.integration`` installs, the check of a job's pin against the extra's range, the check
of a venv's versions, and ``validate``'s line of what the nodes install."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from spec_samples import FLEET_AWS, LOCAL, VALID, spec_with

from spottrain.spec import (
    FRAMEWORK_EXTRAS,
    FRAMEWORK_PACKAGES,
    Integration,
    JobSpec,
    describe_framework,
    extra_requirements,
    framework_extra,
    parse_spec,
    range_conflict,
    requirement_lines,
    venv_framework_problem,
)
from spottrain.spec.frameworks import specifiers_overlap

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"
# spottrain's Requires-Dist as its wheel's METADATA writes them (controller/run/wheel.py).
REQUIRES = [
    "redis<7,>=6.0",
    "torch<2.15,>=2.13; extra == 'agent'",
    "torchft==0.2.0; extra == 'replica'",
    "transformers<5.19,>=5.18; extra == 'hf'",
    "accelerate<1.16,>=1.15; extra == 'hf'",
    "accelerate<1.16,>=1.15; extra == 'accelerate'",
    "lightning<2.7,>=2.6.6; extra == 'lightning'",
]


def _spec(base: dict[str, Any], integration: str, **paths: Any) -> JobSpec:
    data = spec_with(base, "train.integration", integration)
    for path, value in paths.items():
        data = spec_with(data, path.replace("__", "."), value)
    return parse_spec(yaml.safe_dump(data)).spec


def test_the_framework_extras_are_pyprojects() -> None:
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    for extra, names in FRAMEWORK_PACKAGES.items():
        assert tuple(Requirement(r).name for r in extras[extra]) == names
        # torch stays pinned by whoever installs (the agent extra, the lock): never here.
        assert "torch" not in names
    assert set(FRAMEWORK_EXTRAS.values()) == set(FRAMEWORK_PACKAGES)
    assert all(extra == integration.value for integration, extra in FRAMEWORK_EXTRAS.items())


def test_each_integration_names_its_extra_and_sdk_and_plain_none() -> None:
    want = {"sdk": None, "hf": "hf", "accelerate": "accelerate", "lightning": "lightning"}
    want["plain"] = None
    for integration in Integration:
        assert framework_extra(_spec(VALID, integration.value)) == want[integration.value]


def test_the_extras_requirements_are_its_own_only() -> None:
    hf = [f"{r.name}{r.specifier}" for r in extra_requirements(REQUIRES, "hf")]
    assert hf == ["transformers<5.19,>=5.18", "accelerate<1.16,>=1.15"]
    assert [r.name for r in extra_requirements(REQUIRES, "lightning")] == ["lightning"]
    assert extra_requirements(REQUIRES, "wandb") == []


def test_ranges_overlap_when_some_version_satisfies_both() -> None:
    ours = SpecifierSet(">=5.18,<5.19")
    for theirs in ("", ">=5.17", "==5.18.2", "~=5.18.0", "==5.18.*", "<5.18.1", ">5.18,<6"):
        assert specifiers_overlap(ours, SpecifierSet(theirs)), theirs
    for theirs in ("==5.20.0", "<5.18", ">=5.19", "==4.*", "<=5.17.9", ">=5.19.0rc1"):
        assert not specifiers_overlap(ours, SpecifierSet(theirs)), theirs
    assert not specifiers_overlap(SpecifierSet("==2.6.6"), SpecifierSet("!=2.6.6"))


def test_a_requirements_file_gives_its_requirements_only() -> None:
    text = (
        "# the job's\n--index-url https://example.com/simple\n-r other.txt\n\n"
        "transformers==5.20.0  # newest\nnumpy>=1.26 ; python_version >= '3.11'\n"
        "./local/pkg\ngit+https://example.com/x.git\n"
    )
    assert [str(r) for r in requirement_lines(text)] == [
        "transformers==5.20.0",
        'numpy>=1.26; python_version >= "3.11"',
    ]


def test_a_pin_outside_the_extras_range_is_one_line_with_both_ranges_and_the_fix() -> None:
    job = requirement_lines("numpy\nTransformers==4.46.0\n")
    assert range_conflict("hf", REQUIRES, job, "code/requirements.txt") == (
        "code/requirements.txt: Transformers==4.46.0 is outside the range spottrain[hf] pins "
        "(transformers<5.19,>=5.18, the versions its hf integration is tested with), which "
        "every VM of a train.integration: hf job installs: change it to "
        "transformers<5.19,>=5.18 or remove it"
    )
    lightning = range_conflict("lightning", REQUIRES, requirement_lines("lightning<2\n"), "r")
    assert lightning is not None and "lightning<2.7,>=2.6.6" in lightning
    assert "\n" not in lightning


def test_a_pin_inside_the_range_or_of_another_package_or_platform_is_no_conflict() -> None:
    envs = [{"sys_platform": "linux", "python_version": "3.11", "python_full_version": "3.11.2"}]
    for text in (
        "transformers\n",
        "transformers>=5.18.0\n",
        "lightning==1.0\n",  # not the hf extra's
        "transformers==4.0; sys_platform == 'darwin'\n",  # not the VMs'
    ):
        assert range_conflict("hf", REQUIRES, requirement_lines(text), "r", envs) is None, text
    # Without spottrain's metadata there is no range to compare: pip decides.
    assert range_conflict("hf", [], requirement_lines("transformers==4.0\n"), "r") is None


def test_a_venv_without_the_framework_or_outside_its_range_is_refused_naming_the_fix() -> None:
    where = "this venv (/v)"
    good = {"transformers": "5.18.0", "accelerate": "1.15.0"}
    assert venv_framework_problem("hf", REQUIRES, good, where) is None
    missing = venv_framework_problem("hf", REQUIRES, {**good, "transformers": None}, where)
    assert missing == (
        "train.integration: hf needs transformers in this venv (/v), which has none: install "
        "it with pip install 'spottrain[hf]'"
    )
    old = venv_framework_problem("hf", REQUIRES, {**good, "accelerate": "1.12.0"}, where)
    assert old == (
        "train.integration: hf needs accelerate<1.16,>=1.15 (spottrain[hf]: the versions its "
        "integration is tested with), and this venv (/v) has accelerate 1.12.0: install the "
        "range with pip install 'spottrain[hf]'"
    )
    assert venv_framework_problem("lightning", [], {"lightning": "9.0"}, where) is None


def test_validates_line_says_what_the_nodes_install_and_from_where() -> None:
    assert describe_framework(_spec(VALID, "sdk"), REQUIRES) is None
    assert describe_framework(_spec(VALID, "plain"), REQUIRES) is None
    hf = "spottrain[hf] (transformers<5.19,>=5.18, accelerate<1.16,>=1.15)"
    image = _spec(VALID, "hf")
    assert describe_framework(image, REQUIRES) == (
        "framework transformers and accelerate: the image must hold transformers and "
        "accelerate (pip install 'spottrain[agent,hf]'): nothing installs them at boot"
    )
    archive = _spec(VALID, "hf", code={"archive": {"path": "."}})
    assert describe_framework(archive, REQUIRES) == (
        f"framework transformers and accelerate: each VM installs {hf}, locked with the agent"
    )
    local = _spec(LOCAL, "lightning")
    assert describe_framework(local, REQUIRES) == (
        "framework lightning: the local VMs run in this venv, which needs spottrain[lightning] "
        "(lightning<2.7,>=2.6.6)"
    )
    fleet = _spec(FLEET_AWS, "accelerate")
    assert str(describe_framework(fleet, REQUIRES)).startswith(
        "framework accelerate: each VM installs spottrain[accelerate] (accelerate<1.16,>=1.15) "
        "(the Terraform module's integration variable, or its env_lock)"
    )
    # Without spottrain's metadata, the packages by name.
    assert describe_framework(archive, []) == (
        "framework transformers and accelerate: each VM installs spottrain[hf] (transformers, "
        "accelerate), locked with the agent"
    )

"""The lock is resolved on the controller for the VMs: their wheel tags and their markers,
not the controller's (pure: no pip here)."""

from __future__ import annotations

from typing import Any

from spottrain.controller.run.env_lock import LockTarget, missing_on_target


def _item(name: str, *requires: str, extras: tuple[str, ...] = ()) -> dict[str, Any]:
    item: dict[str, Any] = {"metadata": {"name": name, "version": "1.0"}}
    item["metadata"]["requires_dist"] = list(requires)
    if extras:
        item["requested_extras"] = list(extras)
    return item


def test_pip_gets_every_manylinux_tag_a_vm_installs() -> None:
    tags = LockTarget().platform_tags()
    assert tags[0] == "manylinux_2_28_x86_64" and tags[-1] == "manylinux1_x86_64"
    # pydantic-core, grpcio, torchft... ship manylinux_2_17 / manylinux2014 wheels only.
    assert {"manylinux_2_17_x86_64", "manylinux2014_x86_64"} <= set(tags)
    assert "manylinux_2_29_x86_64" not in tags  # newer than the VMs' glibc
    arm = LockTarget(platform="manylinux_2_28_aarch64").platform_tags()
    assert all(t.endswith("_aarch64") for t in arm)
    assert LockTarget(platform="win_amd64").platform_tags() == ["win_amd64"]


def test_what_only_an_older_patch_release_needs_is_added() -> None:
    report = {"install": [_item("redis", "async-timeout>=4.0.3; python_full_version < '3.11.3'")]}
    assert missing_on_target(report, LockTarget("3.11")) == ["async-timeout>=4.0.3"]
    assert missing_on_target(report, LockTarget("3.12")) == []
    report["install"].append(_item("async-timeout"))
    assert missing_on_target(report, LockTarget("3.11")) == []


def test_what_a_linux_vm_needs_is_added_whatever_the_controller_runs_on() -> None:
    report = {
        "install": [
            _item(
                "torch",
                "nvidia-nccl-cu12==2.27.5; "
                'platform_system == "Linux" and platform_machine == "x86_64"',
                'pywin32; sys_platform == "win32"',
            )
        ]
    }
    assert missing_on_target(report, LockTarget()) == ["nvidia-nccl-cu12==2.27.5"]
    arm = LockTarget(platform="manylinux_2_28_aarch64")
    assert missing_on_target(report, arm) == []


def test_an_extras_requirements_count_only_where_the_extra_was_asked_for() -> None:
    needs = 'boto3>=1.34; extra == "aws"'
    assert missing_on_target({"install": [_item("spottrain", needs)]}, LockTarget()) == []
    asked = {"install": [_item("spottrain", needs, extras=("agent", "aws"))]}
    assert missing_on_target(asked, LockTarget()) == ["boto3>=1.34"]

"""``spottrain lock``: write the hashed lock of the environment a cloud's VMs install."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from spottrain.controller.cli.common import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, err
from spottrain.controller.run.env_lock import (
    LOCKED_CLOUDS,
    LockTarget,
    ResolveError,
    lock_for_cloud,
)
from spottrain.envlock import lock_sha256
from spottrain.spec import JobSpec


def add_parser(sub: Any) -> None:
    """``spottrain lock``: the subcommand's arguments."""
    p = sub.add_parser(
        "lock",
        help="write the hashed lock of the environment a cloud's VMs install for a job",
        description="Resolve the agent's environment for a cloud's VMs (the spec's "
        "packages.python, manylinux x86_64; with torchft for a replica-mode job and the "
        "framework of its train.integration, hf, accelerate or lightning, at the range of "
        "spottrain's extra) with this machine's pip, the spec's index "
        "(packages:) and pip's own configuration, and write it as a hashed requirements "
        "file. spottrain itself is this controller's own wheel, pinned by its sha256 (no "
        "index needs to carry it; the run ships the wheel to its VMs). `spottrain up JOB.yaml "
        "--env-lock CLOUD=FILE` uses the file instead of resolving again (for a controller "
        "without access to the index); it refuses a lock made by another spottrain build.",
    )
    p.add_argument("spec", help="the job's YAML file")
    p.add_argument("--cloud", choices=LOCKED_CLOUDS, required=True, help="whose VMs")
    p.add_argument("-o", "--output", help="the file to write (default: standard output)")
    p.add_argument(
        "--platform",
        default=LockTarget.platform,
        help="the VMs' wheel platform tag (default: %(default)s; older manylinux tags are "
        "accepted too; manylinux_2_28_aarch64 for Arm VMs)",
    )
    p.add_argument(
        "--python-version",
        default=None,
        help="the VMs' python3 (default: the spec's packages.python, else 3.11); the boot "
        "refuses another",
    )


def command(args: Any) -> int:
    """Run ``spottrain lock``: exit 0 written, 1 resolution failed, 2 bad spec."""
    from spottrain.spec import SpecError, load_spec

    try:
        loaded = load_spec(args.spec)
    except SpecError as e:
        print(str(e), file=sys.stderr)
        return EXIT_BAD_INPUT
    from spottrain.controller.run.create import build_self_wheel
    from spottrain.controller.run.records import RunError

    spec = loaded.spec
    try:
        wheel = build_self_wheel()
        target = LockTarget(
            python_version=args.python_version or spec.packages.python, platform=args.platform
        )
        lock = lock_for_cloud(spec, loaded.base_dir, args.cloud, wheel, target=target)
    except (ResolveError, RunError) as e:
        err(str(e))
        return EXIT_FAILED
    text = lock.text()
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    err(
        f"{len(lock.packages)} packages locked for {args.cloud} "
        f"({lock.target}), sha256 {lock_sha256(text)}; spottrain is this controller's wheel "
        f"{wheel.filename} (sha256 {wheel.sha256[:16]}), which `spottrain up` ships to the VMs"
        + framework_note(spec, lock.versions())
    )
    return EXIT_OK


def framework_note(spec: JobSpec, versions: dict[str, str]) -> str:
    """The lock's framework for the job's integration, as the end of the summary line ("" for
    sdk and plain): a lock is for one integration's jobs (``up`` refuses it for another)."""
    from spottrain.spec import FRAMEWORK_PACKAGES, framework_extra

    extra = framework_extra(spec)
    if extra is None:
        return ""
    held = ", ".join(f"{n} {versions.get(n, '(none)')}" for n in FRAMEWORK_PACKAGES[extra])
    return f"; train.integration {extra}: {held}"

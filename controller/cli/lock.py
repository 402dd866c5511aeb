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


def add_parser(sub: Any) -> None:
    """``spottrain lock``: the subcommand's arguments."""
    p = sub.add_parser(
        "lock",
        help="write the hashed lock of the environment a cloud's VMs install for a job",
        description="Resolve the agent's environment for a cloud's VMs (python 3.11, "
        "manylinux x86_64) with this machine's pip and its configuration, and write it as a "
        "hashed requirements file. `spottrain up JOB.yaml --env-lock CLOUD=FILE` uses it "
        "instead of resolving again (for a controller without access to the index).",
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
        default=LockTarget.python_version,
        help="the VMs' python3 (default: %(default)s); the boot refuses another",
    )


def command(args: Any) -> int:
    """Run ``spottrain lock``: exit 0 written, 1 resolution failed, 2 bad spec."""
    from spottrain.spec import SpecError, load_spec

    try:
        loaded = load_spec(args.spec)
    except SpecError as e:
        print(str(e), file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        target = LockTarget(python_version=args.python_version, platform=args.platform)
        lock = lock_for_cloud(loaded.spec, loaded.base_dir, args.cloud, target=target)
    except ResolveError as e:
        err(str(e))
        return EXIT_FAILED
    text = lock.text()
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    err(
        f"{len(lock.packages)} packages locked for {args.cloud} "
        f"({lock.target}), sha256 {lock_sha256(text)}"
    )
    return EXIT_OK

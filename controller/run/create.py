"""Making a new run of a spec: its directory, its Redis (embedded or checked), its code."""

from __future__ import annotations

import time
from pathlib import Path

from spottrain.controller.run.boot import (
    BootFiles,
    CodeRef,
    UserDataTooLarge,
    check_user_data_fits,
)
from spottrain.controller.run.boot_files import ship_boot_files
from spottrain.controller.run.code import local_secret_files, prepare_code
from spottrain.controller.run.env_lock import (
    ResolveError,
    capture_locks,
    local_framework_problem,
)
from spottrain.controller.run.lighthouse import (
    find_lighthouse_binary,
    find_torchft,
    place_lighthouse,
    replica_mode,
    uses_lighthouse,
)
from spottrain.controller.run.records import RunError, RunInfo, home_dir
from spottrain.controller.run.run_redis import (
    open_redis,
    start_embedded_redis,
    stop_embedded_redis,
)
from spottrain.controller.run.wheel import SelfWheel, WheelError, self_wheel
from spottrain.protocol.keys import make_run_id, validate_run_id
from spottrain.spec import JobSpec, LoadedSpec


def build_self_wheel() -> SelfWheel:
    """The wheel of this spottrain, which the run ships to its VMs (built once per source,
    kept in ``$SPOTTRAIN_HOME/wheels``).

    Raises:
        RunError: the running spottrain cannot be made into a wheel.
    """
    try:
        return self_wheel(home_dir() / "wheels")
    except WheelError as e:
        raise RunError(f"cannot build spottrain's wheel for the VMs: {e}") from None


def _environment(
    loaded: LoadedSpec, info: RunInfo, env_locks: dict[str, Path] | None
) -> SelfWheel | None:
    """For a run that launches AWS or GCP VMs: the wheel it ships and its locks (recorded in
    ``info``); None for any other run.

    Raises:
        RunError: no store for the boot files, no wheel, or no lock.
    """
    spec = loaded.spec
    if not spec.launches_vms():
        return None
    problem = spec.files_store_problem()
    if problem:
        raise RunError(problem)
    wheel = build_self_wheel()
    info.wheel = {
        "sha256": wheel.sha256,
        "filename": wheel.filename,
        "version": wheel.version,
        "origin": wheel.origin,
    }
    try:
        info.env_locks = capture_locks(spec, loaded.base_dir, info.dir, wheel, env_locks)
    except ResolveError as e:
        raise RunError(str(e)) from None
    return wheel


def reserve_run_dir(name: str, given: str | None = None, epoch: int | None = None) -> str:
    """Make a new run's directory, which no other ``up`` can then have: two ``up`` of one
    job in the same second get two runs (the later one a second on) rather than one
    directory that mixes their records. Returns the run id.

    Raises:
        RunError: ``given`` (a run id asked for) is taken already.
    """
    runs = home_dir() / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    if given is not None:
        try:
            (runs / given).mkdir()
        except FileExistsError:
            raise RunError(
                f"run {given} exists on this machine already (or another `spottrain up` is "
                f"making it): `spottrain status {given}` shows it; give another run id"
            ) from None
        return given
    at = int(time.time()) if epoch is None else epoch
    while True:
        rid = make_run_id(name, at)
        try:
            (runs / rid).mkdir()
            return rid
        except FileExistsError:
            at += 1


def create_run(
    loaded: LoadedSpec, *, run_id: str | None = None, env_locks: dict[str, Path] | None = None
) -> RunInfo:
    """Make a new run of a spec: its directory, Redis (embedded or checked), and code.

    Raises:
        RunError: Redis unreachable or refusing, the code cannot be archived or uploaded,
            the agent's environment cannot be locked (``env_locks``: the user's lock files
            by cloud, instead of resolving).
    """
    spec = loaded.spec
    given = validate_run_id(run_id) if run_id else None
    if given is None and spec.fleet is not None:
        # The fleet's VMs were booted with the module's run id: the run must be that one.
        given = spec.fleet.run_id
        if (home_dir() / "runs" / given / "run.json").exists():
            raise RunError(
                f"run {given} of this Terraform fleet already exists on this machine: "
                f"`spottrain resume {given}` drives it again, `spottrain down {given}` ends it"
            )
    if "local" in spec.resources.clouds:
        local_secret_files(spec)  # fail now, before anything starts
    # Fail now, before anything starts, when the replica extra is missing: the lighthouse
    # runs here, and the local cloud's VMs run torchft's manager from this venv.
    if uses_lighthouse(spec):
        find_lighthouse_binary()
    elif replica_mode(spec) and "local" in spec.resources.clouds:
        find_torchft()
    # Likewise the framework a local job's integration trains with (hf, lightning, ...).
    problem = local_framework_problem(spec)
    if problem:
        raise RunError(problem)
    rid = reserve_run_dir(spec.name, given)
    info = RunInfo.from_loaded(
        loaded,
        rid,
        redis_url="",
        embedded_redis=spec.redis.url == "embedded",
        created_at=time.time(),
    )
    wheel = _environment(loaded, info, env_locks)
    if info.embedded_redis:
        info.redis_url = start_embedded_redis(info.dir, spec.nodes.max)
    else:
        info.redis_url = spec.redis.url
        open_redis(info, spec)  # fail now, before anything is launched
    if uses_lighthouse(spec):
        # The controller starts it (drive.py) beside the Redis the VMs reach. A Redis-quorum
        # run records none: its quorum lives in the run's Redis, nothing to start or stop.
        placed = place_lighthouse(info.redis_url)
        info.lighthouse, info.lighthouse_bind = placed.address, placed.bind
    if "local" in spec.resources.clouds:
        info.local_state_dir = str(home_dir() / "local")
    try:
        # A Terraform fleet's boot script pins and fetches the code itself.
        code = CodeRef() if spec.fleet else prepare_code(spec, loaded.base_dir, info.dir)
    except Exception as e:
        if info.embedded_redis:
            stop_embedded_redis(info)
        raise RunError(f"cannot prepare the job's code: {e}") from None
    info.code_url, info.code_sha256 = code.archive_url, code.archive_sha256
    if wheel is not None:
        try:
            info.boot_files = _ship(spec, info, code, wheel)
        except RunError:
            if info.embedded_redis:
                stop_embedded_redis(info)
            raise
    info.save()
    jobs = home_dir() / "jobs"
    jobs.mkdir(parents=True, exist_ok=True)
    (jobs / spec.name).write_text(rid)
    return info


def _ship(
    spec: JobSpec, info: RunInfo, code: CodeRef, wheel: SelfWheel
) -> dict[str, dict[str, dict[str, str]]]:
    """The run's boot files, shipped to its store, once every cloud's user data is known to
    fit what the cloud takes."""
    shipped = ship_boot_files(spec, info, code, wheel)
    try:
        check_user_data_fits(
            spec,
            info.run_id,
            info.redis_url,
            {c: BootFiles.from_dict(d) for c, d in shipped.items()},
            password_secret=spec.redis.password_secret,
        )
    except UserDataTooLarge as e:
        raise RunError(str(e)) from None
    return shipped

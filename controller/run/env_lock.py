"""Resolve the agent's environment into a hashed lock (:mod:`spottrain.envlock`) on the
controller, for the VMs of one cloud.

Real pip resolves it, for the VMs' interpreter and platform rather than this machine's::

    pip install --dry-run --ignore-installed --quiet --report FILE --only-binary=:all:
        --platform manylinux_2_28_x86_64 --python-version 3.11 --implementation cp
        [the spec's packages: --index-url, --extra-index-url, --find-links]
        'spottrain[agent,aws] @ file:///.../spottrain-0.1.0-py3-none-any.whl'
        [-r <archive>/requirements.txt]

and its report (each wheel's name, version and sha256) becomes the lock. spottrain itself is
the wheel of this very controller (``controller/run/wheel.py``), given to pip by its path, so
no index needs to carry it: the lock pins it as ``spottrain==<version>`` with that wheel's
sha256, the run ships the wheel to its store, and the VMs install it from there beside the
rest. Everything else comes from the spec's index (``packages:``) or pip's own configuration
on this machine (``PIP_INDEX_URL``, pip.conf, which also holds the controller's credentials
for a private index); the VMs install the lock from the same index, and a file whose hash
differs is refused there.

What the lock covers:

- the agent requirement, ``spottrain[agent,<cloud>]==<this version>`` for the cloud, with
  the ``replica`` extra (torchft) for a replica-mode job
  (``train.fault_tolerance: replica``), and the framework's extra (``hf``, ``accelerate``,
  ``lightning``: :mod:`spottrain.spec.frameworks`) for a job whose ``train.integration``
  needs one: the extra's range wins, a job requirement pinning the framework outside it is
  refused before pip runs, in one line naming both;
- ``code.archive``: the job's ``requirements.txt`` beside it, resolved together with the
  agent, so a job requirement can never move torch: the VM installs the lock instead of the
  file;
- ``code.git``: the controller does not have the pinned commit, so the VM installs the
  checkout's ``requirements.txt`` constrained to the lock's versions (``-c``), and verifies
  the lock afterwards: the job's own extra packages are pinned by version, not by hash;
- ``code.image``: the image is the environment; no lock is made.

The local cloud's VMs run in the controller's own venv: no lock either; a framework the
integration needs must be in that venv, in its extra's range (:func:`local_framework_problem`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from packaging.requirements import InvalidRequirement, Requirement

from spottrain import __version__
from spottrain.controller.run.wheel import SelfWheel, WheelError, find_source
from spottrain.envlock import (
    EnvLock,
    LockedPackage,
    LockError,
    canonical_name,
    lock_sha256,
    make_lock,
    parse_lock,
)
from spottrain.spec import (
    FRAMEWORK_PACKAGES,
    ArchiveCode,
    FaultTolerance,
    ImageCode,
    JobSpec,
    extra_requirements,
    framework_extra,
    range_conflict,
    requirement_lines,
    venv_framework_problem,
)

LOCKED_CLOUDS = ("aws", "gcp")


@dataclass(frozen=True)
class LockTarget:
    """The VMs' interpreter and platform, which pip resolves for."""

    python_version: str = "3.11"
    platform: str = "manylinux_2_28_x86_64"
    implementation: str = "cp"

    def describe(self) -> str:
        return f"python {self.python_version} {self.implementation} {self.platform}"

    def platform_tags(self) -> list[str]:
        """The wheel tags a VM of ``platform`` installs, best first: pip takes only the tags
        it is given, and many wheels are built for older glibcs (``manylinux_2_17``,
        ``manylinux2014``) than the VMs have. Each ``manylinux_2_N`` down to 2.5, then the
        legacy names; another platform is taken as it is."""
        m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", self.platform)
        if m is None:
            return [self.platform]
        minor, arch = int(m[1]), m[2]
        tags = [f"manylinux_2_{n}_{arch}" for n in range(minor, 4, -1)]
        aliases = ((17, "manylinux2014"), (12, "manylinux2010"), (5, "manylinux1"))
        return tags + [f"{name}_{arch}" for since, name in aliases if minor >= since]

    def environments(self) -> list[dict[str, str]]:
        """The marker environments of the VMs (PEP 508), one per patch release of
        ``python_version``: pip evaluates a requirement's marker on the machine it runs on
        (this controller, maybe a Mac, maybe a newer Python) whatever ``--platform`` and
        ``--python-version`` say, so the lock checks them again for the VMs
        (:func:`missing_on_target`)."""
        m = re.fullmatch(r"(?:many|musl)linux_\d+_\d+_(\w+)", self.platform)
        arch = m[1] if m else ""
        base = {
            "os_name": "posix",
            "sys_platform": "linux",
            "platform_system": "Linux",
            "platform_machine": arch,
            "platform_release": "",
            "platform_version": "",
            "implementation_name": "cpython",
            "platform_python_implementation": "CPython",
            "python_version": self.python_version,
        }
        full = [f"{self.python_version}.{patch}" for patch in range(_PATCHES)]
        return [{**base, "python_full_version": v, "implementation_version": v} for v in full]


# Patch releases a VM's python3 may be (3.11.0 ... 3.11.29): their markers differ (redis
# needs async-timeout below 3.11.3; Debian 12 ships 3.11.2).
_PATCHES = 30


def agent_requirement(
    cloud: str,
    *,
    replica: bool = False,
    framework: str | None = None,
    wheel: SelfWheel | None = None,
) -> str:
    """What a VM of ``cloud`` installs: the agent at this controller's version (with
    ``wheel``: that very file, so pip needs no index that carries spottrain); with
    ``replica``, also torchft (the ``replica`` extra), which only replica mode imports; with
    ``framework`` (an extra: ``hf``, ``accelerate``, ``lightning``), the framework the job's
    integration trains with, at the extra's range."""
    extras = ",".join(
        ["agent", cloud, *(["replica"] if replica else []), *filter(None, [framework])]
    )
    if wheel is not None:
        return f"spottrain[{extras}] @ {wheel.file_url}"
    return f"spottrain[{extras}]=={__version__}"


def needs_replica_extra(spec: JobSpec) -> bool:
    """Whether the job's VMs need torchft: in replica mode only (an elastic job's lock, and
    its boot script, stay as they were)."""
    return spec.train.fault_tolerance is FaultTolerance.REPLICA


def spec_agent_requirement(spec: JobSpec, cloud: str, wheel: SelfWheel | None = None) -> str:
    """:func:`agent_requirement` for ``spec``'s VMs on ``cloud``."""
    return agent_requirement(
        cloud, replica=needs_replica_extra(spec), framework=framework_extra(spec), wheel=wheel
    )


def wheel_requires(wheel: SelfWheel) -> list[str]:
    """The ``Requires-Dist`` strings of ``wheel``'s METADATA: the extras' ranges pip
    resolves with, read from the very file the run ships.

    Raises:
        ResolveError: the wheel cannot be read.
    """
    name = f"spottrain-{wheel.version}.dist-info/METADATA"
    try:
        with zipfile.ZipFile(wheel.path) as z:
            text = z.read(name).decode()
    except (OSError, KeyError, zipfile.BadZipFile) as e:
        raise ResolveError(f"cannot read {name} in {wheel.path}: {e}") from None
    return metadata_requires(text)


def metadata_requires(text: str) -> list[str]:
    """The ``Requires-Dist`` values of a METADATA text."""
    head = text.split("\n\n", 1)[0]
    return [
        ln.partition(":")[2].strip() for ln in head.splitlines() if ln.startswith("Requires-Dist:")
    ]


def spottrain_requires() -> list[str]:
    """This controller's spottrain's ``Requires-Dist`` strings, from the source its wheel is
    built from (a checkout's pyproject.toml, or the installed METADATA); empty when neither
    can be read (then only the framework's names are checked, not its range)."""
    try:
        return metadata_requires(find_source().metadata_text)
    except WheelError:
        pass
    try:
        return list(metadata.requires("spottrain") or [])
    except metadata.PackageNotFoundError:
        return []


def installed_version(dist: str) -> str | None:
    """The version of ``dist`` in this venv, or None: read from its metadata, so a heavy
    framework is never imported to ask."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def local_framework_problem(spec: JobSpec, requires: Sequence[str] | None = None) -> str | None:
    """Why this venv, where the local cloud's VMs run, cannot run the job's integration (its
    framework missing, or outside its extra's range), in one line; None when it can, or the
    job has no local VM or needs no framework."""
    extra = framework_extra(spec)
    if extra is None or "local" not in spec.resources.clouds or spec.fleet is not None:
        return None
    reqs = spottrain_requires() if requires is None else requires
    installed = {name: installed_version(name) for name in FRAMEWORK_PACKAGES[extra]}
    where = f"this venv ({sys.prefix}, where the local cloud's VMs run)"
    return venv_framework_problem(extra, reqs, installed, where)


def framework_lock_problem(
    versions: Mapping[str, str], extra: str, requires: Sequence[str]
) -> str | None:
    """What a lock holding ``versions`` lacks for ``extra``'s integration: a framework
    package missing, or locked outside the extra's range (``requires``: spottrain's
    ``Requires-Dist``), in words that follow "the lock"; None when it has them."""
    missing = [p for p in FRAMEWORK_PACKAGES[extra] if p not in versions]
    if missing:
        return f"holds no {' or '.join(missing)}"
    for req in extra_requirements(requires, extra):
        have = versions.get(req.name)
        if have is not None and not req.specifier.contains(have, prereleases=True):
            return (
                f"holds {req.name} {have}, outside spottrain[{extra}]'s {req.name}{req.specifier}"
            )
    return None


def pip_command(
    requirements: Sequence[str],
    requirement_files: Sequence[Path],
    report: Path,
    target: LockTarget,
    pip_args: Sequence[str] = (),
) -> list[str]:
    """The pip command line that resolves the requirements for ``target`` into ``report``."""
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed"]
    # Not --quiet: it would hide pip's account of a conflict, which the error shows.
    cmd += ["--report", str(report), "--only-binary=:all:"]
    for tag in target.platform_tags():
        cmd += ["--platform", tag]
    cmd += ["--python-version", target.python_version]
    cmd += ["--implementation", target.implementation, *pip_args, *requirements]
    for f in requirement_files:
        cmd += ["-r", str(f)]
    return cmd


def lock_from_report(
    report: Mapping[str, Any],
    target: LockTarget,
    requires: Sequence[str],
    wheel: SelfWheel | None = None,
) -> EnvLock:
    """The lock of pip's installation report. ``wheel``: the spottrain wheel that was given
    to pip by its path, pinned as ``spottrain==<version>`` with its sha256 (the run ships it).

    Raises:
        LockError: an item has no sha256 hash, or is a direct reference to a local file or
            folder (the VMs cannot reach it), other than ``wheel``.
    """
    packages = []
    for item in report.get("install", []):
        meta = item.get("metadata", {})
        name, version = meta.get("name", "?"), meta.get("version", "")
        info = item.get("download_info") or {}
        url = str(info.get("url", ""))
        if wheel is not None and canonical_name(name) == "spottrain":
            if url != wheel.file_url or version != wheel.version:
                raise LockError(
                    f"pip chose spottrain {version} from {url or 'nowhere'}, not this "
                    f"controller's wheel {wheel.path}: remove spottrain from the job's "
                    "requirements (the run ships its own)"
                )
            packages.append(LockedPackage("spottrain", version, (f"sha256:{wheel.sha256}",)))
            continue
        if item.get("is_direct") and urlparse(url).scheme in ("file", ""):
            raise LockError(
                f"{name} {version} comes from {url}, a local path the VMs cannot reach: "
                "publish it to an index (or object storage they can reach) and require it "
                "by name"
            )
        sha = (info.get("archive_info") or {}).get("hashes", {}).get("sha256")
        if not sha:
            raise LockError(
                f"{name} {version} ({url or 'no URL'}) has no sha256 hash (a folder or a VCS "
                "checkout?): require a released wheel instead"
            )
        direct = url if item.get("is_direct") else ""
        packages.append(LockedPackage(name, version, (f"sha256:{sha}",), direct))
    return make_lock(packages, target=target.describe(), requires=requires)


def missing_on_target(report: Mapping[str, Any], target: LockTarget) -> list[str]:
    """What the packages of pip's report require on some VM of ``target`` but the report
    does not hold: pip evaluated each marker on this machine (another OS, another patch
    release of Python), so e.g. redis's ``async-timeout; python_full_version < '3.11.3'``
    is left out by a controller on 3.11.7 for VMs on Debian 12's 3.11.2, and CUDA torch's
    ``nvidia-*; platform_system == "Linux"`` by one on a Mac. Each marker is evaluated for
    every patch release of the target (:meth:`LockTarget.environments`) with the extras its
    package was asked for."""
    items = list(report.get("install", []))
    have = {canonical_name(i.get("metadata", {}).get("name", "")) for i in items}
    envs = target.environments()
    out: set[str] = set()
    for item in items:
        extras = ["", *(item.get("requested_extras") or [])]
        for text in item.get("metadata", {}).get("requires_dist") or []:
            try:
                req = Requirement(text)
            except InvalidRequirement:
                continue
            if canonical_name(req.name) in have or req.marker is None:
                continue
            marker = req.marker
            if any(marker.evaluate({**env, "extra": x}) for env in envs for x in extras):
                bare = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
                out.add(f"{req.name}{bare}{req.specifier}")
    return sorted(out)


class ResolveError(Exception):
    """pip could not resolve the environment; the message names the requirements, pip's own
    words, and the way out."""


def resolve_lock(
    requirements: Sequence[str],
    *,
    requirement_files: Sequence[Path] = (),
    target: LockTarget = LockTarget(),
    pip_args: Sequence[str] = (),
    timeout_s: float = 600.0,
    wheel: SelfWheel | None = None,
) -> EnvLock:
    """Resolve ``requirements`` (and requirement files) with real pip for ``target``.

    Raises:
        ResolveError: pip failed, or its report cannot become a lock.
    """
    what = ", ".join([*requirements, *(f"-r {f}" for f in requirement_files)])
    extra: list[str] = []
    # pip resolves with this machine's markers; what the VMs need besides is added and the
    # whole resolved again, until nothing is missing (one more round, in practice).
    for _ in range(4):
        found = _resolve_report(
            [*requirements, *extra], requirement_files, target, pip_args, timeout_s, what
        )
        missing = [m for m in missing_on_target(found, target) if m not in extra]
        if not missing:
            break
        extra += missing
    try:
        return lock_from_report(found, target, [*requirements], wheel)
    except LockError as e:
        raise ResolveError(_advice(what, str(e))) from None


def _resolve_report(
    requirements: Sequence[str],
    requirement_files: Sequence[Path],
    target: LockTarget,
    pip_args: Sequence[str],
    timeout_s: float,
    what: str,
) -> dict[str, Any]:
    """pip's installation report of one resolution."""
    with tempfile.TemporaryDirectory(prefix="spottrain-lock-") as tmp:
        report = Path(tmp) / "report.json"
        cmd = pip_command(requirements, requirement_files, report, target, pip_args)
        env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise ResolveError(_advice(what, f"pip ran past {timeout_s:g} s")) from None
        if proc.returncode != 0 or not report.exists():
            said = proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}"
            raise ResolveError(_advice(what, said[-2000:]))
        data: dict[str, Any] = json.loads(report.read_text())
        return data


def _advice(what: str, said: str) -> str:
    return (
        f"cannot lock the agent's environment ({what}) for the VMs: {said}\n"
        "pip uses this machine's configuration (PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, "
        "PIP_FIND_LINKS, pip.conf); on a controller without access to the index, make a "
        "lock where there is one (`spottrain lock JOB.yaml --cloud CLOUD -o FILE`) and pass "
        "it: `spottrain up JOB.yaml --env-lock CLOUD=FILE`"
    )


def job_requirement_files(spec: JobSpec, base_dir: Path) -> list[Path]:
    """The job's requirements the lock includes: ``requirements.txt`` of ``code.archive``."""
    if isinstance(spec.code, ArchiveCode):
        path = base_dir / spec.code.archive.path / "requirements.txt"
        if path.is_file():
            return [path]
    return []


def clouds_to_lock(spec: JobSpec) -> list[str]:
    """The clouds whose VMs install a lock: AWS and GCP, unless the job runs in its image
    or on a Terraform fleet (whose module takes ``env_lock`` itself)."""
    if isinstance(spec.code, ImageCode) or spec.fleet is not None:
        return []
    return [c for c in spec.resources.clouds if c in LOCKED_CLOUDS]


def lock_target(spec: JobSpec) -> LockTarget:
    """The VMs' interpreter the spec names (``packages.python``), on manylinux x86_64."""
    return LockTarget(python_version=spec.packages.python)


def lock_for_cloud(
    spec: JobSpec, base_dir: Path, cloud: str, wheel: SelfWheel, **kw: Any
) -> EnvLock:
    """Resolve the lock a VM of ``cloud`` installs for ``spec``, spottrain being ``wheel``
    and everything else from the spec's index (``packages:``) or pip's configuration.

    Raises:
        ResolveError: pip failed; or, before pip runs, the job's requirements pin the
            integration's framework outside its extra's range (one line naming both).
    """
    kw.setdefault("target", lock_target(spec))
    files = job_requirement_files(spec, base_dir)
    extra = framework_extra(spec)
    requires = wheel_requires(wheel) if extra else []
    if extra:
        check_framework_pins(extra, requires, files, kw["target"])
    lock = resolve_lock(
        [spec_agent_requirement(spec, cloud, wheel)],
        requirement_files=files,
        pip_args=[*spec.packages.pip_args(), *kw.pop("pip_args", ())],
        wheel=wheel,
        **kw,
    )
    problem = extra and framework_lock_problem(lock.versions(), extra, requires)
    if problem:
        # pip warns and goes on when the wheel has no such extra (a spottrain older than the
        # integration): the lock would hold no framework, and every worker fail at import.
        raise ResolveError(
            f"the lock pip made for {cloud} {problem}, which train.integration: {extra} needs "
            f"on every VM: is spottrain's wheel {wheel.path} built with the {extra} extra?"
        )
    return lock


def check_framework_pins(
    extra: str, requires: Sequence[str], files: Sequence[Path], target: LockTarget
) -> None:
    """Refuse, in one line, a job requirements file that pins ``extra``'s framework outside
    the extra's range: pip would only say that it cannot resolve, in many lines.

    Raises:
        ResolveError: the first such pin, with both ranges and the fix.
    """
    envs = target.environments()
    for f in files:
        try:
            text = f.read_text()
        except OSError as e:
            raise ResolveError(f"cannot read the job's {f}: {e.strerror}") from None
        problem = range_conflict(extra, requires, requirement_lines(text), str(f), envs)
        if problem:
            raise ResolveError(problem)


def read_lock_file(
    path: Path,
    cloud: str,
    *,
    replica: bool = False,
    framework: str | None = None,
    wheel: SelfWheel | None = None,
) -> EnvLock:
    """A lock the user made (``spottrain lock``), checked to hold this spottrain (with
    ``wheel``: pinned to that very wheel's sha256), for a ``replica`` job torchft, and for a
    job whose integration needs ``framework`` (an extra) its packages in the extra's range
    (``wheel``'s; without it, only their names): a lock made for another integration's job
    is refused.

    Raises:
        ResolveError: unreadable, malformed, for another spottrain, a replica job's lock
            without torchft, or a lock without the integration's framework.
    """
    try:
        lock = parse_lock(path.read_text(), str(path))
    except (OSError, LockError) as e:
        raise ResolveError(f"--env-lock {cloud}={path}: {e}") from None
    have = lock.versions().get("spottrain")
    again = f"make it again with this controller: spottrain lock JOB.yaml --cloud {cloud} -o {path}"
    if have != __version__:
        raise ResolveError(
            f"--env-lock {cloud}={path}: the lock holds spottrain {have or '(none)'}, this "
            f"controller is {__version__}: every node must run the controller's agent ({again})"
        )
    pinned = next(p for p in lock.packages if p.name == "spottrain")
    if wheel is not None and f"sha256:{wheel.sha256}" not in pinned.hashes:
        raise ResolveError(
            f"--env-lock {cloud}={path}: the lock pins spottrain by sha256 "
            f"{pinned.hashes[0].removeprefix('sha256:')[:16]}, not this controller's wheel "
            f"({wheel.sha256[:16]}, built from {wheel.origin}): {again}"
        )
    missing = [p for p in ("torchft", "grpcio") if replica and p not in lock.versions()]
    if missing:
        # Without torchft every worker fails at its first import; without grpcio the agent
        # cannot serve its workers the Redis quorum.
        raise ResolveError(
            f"--env-lock {cloud}={path}: the lock holds no {' or '.join(missing)}, which "
            "replica mode (train.fault_tolerance: replica) needs on every VM: make it again "
            f"from the replica job's spec: spottrain lock JOB.yaml --cloud {cloud} -o {path}"
        )
    requires = wheel_requires(wheel) if framework and wheel is not None else []
    problem = framework and framework_lock_problem(lock.versions(), framework, requires)
    if problem:
        raise ResolveError(
            f"--env-lock {cloud}={path}: the lock {problem}, which train.integration: "
            f"{framework} needs on every VM: make it again from this job's spec: spottrain "
            f"lock JOB.yaml --cloud {cloud} -o {path}"
        )
    return lock


def capture_locks(
    spec: JobSpec,
    base_dir: Path,
    run_dir: Path,
    wheel: SelfWheel,
    given: Mapping[str, Path] | None = None,
    **kw: Any,
) -> dict[str, dict[str, Any]]:
    """Make (or take from ``given``, by cloud) the lock of every cloud the run launches on,
    write each as ``<run dir>/env-<cloud>.lock``, and return what the run record keeps:
    ``{cloud: {"file", "sha256", "packages"}}``.

    Raises:
        ResolveError: a lock cannot be made or read, or a given one pins another spottrain
            wheel than ``wheel``.
    """
    out: dict[str, dict[str, Any]] = {}
    for cloud in clouds_to_lock(spec):
        path = (given or {}).get(cloud)
        lock = (
            read_lock_file(
                path,
                cloud,
                replica=needs_replica_extra(spec),
                framework=framework_extra(spec),
                wheel=wheel,
            )
            if path
            else lock_for_cloud(spec, base_dir, cloud, wheel, **kw)
        )
        text = lock.text()
        name = f"env-{cloud}.lock"
        (run_dir / name).write_text(text)
        out[cloud] = {"file": name, "sha256": lock_sha256(text), "packages": len(lock.packages)}
    return out


def read_run_lock(run_dir: Path, cloud: str, record: Mapping[str, Any]) -> str:
    """A run's lock for ``cloud`` as ``run.json`` recorded it, checked against its sha256
    (an edited file would reach every backfilled VM).

    Raises:
        ResolveError: the file is missing or is not the one the run recorded.
    """
    path = run_dir / str(record["file"])
    try:
        text = path.read_text()
    except OSError as e:
        raise ResolveError(f"the run's lock {path} cannot be read: {e.strerror}") from None
    if lock_sha256(text) != record["sha256"]:
        raise ResolveError(
            f"the run's lock {path} is not the one this run recorded (sha256 "
            f"{lock_sha256(text)[:16]}, run.json says {str(record['sha256'])[:16]}): it was "
            "changed; put the original back, or start a new run with the new lock (spottrain "
            "up JOB.yaml --env-lock CLOUD=FILE)"
        )
    return text


def parse_lock_args(values: Sequence[str], clouds: Sequence[str]) -> dict[str, Path]:
    """``--env-lock`` values: ``CLOUD=FILE``, or ``FILE`` alone when the spec has one cloud
    that takes a lock.

    Raises:
        ValueError: a value names another cloud, or FILE alone with several clouds.
    """
    out: dict[str, Path] = {}
    for v in values:
        cloud, sep, file = v.partition("=")
        if not sep:
            if len(clouds) != 1:
                where = ", ".join(clouds) or "no cloud that takes a lock"
                raise ValueError(
                    f"--env-lock {v}: the run launches on {where}: give CLOUD=FILE for each"
                )
            cloud, file = clouds[0], v
        if cloud not in clouds:
            raise ValueError(f"--env-lock {v}: the run launches no {cloud} VM that takes a lock")
        out[cloud] = Path(file)
    return out


def env_lock_lines(locks: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """What ``up`` and ``status`` say of a run's locks, one line per cloud."""
    return [
        f"env lock {cloud}: {v['packages']} packages, sha256 {v['sha256'][:16]} ({v['file']})"
        for cloud, v in sorted(locks.items())
    ]

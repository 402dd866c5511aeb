"""A local package index for the box: the wheels spottrain's agent needs, served over HTTP as a
PEP 503 simple repository that never carries spottrain itself.

In the box, the controller resolves a VM's lock against this index and the VMs install the
lock from it, as they would from PyPI, with no internet. Two halves:

- :func:`assemble_wheels` makes (once, into a cache folder) the folder of every wheel that
  ``spottrain[agent,aws]``, ``spottrain[agent,gcp]`` and their ``replica`` variants need on
  CPython 3.11 manylinux x86_64, at exactly the versions installed in this venv: torch is the
  local CPU build (``2.13.0+cpu``, whose metadata requires no ``nvidia-*`` package). Real pip
  works out the set, with no configuration of this machine's but what is passed to it::

      pip install --dry-run --ignore-installed --report R --only-binary=:all:
          --platform manylinux_2_28_x86_64 ... --platform manylinux_2_5_x86_64 (and aliases)
          --python-version 3.11 --implementation cp --index-url https://pypi.org/simple
          --find-links <the venv's local builds: torch 2.13.0+cpu from /opt/wheels>
          -c <the venv's versions, name==version> <spottrain's requirements of those extras>

  then again for what only older patch releases of Python 3.11 need (pip evaluates markers on
  the interpreter it runs on: redis requires ``async-timeout; python_full_version <
  '3.11.3'``, which a VM's Python 3.11.2, Debian 12's, needs and this venv cannot hold: it is
  taken at its newest release), then takes each chosen file from a local folder when one
  holds it (same name and sha256), else downloads the rest with ``pip download --no-deps
  --require-hashes``. With every version pinned, the four extras' sets are subsets of this
  one resolution of their union.

- :class:`LocalIndex` serves such a folder (or any folder of wheels): ``/simple/``,
  ``/simple/<name>/`` (anchors with ``#sha256=``, ``data-requires-python`` and the PEP 658
  ``.metadata`` of each wheel, so a recent pip resolves without downloading torch), and the
  files under ``/files/``, streamed::

      wheels = assemble_wheels(default_cache_dir())
      with LocalIndex(wheels.path) as index:
          pip install --index-url {index.url} ...
          index.missing = {"torch"}        # /simple/torch/ and its files now answer 404
          index.count("/files/torch-")     # requests so far whose path starts so

Every platform tag up to ``manylinux_2_28`` is given to pip because ``--platform
manylinux_2_28_x86_64`` alone accepts only wheels tagged exactly so, and several the agent
needs (pydantic-core, torchft, grpcio, google-crc32c, cffi) are tagged ``manylinux_2_17``
only; a VM of that platform installs either.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import tomllib
import zipfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from email.parser import HeaderParser
from importlib import metadata
from pathlib import Path
from types import TracebackType
from typing import Any, Self
from urllib.parse import quote, unquote, urlsplit

from fakes.http_fake import DispatchingHandler, QuietHTTPServer
from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = REPO / "pyproject.toml"
PYPI = "https://pypi.org/simple"
# Folders of wheels a machine may have: the local CPU torch (every machine of this kind) and
# mirrors of PyPI's files (some machines only). A file is taken from them only when its name
# and sha256 are those of the file the resolution chose, so the result is the same without.
LOCAL_WHEEL_DIRS = (Path("/opt/wheels"), Path("/opt/pypi/files"), Path("/opt/pypi-more/files"))
# What the VMs install: spottrain[agent,<cloud>], with replica for a replica-mode job.
AGENT_EXTRAS = (
    ("agent", "aws"),
    ("agent", "gcp"),
    ("agent", "aws", "replica"),
    ("agent", "gcp", "replica"),
)
PYTHON_VERSION = "3.11"
PLATFORM = "manylinux_2_28_x86_64"
# The run ships its own wheel; an index that carried spottrain would hide a lock that forgot it.
NEVER_SERVED = "spottrain"
MANIFEST = "manifest.json"
# Bumped when the folder's layout or the way it is made changes: older folders are not reused.
_FORMAT = 2
_PIP_TIMEOUT_S = "60"


class WheelFolderError(Exception):
    """The wheel folder cannot be made; the message says what pip or the venv said, and why."""


def normalize(name: str) -> str:
    """A project name as PEP 503 spells it in URLs: lower case, runs of ``-_.`` as ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def default_cache_dir() -> Path:
    """Where callers keep the folders: ``$SPOTTRAIN_BOX_CACHE/wheels``, else
    ``$XDG_CACHE_HOME/spottrain-box/wheels`` (``~/.cache/spottrain-box/wheels``): outside the
    repository, kept across runs."""
    base = os.environ.get("SPOTTRAIN_BOX_CACHE")
    if base:
        return Path(base) / "wheels"
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "spottrain-box" / "wheels"


def manylinux_platforms(platform: str = PLATFORM) -> list[str]:
    """The platform tags a machine of ``platform`` (``manylinux_2_<minor>_<arch>``) installs,
    best first: every ``manylinux_2_N`` down to ``manylinux_2_5``, and the legacy aliases
    (``manylinux2014`` = 2.17, ``manylinux2010`` = 2.12, ``manylinux1`` = 2.5).

    Raises:
        ValueError: ``platform`` is not a ``manylinux_2_<minor>_<arch>`` tag.
    """
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not m:
        raise ValueError(f"{platform!r} is not a manylinux_2_<minor>_<arch> platform tag")
    minor, arch = int(m[1]), m[2]
    tags = [f"manylinux_2_{n}_{arch}" for n in range(minor, 4, -1)]
    aliases = ((17, "manylinux2014"), (12, "manylinux2010"), (5, "manylinux1"))
    tags += [f"{alias}_{arch}" for since, alias in aliases if minor >= since]
    return tags


def target_args(python_version: str = PYTHON_VERSION, platform: str = PLATFORM) -> list[str]:
    """pip's options that resolve for a VM of ``platform`` with CPython ``python_version``,
    wheels only."""
    out = ["--only-binary=:all:"]
    for tag in manylinux_platforms(platform):
        out += ["--platform", tag]
    return [*out, "--python-version", python_version, "--implementation", "cp"]


def project_requirements(
    extras: Iterable[str], pyproject: Path = PYPROJECT
) -> dict[str, tuple[str, ...]]:
    """spottrain's requirements from ``pyproject``: ``""`` for the core, and each of
    ``extras`` by name.

    Raises:
        ValueError: an extra the project does not declare.
    """
    project = tomllib.loads(pyproject.read_text())["project"]
    optional: Mapping[str, list[str]] = project.get("optional-dependencies", {})
    unknown = sorted(set(extras) - set(optional))
    if unknown:
        raise ValueError(f"{pyproject} declares no extra {', '.join(unknown)}")
    out = {"": tuple(project.get("dependencies", []))}
    out.update({e: tuple(optional[e]) for e in extras})
    return out


def agent_requirements(
    extra_sets: Iterable[Sequence[str]] = AGENT_EXTRAS, pyproject: Path = PYPROJECT
) -> list[str]:
    """The requirements of spottrain's core and of every extra in ``extra_sets``, once each,
    in the order ``pyproject`` lists them."""
    extras = list(dict.fromkeys(e for s in extra_sets for e in s))
    by_extra = project_requirements(extras, pyproject)
    return list(dict.fromkeys(r for reqs in by_extra.values() for r in reqs))


def installed_versions(venv: Path) -> dict[str, str]:
    """Each distribution installed in ``venv`` (by normalized name) at its version, spottrain
    (editable, or not) left out.

    Raises:
        WheelFolderError: ``venv`` has no site-packages.
    """
    sites = sorted(venv.glob("lib/python3*/site-packages"))
    if not sites:
        raise WheelFolderError(f"{venv} is not a venv: it has no lib/python3*/site-packages")
    out: dict[str, str] = {}
    for dist in metadata.distributions(path=[str(s) for s in sites]):
        name = dist.metadata["Name"]
        if name:
            out.setdefault(normalize(name), dist.version)
    out.pop(NEVER_SERVED, None)
    return out


def wheel_name_version(filename: str) -> tuple[str, str]:
    """The normalized project name and the version a wheel's file name gives.

    Raises:
        ValueError: not a wheel's file name.
    """
    parts = filename.removesuffix(".whl").split("-")
    if not filename.endswith(".whl") or len(parts) not in (5, 6):
        raise ValueError(f"{filename!r} is not a wheel's file name")
    return normalize(parts[0]), parts[1]


def sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@dataclass(frozen=True)
class Wheel:
    """One file of a wheel folder."""

    name: str  # normalized
    version: str
    filename: str
    sha256: str
    size: int


@dataclass(frozen=True)
class WheelFolder:
    """A folder that :func:`assemble_wheels` made, and what its manifest says it holds."""

    path: Path
    wheels: tuple[Wheel, ...]
    # Packages the venv cannot hold: needed only below its Python's patch release.
    older_patches_only: tuple[str, ...] = ()

    def versions(self) -> dict[str, str]:
        return {w.name: w.version for w in self.wheels}

    def total_size(self) -> int:
        return sum(w.size for w in self.wheels)


def assemble_wheels(
    cache_dir: Path,
    *,
    venv: Path | None = None,
    pip_python: Path | None = None,
    requirements: Sequence[str] | None = None,
    local_dirs: Sequence[Path] = LOCAL_WHEEL_DIRS,
    index_url: str = PYPI,
    python_version: str = PYTHON_VERSION,
    platform: str = PLATFORM,
    timeout_s: float = 1200.0,
) -> WheelFolder:
    """The folder of the wheels ``requirements`` need (default: spottrain's core and its
    ``agent``, ``aws``, ``gcp`` and ``replica`` extras) at the versions installed in ``venv``
    (default: the venv running this), for CPython ``python_version`` on ``platform``, with
    the pip of ``pip_python`` (default: the venv's python).

    The folder is ``cache_dir/wheels-<key>``, the key a hash of the venv's versions, the
    requirements, the target and ``index_url``: a call finds it made and returns at once, and
    a change of versions makes another. It is built in a temporary folder beside it and
    renamed into place once complete, under a lock file, so concurrent callers build it once
    and an interrupted build leaves nothing that is taken for a folder (its leftovers are
    removed by the next build of that key).

    Packages that only older patch releases of ``python_version`` need (see
    :func:`older_patch_needs`) are added at their newest release; the manifest lists them
    (``older_patches_only``).

    Raises:
        WheelFolderError: pip cannot resolve or download the set, or the resolution strays
            from the venv (another version, a package the venv lacks but for those, an
            ``nvidia-*`` one, spottrain itself), or a file's sha256 is not the one pip chose.
    """
    venv = Path(sys.prefix) if venv is None else venv
    python = venv / "bin" / "python" if pip_python is None else pip_python
    reqs = agent_requirements() if requirements is None else list(requirements)
    installed = installed_versions(venv)
    key_data = {
        "format": _FORMAT,
        "requirements": sorted(reqs),
        "installed": sorted(installed.items()),
        "target": [python_version, platform],
        "index_url": index_url,
    }
    key = hashlib.sha256(json.dumps(key_data).encode()).hexdigest()[:16]
    final = cache_dir / f"wheels-{key}"
    found = _read_folder(final)
    if found is not None:
        return found
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(cache_dir / f".wheels-{key}.lock"):
        found = _read_folder(final)
        if found is not None:  # another process built it while this one waited
            return found
        for stale in cache_dir.glob(f".tmp-wheels-{key}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-wheels-{key}-", dir=cache_dir))
        try:
            builder = _Builder(
                venv, python, installed, local_dirs, index_url, python_version, timeout_s
            )
            wheels = builder.build(tmp, reqs, target_args(python_version, platform))
            manifest = {
                **key_data,
                "key": key,
                "older_patches_only": sorted(builder.older_only),
                "wheels": [w.__dict__ for w in wheels],
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
            tmp.chmod(0o755)  # mkdtemp's 0700: the folder is read by whoever serves it
            if final.exists():  # a folder without a complete manifest: not one of ours
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return WheelFolder(final, tuple(wheels), tuple(sorted(builder.older_only)))


def _read_folder(path: Path) -> WheelFolder | None:
    """The folder at ``path`` if its manifest is complete and every file it lists is there at
    its size; else None."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        if manifest.get("format") != _FORMAT:
            return None
        wheels = tuple(Wheel(**w) for w in manifest["wheels"])
        if any((path / w.filename).stat().st_size != w.size for w in wheels):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return WheelFolder(path, wheels, tuple(manifest["older_patches_only"]))


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    # flock: released by the kernel when a holder dies, so an interrupted build frees it.
    with lock_path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@dataclass(frozen=True)
class _Chosen:
    name: str
    version: str
    filename: str
    sha256: str
    url: str


def _chosen_of(item: Mapping[str, Any]) -> _Chosen:
    """One ``install`` item of pip's report."""
    meta, info = item.get("metadata", {}), item.get("download_info") or {}
    url = str(info.get("url", ""))
    sha = (info.get("archive_info") or {}).get("hashes", {}).get("sha256", "")
    filename = unquote(urlsplit(url).path.rsplit("/", 1)[-1])
    return _Chosen(
        normalize(str(meta.get("name", ""))), str(meta.get("version", "")), filename, sha, url
    )


def older_patch_needs(
    items: Sequence[Mapping[str, Any]],
    requirements: Sequence[str],
    python_version: str,
    have: set[str],
) -> list[str]:
    """What the packages of pip's report ``items`` require on ``<python_version>.0`` but not on
    the interpreter running this (pip evaluates markers there, whatever ``--python-version``
    says), and that ``have`` lacks: e.g. redis's ``async-timeout; python_full_version <
    '3.11.3'``, which a VM's Python 3.11.2 (Debian 12's) needs. Markers are evaluated with
    the extras each package is required with (from ``requirements`` and ``items``)."""
    here = {k: str(v) for k, v in default_environment().items()}
    low = {**here, "python_version": python_version}
    low["python_full_version"] = low["implementation_version"] = f"{python_version}.0"
    requires = {normalize(i["metadata"]["name"]): _requires(i) for i in items}
    extras: dict[str, set[str]] = {name: {""} for name in requires}
    for r in requirements:
        with contextlib.suppress(InvalidRequirement):
            req = Requirement(r)
            extras.setdefault(normalize(req.name), {""}).update(req.extras)
    grown = True
    while grown:  # extras that required packages pass on to theirs
        grown = False
        for name, reqs in requires.items():
            for req in reqs:
                dep = extras.setdefault(normalize(req.name), {""})
                if _holds(req, here, extras[name]) and not req.extras <= dep:
                    dep.update(req.extras)
                    grown = True
    out = set()
    for name, reqs in requires.items():
        for req in reqs:
            if normalize(req.name) in have or req.marker is None:
                continue
            if _holds(req, low, extras[name]) and not _holds(req, here, extras[name]):
                bare = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
                out.add(f"{req.name}{bare}{req.specifier}")
    return sorted(out)


def _requires(item: Mapping[str, Any]) -> list[Requirement]:
    out = []
    for r in item.get("metadata", {}).get("requires_dist") or []:
        with contextlib.suppress(InvalidRequirement):
            out.append(Requirement(r))
    return out


def _holds(req: Requirement, env: Mapping[str, str], extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": e}) for e in extras)


class _Builder:
    def __init__(
        self,
        venv: Path,
        python: Path,
        installed: Mapping[str, str],
        local_dirs: Sequence[Path],
        index_url: str,
        python_version: str,
        timeout_s: float,
    ) -> None:
        self.venv = venv
        self.python = python
        self.installed = installed
        self.local_dirs = [d for d in local_dirs if d.is_dir()]
        self.index_url = index_url
        self.python_version = python_version
        self.timeout_s = timeout_s
        # What the venv cannot have: needed only below its Python's patch release.
        self.older_only: set[str] = set()

    def build(self, dest: Path, reqs: Sequence[str], target: Sequence[str]) -> list[Wheel]:
        with tempfile.TemporaryDirectory(prefix="spottrain-box-wheels-") as tmp:
            work = Path(tmp)
            chosen = self._resolve(work, reqs, target)
            wanted = []
            for c in chosen:
                local = self._local_file(c)
                if local is None:
                    wanted.append(c)
                else:
                    shutil.copyfile(local, dest / c.filename)
            if wanted:
                self._download(work, dest, wanted, target)
        return self._verify(dest, chosen)

    def _resolve(self, work: Path, reqs: Sequence[str], target: Sequence[str]) -> list[_Chosen]:
        """pip's choice for ``reqs``, then for what only older patch releases of the target
        Python need (pip evaluates markers on the interpreter it runs on), until nothing more
        is needed."""
        pins = dict(self.installed)
        constraints = work / "constraints.txt"
        links = work / "links"
        links.mkdir()
        for path in self._local_builds():
            (links / path.name).symlink_to(path)
        # Not --quiet: pip says why a resolution is impossible at its normal verbosity only.
        args = ["install", "--dry-run", "--ignore-installed"]
        args += [*target, "--index-url", self.index_url, "--find-links", str(links)]
        chosen: dict[str, _Chosen] = {}
        items: list[Mapping[str, Any]] = []
        ask = list(reqs)
        for round_ in range(5):
            constraints.write_text("".join(f"{n}=={v}\n" for n, v in sorted(pins.items())))
            report = work / f"report-{round_}.json"
            what = "resolve " + ", ".join(ask)
            self._pip([*args, "--report", str(report), "-c", str(constraints), *ask], what)
            for item in json.loads(report.read_text()).get("install", []):
                c = _chosen_of(item)
                if c.name not in chosen:
                    chosen[c.name] = c
                    items.append(item)
                    pins.setdefault(c.name, c.version)
                    if round_:
                        self.older_only.add(c.name)
            ask = older_patch_needs(items, reqs, self.python_version, set(chosen))
            if not ask:
                break
        self._check(list(chosen.values()))
        return list(chosen.values())

    def _local_builds(self) -> list[Path]:
        """Wheels in the local folders of the venv's local versions (``2.13.0+cpu``), which
        no public index has: pip finds them by these links."""
        local = {n: v for n, v in self.installed.items() if "+" in v}
        out = []
        for d in self.local_dirs:
            for path in sorted(d.glob("*.whl")):
                with contextlib.suppress(ValueError):
                    name, version = wheel_name_version(path.name)
                    if local.get(name) == version:
                        out.append(path)
        return out

    def _check(self, chosen: Sequence[_Chosen]) -> None:
        problems = []
        for c in chosen:
            have = self.installed.get(c.name)
            if c.name == NEVER_SERVED or c.name.startswith("nvidia-"):
                problems.append(f"{c.name} {c.version} (never in the box's index)")
            elif have is None and c.name not in self.older_only:
                problems.append(f"{c.name} {c.version} (not installed in {self.venv})")
            elif have is not None and have != c.version:
                problems.append(f"{c.name} {c.version} (the venv has {have})")
            elif not c.sha256 or not c.filename.endswith(".whl"):
                problems.append(f"{c.name} {c.version} from {c.url} (not a hashed wheel)")
        if problems:
            raise WheelFolderError(
                "the resolution strays from the venv: " + "; ".join(problems) + ": run "
                "scripts/setup so the venv holds what spottrain's extras need, and make sure "
                "no nvidia-* wheel is asked for (torch must be the local CPU build)"
            )

    def _local_file(self, c: _Chosen) -> Path | None:
        if urlsplit(c.url).scheme == "file":
            return Path(unquote(urlsplit(c.url).path))
        for d in self.local_dirs:
            path = d / c.filename
            if path.is_file() and sha256_file(path) == c.sha256:
                return path
        return None

    def _download(
        self, work: Path, dest: Path, wanted: Sequence[_Chosen], target: Sequence[str]
    ) -> None:
        hashed = work / "download.txt"
        hashed.write_text(
            "".join(f"{c.name}=={c.version} --hash=sha256:{c.sha256}\n" for c in wanted)
        )
        args = ["download", "--no-deps", "--require-hashes", *target]
        args += ["--index-url", self.index_url, "--dest", str(dest), "-r", str(hashed)]
        self._pip(args, f"download {len(wanted)} wheels")

    def _verify(self, dest: Path, chosen: Sequence[_Chosen]) -> list[Wheel]:
        wheels = []
        for c in chosen:
            path = dest / c.filename
            got = sha256_file(path) if path.is_file() else "(no file)"
            if got != c.sha256:
                raise WheelFolderError(
                    f"{c.filename}: sha256 {got}, but pip chose the file of sha256 {c.sha256}"
                )
            wheels.append(Wheel(c.name, c.version, c.filename, c.sha256, path.stat().st_size))
        extra = sorted({p.name for p in dest.iterdir()} - {c.filename for c in chosen})
        if extra:
            raise WheelFolderError(f"pip left files nobody chose in {dest}: {', '.join(extra)}")
        return sorted(wheels, key=lambda w: w.name)

    def _pip(self, args: Sequence[str], what: str) -> None:
        # No configuration of this machine's (pip.conf, /etc/xdg/pip's torch cap, PIP_*
        # variables) reaches pip: only what is passed here.
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
        env["PIP_CONFIG_FILE"] = os.devnull
        cmd = [str(self.python), "-m", "pip", "--disable-pip-version-check", "--no-input"]
        cmd += ["--timeout", _PIP_TIMEOUT_S, *args]
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, env=env, timeout=self.timeout_s
            )
        except subprocess.TimeoutExpired:
            raise WheelFolderError(f"pip ran past {self.timeout_s:g} s to {what}") from None
        if proc.returncode != 0:
            said = "\n".join(p.strip() for p in (proc.stdout, proc.stderr) if p.strip())[-3000:]
            local = ", ".join(f"{n} {v}" for n, v in self.installed.items() if "+" in v)
            where = ", ".join(map(str, self.local_dirs)) or "no local folder"
            raise WheelFolderError(
                f"pip could not {what} (exit {proc.returncode}): {said}\n"
                f"(index {self.index_url}; local builds of the venv ({local or 'none'}) are "
                f"looked for in {where})"
            )


# The index.


@dataclass(frozen=True)
class IndexedFile:
    """A wheel :class:`LocalIndex` serves: its project, version, sha256, and core metadata
    (served as ``<file>.metadata``, PEP 658)."""

    project: str  # normalized
    version: str
    filename: str
    path: Path
    sha256: str
    requires_python: str | None
    metadata: bytes

    @property
    def metadata_sha256(self) -> str:
        return hashlib.sha256(self.metadata).hexdigest()


def scan_wheels(folder: Path) -> dict[str, IndexedFile]:
    """Every wheel in ``folder`` by file name, spottrain's left out.

    Raises:
        ValueError: a ``.whl`` that is not a wheel (its name, or no METADATA inside).
    """
    out = {}
    for path in sorted(folder.glob("*.whl")):
        project, version = wheel_name_version(path.name)
        if project == NEVER_SERVED:
            continue
        with zipfile.ZipFile(path) as z:
            entries = [n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
            # <name>-<version>.dist-info/METADATA: the wheel's own (a vendored one aside).
            dirs = {n: n.split("/")[0].removesuffix(".dist-info") for n in entries}
            ours = [n for n, d in dirs.items() if normalize(d.rsplit("-", 1)[0]) == project]
            if not ours:
                raise ValueError(f"{path}: no {project} .dist-info/METADATA inside")
            meta = z.read(ours[0])
        requires = HeaderParser().parsestr(meta.decode("utf-8", "replace")).get("Requires-Python")
        out[path.name] = IndexedFile(
            project, version, path.name, path, sha256_file(path), requires, meta
        )
    return out


class _IndexHandler(DispatchingHandler, methods=("GET", "HEAD")):
    pass


class LocalIndex:
    """A folder of wheels served over HTTP as a PEP 503 simple repository, on ``host`` and a
    free port (or ``port``), one thread per connection:

    - ``/simple/``: every project; ``/simple/<normalized name>/``: its files, each anchor
      ``/files/<file>#sha256=<hex>`` with ``data-requires-python`` (where the wheel's
      metadata has ``Requires-Python``) and ``data-core-metadata`` (PEP 658/714: pip 23.3
      and newer read ``/files/<file>.metadata`` instead of downloading the wheel to
      resolve);
    - ``/files/<file>``: the file, sent from disk with ``sendfile`` (never read whole).

    spottrain is never served, even if its wheel is in the folder; nor is a project named in
    ``missing`` (answered 404, and left out of ``/simple/``). The folder is read once, on
    construction. The port is bound on construction, so ``url`` is known before start().

    pip trusts plain HTTP on loopback only: a pip that reaches the index at another address
    (a box VM on its own network) needs ``--trusted-host <host>`` or ignores the index.

    Raises (on construction):
        ValueError: a ``.whl`` in the folder that is not a wheel.
        OSError: the address cannot be bound.
    """

    def __init__(self, folder: Path, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.folder = folder
        self.missing: set[str] = set()
        self._files = scan_wheels(folder)
        self._projects: dict[str, list[IndexedFile]] = {}
        for f in self._files.values():
            self._projects.setdefault(f.project, []).append(f)
        self._requests: list[str] = []
        self._lock = threading.Lock()
        self._server = QuietHTTPServer((host, port), _IndexHandler)
        self._server.fake = self
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="box-local-index",
            daemon=True,
        )

    @property
    def host(self) -> str:
        return str(self._server.server_address[0])

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """The simple repository's URL, for ``--index-url``."""
        return f"http://{self.host}:{self.port}/simple"

    @property
    def files(self) -> Mapping[str, IndexedFile]:
        """Every file it serves (those of ``missing`` projects included), by file name."""
        return dict(self._files)

    def file_url(self, filename: str) -> str:
        return f"http://{self.host}:{self.port}/files/{quote(filename)}"

    @property
    def requests(self) -> list[str]:
        """The path of every request so far, in order."""
        with self._lock:
            return list(self._requests)

    def count(self, path_prefix: str) -> int:
        """How many requests so far had a path starting with ``path_prefix``."""
        return sum(1 for p in self.requests if p.startswith(path_prefix))

    def start(self) -> Self:
        self._thread.start()
        return self

    def close(self) -> None:
        # shutdown() waits for serve_forever to return, forever if it never started.
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _served(self, project: str) -> list[IndexedFile] | None:
        refused = {normalize(m) for m in self.missing} | {NEVER_SERVED}
        return None if project in refused else self._projects.get(project)

    def _handle(self, handler: Any, method: str) -> None:
        path = unquote(urlsplit(handler.path).path)
        with self._lock:
            self._requests.append(path)
        if path in ("/simple", "/simple/"):
            names = sorted(p for p in self._projects if self._served(p) is not None)
            return _send(handler, method, 200, _root_page(names))
        m = re.fullmatch(r"/simple/([^/]+)/?", path)
        if m:
            files = self._served(normalize(m[1]))
            if files is None:
                return _send(handler, method, 404, f"no project {m[1]} here\n", "text/plain")
            return _send(handler, method, 200, _project_page(normalize(m[1]), files))
        m = re.fullmatch(r"/files/([^/]+?)(\.metadata)?", path)
        f = self._files.get(m[1]) if m else None
        if m and f is not None and self._served(f.project) is not None:
            if m[2]:
                return _send(handler, method, 200, f.metadata, "application/octet-stream")
            return _send_file(handler, method, f.path)
        return _send(handler, method, 404, f"nothing at {path}\n", "text/plain")


def _root_page(names: Sequence[str]) -> str:
    links = "".join(f'<a href="{quote(n)}/">{html.escape(n)}</a>\n' for n in names)
    return _page("Simple index", links)


def _project_page(project: str, files: Sequence[IndexedFile]) -> str:
    links = []
    for f in sorted(files, key=lambda f: f.filename):
        attrs = f'href="/files/{quote(f.filename)}#sha256={f.sha256}"'
        if f.requires_python:
            attrs += f' data-requires-python="{html.escape(f.requires_python)}"'
        # PEP 714's name only: pip 22.3 to 23.0 (Debian 12's venvs have 23.0.1) read the older
        # data-dist-info-metadata and then refuse a wheel whose metadata spells its name
        # otherwise (PyYAML for pyyaml); they download the wheel instead.
        attrs += f' data-core-metadata="sha256={f.metadata_sha256}"'
        links.append(f"<a {attrs}>{html.escape(f.filename)}</a><br>\n")
    return _page(f"Links for {project}", "".join(links))


def _page(title: str, body: str) -> str:
    return (
        '<!DOCTYPE html>\n<html><head><meta name="pypi:repository-version" content="1.0">'
        f"<title>{html.escape(title)}</title></head>\n<body>\n<h1>{html.escape(title)}</h1>\n"
        f"{body}</body></html>\n"
    )


def _send(
    handler: Any,
    method: str,
    status: int,
    body: str | bytes,
    content_type: str = "text/html; charset=utf-8",
) -> None:
    data = body.encode() if isinstance(body, str) else body
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    if method != "HEAD":
        handler.wfile.write(data)


def _send_file(handler: Any, method: str, path: Path) -> None:
    with path.open("rb") as f:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/octet-stream")
        handler.send_header("Content-Length", str(os.fstat(f.fileno()).st_size))
        handler.end_headers()  # written to the socket at once: the handler's writes are unbuffered
        if method != "HEAD":
            handler.connection.sendfile(f)

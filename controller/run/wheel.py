"""The wheel of the very spottrain this controller runs, which a run ships to its VMs.

No package index needs to carry spottrain: ``spottrain up`` (and ``spottrain lock``) build the
wheel of the running copy, pin it by its sha256 in the run's lock, and put it in the run's
object store beside the code archive; every VM installs exactly those bytes. The wheel is
built here, without pip, setuptools or a download:

- **from a checkout** (the ``spottrain`` package sits beside a ``pyproject.toml`` that names
  it, as in an editable install or a ``PYTHONPATH`` run): the files setuptools would put in
  a wheel (the packages ``[tool.setuptools]`` lists, mapped by ``package-dir``, their ``.py``
  files and ``package-data``) and metadata made from ``[project]``;
- **from an installed copy** (site-packages): the files its ``RECORD`` lists under
  ``spottrain/`` and its own ``METADATA`` (headers only) and ``entry_points.txt``.

The same source gives the same bytes: entries sorted, every timestamp 1980-01-01, modes
normalised, one compression level. A wheel is kept in ``$SPOTTRAIN_HOME/wheels/<key>/``,
``key`` a hash of every file's name and content and the metadata, so an unchanged source
reuses it without building (the way SkyPilot keys the wheel it ships to its clusters by a
hash of the package's files). Concurrent builders write the same bytes and rename into
place, so a race costs only time.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import re
import tomllib
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from importlib import metadata
from pathlib import Path
from typing import Any

DIST = "spottrain"
TAG = "py3-none-any"
# Changing how wheels are laid out changes this, so no wheel of an older layout is reused.
BUILDER = "spottrain-wheel-1"
_EPOCH = (1980, 1, 1, 0, 0, 0)
_SKIP_DIRS = {"__pycache__"}


class WheelError(Exception):
    """The running spottrain cannot be made into a wheel; the message says why."""


@dataclass(frozen=True)
class WheelSource:
    """What goes into the wheel: files by their path in it, and the dist-info texts."""

    version: str
    files: Mapping[str, Path]
    metadata_text: str
    entry_points: str
    origin: str  # "checkout <dir>" or "installed <dir>", for messages

    def key(self) -> str:
        """A hash of everything that decides the wheel's bytes."""
        h = hashlib.sha256(BUILDER.encode())
        for arc in sorted(self.files):
            h.update(b"\0" + arc.encode() + b"\0")
            h.update(hashlib.sha256(self.files[arc].read_bytes()).digest())
        h.update(b"\0metadata\0" + self.metadata_text.encode())
        h.update(b"\0entry_points\0" + self.entry_points.encode())
        return h.hexdigest()


@dataclass(frozen=True)
class SelfWheel:
    """A built wheel of spottrain: its file, sha256 and version."""

    path: Path
    sha256: str
    version: str
    origin: str

    @property
    def filename(self) -> str:
        return self.path.name

    @property
    def file_url(self) -> str:
        return self.path.resolve().as_uri()


def wheel_filename(version: str) -> str:
    return f"{DIST}-{version}-{TAG}.whl"


# --- the source --------------------------------------------------------------------------------
def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise WheelError(f"cannot find the package {name} this controller runs")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def find_source() -> WheelSource:
    """The source of the running spottrain: its checkout, or its installed copy.

    Raises:
        WheelError: neither can be read (the message says what is missing).
    """
    top = _package_dir(DIST)
    pyproject = top.parent / "pyproject.toml"
    if pyproject.is_file():
        data = tomllib.loads(pyproject.read_text())
        if data.get("project", {}).get("name") == DIST:
            return checkout_source(top.parent, data)
    return installed_source(top.parent)


def checkout_source(root: Path, pyproject: Mapping[str, Any]) -> WheelSource:
    """The wheel's source in a checkout, as setuptools would build it from ``pyproject``."""
    project = pyproject["project"]
    tool = pyproject.get("tool", {}).get("setuptools", {})
    packages: Sequence[str] = tool.get("packages") or []
    if not packages:
        raise WheelError(f"{root / 'pyproject.toml'} lists no [tool.setuptools] packages")
    dirs: Mapping[str, str] = tool.get("package-dir", {})
    data: Mapping[str, Sequence[str]] = tool.get("package-data", {})
    files: dict[str, Path] = {}
    for pkg in packages:
        folder = root / _mapped(pkg, dirs)
        if not folder.is_dir():
            raise WheelError(f"package {pkg}: {folder} is not a folder")
        arc_dir = pkg.replace(".", "/")
        patterns = ["*.py", *data.get(pkg, ())]
        for f in sorted(folder.iterdir()):
            if f.is_file() and any(fnmatch(f.name, p) for p in patterns):
                files[f"{arc_dir}/{f.name}"] = f
    return WheelSource(
        version=str(project["version"]),
        files=files,
        metadata_text=_metadata_from_project(project),
        entry_points=_entry_points_from_project(project),
        origin=f"checkout {root}",
    )


def _mapped(pkg: str, dirs: Mapping[str, str]) -> str:
    """The folder of a package, through the longest ``package-dir`` prefix mapping it."""
    parts = pkg.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in dirs:
            return "/".join([dirs[prefix], *parts[n:]]).lstrip("/")
    return "/".join(parts)


def _metadata_from_project(project: Mapping[str, Any]) -> str:
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {project['name']}",
        f"Version: {project['version']}",
    ]
    if project.get("description"):
        lines.append(f"Summary: {project['description']}")
    if isinstance(project.get("license"), str):
        lines.append(f"License: {project['license']}")
    if project.get("requires-python"):
        lines.append(f"Requires-Python: {project['requires-python']}")
    lines += [f"Requires-Dist: {r}" for r in project.get("dependencies", ())]
    for extra, reqs in project.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        lines += [f"Requires-Dist: {_with_extra(r, extra)}" for r in reqs]
    return "\n".join(lines) + "\n"


def _with_extra(req: str, extra: str) -> str:
    spec, sep, marker = req.partition(";")
    cond = f'extra == "{extra}"'
    return f"{spec.strip()}; ({marker.strip()}) and {cond}" if sep else f"{spec.strip()}; {cond}"


def _entry_points_from_project(project: Mapping[str, Any]) -> str:
    groups: dict[str, Mapping[str, str]] = {}
    if project.get("scripts"):
        groups["console_scripts"] = project["scripts"]
    groups.update(project.get("entry-points", {}))
    out = []
    for group in sorted(groups):
        out.append(f"[{group}]")
        out += [f"{k} = {v}" for k, v in sorted(groups[group].items())]
        out.append("")
    return "\n".join(out)


def installed_source(site: Path) -> WheelSource:
    """The wheel's source in an installed copy under ``site`` (its RECORD's files)."""
    dists = [d for d in metadata.distributions(path=[str(site)]) if d.metadata["Name"] == DIST]
    if not dists:
        raise WheelError(
            f"spottrain at {site} is neither a checkout (no pyproject.toml beside it) nor an "
            "installed distribution (no spottrain-*.dist-info): reinstall it with pip"
        )
    dist = dists[0]
    files: dict[str, Path] = {}
    for rel in dist.files or ():
        parts = rel.parts
        if not parts or parts[0] != DIST or _SKIP_DIRS & set(parts) or rel.suffix == ".pyc":
            continue
        path = Path(str(dist.locate_file(rel)))
        if path.is_file():
            files["/".join(parts)] = path
    if not files:
        raise WheelError(f"the installed spottrain at {site} lists no files in its RECORD")
    head = (dist.read_text("METADATA") or "").split("\n\n", 1)[0]
    if not head.strip():
        raise WheelError(f"the installed spottrain at {site} has no METADATA")
    return WheelSource(
        version=dist.version,
        files=files,
        metadata_text=head.rstrip("\n") + "\n",
        entry_points=dist.read_text("entry_points.txt") or "",
        origin=f"installed {site}",
    )


# --- the wheel ---------------------------------------------------------------------------------
def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def _entry(arc: str, data: bytes, executable: bool = False) -> tuple[zipfile.ZipInfo, bytes]:
    info = zipfile.ZipInfo(arc, date_time=_EPOCH)
    info.create_system = 3  # unix, so external_attr is read as a mode
    info.external_attr = ((0o100755 if executable else 0o100644) & 0xFFFF) << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    return info, data


def build_wheel(source: WheelSource, out_dir: Path) -> Path:
    """Write the wheel of ``source`` into ``out_dir`` (deterministic bytes); returns its path."""
    dist_info = f"{DIST}-{source.version}.dist-info"
    entries = [
        _entry(arc, source.files[arc].read_bytes(), os.access(source.files[arc], os.X_OK))
        for arc in sorted(source.files)
    ]
    meta = {
        f"{dist_info}/METADATA": source.metadata_text.encode(),
        f"{dist_info}/WHEEL": (
            f"Wheel-Version: 1.0\nGenerator: {BUILDER}\nRoot-Is-Purelib: true\nTag: {TAG}\n"
        ).encode(),
    }
    if source.entry_points.strip():
        meta[f"{dist_info}/entry_points.txt"] = source.entry_points.encode()
    entries += [_entry(arc, data) for arc, data in sorted(meta.items())]
    record = [f"{i.filename},{_record_hash(d)},{len(d)}" for i, d in entries]
    record.append(f"{dist_info}/RECORD,,")
    entries.append(_entry(f"{dist_info}/RECORD", ("\n".join(record) + "\n").encode()))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / wheel_filename(source.version)
    tmp = out_dir / f".{path.name}.{os.getpid()}.part"
    with zipfile.ZipFile(tmp, "w") as z:
        for info, data in entries:
            z.writestr(info, data, compresslevel=6)
    os.replace(tmp, path)
    return path


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def self_wheel(cache_dir: Path, source: WheelSource | None = None) -> SelfWheel:
    """The wheel of the running spottrain (or of ``source``), built into ``cache_dir`` or
    reused from there.

    Raises:
        WheelError: the source cannot be read.
    """
    src = source or find_source()
    folder = cache_dir / src.key()[:32]
    path = folder / wheel_filename(src.version)
    if not path.is_file():
        build_wheel(src, folder)
    return SelfWheel(path, file_sha256(path), src.version, src.origin)


def wheel_names(path: Path) -> Iterable[str]:
    """The names inside a wheel (for tests and ``status``)."""
    with zipfile.ZipFile(path) as z:
        return z.namelist()


_NAME_RE = re.compile(r"^spottrain-(?P<version>[^-]+)-py3-none-any\.whl\Z")


def version_of(filename: str) -> str | None:
    """The version in a spottrain wheel's file name, or None if it is not one."""
    m = _NAME_RE.match(filename)
    return m["version"] if m else None

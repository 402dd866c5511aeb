"""The agent's environment lock: every package a node's venv holds, pinned by version and by
the sha256 of the wheel, so a node backfilled a week later runs exactly what the others run.

The lock is a pip requirements file that ``pip install --require-hashes --no-deps -r LOCK``
installs as is::

    # spottrain environment lock
    # target: python 3.11 cp manylinux_2_28_x86_64
    # requires: spottrain[agent,aws]==0.1.0
    numpy==2.1.0 --hash=sha256:<64 hex>
    torch==2.14.0 --hash=sha256:<64 hex>

one line per package (canonical name, sorted), one or more hashes each; a package a direct
URL names is ``name @ URL --hash=...``. The header says what was locked and for which
target; nothing reads it back but people (a VM's boot carries the lock's sha256, never its
text). A line with a control character, the header's too, is refused.

``spottrain.controller.run.env_lock`` makes the lock at ``spottrain up`` (or ``spottrain lock``);
a VM's boot script installs it and then runs ``python -m spottrain.envlock verify LOCK``,
which compares the venv's installed distributions with the lock and exits 1 naming each
package that differs (missing, or at another version).
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata

from spottrain.safetext import LINE_CONTROLS

HEADER = "# spottrain environment lock"
_HASH = re.compile(r"^sha256:[0-9a-f]{64}$")
_LINE = re.compile(
    r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)\s*"
    r"(?:==\s*(?P<version>[^\s;@]+)|@\s*(?P<url>\S+))\s*(?P<rest>.*)$"
)


class LockError(ValueError):
    """A lock file that cannot be read, or a resolution that cannot become one."""


def canonical_name(name: str) -> str:
    """PEP 503's normalized name: lower case, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class LockedPackage:
    """One line of a lock: a package at one version with the hashes of its files."""

    name: str
    version: str
    hashes: tuple[str, ...]
    url: str = ""

    def line(self) -> str:
        pin = f"{self.name} @ {self.url}" if self.url else f"{self.name}=={self.version}"
        return " ".join([pin, *(f"--hash={h}" for h in self.hashes)])


@dataclass(frozen=True)
class EnvLock:
    """A whole lock: its packages by canonical name, and the header's description."""

    packages: tuple[LockedPackage, ...]
    target: str = ""
    requires: tuple[str, ...] = field(default_factory=tuple)

    def text(self) -> str:
        head = [HEADER]
        if self.target:
            head.append(f"# target: {self.target}")
        head += [f"# requires: {r}" for r in self.requires]
        body = [p.line() for p in sorted(self.packages, key=lambda p: p.name)]
        return "\n".join(head + body) + "\n"

    def versions(self) -> dict[str, str]:
        return {p.name: p.version for p in self.packages}


def lock_sha256(text: str) -> str:
    """The lock's identity: the sha256 of its text (what a VM's venv records)."""
    return hashlib.sha256(text.encode()).hexdigest()


def make_lock(
    packages: Iterable[LockedPackage], *, target: str = "", requires: Sequence[str] = ()
) -> EnvLock:
    """A lock of ``packages`` (names made canonical, each hash checked).

    Raises:
        LockError: a package twice, a hash that is not ``sha256:<64 hex>``, or a control
            character in the header's values or in a package's name, version or URL (the
            lock's text would not read back as this lock).
    """
    for what in (target, *requires):
        if LINE_CONTROLS.search(what):
            raise LockError(f"{what!r}: a lock's header holds no control character")
    seen: dict[str, LockedPackage] = {}
    for p in packages:
        if LINE_CONTROLS.search(p.name + p.version + p.url):
            raise LockError(
                f"{p.name!r}: a package's name, version or URL holds a control character"
            )
        name = canonical_name(p.name)
        if name in seen:
            raise LockError(f"{name} is in the lock twice")
        if not p.hashes:
            raise LockError(f"{name}=={p.version}: no sha256 hash")
        for h in p.hashes:
            if not _HASH.match(h):
                raise LockError(f"{name}=={p.version}: {h!r} is not a sha256:<64 hex> hash")
        seen[name] = LockedPackage(name, p.version, tuple(sorted(set(p.hashes))), p.url)
    return EnvLock(tuple(sorted(seen.values(), key=lambda p: p.name)), target, tuple(requires))


def parse_lock(text: str, source: str = "the lock") -> EnvLock:
    """Read a lock file back.

    Raises:
        LockError: a line is not ``name==version --hash=sha256:...``, or a line (a header's
            comment too) holds a control character (the message names the line).
    """
    target, requires, packages = "", [], []
    for n, raw in enumerate(text.splitlines(), 1):
        # A lock is text of printable lines: `spottrain lock` never wrote this one.
        bad = LINE_CONTROLS.search(raw)
        if bad:
            # Named by its escape only: the rest of the line may be a terminal's escape.
            raise LockError(
                f"{source}:{n}: holds the control character {bad.group()!r}, which no lock "
                "has: make it again with `spottrain lock`"
            )
        line = raw.strip()
        if line.startswith("# target:"):
            target = line.partition(":")[2].strip()
            continue
        if line.startswith("# requires:"):
            requires.append(line.partition(":")[2].strip())
            continue
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            raise LockError(f"{source}:{n}: not `name==version --hash=sha256:...`: {line!r}")
        hashes = []
        for opt in m.group("rest").split():
            if not opt.startswith("--hash="):
                raise LockError(f"{source}:{n}: only --hash options belong in a lock: {opt!r}")
            hashes.append(opt.removeprefix("--hash="))
        url = m.group("url") or ""
        version = m.group("version") or ""
        if url:
            version = _version_from_url(url)
        packages.append(LockedPackage(m.group("name"), version, tuple(hashes), url))
    try:
        return make_lock(packages, target=target, requires=requires)
    except LockError as e:
        raise LockError(f"{source}: {e}") from None


def _version_from_url(url: str) -> str:
    """The version in a wheel's file name (``name-1.0-py3-none-any.whl``); empty if none."""
    name = url.rsplit("/", 1)[-1].split("#", 1)[0]
    parts = name.split("-")
    return parts[1] if name.endswith(".whl") and len(parts) >= 5 else ""


def installed_versions(path: Sequence[str] | None = None) -> dict[str, list[str]]:
    """The versions of each distribution installed on ``path`` (default: this interpreter's
    ``sys.path``), by canonical name, in the order import would find them. More than one
    version of a name (a leftover ``.dist-info``, a shadowing copy) makes the environment
    ambiguous, and :func:`differences` names it."""
    out: dict[str, list[str]] = {}
    if path is not None:
        dists = metadata.distributions(path=list(path))
    else:
        dists = metadata.distributions()
    for dist in dists:
        name = dist.metadata["Name"]
        if name:
            versions = out.setdefault(canonical_name(name), [])
            if dist.version not in versions:
                versions.append(dist.version)
    return out


def differences(lock: EnvLock, installed: Mapping[str, Sequence[str]]) -> list[str]:
    """One line per locked package the environment does not hold at exactly the locked
    version (missing, another version, or several versions at once)."""
    out = []
    for p in lock.packages:
        have = list(installed.get(p.name, ()))
        if not have:
            out.append(f"{p.name}: locked {p.version or p.url}, not installed")
        elif p.version and have != [p.version]:
            out.append(f"{p.name}: locked {p.version}, installed {' and '.join(have)}")
    return out


def verify(lock: EnvLock, path: Sequence[str] | None = None) -> list[str]:
    """What differs between the lock and the environment on ``path`` (empty: it matches)."""
    return differences(lock, installed_versions(path))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m spottrain.envlock verify LOCK [--path DIR]``: exit 0 when this
    environment holds every locked package at its version, 1 (naming each that differs)
    when not, 2 on a bad lock file or bad arguments."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) not in (2, 4) or args[0] != "verify" or (len(args) == 4 and args[2] != "--path"):
        print("usage: python -m spottrain.envlock verify LOCK [--path DIR]", file=sys.stderr)
        return 2
    try:
        with open(args[1]) as f:
            lock = parse_lock(f.read(), args[1])
    except (OSError, LockError) as e:
        print(f"spottrain: {e}", file=sys.stderr)
        return 2
    diff = verify(lock, [args[3]] if len(args) == 4 else None)
    if diff:
        print(
            f"spottrain: this environment ({sys.prefix}) does not match the lock {args[1]}: "
            f"{len(diff)} of {len(lock.packages)} packages differ:",
            file=sys.stderr,
        )
        for line in diff:
            print(f"  {line}", file=sys.stderr)
        return 1
    print(f"spottrain: {len(lock.packages)} packages match the lock {args[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The framework a job's integration needs (``train.integration``: hf, accelerate, lightning)
on every node, and the checks of its versions: pure decisions over requirement strings.

Each framework comes from spottrain's extra of the same name (pyproject's
``[project.optional-dependencies]``: the versions the tests ran on). The ranges are read
from spottrain's own metadata by the caller (the shipped wheel's for a lock, this
controller's for its venv) and given here as ``requires``, its ``Requires-Dist`` strings, so
these functions read no file and import no framework. ``sdk`` and ``plain`` need none.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from .code import ImageCode
from .sections import Integration

if TYPE_CHECKING:
    from .job import JobSpec

# The extra each integration installs; its name is the integration's.
FRAMEWORK_EXTRAS = {
    Integration.HF: "hf",
    Integration.ACCELERATE: "accelerate",
    Integration.LIGHTNING: "lightning",
}
# What each extra brings, by distribution name (tests/unit/spottrain/test_spec_frameworks.py
# checks them against pyproject.toml): what a given lock and the local venv must hold even
# where spottrain's metadata cannot be read.
FRAMEWORK_PACKAGES = {
    "hf": ("transformers", "accelerate"),
    "accelerate": ("accelerate",),
    "lightning": ("lightning",),
}


def framework_extra(spec: JobSpec) -> str | None:
    """The spottrain extra the job's integration needs on every node, or None (sdk, plain)."""
    return FRAMEWORK_EXTRAS.get(spec.train.integration)


def extra_requirements(requires: Iterable[str], extra: str) -> list[Requirement]:
    """What spottrain's ``Requires-Dist`` strings (``requires``) name for ``extra`` only."""
    out = []
    for text in requires:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        marker = req.marker
        if marker is None or "extra" not in str(marker):
            continue
        if marker.evaluate({"extra": extra}) and not marker.evaluate({"extra": ""}):
            out.append(req)
    return out


def install_hint(extra: str) -> str:
    """The command that puts ``extra``'s framework, in its range, in a venv."""
    return f"pip install 'spottrain[{extra}]'"


def _candidates(specs: Iterable[SpecifierSet]) -> list[Version]:
    """Versions that stand for every region the specifiers' bounds cut the line into: each
    bound, a version just above it and one just below it, and the extremes."""
    out = [Version("0")]
    for spec in specs:
        for s in spec:
            try:
                v = Version(s.version.removesuffix(".*"))
            except InvalidVersion:
                continue
            rel = list(v.release) + [0] * max(0, 3 - len(v.release))
            out += [v, Version(".".join(map(str, [*rel, 1]))), Version(f"{rel[0] + 1}")]
            if any(rel):
                i = max(n for n, x in enumerate(rel) if x)
                below = [*rel[:i], rel[i] - 1, 999_999]
                out.append(Version(".".join(map(str, below))))
    return out


def specifiers_overlap(a: SpecifierSet, b: SpecifierSet) -> bool:
    """Whether some version satisfies both ``a`` and ``b`` (tried at every bound either
    names, and just above and below it: enough for the ranges requirement files write)."""
    return any(
        a.contains(v, prereleases=True) and b.contains(v, prereleases=True)
        for v in _candidates((a, b))
    )


def requirement_lines(text: str) -> list[Requirement]:
    """The requirements of a ``requirements.txt`` text, as pip reads plain lines: comments,
    options (``-r``, ``--index-url``, ...) and what is not a requirement are skipped."""
    out = []
    for raw in text.splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith(("#", "-")):
            continue
        try:
            out.append(Requirement(line))
        except InvalidRequirement:
            continue
    return out


def range_conflict(
    extra: str,
    requires: Sequence[str],
    job: Sequence[Requirement],
    source: str,
    environments: Sequence[Mapping[str, str]] = (),
) -> str | None:
    """The first of the job's requirements (``job``, from ``source``) that pins a package of
    ``extra`` outside the extra's range, in one line naming both ranges and the fix; None
    when they agree (pip resolves the rest). A requirement whose marker holds on none of
    ``environments`` (the VMs') is not the VMs'."""
    ranges = {canonicalize_name(r.name): r for r in extra_requirements(requires, extra)}
    for req in job:
        ours = ranges.get(canonicalize_name(req.name))
        if ours is None:
            continue
        marker = req.marker
        if (
            marker is not None
            and environments
            and not any(marker.evaluate(dict(env)) for env in environments)
        ):
            continue
        if specifiers_overlap(ours.specifier, req.specifier):
            continue
        return (
            f"{source}: {req.name}{req.specifier} is outside the range spottrain[{extra}] "
            f"pins ({ours.name}{ours.specifier}, the versions its {extra} integration is "
            f"tested with), which every VM of a train.integration: {extra} job installs: "
            f"change it to {ours.name}{ours.specifier} or remove it"
        )
    return None


def venv_framework_problem(
    extra: str, requires: Sequence[str], installed: Mapping[str, str | None], where: str
) -> str | None:
    """Why a venv whose distributions are at ``installed`` (name to version, None when
    absent) cannot run ``extra``'s integration, in one line, or None. ``where`` says which
    venv (the local cloud's VMs run in the controller's)."""
    ranges = {canonicalize_name(r.name): r for r in extra_requirements(requires, extra)}
    for name in FRAMEWORK_PACKAGES[extra]:
        have = installed.get(name)
        if have is None:
            return (
                f"train.integration: {extra} needs {name} in {where}, which has none: "
                f"install it with {install_hint(extra)}"
            )
        ours = ranges.get(canonicalize_name(name))
        if ours is not None and not ours.specifier.contains(have, prereleases=True):
            return (
                f"train.integration: {extra} needs {name}{ours.specifier} (spottrain[{extra}]: "
                f"the versions its integration is tested with), and {where} has {name} "
                f"{have}: install the range with {install_hint(extra)}"
            )
    return None


def extra_summary(extra: str, requires: Sequence[str]) -> str:
    """``spottrain[hf] (transformers<5.19,>=5.18, accelerate<1.16,>=1.15)``: the extra and
    its ranges (names only where the metadata gave none)."""
    reqs = extra_requirements(requires, extra)
    named = [f"{r.name}{r.specifier}" for r in reqs] or list(FRAMEWORK_PACKAGES[extra])
    return f"spottrain[{extra}] ({', '.join(named)})"


def describe_framework(spec: JobSpec, requires: Sequence[str] = ()) -> str | None:
    """``validate``'s line of what the nodes install for the job's integration (None for sdk
    and plain, which need nothing): the extra and its ranges (``requires``: spottrain's
    ``Requires-Dist``), and where it comes from."""
    extra = framework_extra(spec)
    if extra is None:
        return None
    what = extra_summary(extra, requires)
    names = " and ".join(FRAMEWORK_PACKAGES[extra])
    them = "them" if len(FRAMEWORK_PACKAGES[extra]) > 1 else "it"
    sources = []
    if spec.fleet is not None:
        # The module's boot script installs the VMs' environment, whatever the spec's code.
        sources.append(
            f"each VM installs {what} (the Terraform module's integration variable, or its "
            "env_lock)"
        )
    elif isinstance(spec.code, ImageCode):
        sources.append(
            f"the image must hold {names} (pip install 'spottrain[agent,{extra}]'): nothing "
            f"installs {them} at boot"
        )
    elif set(spec.resources.clouds) - {"local"}:
        sources.append(f"each VM installs {what}, locked with the agent")
    if "local" in spec.resources.clouds and spec.fleet is None:
        sources.append(f"the local VMs run in this venv, which needs {what}")
    return f"framework {names}: " + "; ".join(sources)

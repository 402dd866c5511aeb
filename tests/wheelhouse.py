"""Tiny wheels in a local folder, for tests that run real pip without PyPI.

:func:`build_wheelhouse` writes a stand-in ``spottrain`` (its extras ``agent``, ``aws``,
``gcp`` require the tiny ``alpha``, ``beta``, ``delta`` wheels, and it carries the real
``spottrain/envlock.py``, so a venv built from a lock can verify itself) and a few versions
of each; its framework extras (``hf``, ``accelerate``, ``lightning``) require what
pyproject.toml's do, and stand-ins of those frameworks sit beside them at versions inside
and outside those ranges (the newest outside, so a lock shows whose range won). Point pip
at it with ``--no-index --find-links DIR`` (or ``PIP_NO_INDEX=1``, ``PIP_FIND_LINKS=DIR``).
"""

from __future__ import annotations

import base64
import hashlib
import tomllib
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from spottrain import __version__
from spottrain.controller.run.wheel import SelfWheel

ENVLOCK_SOURCE = Path(__file__).resolve().parents[1] / "spottrain" / "envlock.py"
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
FRAMEWORK_EXTRAS = ("hf", "accelerate", "lightning")
# The stand-in frameworks: name, versions (pyproject's ranges: transformers 5.18.x,
# accelerate 1.15.x, lightning 2.6.6 up to 2.7).
FRAMEWORK_WHEELS = {
    "transformers": ("5.17.0", "5.18.0", "5.20.0"),
    "accelerate": ("1.15.0", "1.16.0"),
    "lightning": ("2.6.6", "2.7.0"),
}


def framework_requires() -> list[str]:
    """pyproject.toml's framework extras as the wheel's ``Requires-Dist`` strings."""
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    return [f'{r}; extra == "{e}"' for e in FRAMEWORK_EXTRAS for r in extras[e]]


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(
    folder: Path,
    name: str,
    version: str,
    requires: Sequence[str] = (),
    extras: Sequence[str] = (),
    files: Mapping[str, str] | None = None,
) -> Path:
    """A pure-Python wheel ``name-version-py3-none-any.whl`` in ``folder``, with METADATA,
    WHEEL and RECORD, holding ``files`` (default: ``<name>/__init__.py``)."""
    folder.mkdir(parents=True, exist_ok=True)
    dist_info = f"{name}-{version}.dist-info"
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    meta += [f"Provides-Extra: {e}" for e in extras]
    meta += [f"Requires-Dist: {r}" for r in requires]
    content = dict(files or {f"{name}/__init__.py": f"VERSION = {version!r}\n"})
    content[f"{dist_info}/METADATA"] = "\n".join(meta) + "\n"
    content[f"{dist_info}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: spottrain-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    path = folder / f"{name}-{version}-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(path, "w") as z:
        for arc, text in content.items():
            data = text.encode()
            z.writestr(arc, data)
            record.append(f"{arc},{_record_hash(data)},{len(data)}")
        record.append(f"{dist_info}/RECORD,,")
        z.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")
    return path


def build_wheelhouse(folder: Path) -> dict[str, Path]:
    """The stand-in index (see the module docstring); returns each wheel by ``name-version``."""
    spottrain_files = {
        "spottrain/__init__.py": f"__version__ = {__version__!r}\n",
        "spottrain/envlock.py": ENVLOCK_SOURCE.read_text(),
    }
    wheels = [
        build_wheel(
            folder / "own",
            "spottrain",
            __version__,
            requires=[
                'alpha>=1; extra == "agent"',
                'beta; extra == "aws"',
                'delta; extra == "gcp"',
                *framework_requires(),
            ],
            extras=("agent", "aws", "gcp", *FRAMEWORK_EXTRAS),
            files=spottrain_files,
        ),
        build_wheel(folder, "alpha", "1.0", requires=["beta<3"]),
        build_wheel(folder, "beta", "1.0"),
        build_wheel(folder, "beta", "2.0"),
        build_wheel(folder, "delta", "1.0"),
        build_wheel(folder, "gamma", "1.0"),
        *(build_wheel(folder, n, v) for n, vs in FRAMEWORK_WHEELS.items() for v in vs),
    ]
    return {p.name.split("-py3")[0]: p for p in wheels}


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def own_wheel(folder: Path) -> SelfWheel:
    """The stand-in spottrain wheel of :func:`build_wheelhouse` as the controller's own."""
    path = folder / "own" / f"spottrain-{__version__}-py3-none-any.whl"
    return SelfWheel(path, sha256_of(path), __version__, "the test wheelhouse")


# What `spottrain lock` gives for spottrain[agent,aws] on manylinux x86_64 with torch's CUDA
# 12 wheels (names as of torch 2.13; the versions here are placeholders of realistic length):
# one wheel hash per package. Used to measure the boot script against AWS's 16 KB of user data.
REALISTIC_AWS_PACKAGES = (  # noqa: SIM905
    "annotated-types boto3 botocore filelock fsspec jinja2 jmespath markupsafe mpmath "
    "networkx numpy nvidia-cublas-cu12 nvidia-cuda-cupti-cu12 nvidia-cuda-nvrtc-cu12 "
    "nvidia-cuda-runtime-cu12 nvidia-cudnn-cu12 nvidia-cufft-cu12 nvidia-cufile-cu12 "
    "nvidia-curand-cu12 nvidia-cusolver-cu12 nvidia-cusparse-cu12 nvidia-cusparselt-cu12 "
    "nvidia-nccl-cu12 nvidia-nvjitlink-cu12 nvidia-nvshmem-cu12 nvidia-nvtx-cu12 pydantic "
    "pydantic-core python-dateutil pyyaml redis s3transfer setuptools six spottrain sympy "
    "torch triton typing-extensions typing-inspection urllib3"
).split()


def realistic_lock_text() -> str:
    """A lock of :data:`REALISTIC_AWS_PACKAGES` (a distinct fake hash each)."""
    return lock_of(len(REALISTIC_AWS_PACKAGES))


def lock_of(n: int, spottrain_sha256: str = "") -> str:
    """A lock of ``n`` packages (n >= 41): :data:`REALISTIC_AWS_PACKAGES` (a CUDA torch stack)
    and a job's own requirements after them, each with a distinct fake hash (spottrain's
    ``spottrain_sha256`` where given: a controller's own wheel)."""
    from spottrain.envlock import LockedPackage, make_lock

    names = [*REALISTIC_AWS_PACKAGES]
    names += [f"job-requirement-{i:03d}" for i in range(n - len(names))]
    packages = [
        LockedPackage(
            name,
            __version__ if name == "spottrain" else "12.8.4.1",
            (
                "sha256:"
                + (
                    spottrain_sha256
                    if name == "spottrain" and spottrain_sha256
                    else hashlib.sha256(name.encode()).hexdigest()
                ),
            ),
        )
        for name in names
    ]
    lock = make_lock(
        packages,
        target="python 3.11 cp manylinux_2_28_x86_64",
        requires=[f"spottrain[agent,aws]=={__version__}"],
    )
    return lock.text()

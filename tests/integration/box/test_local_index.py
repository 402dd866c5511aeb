"""The box's local package index (tests/box/index.py) against the real pip of a fresh venv.

The venv is made by the system's ``python3 -m venv`` and its pip runs with no configuration
of this machine's (``PIP_CONFIG_FILE=/dev/null``, no ``PIP_*`` variables, no proxy), so it
knows only the index it is given, as a box VM's pip does. The agent's wheel folder is built
once per machine into the cache (``~/.cache/spottrain-box/wheels``); its first build resolves
against PyPI and downloads about 265 MB, hence ``slow``. The other tests use a small folder
(pyyaml and redis, also cached) or stand-in wheels made here; the wheel folder's own rules
(pinned to the venv, cached by its versions, built once, nothing left by a failed build) are
checked offline, against stand-in wheels served by a LocalIndex and a stand-in venv.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from box.index import (
    AGENT_EXTRAS,
    LocalIndex,
    WheelFolder,
    WheelFolderError,
    assemble_wheels,
    default_cache_dir,
    installed_versions,
    project_requirements,
    sha256_file,
    target_args,
)
from wheelhouse import build_wheel

from spottrain import __version__

SYSTEM_PYTHON = Path("/usr/bin/python3")


def _pip_env() -> dict[str, str]:
    """No pip configuration and no proxy: pip reaches only the URLs on its command line."""
    proxies = {"http_proxy", "https_proxy", "all_proxy", "no_proxy"}
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k.lower() not in proxies
    }
    return {**env, "PIP_CONFIG_FILE": os.devnull}


def _pip(venv: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    cmd = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    cmd += ["--no-cache-dir", "--no-input", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=_pip_env(), timeout=timeout)


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not SYSTEM_PYTHON.exists():
        pytest.skip(f"no {SYSTEM_PYTHON} to make a fresh venv with")
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run(
        [str(SYSTEM_PYTHON), "-m", "venv", str(venv)],
        check=True,
        env=_pip_env(),
        timeout=120,
    )
    return venv


@pytest.fixture(scope="module")
def small_wheels() -> WheelFolder:
    """pyyaml and redis at this venv's versions, and what they need (async-timeout, on
    Python 3.11.0 to 3.11.2)."""
    return assemble_wheels(default_cache_dir(), requirements=["pyyaml", "redis"])


@pytest.fixture
def small_index(small_wheels: WheelFolder) -> Iterator[LocalIndex]:
    with LocalIndex(small_wheels.path) as index:
        yield index


def _anchors(index: LocalIndex, project: str) -> dict[str, dict[str, str]]:
    """The project page's anchors: file name -> {"href", "sha256", "requires-python"}."""
    page = urllib.request.urlopen(f"{index.url}/{project}/", timeout=10).read().decode()
    out = {}
    for attrs, text in re.findall(r"<a ([^>]*)>([^<]*)</a>", page):
        a = dict(re.findall(r'([\w-]+)="([^"]*)"', attrs))
        href, _, frag = a["href"].partition("#sha256=")
        requires = a.get("data-requires-python", "").replace("&gt;", ">").replace("&lt;", "<")
        out[text] = {"href": href, "sha256": frag, "requires-python": requires}
    return out


def _status(url: str) -> int:
    try:
        return int(urllib.request.urlopen(url, timeout=10).status)
    except urllib.error.HTTPError as e:
        return e.code


def test_a_locked_subset_installs_from_the_index_with_hashes_into_a_fresh_venv(
    small_index: LocalIndex, small_wheels: WheelFolder, fresh_venv: Path, tmp_path: Path
) -> None:
    # pyyaml, redis, and async-timeout, which redis needs below Python 3.11.3 (the system
    # python3 may be older: Debian 12's is 3.11.2).
    assert set(small_wheels.versions()) == {"pyyaml", "redis", "async-timeout"}
    lock = []
    for project, version in small_wheels.versions().items():
        anchors = _anchors(small_index, project)
        assert len(anchors) == 1
        ((filename, a),) = anchors.items()
        assert a["sha256"] == sha256_file(small_wheels.path / filename)
        assert a["href"] == f"/files/{quote(filename)}"
        if project == "pyyaml":  # its metadata says Requires-Python: >=3.x
            assert re.fullmatch(r">=3\.\d+", a["requires-python"])
        lock.append(f"{project}=={version} --hash=sha256:{a['sha256']}")
    (tmp_path / "lock.txt").write_text("\n".join(lock) + "\n")

    proc = _pip(
        fresh_venv,
        "install",
        "--require-hashes",
        "--no-deps",
        "--only-binary=:all:",
        "-r",
        str(tmp_path / "lock.txt"),
        "--index-url",
        small_index.url,
    )
    assert proc.returncode == 0, proc.stderr

    have = installed_versions(fresh_venv)
    assert {n: have[n] for n in small_wheels.versions()} == small_wheels.versions()
    imported = subprocess.run(
        [
            str(fresh_venv / "bin" / "python"),
            "-c",
            "import yaml, redis; print(yaml.__with_libyaml__)",
        ],
        capture_output=True,
        text=True,
    )
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip() == "True"  # the manylinux wheel, with its C extension
    for w in small_wheels.wheels:
        assert small_index.count(f"/files/{w.filename}") == 1


def test_a_missing_project_answers_404_and_pip_names_it(fresh_venv: Path, tmp_path: Path) -> None:
    folder = tmp_path / "wheels"
    build_wheel(folder, "alpha", "1.0", requires=["beta_pkg>=1"])
    build_wheel(folder, "beta_pkg", "1.0")
    with LocalIndex(folder) as index:
        index.missing = {"Beta.Pkg"}  # any spelling of the name
        assert _status(f"{index.url}/beta-pkg/") == 404
        assert _status(index.file_url("beta_pkg-1.0-py3-none-any.whl")) == 404
        assert "beta-pkg" not in urllib.request.urlopen(index.url + "/").read().decode()
        assert _status(f"{index.url}/alpha/") == 200

        proc = _pip(
            fresh_venv, "download", "--dest", str(tmp_path / "d"), "alpha", "--index-url", index.url
        )
        assert proc.returncode != 0
        assert "No matching distribution found for beta" in proc.stderr.replace("_", "-")
        assert index.count("/simple/beta-pkg/") >= 1

        index.missing = set()
        proc = _pip(
            fresh_venv, "download", "--dest", str(tmp_path / "d"), "alpha", "--index-url", index.url
        )
        assert proc.returncode == 0, proc.stderr


def test_spottrain_is_never_served_even_when_its_wheel_is_in_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "wheels"
    build_wheel(folder, "spottrain", __version__)
    build_wheel(folder, "alpha", "1.0")
    with LocalIndex(folder) as index:
        assert set(index.files) == {"alpha-1.0-py3-none-any.whl"}
        assert _status(f"{index.url}/spottrain/") == 404
        assert _status(index.file_url(f"spottrain-{__version__}-py3-none-any.whl")) == 404
        assert _status(index.file_url(f"spottrain-{__version__}-py3-none-any.whl.metadata")) == 404
        root = urllib.request.urlopen(index.url + "/").read().decode()
        assert "alpha/" in root and "spottrain" not in root
        assert index.count("/simple/spottrain") == 1 and index.count("/files/spottrain-") == 2


def test_a_built_wheel_folder_is_found_again_without_pip(small_wheels: WheelFolder) -> None:
    started = time.monotonic()
    again = assemble_wheels(small_wheels.path.parent, requirements=["pyyaml", "redis"])
    assert time.monotonic() - started < 1  # found, not built: a build runs pip twice
    assert again == small_wheels
    assert set(small_wheels.versions()) == {"pyyaml", "redis", "async-timeout"}
    assert sorted(p.name for p in small_wheels.path.iterdir()) == sorted(
        [*(w.filename for w in small_wheels.wheels), "manifest.json"]
    )


# The wheel folder, offline: stand-in wheels on a LocalIndex, a venv of dist-info folders.

MINOR = f"{sys.version_info.major}.{sys.version_info.minor}"


def _standin_venv(root: Path, versions: Mapping[str, str]) -> Path:
    """A venv as installed_versions reads one: a dist-info folder per distribution."""
    site = root / "lib" / f"python{MINOR}" / "site-packages"
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    for name, version in versions.items():
        info = site / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return root


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[LocalIndex]:
    """alpha 1.0 requires beta (1.0 and 2.0 here) and, below this Python's patch release,
    gamma; delta 1.0+cpu is a local build, only in ``tmp_path/local``."""
    folder = tmp_path / "index"
    below_here = f'gamma; python_full_version < "{platform.python_version()}"'
    build_wheel(folder, "alpha", "1.0", requires=["beta>=1", below_here])
    for version in ("1.0", "2.0"):
        build_wheel(folder, "beta", version)
    build_wheel(folder, "gamma", "1.0")
    build_wheel(tmp_path / "local", "delta", "1.0+cpu")
    with LocalIndex(folder) as index:
        yield index


ALL = {"alpha": "1.0", "beta": "1.0", "delta": "1.0+cpu"}


def _assemble(tmp_path: Path, index: LocalIndex, venv: Path, **kw: Any) -> WheelFolder:
    kw.setdefault("local_dirs", [tmp_path / "local"])
    return assemble_wheels(
        tmp_path / "cache",
        venv=venv,
        pip_python=Path(sys.executable),
        requirements=["alpha", "delta"],
        index_url=index.url,
        python_version=MINOR,
        timeout_s=120,
        **kw,
    )


def test_the_wheel_folder_holds_the_venvs_versions_and_what_older_patches_need(
    standin: LocalIndex, tmp_path: Path
) -> None:
    if sys.version_info.micro == 0:
        pytest.skip("no patch release of this Python is older")
    folder = _assemble(tmp_path, standin, _standin_venv(tmp_path / "venv", ALL))
    assert folder.versions() == {**ALL, "gamma": "1.0"}  # beta 1.0, as the venv has it
    assert folder.older_patches_only == ("gamma",)
    for w in folder.wheels:
        source = tmp_path / ("local" if w.name == "delta" else "index") / w.filename
        assert w.sha256 == sha256_file(source) == sha256_file(folder.path / w.filename)
    assert sorted(p.name for p in folder.path.iterdir()) == sorted(
        [*(w.filename for w in folder.wheels), "manifest.json"]
    )
    assert [p.name for p in (tmp_path / "cache").glob(".tmp-*")] == []


def test_a_change_of_the_venvs_versions_makes_another_folder(
    standin: LocalIndex, tmp_path: Path
) -> None:
    venv = _standin_venv(tmp_path / "venv", ALL)
    first = _assemble(tmp_path, standin, venv)
    asked = len(standin.requests)
    assert _assemble(tmp_path, standin, venv) == first
    assert len(standin.requests) == asked  # found: pip did not run

    _standin_venv(venv, {**ALL, "beta": "2.0"})
    second = _assemble(tmp_path, standin, venv)
    assert second.path != first.path and first.path.is_dir()
    assert second.versions()["beta"] == "2.0"


def test_a_failed_or_interrupted_build_leaves_nothing_that_is_taken_for_a_folder(
    standin: LocalIndex, tmp_path: Path
) -> None:
    venv = _standin_venv(tmp_path / "venv", ALL)
    standin.missing = {"beta"}
    with pytest.raises(WheelFolderError, match="beta"):
        _assemble(tmp_path, standin, venv)
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []

    standin.missing = set()
    built = _assemble(tmp_path, standin, venv)
    # As a build killed halfway leaves it: its temporary folder, and a folder with no manifest.
    shutil.rmtree(built.path)
    leftover = built.path.parent / f".tmp-{built.path.name}-killed"
    leftover.mkdir()
    built.path.mkdir()
    (built.path / "alpha-1.0-py3-none-any.whl").write_bytes(b"half")
    again = _assemble(tmp_path, standin, venv)
    assert again == built
    assert not leftover.exists()
    assert sha256_file(again.path / "alpha-1.0-py3-none-any.whl") == again.wheels[0].sha256


def test_concurrent_callers_build_the_folder_once(standin: LocalIndex, tmp_path: Path) -> None:
    venv = _standin_venv(tmp_path / "venv", ALL)
    results: list[WheelFolder] = []

    def call() -> None:
        results.append(_assemble(tmp_path, standin, venv))

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 3 and results[0] == results[1] == results[2]
    assert standin.requests.count("/files/alpha-1.0-py3-none-any.whl") == 1


def test_a_resolution_that_strays_from_the_venv_is_refused(
    standin: LocalIndex, tmp_path: Path
) -> None:
    without_beta = _standin_venv(tmp_path / "venv", {"alpha": "1.0", "delta": "1.0+cpu"})
    with pytest.raises(WheelFolderError, match=r"beta 2\.0 \(not installed in"):
        _assemble(tmp_path, standin, without_beta)
    # The venv's local build is in no local folder: pip says what it lacks, and where we looked.
    venv = _standin_venv(tmp_path / "venv", ALL)
    with pytest.raises(WheelFolderError, match=r"(?s)delta.*local builds of the venv"):
        _assemble(tmp_path, standin, venv, local_dirs=[])


def _standin_spottrain(folder: Path) -> Path:
    """A tiny spottrain wheel whose Requires-Dist are pyproject's, extras and all."""
    extras = sorted({e for s in AGENT_EXTRAS for e in s})
    by_extra = project_requirements(extras)
    requires = list(by_extra[""])
    for extra in extras:
        for req in by_extra[extra]:
            spec, _, marker = req.partition(";")
            cond = f'({marker.strip()}) and extra == "{extra}"' if marker else f'extra == "{extra}"'
            requires.append(f"{spec.strip()}; {cond}")
    return build_wheel(folder, "spottrain", __version__, requires=requires, extras=extras)


def _python_version(venv: Path) -> tuple[int, ...]:
    said = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import platform; print(platform.python_version())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return tuple(int(x) for x in said.stdout.strip().split("."))


def _resolve(
    pip: str, venv: Path, index: LocalIndex, wheel: Path, extras: Sequence[str], report: Path
) -> subprocess.CompletedProcess[str]:
    """``controller``: as ``spottrain lock`` does, with this venv's pip, for the VMs' platform;
    ``vm``: with the fresh venv's own pip for its own interpreter (pip 23.0 refuses
    ``--platform`` with ``--dry-run``)."""
    target = target_args() if pip == "controller" else ["--only-binary=:all:"]
    return _pip(
        venv,
        "install",
        "--dry-run",
        "--ignore-installed",
        "--quiet",
        "--report",
        str(report),
        *target,
        "--index-url",
        index.url,
        f"spottrain[{','.join(extras)}] @ {wheel.as_uri()}",
    )


@pytest.mark.slow  # the agent's wheel folder: its first build downloads about 265 MB
@pytest.mark.parametrize("pip", ["controller", "vm"])
@pytest.mark.parametrize("extras", AGENT_EXTRAS, ids=lambda e: ",".join(e))
def test_the_agent_resolves_entirely_from_the_index_with_the_cpu_torch(
    extras: tuple[str, ...], pip: str, fresh_venv: Path, tmp_path: Path
) -> None:
    wheels = assemble_wheels(default_cache_dir())
    venv = Path(sys.prefix) if pip == "controller" else fresh_venv
    standin = _standin_spottrain(tmp_path / "own")
    with LocalIndex(wheels.path) as index:
        proc = _resolve(pip, venv, index, standin, extras, tmp_path / "report.json")
        assert proc.returncode == 0, proc.stderr
        items = json.loads((tmp_path / "report.json").read_text())["install"]
        got = {i["metadata"]["name"].lower().replace("_", "-"): i for i in items}

        assert got.pop("spottrain")["download_info"]["url"] == standin.as_uri()
        assert got["torch"]["metadata"]["version"] == "2.13.0+cpu"
        assert not [n for n in got if n.startswith("nvidia-")]
        files = {w.name: w for w in wheels.wheels}
        for name, item in got.items():
            info = item["download_info"]
            assert info["url"].startswith(f"http://127.0.0.1:{index.port}/files/"), name
            assert info["archive_info"]["hashes"]["sha256"] == files[name].sha256
            assert item["metadata"]["version"] == files[name].version
        assert ("torchft" in got) == ("replica" in extras)
        # spottrain came from its file, and the index refuses it anyway.
        assert index.count("/simple/spottrain") == 0
        assert _status(f"{index.url}/spottrain/") == 404
        sent = [p for p in index.requests if p.startswith("/files/") and p.endswith(".whl")]
        if pip == "controller":  # it read each wheel's metadata (PEP 658): no wheel was sent
            assert sent == []
        else:  # pip 23.0 reads no PEP 714 metadata: it takes each wheel to read its own
            assert len(sent) == len(got)

        if pip == "vm":  # redis needs async-timeout below 3.11.3: Debian 12's python3 is 3.11.2
            older = _python_version(venv) < (3, 11, 3)
            assert ("async-timeout" in got) == older

        if extras == ("agent", "aws"):
            index.missing = {"torch"}
            proc = _resolve(pip, venv, index, standin, extras, tmp_path / "again.json")
            assert proc.returncode != 0
            assert "No matching distribution found for torch" in proc.stderr


@pytest.mark.slow
def test_the_agent_wheel_folder_holds_the_venvs_versions_and_only_wheels() -> None:
    wheels = assemble_wheels(default_cache_dir())
    venv = installed_versions(Path(sys.prefix))
    assert wheels.versions()["torch"] == "2.13.0+cpu"
    assert wheels.older_patches_only == ("async-timeout",)  # redis's, below Python 3.11.3
    for w in wheels.wheels:
        if w.name not in wheels.older_patches_only:
            assert w.version == venv[w.name], w.name
        assert w.filename.endswith(".whl")
        assert sha256_file(wheels.path / w.filename) == w.sha256
    assert "spottrain" not in wheels.versions()
    assert not [n for n in wheels.versions() if n.startswith("nvidia-")]

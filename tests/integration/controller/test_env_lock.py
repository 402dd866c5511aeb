"""The agent's environment lock end to end, with real pip and no PyPI: tiny wheels in a local
folder stand in for the index (issue 18 item 3).

The resolver turns pip's report into the lock (hashes = the files' sha256), refuses what a
VM cannot install, and includes an archive job's requirements so they cannot move a locked
package; a venv installed from the lock verifies, one that differs names the package; the
boot script's lock section, run for real, builds the venv from the lock, keeps it while the
lock is the same, rebuilds it for another lock, and stops the boot when the venv was
changed; ``up`` on moto's AWS records the lock in the run and sends it in the user data; a
job whose ``train.integration`` trains with a framework (hf, lightning) gets it locked at its
extra's range, and a job requirement pinning it outside that range is refused in one line.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from spec_samples import VALID, spec_with
from wheelhouse import build_wheel, build_wheelhouse, own_wheel, sha256_of

from spottrain import __version__
from spottrain.controller.run.boot import (
    ENV_LOCK_MARK,
    ENV_LOCK_PATH,
    VENV,
    WHEEL_DIR,
    NodeIdentity,
)
from spottrain.controller.run.env_lock import (
    LockTarget,
    ResolveError,
    agent_requirement,
    capture_locks,
    env_lock_lines,
    lock_for_cloud,
    parse_lock_args,
    read_lock_file,
    resolve_lock,
)
from spottrain.controller.run.wheel import SelfWheel
from spottrain.envlock import EnvLock, lock_sha256, main, parse_lock, verify
from spottrain.spec import JobSpec, parse_spec

PY = sys.executable
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("wheelhouse")
    build_wheelhouse(folder)
    return folder


def _index(folder: Path) -> list[str]:
    return ["--no-index", "--find-links", str(folder)]


@pytest.fixture(scope="module")
def own(wheels: Path) -> SelfWheel:
    """The stand-in of the controller's own wheel: in no index."""
    return own_wheel(wheels)


@pytest.fixture(scope="module")
def aws_lock(wheels: Path, own: SelfWheel) -> EnvLock:
    """The agent's lock for AWS from the wheelhouse: one pip resolution that the tests which
    only read it share."""
    return resolve_lock([agent_requirement("aws", wheel=own)], pip_args=_index(wheels), wheel=own)


def test_the_lock_pins_every_package_by_the_sha256_of_its_wheel_and_spottrain_by_its_own(
    wheels: Path, own: SelfWheel, aws_lock: EnvLock
) -> None:
    lock = aws_lock
    assert not list(wheels.glob("spottrain-*"))  # no index carries spottrain
    assert lock.versions() == {"alpha": "1.0", "beta": "2.0", "spottrain": __version__}
    files = {
        "alpha": wheels / "alpha-1.0-py3-none-any.whl",
        "beta": wheels / "beta-2.0-py3-none-any.whl",
        "spottrain": own.path,
    }
    for p in lock.packages:
        assert p.hashes == (f"sha256:{sha256_of(files[p.name])}",)
        assert p.url == ""  # installed by name: spottrain from the shipped file beside the rest
    assert lock.target == LockTarget().describe() == "python 3.11 cp manylinux_2_28_x86_64"
    assert lock.requires == (f"spottrain[agent,aws] @ {own.file_url}",)
    assert parse_lock(lock.text()) == lock
    # Each cloud gets its own extra.
    gcp = resolve_lock([agent_requirement("gcp", wheel=own)], pip_args=_index(wheels), wheel=own)
    assert set(gcp.versions()) == {"alpha", "beta", "delta", "spottrain"}
    # Without the wheel, an index without spottrain cannot resolve the agent.
    with pytest.raises(ResolveError, match=f"spottrain\\[agent,aws\\]=={__version__}"):
        resolve_lock([agent_requirement("aws")], pip_args=_index(wheels))


def test_pip_configuration_from_the_environment_is_used(
    wheels: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    assert resolve_lock(["alpha==1.0"]).versions() == {"alpha": "1.0", "beta": "2.0"}


def test_a_job_requirement_is_locked_with_the_agent_and_cannot_move_it(
    wheels: Path, own: SelfWheel, tmp_path: Path
) -> None:
    req = tmp_path / "requirements.txt"
    req.write_text("gamma==1.0\nbeta<2\n")
    agent = agent_requirement("aws", wheel=own)
    lock = resolve_lock([agent], requirement_files=[req], pip_args=_index(wheels), wheel=own)
    assert lock.versions()["gamma"] == "1.0" and lock.versions()["beta"] == "1.0"
    req.write_text("alpha==9.9\n")  # against the agent's alpha>=1 from the index: none
    with pytest.raises(ResolveError) as e:
        resolve_lock([agent], requirement_files=[req], pip_args=_index(wheels), wheel=own)
    said = str(e.value)
    assert agent in said and f"-r {req}" in said
    assert "alpha==9.9" in said  # pip's own words
    assert "--env-lock" in said and "spottrain lock" in said
    # A job that requires spottrain itself gets the shipped wheel, or no lock at all.
    req.write_text(f"spottrain=={__version__}\n")
    same = resolve_lock([agent], requirement_files=[req], pip_args=_index(wheels), wheel=own)
    assert same.text() == resolve_lock([agent], pip_args=_index(wheels), wheel=own).text()
    req.write_text("spottrain==0.0.9\n")
    with pytest.raises(ResolveError, match=r"spottrain==0\.0\.9"):
        resolve_lock([agent], requirement_files=[req], pip_args=_index(wheels), wheel=own)


def test_a_requirement_no_index_has_is_refused_with_the_way_out(wheels: Path) -> None:
    with pytest.raises(ResolveError, match=r"(?s)no-such-pkg.*--env-lock CLOUD=FILE"):
        resolve_lock(["no-such-pkg==1.0"], pip_args=_index(wheels))


def test_a_local_file_the_vms_cannot_reach_is_refused(wheels: Path) -> None:
    wheel = wheels / "gamma-1.0-py3-none-any.whl"
    with pytest.raises(ResolveError, match="a local path the VMs cannot reach"):
        resolve_lock([str(wheel)], pip_args=_index(wheels))


def test_a_venv_from_the_lock_verifies_and_one_that_differs_names_the_package(
    wheels: Path, own: SelfWheel, aws_lock: EnvLock, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    lock = aws_lock
    path = tmp_path / "env.lock"
    path.write_text(lock.text())
    target = tmp_path / "site"
    shipped = ["--find-links", str(own.path.parent)]
    pip = [PY, "-m", "pip", "install", "-q", "--target", str(target), *_index(wheels)]
    subprocess.run([*pip, *shipped, "--require-hashes", "--no-deps", "-r", str(path)], check=True)
    assert verify(lock, [str(target)]) == []
    assert main(["verify", str(path), "--path", str(target)]) == 0
    # A wheel whose hash differs from the lock's is refused by pip itself.
    forged = tmp_path / "forged"
    build_wheel(forged, "beta", "2.0", files={"beta/__init__.py": "EVIL = 1\n"})
    for wheel in wheels.glob("*.whl"):
        if not wheel.name.startswith("beta-"):
            shutil.copy(wheel, forged)
    hashed = ["--require-hashes", "--no-deps", "-r", str(path)]
    refused = subprocess.run(
        [*pip[:6], str(tmp_path / "other"), *_index(forged), *shipped, *hashed],
        capture_output=True,
        text=True,
    )
    assert refused.returncode != 0 and "DO NOT MATCH THE HASHES" in refused.stderr
    # Another beta in the environment: verify names it.
    subprocess.run([*pip, "--upgrade", "--no-deps", "beta==1.0"], check=True, capture_output=True)
    capsys.readouterr()
    assert main(["verify", str(path), "--path", str(target)]) == 1
    # pip --target leaves beta 2.0's .dist-info beside 1.0's: both are named.
    assert "beta: locked 2.0, installed " in capsys.readouterr().err


# --- the framework a job's integration trains with ---------------------------------------------


def _framework_job(tmp_path: Path, integration: str, requirements: str | None) -> JobSpec:
    """An AWS job of ``code.archive`` (``code/``, with ``requirements`` as its
    requirements.txt when given) whose ``train.integration`` is ``integration``."""
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    (code / "requirements.txt").unlink(missing_ok=True)
    if requirements is not None:
        (code / "requirements.txt").write_text(requirements)
    data = spec_with(_aws_data(), "code", {"archive": {"path": "code", "store": "file:///tmp"}})
    data = spec_with(data, "checkpoint.copy_to", ...)
    data = spec_with(data, "train.integration", integration)
    return parse_spec(yaml.safe_dump(data), base_dir=tmp_path).spec


def test_an_hf_jobs_lock_pins_transformers_in_the_extras_range(
    wheels: Path, own: SelfWheel, tmp_path: Path
) -> None:
    index = _index(wheels)
    # The job asks for transformers unpinned; the index's newest, 5.20.0, is outside the
    # extra's range (5.18.x): the extra's range wins.
    lock = lock_for_cloud(
        _framework_job(tmp_path, "hf", "transformers\n"), tmp_path, "aws", own, pip_args=index
    )
    versions = lock.versions()
    assert versions["transformers"] == "5.18.0" and versions["accelerate"] == "1.15.0"
    assert lock.requires == (f"spottrain[agent,aws,hf] @ {own.file_url}",)
    wheel = wheels / "transformers-5.18.0-py3-none-any.whl"
    (pinned,) = [p for p in lock.packages if p.name == "transformers"]
    assert pinned.hashes == (f"sha256:{sha256_of(wheel)}",)
    # Without a requirements.txt, and for Lightning, likewise; an SDK job's lock holds none.
    bare = lock_for_cloud(
        _framework_job(tmp_path, "hf", None), tmp_path, "aws", own, pip_args=index
    )
    assert bare.versions()["transformers"] == "5.18.0"
    lightning = _framework_job(tmp_path, "lightning", None)
    got = lock_for_cloud(lightning, tmp_path, "gcp", own, pip_args=index).versions()
    assert got["lightning"] == "2.6.6" and "transformers" not in got
    sdk = lock_for_cloud(
        _framework_job(tmp_path, "sdk", None), tmp_path, "aws", own, pip_args=index
    )
    assert set(sdk.versions()) == {"alpha", "beta", "spottrain"}


def test_a_job_pinning_the_framework_outside_the_extras_range_fails_the_lock_in_one_line(
    wheels: Path, own: SelfWheel, tmp_path: Path
) -> None:
    index = _index(wheels)
    spec = _framework_job(tmp_path, "hf", "gamma==1.0\ntransformers==5.20.0  # the newest\n")
    with pytest.raises(ResolveError) as err:
        lock_for_cloud(spec, tmp_path, "aws", own, pip_args=index)
    assert str(err.value) == (
        f"{tmp_path / 'code' / 'requirements.txt'}: transformers==5.20.0 is outside the range "
        "spottrain[hf] pins (transformers<5.19,>=5.18, the versions its hf integration is "
        "tested with), which every VM of a train.integration: hf job installs: change it to "
        "transformers<5.19,>=5.18 or remove it"
    )
    below = _framework_job(tmp_path, "hf", "accelerate<1.15\n")
    with pytest.raises(
        ResolveError, match=r"^\S+: accelerate<1\.15 is outside .*accelerate<1\.16,>=1\.15"
    ):
        lock_for_cloud(below, tmp_path, "aws", own, pip_args=index)
    # A spottrain wheel without the extra (older than the integration): pip only warns, so
    # the lock would hold no framework; refused, naming the wheel.
    older = tmp_path / "older"
    path = build_wheel(older, "spottrain", __version__, ['alpha>=1; extra == "agent"'], ["agent"])
    bare = SelfWheel(path, sha256_of(path), __version__, "an older checkout")
    with pytest.raises(ResolveError, match=r"holds no transformers or accelerate, which .*hf"):
        lock_for_cloud(_framework_job(tmp_path, "hf", None), tmp_path, "aws", bare, pip_args=index)
    # A range that meets the extra's is the job's to narrow.
    inside = _framework_job(tmp_path, "hf", "transformers>=5.17\n")
    got = lock_for_cloud(inside, tmp_path, "aws", own, pip_args=index).versions()
    assert got["transformers"] == "5.18.0"


# --- the boot script's lock section, run for real ---------------------------------------------


def _lock_section(script: str, root: Path) -> str:
    """The boot's environment section, from the venv's check to its verification, with /opt,
    /etc and the fetched wheels moved under ``root``."""
    start = script.index(f'if [ "$(cat {ENV_LOCK_MARK}')
    verify_line = f"{VENV}/bin/python -m spottrain.envlock verify {ENV_LOCK_PATH}\n"
    end = script.index(verify_line, start) + len(verify_line)
    section = script[start:end]
    return (
        section.replace("/opt/spottrain", str(root / "opt"))
        .replace("/etc/spottrain", str(root / "etc"))
        .replace(WHEEL_DIR, str(root / "wheels"))
    )


def _boot_section(lock_text: str, root: Path) -> str:
    from spottrain.controller.run.boot import CodeRef, render_boot_script

    spec = parse_spec(yaml.safe_dump(spec_with(VALID, "code", {"archive": {"path": "."}}))).spec
    node = NodeIdentity("r-1", "n0", "aws", "us-east-1a", "p4d.24xlarge")
    script = render_boot_script(
        spec, node, "redis://r:6379", code=CodeRef("s3://b/c.tar.gz", "ab" * 32), env_lock=lock_text
    )
    # What the loader fetched: the lock, and the run's own wheel beside it.
    (root / "etc" / "env.lock").write_text(lock_text)
    return _lock_section(script, root)


def _run(section: str, wheels: Path, root: Path) -> subprocess.CompletedProcess[str]:
    bindir = root / "bin"
    bindir.mkdir(exist_ok=True)
    if not (bindir / "python3").exists():
        (bindir / "python3").symlink_to(PY)
    env = {
        "PATH": f"{bindir}:{os.environ['PATH']}",
        "HOME": str(root),
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(wheels),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", section],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.slow  # two venvs built with pip: about a minute on a busy machine
def test_the_boot_builds_the_venv_from_the_lock_rebuilds_it_for_another_and_verifies(
    wheels: Path, own: SelfWheel, aws_lock: EnvLock, tmp_path: Path
) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "opt").mkdir()
    (tmp_path / "wheels").mkdir()
    shutil.copy(own.path, tmp_path / "wheels")
    venv = tmp_path / "opt" / "venv"
    mark = Path(ENV_LOCK_MARK.replace("/opt/spottrain", str(tmp_path / "opt")))
    first = aws_lock.text()
    done = _run(_boot_section(first, tmp_path), wheels, tmp_path)
    assert done.returncode == 0, done.stderr
    assert mark.read_text().strip() == lock_sha256(first)
    assert "3 packages match the lock" in done.stdout
    beta = venv / "lib" / "python3.11" / "site-packages" / "beta" / "__init__.py"
    assert beta.read_text() == "VERSION = '2.0'\n"
    # The same lock again (a VM booting again, or an image baked from one): the venv stays
    # (a marker file inside it survives).
    (venv / "kept").write_text("")
    again = _run(_boot_section(first, tmp_path), wheels, tmp_path)
    assert again.returncode == 0, again.stderr
    assert (venv / "kept").exists() and "was built from this lock" in again.stdout
    # Someone changed the venv: the boot stops, naming the package.
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", "--no-deps", *_index(wheels), "beta==1.0"],
        check=True,
    )
    changed = _run(_boot_section(first, tmp_path), wheels, tmp_path)
    assert changed.returncode == 1
    assert "beta: locked 2.0, installed 1.0" in changed.stderr
    # Another lock (beta pinned to 1.0, as a backfill under a new lock would get): rebuilt.
    second = first.replace(
        f"beta==2.0 --hash=sha256:{sha256_of(wheels / 'beta-2.0-py3-none-any.whl')}",
        f"beta==1.0 --hash=sha256:{sha256_of(wheels / 'beta-1.0-py3-none-any.whl')}",
    )
    assert second != first
    rebuilt = _run(_boot_section(second, tmp_path), wheels, tmp_path)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert not (venv / "kept").exists()
    assert mark.read_text().strip() == lock_sha256(second)
    # A shipped wheel that is not the one the lock pins is refused by pip.
    (tmp_path / "wheels" / own.path.name).write_bytes(b"PK not the wheel")
    shutil.rmtree(venv)
    forged = _run(_boot_section(first, tmp_path), wheels, tmp_path)
    assert forged.returncode != 0 and "DO NOT MATCH THE HASHES" in forged.stderr


# --- up ---------------------------------------------------------------------------------------


def _aws_data() -> dict[str, Any]:
    data: dict[str, Any] = spec_with(VALID, "resources.clouds", ["aws"])
    data = spec_with(data, "resources.regions", ["us-east-1"])
    return spec_with(data, "resources.instance_types", ["p4d.24xlarge"])


def _aws_job(tmp_path: Path, redis_url: str, index_url: str) -> Path:
    (tmp_path / "code").mkdir()
    (tmp_path / "store").mkdir()
    (tmp_path / "code" / "train.py").write_text("print('hi')\n")
    # A job requirement the index has: locked with the agent, never moving it.
    (tmp_path / "code" / "requirements.txt").write_text("six\n")
    data = spec_with(
        _aws_data(), "code", {"archive": {"path": "code", "store": f"file://{tmp_path}/store"}}
    )
    data = spec_with(data, "checkpoint.copy_to", ...)
    data = spec_with(data, "redis", {"url": redis_url})
    data = spec_with(data, "packages", {"index_url": index_url})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def no_pip_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine's pip configuration (its mirrors, its torch cap) stays out: only what
    the spec names is an index."""
    for name in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)


@pytest.mark.slow  # real resolutions of the agent's environment (torch included)
def test_up_on_aws_ships_its_wheel_and_lock_and_the_user_data_pins_them(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    redis_server: Any,
    box_index: Any,
    no_pip_config: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from harnesses.aws import AwsHarness

    from spottrain.cloud.base import LaunchRequest, Market, Offer
    from spottrain.cloud.stores import open_store
    from spottrain.controller.run.code import boot_renderer
    from spottrain.controller.run.create import create_run
    from spottrain.controller.run.records import RunInfo
    from spottrain.controller.run.wheel import self_wheel
    from spottrain.spec import load_spec

    monkeypatch.setenv("SPOTTRAIN_HOME", str(tmp_path / "home"))
    # The index is the session's: other tests' VMs may have asked it before this one.
    asked_before = box_index.count("/simple/spottrain")
    info = create_run(load_spec(_aws_job(tmp_path, redis_server.url, box_index.url)))
    # nobody asked an index for spottrain
    assert box_index.count("/simple/spottrain") == asked_before
    run = RunInfo.load(info.run_id)
    rec = run.env_locks
    text = (info.dir / "env-aws.lock").read_text()
    lock = parse_lock(text)
    assert rec["aws"]["sha256"] == lock_sha256(text)
    assert rec["aws"]["packages"] == len(lock.packages) > 20
    versions = lock.versions()
    assert versions["torch"] == "2.13.0+cpu" and versions["six"]  # the job's requirement too
    # redis needs async-timeout on a VM's Python 3.11.0-3.11.2 (Debian 12's): locked too,
    # though this controller's own Python does not need it.
    assert "async-timeout" in versions
    # spottrain is this controller's own wheel, pinned by its sha256.
    wheel = self_wheel(tmp_path / "home" / "wheels")
    assert run.wheel["sha256"] == wheel.sha256
    (pinned,) = [p for p in lock.packages if p.name == "spottrain"]
    assert pinned.hashes == (f"sha256:{wheel.sha256}",) and pinned.url == ""
    # The run's store holds the boot files by content.
    store = open_store(f"file://{tmp_path}/store")
    files = run.boot_files["aws"]
    assert set(files) == {"script", "loader", "lock", "wheel"}
    for f in files.values():
        key = f["url"].removeprefix(store.url() + "/")
        assert store.stat(key).sha256 == f["sha256"]
    assert files["lock"]["sha256"] == lock_sha256(text)
    assert files["wheel"]["sha256"] == wheel.sha256
    from spottrain.controller.cli import main as cli

    capsys.readouterr()
    assert cli.main(["status", info.run_id]) == 0
    assert f"  {env_lock_lines(rec)[0]}\n" in capsys.readouterr().out
    offer = Offer(
        cloud="aws", region="us-east-1", zone="us-east-1a", instance_type="p4d.24xlarge",
        gpus=8, gpu_type="A100-40GB", market=Market.SPOT, price_per_hour=8.0,
        interruption_risk=0.1, network="efa",
    )  # fmt: skip
    script = boot_renderer(info.spec(), info)("n0", offer)
    # The user data pins every file by sha256 and carries none of them.
    for f in files.values():
        assert f["sha256"] in script
    assert "torch==" not in script and len(script.encode()) < 12 * 1024
    harness = AwsHarness()
    try:
        vm = harness.provider.launch(
            LaunchRequest(f"r-{uuid.uuid4().hex[:8]}", info.run_id, "n0", offer, script)
        )
        sent = harness.admin().describe_instance_attribute(InstanceId=vm.id, Attribute="userData")
        assert base64.b64decode(sent["UserData"]["Value"]).decode() == script
    finally:
        harness.close()
    # A boot file gone from the store is put back before anything launches again.
    key = files["script"]["url"].removeprefix(store.url() + "/")
    store.delete(key)
    boot_renderer(info.spec(), info)
    assert store.stat(key).sha256 == files["script"]["sha256"]


def test_up_takes_a_prebuilt_lock_and_refuses_one_for_another_spottrain(
    aws_lock: EnvLock, own: SelfWheel, tmp_path: Path
) -> None:
    archive = spec_with(
        spec_with(_aws_data(), "code", {"archive": {"path": "."}}), "checkpoint.copy_to", ...
    )
    archive = spec_with(archive, "code.archive.store", "file:///tmp")
    spec = parse_spec(yaml.safe_dump(archive)).spec
    lock = aws_lock
    given = tmp_path / "aws.lock"
    given.write_text(lock.text())
    # No resolution happens (pip would find no index here): the file is taken as it is.
    out = capture_locks(spec, tmp_path, tmp_path, own, {"aws": given}, pip_args=["--no-index"])
    assert out["aws"]["sha256"] == lock_sha256(lock.text())
    assert (tmp_path / "env-aws.lock").read_text() == lock.text()
    given.write_text(lock.text().replace(f"spottrain=={__version__}", "spottrain==0.0.1"))
    with pytest.raises(ResolveError, match=r"holds spottrain 0\.0\.1"):
        read_lock_file(given, "aws")
    # A lock made by another spottrain build (another checkout, another wheel): refused in
    # one line that names the command making it again.
    other = SelfWheel(own.path, "0f" * 32, own.version, "another checkout")
    given.write_text(lock.text())
    with pytest.raises(ResolveError) as err:
        capture_locks(spec, tmp_path, tmp_path, other, {"aws": given})
    said = str(err.value)
    assert "\n" not in said and "not this controller's wheel" in said
    assert f"spottrain lock JOB.yaml --cloud aws -o {given}" in said
    assert parse_lock_args(["x.lock"], ["aws"]) == {"aws": Path("x.lock")}
    assert parse_lock_args(["gcp=y.lock"], ["aws", "gcp"]) == {"gcp": Path("y.lock")}
    with pytest.raises(ValueError, match="give CLOUD=FILE"):
        parse_lock_args(["x.lock"], ["aws", "gcp"])
    with pytest.raises(ValueError, match="no gcp VM"):
        parse_lock_args(["gcp=x.lock"], ["aws"])
    # The image is the environment; the local cloud runs in the controller's venv.
    image = parse_spec(yaml.safe_dump(_aws_data())).spec
    assert capture_locks(image, tmp_path, tmp_path, own) == {}


@pytest.mark.slow  # real resolutions of the agent's environment (torch included)
def test_the_lock_command_works_with_an_index_that_has_no_spottrain(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    box_index: Any,
    no_pip_config: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``spottrain lock examples/gcp_job.yaml --cloud gcp`` against an index that does not
    carry spottrain: the lock pins this controller's own wheel by its sha256."""
    from spottrain.controller.cli import main as cli
    from spottrain.controller.run.wheel import self_wheel

    monkeypatch.setenv("SPOTTRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIP_INDEX_URL", box_index.url)
    out = tmp_path / "gcp.lock"
    job = str(REPO / "examples" / "gcp_job.yaml")
    asked_before = box_index.count("/simple/spottrain")  # the session's index: others ask it
    assert cli.main(["lock", job, "--cloud", "gcp", "-o", str(out)]) == 0, capsys.readouterr()
    lock = parse_lock(out.read_text())
    versions = lock.versions()
    assert versions["spottrain"] == __version__ and "google-cloud-compute" in versions
    assert "boto3" not in versions  # the other cloud's client is not a GCP VM's
    wheel = self_wheel(tmp_path / "home" / "wheels")
    (pinned,) = [p for p in lock.packages if p.name == "spottrain"]
    assert pinned.hashes == (f"sha256:{wheel.sha256}",)
    err = capsys.readouterr().err
    assert f"spottrain is this controller's wheel {wheel.filename}" in err
    assert box_index.count("/simple/spottrain") == asked_before
    # Another index without torch: the lock fails, in pip's words, with the way out.
    box_index.missing = {"torch"}
    try:
        assert cli.main(["lock", job, "--cloud", "gcp", "-o", str(tmp_path / "x.lock")]) == 1
    finally:
        box_index.missing = set()
    err = capsys.readouterr().err
    assert "torch" in err and "--env-lock CLOUD=FILE" in err
    # up refuses an --env-lock for a cloud the run does not use, before anything starts.
    assert cli.main(["up", job, "--env-lock", f"aws={out}"]) == 2
    assert "no aws VM" in capsys.readouterr().err
    assert not (tmp_path / "home" / "runs").exists()


# --- resume -----------------------------------------------------------------------------------


def _run_with_a_given_lock(tmp_path: Path, redis_url: str) -> Any:
    """A run on AWS made by ``up --env-lock`` (no resolution): its lock pins this
    controller's own wheel."""
    from spottrain.controller.run.create import create_run
    from spottrain.controller.run.wheel import self_wheel
    from spottrain.envlock import LockedPackage, make_lock
    from spottrain.spec import load_spec

    wheel = self_wheel(tmp_path / "home" / "wheels")  # the one `up` builds: cached there
    pinned = LockedPackage("spottrain", __version__, (f"sha256:{wheel.sha256}",))
    given = tmp_path / "aws.lock"
    given.write_text(make_lock([pinned], target=LockTarget().describe()).text())
    (tmp_path / "code").mkdir()
    (tmp_path / "store").mkdir()
    (tmp_path / "code" / "train.py").write_text("print('hi')\n")
    data = spec_with(
        _aws_data(), "code", {"archive": {"path": "code", "store": f"file://{tmp_path}/store"}}
    )
    data = spec_with(spec_with(data, "checkpoint.copy_to", ...), "redis", {"url": redis_url})
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(data))
    return create_run(load_spec(job), env_locks={"aws": given})


@pytest.mark.parametrize("edited", ["env-aws.lock", "job-aws.sh", "loader.py", "wheel"])
def test_resume_refuses_a_run_whose_lock_boot_script_or_wheel_was_edited(
    edited: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_server: Any
) -> None:
    """The run's directory keeps the lock, each cloud's job boot, the loader and the wheel
    it shipped; a controller that starts (`spottrain resume`) checks each against the
    sha256 in run.json, so an edited copy never reaches a VM launched later: it stops before
    anything launches, in one line naming the file and the fix."""
    from spottrain.controller.run.records import RunError, RunInfo
    from spottrain.controller.run.wiring import build_controller

    monkeypatch.setenv("SPOTTRAIN_HOME", str(tmp_path / "home"))
    info = _run_with_a_given_lock(tmp_path, redis_server.url)
    build_controller(RunInfo.load(info.run_id))  # as it was shipped: the controller starts
    copies = {
        "env-aws.lock": info.dir / "env-aws.lock",
        "job-aws.sh": info.dir / "boot" / "job-aws.sh",
        "loader.py": info.dir / "boot" / "loader.py",
        "wheel": info.dir / "boot" / str(info.wheel["filename"]),
    }
    path = copies[edited]
    with path.open("ab") as f:
        f.write(b"\n# edited\n")
    with pytest.raises(RunError) as refused:
        build_controller(RunInfo.load(info.run_id))
    said = str(refused.value)
    assert "\n" not in said and str(path) in said, said
    assert "changed" in said and "put the original back" in said and "spottrain up" in said
    path.unlink()
    with pytest.raises(RunError, match=f"{path} cannot be read"):
        build_controller(RunInfo.load(info.run_id))

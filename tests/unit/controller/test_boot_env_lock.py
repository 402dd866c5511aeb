"""A VM's boot installs the run's hashed environment lock (fetched from the run's store by its
sha256, with spottrain's own shipped wheel), rebuilds a venv made from another lock, reuses
one made from this lock (a pre-baked image), and verifies it at every boot. Before, it
installed ``spottrain[agent,aws]==<version>`` from an index that had none, and carried the
lock in the user data, where a big one broke AWS's 16 KB."""

from __future__ import annotations

import gzip
import hashlib
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from spec_samples import COMMIT, VALID, spec_with
from terraform_hcl import block_text, render_template, template_names, terraform_console
from wheelhouse import lock_of, realistic_lock_text

from spottrain.controller.run.boot import (
    BOOT_CONF,
    ENV_LOCK_MARK,
    ENV_LOCK_PATH,
    FETCH_PATH,
    PIP_CONF_PATH,
    VENV,
    WHEEL_DIR,
    BootFile,
    BootFiles,
    CodeRef,
    NodeIdentity,
    render_boot_script,
    render_job_boot,
    render_user_data,
)
from spottrain.controller.run.env_lock import ResolveError, read_lock_file
from spottrain.envlock import lock_sha256, parse_lock
from spottrain.spec import JobSpec, parse_spec

NODE = NodeIdentity("gpt-small-1795000000", "node-3", "aws", "us-east-1a", "p4d.24xlarge")
REDIS = "rediss://redis.internal:6380"
SHA = "ab" * 32
TERRAFORM = Path(__file__).resolve().parents[3] / "terraform"


def _spec(data: dict[str, Any]) -> JobSpec:
    return parse_spec(yaml.safe_dump(data)).spec


def _archive_spec() -> JobSpec:
    return _spec(spec_with(VALID, "code", {"archive": {"path": "."}}))


def _git_spec() -> JobSpec:
    return _spec(
        spec_with(VALID, "code", {"git": {"repo": "https://github.com/a/t", "commit": COMMIT}})
    )


def _render(spec: JobSpec, lock: str | None) -> str:
    return render_boot_script(
        spec,
        NODE,
        REDIS,
        code=CodeRef(f"s3://b/code/{SHA}.tar.gz", SHA),
        password_secret="spottrain/redis",
        env_lock=lock,
    )


def test_the_boot_installs_the_fetched_lock_with_hashes_and_the_shipped_wheel() -> None:
    lock = realistic_lock_text()
    script = _render(_archive_spec(), lock)
    # The lock is fetched from the run's store (pinned by sha256), not carried inline.
    assert lock not in script
    fetch = f"python3 {FETCH_PATH} {BOOT_CONF} lock {ENV_LOCK_PATH}"
    assert fetch in script
    install = (
        f"{VENV}/bin/pip install -q --require-hashes --no-deps --only-binary=:all: "
        f"--find-links {WHEEL_DIR} -r {ENV_LOCK_PATH}"
    )
    assert script.index(fetch) < script.index(install)
    # Nothing is installed by name and range any more.
    assert "pip install -q 'spottrain[agent" not in script
    assert "pip install -q -r /opt/job/requirements.txt" not in script
    # pip's index and its credentials come from a root-only configuration file.
    assert f"pip-config {PIP_CONF_PATH}" in script
    assert f"export PIP_CONFIG_FILE={PIP_CONF_PATH}" in script
    # Verified at every boot, after the (re)build and also when the venv already exists.
    verify = f"{VENV}/bin/python -m spottrain.envlock verify {ENV_LOCK_PATH}"
    fi = script.index("fi\n", script.index(install))
    assert script[fi:].startswith(f"fi\n{verify}\n")
    assert script.index(verify) < script.index("systemctl enable --now spottrain-agent")
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_a_venv_built_from_another_lock_is_rebuilt_and_one_from_this_lock_reused() -> None:
    lock = realistic_lock_text()
    script = _render(_archive_spec(), lock)
    sha = lock_sha256(lock)
    rebuild = f'if [ "$(cat {ENV_LOCK_MARK} 2>/dev/null)" != {sha} ]; then\n'
    assert rebuild in script
    block = script[script.index(rebuild) : script.index("fi\n", script.index(rebuild))]
    assert f"rm -rf {VENV}\n" in block and f"python3 -m venv {VENV}\n" in block
    assert f"echo {sha} > {ENV_LOCK_MARK}\n" in block
    assert "else\n  echo 'the venv in /opt/spottrain/venv was built from this lock" in block
    # Another lock, another mark: the venv of the first lock does not pass for the second.
    other = lock.replace("12.8.4.1", "12.8.4.2", 1)
    assert lock_sha256(other) in _render(_archive_spec(), other)


def test_the_image_check_wants_the_locked_python_and_its_venv_module() -> None:
    spec = _spec(
        spec_with(
            spec_with(VALID, "code", {"archive": {"path": "."}}), "packages", {"python": "3.12"}
        )
    )
    script = _render(spec, realistic_lock_text())
    check = script[script.index("spottrain_stage 'check the image'") :]
    check = check[: check.index("spottrain_stage 'fetch the boot files'")]
    assert '[ "$have" = 3.12 ]' in check
    assert "import venv, ensurepip" in check and "command -v python3" in check


def test_a_git_jobs_requirements_are_installed_constrained_to_the_lock() -> None:
    lock = realistic_lock_text()
    script = _render(_git_spec(), lock)
    assert f"sed -e 's/ --hash=[^ ]*//g' {ENV_LOCK_PATH} > {ENV_LOCK_PATH}.constraints" in script
    constrained = (
        f"{VENV}/bin/pip install -q -c {ENV_LOCK_PATH}.constraints -r /opt/job/requirements.txt"
    )
    assert constrained in script
    verify = f"{VENV}/bin/python -m spottrain.envlock verify {ENV_LOCK_PATH}"
    assert script.index(verify, script.index(constrained)) > script.index(constrained)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_the_constraints_are_the_lock_without_hashes(tmp_path: Path) -> None:
    lock = realistic_lock_text()
    path = tmp_path / "env.lock"
    path.write_text(lock)
    out = subprocess.run(
        ["sed", "-e", "s/ --hash=[^ ]*//g", str(path)], capture_output=True, text=True, check=True
    ).stdout
    pins = [line for line in out.splitlines() if not line.startswith("#")]
    assert pins == [f"{p.name}=={p.version}" for p in parse_lock(lock).packages]


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_a_150_package_lock_leaves_the_user_data_far_below_16_kb(cloud: str) -> None:
    """The user data carries the sha256s, not the files: its size does not grow with the
    lock (AWS refuses user data over 16 KB; GCP a metadata value over 256 KB)."""
    lock, small = lock_of(150), lock_of(40)
    assert len(parse_lock(lock).packages) == 150 and len(lock.encode()) > 15_000
    zone, itype = ("us-east-1a", "p4d.24xlarge") if cloud == "aws" else ("us-central1-a", "a2")
    node = NodeIdentity("gpt-small-1795000000", "node-3", cloud, zone, itype)
    for spec in (_archive_spec(), _git_spec()):
        sizes = []
        for text in (lock, small):
            job = render_job_boot(
                spec,
                cloud,
                node.run_id,
                REDIS,
                code=CodeRef(f"s3://b/code/{SHA}.tar.gz", SHA),
                password_secret="spottrain/redis",
                env_lock=text,
            )
            user = render_user_data(
                spec, node, REDIS, _files(job, text), password_secret="spottrain/redis"
            )
            assert lock_sha256(text) in user and "torch==" not in user
            subprocess.run(["bash", "-n"], input=user, text=True, check=True)
            sizes.append(len(user.encode()))
        assert sizes[0] == sizes[1] < 12 * 1024, sizes


def _files(job: str, lock: str) -> BootFiles:
    base = "s3://a-bucket-with-a-long-name/and/a/prefix/of/some/length/gpt-small/code"
    return BootFiles(
        BootFile(f"{base}/boot/{lock_sha256(job)}.sh", lock_sha256(job)),
        BootFile(f"{base}/boot/{SHA}.py", SHA),
        BootFile(f"{base}/locks/{lock_sha256(lock)}.lock", lock_sha256(lock)),
        BootFile(f"{base}/wheels/{SHA}/spottrain-0.1.0-py3-none-any.whl", SHA),
        "spottrain-0.1.0-py3-none-any.whl",
    )


def test_a_bad_lock_is_refused_before_anything_launches(tmp_path: Path) -> None:
    bad = tmp_path / "aws.lock"
    bad.write_text("-e .\n")
    with pytest.raises(ResolveError, match="not `name==version"):
        read_lock_file(bad, "aws")


def test_a_job_that_installs_an_environment_needs_its_lock() -> None:
    with pytest.raises(ValueError, match="environment lock"):
        _render(_archive_spec(), None)
    image = _spec(spec_with(VALID, "code", {"image": "r/i@sha256:" + "a" * 64}))
    script = _render(image, None)
    assert ENV_LOCK_PATH not in script and "spottrain.envlock" not in script


# --- the Terraform modules' env_lock ---------------------------------------------------------


def _lock_line_pattern(module: str) -> re.Pattern[str]:
    text = block_text((TERRAFORM / module / "variables.tf").read_text(), 'variable "env_lock"')
    rules = re.findall(r'can\(regex\("((?:[^"\\]|\\.)+)", line\)\)', text)
    assert len(rules) == 2, rules  # comments, then packages
    return re.compile(rules[1].replace("\\\\", "\\"))


@pytest.mark.parametrize("module", ["aws", "gcp"])
def test_the_modules_env_lock_accepts_a_lock_and_refuses_anything_else(module: str) -> None:
    pattern = _lock_line_pattern(module)
    for line in realistic_lock_text().splitlines():
        assert line.startswith("#") or pattern.fullmatch(line), line
    h = "sha256:" + "c" * 64
    for bad in [
        "-e .",
        "numpy==2.1.0",
        f"numpy>=2 --hash={h}",
        f"numpy==2.1.0 --index-url https://evil --hash={h}",
        f"numpy==2.1.0 --hash={h}; rm -rf /",
        f"spottrain @ file:///home/me/spottrain.whl --hash={h}",
        "LOCK",
    ]:
        assert not pattern.fullmatch(bad), bad


@pytest.mark.parametrize(
    ("module", "template"), [("aws", "boot.sh.tftpl"), ("gcp", "startup.sh.tftpl")]
)
def test_the_modules_build_the_venv_from_the_lock(module: str, template: str) -> None:
    text = (TERRAFORM / module / template).read_text()
    assert "cat >/etc/spottrain/env.lock <<'LOCK'\n${env_lock}\nLOCK\n" in text
    assert (
        '"$VENV/bin/pip" install -q --require-hashes --no-deps --only-binary=:all: '
        "-r /etc/spottrain/env.lock"
    ) in text
    assert 'rm -rf "$VENV"' in text and '"$VENV/.spottrain-env-lock"' in text
    assert '"$VENV/bin/python" -m spottrain.envlock verify /etc/spottrain/env.lock' in text
    main_tf = (TERRAFORM / module / "main.tf").read_text()
    assert re.search(r"^\s*env_lock\s*=\s*var\.env_lock$", main_tf, re.M)


def _longest_lock() -> str:
    """A lock as long as the modules accept (16,000 characters), of distinct hashes."""
    lines, n = [], 0
    while sum(len(line) + 1 for line in lines) < 16000 - 120:
        h = hashlib.sha256(str(n).encode()).hexdigest()
        lines.append(f"package-{n}==1.{n}.0 --hash=sha256:{h}")
        n += 1
    return "\n".join(lines[:-1]) + "\n"


def test_the_aws_module_with_a_lock_fits_its_user_data_gzipped() -> None:
    text = (TERRAFORM / "aws" / "boot.sh.tftpl").read_text()
    values = {name: "x" * 60 for name in template_names(text)}
    for lock in (realistic_lock_text(), _longest_lock()):
        assert len(lock) <= 16000
        values["env_lock"] = lock.rstrip("\n")
        script = render_template(text, values)
        subprocess.run(["bash", "-n"], input=script, text=True, check=True)
        assert len(gzip.compress(script.encode())) < 16 * 1024
    fleet = (TERRAFORM / "aws" / "fleet.tf").read_text()
    assert "base64encode(local.boot_script) : base64gzip(local.boot_script)" in fleet


@pytest.mark.skipif(shutil.which("terraform") is None, reason="no terraform binary here")
@pytest.mark.parametrize("module", ["aws", "gcp"])
def test_terraform_takes_a_real_lock_and_refuses_a_line_that_is_not_one(module: str) -> None:
    variable = block_text((TERRAFORM / module / "variables.tf").read_text(), 'variable "env_lock"')
    h = "sha256:" + "d" * 64
    cases = [
        (realistic_lock_text(), True),
        ("", True),
        (f"numpy==2.1.0 --hash={h}\n-e .\n", False),
        (f"numpy==2.1.0 --hash={h}\nLOCK\nrm -rf /\n", False),
        (_longest_lock() + _longest_lock(), False),
    ]
    for value, accepted in cases:
        out = terraform_console(variable, "length(var.env_lock)", {"env_lock": value})
        refused = "Error: Invalid value for variable" in out.stderr
        assert refused is not accepted, (value[:80], out.stderr)
        if accepted:
            assert out.stdout.strip() == str(len(value)), out.stderr

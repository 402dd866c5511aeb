"""Nothing from a spec or a lock file runs as code on a VM (issue 26).

The lock reaches a VM's boot only as its sha256 (the VM fetches the file and checks it), and
its parser refuses a line with a control character, the header's comments too; a spec value
that a boot script, an environment file or a systemd unit cannot carry exactly is refused at
validation, in one line naming the field; each value that is carried is quoted for the
shell, or for systemd, that reads it. ``tests/integration/controller/test_boot_fuzz.py``
runs such boots for real, as root; these checks need neither.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from boot_text import whole_boot
from spec_samples import COMMIT, VALID, spec_with
from wheelhouse import realistic_lock_text

from spottrain.controller.run.boot import (
    UNIT_PATH,
    NodeIdentity,
    render_job_boot,
    run_ckpt_dir,
)
from spottrain.controller.run.env_lock import ResolveError, read_lock_file
from spottrain.envlock import LockedPackage, LockError, lock_sha256, make_lock, parse_lock
from spottrain.spec import JobSpec, SpecError, parse_spec

NODE = NodeIdentity("gpt-small-1795000000", "node-3", "aws", "us-east-1a", "p4d.24xlarge")
REDIS = "rediss://redis.internal:6380"
REPO = Path(__file__).resolve().parents[3]


def _spec(data: dict[str, Any]) -> JobSpec:
    return parse_spec(yaml.safe_dump(data)).spec


def _systemd() -> Any:
    """The box's systemd stand-in, whose parsers follow systemd's rules."""
    path = REPO / "tests" / "box" / "standin" / "systemd.py"
    spec = importlib.util.spec_from_file_location("standin_systemd_injection", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# --- the lock -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [
        "# target: python 3.11\x1b]0;owned\x07",
        "# requires: spottrain[agent,aws]==0.1.0\x00$(reboot)",
        "# a comment \x1b[2J",
    ],
)
def test_a_lock_whose_header_holds_a_control_character_is_refused_naming_its_line(
    header: str, tmp_path: Path
) -> None:
    lines = realistic_lock_text().splitlines()
    text = "\n".join([lines[0], header, *lines[1:]]) + "\n"
    with pytest.raises(LockError, match=r"^the lock:2: holds the control character"):
        parse_lock(text)
    given = tmp_path / "aws.lock"
    given.write_text(text)
    with pytest.raises(ResolveError) as refused:
        read_lock_file(given, "aws")
    said = str(refused.value)
    assert "\n" not in said and f"{given}:2:" in said and "\x1b" not in said


def test_a_lock_is_not_made_with_a_header_or_package_it_would_not_read_back() -> None:
    pinned = LockedPackage("spottrain", "0.1.0", ("sha256:" + "ab" * 32,))
    with pytest.raises(LockError, match="header"):
        make_lock([pinned], target="python 3.11\n# requires: evil")
    with pytest.raises(LockError, match="header"):
        make_lock([pinned], requires=["spottrain\r-r https://evil/req.txt"])
    bad = LockedPackage("alpha", "1.0\nevil==6.6.6", ("sha256:" + "cd" * 32,))
    with pytest.raises(LockError, match="'alpha': a package's name, version or URL"):
        make_lock([pinned, bad])


def test_nothing_of_a_lock_but_its_sha256_reaches_a_vms_boot() -> None:
    target = "python 3.11 'zqmark\"$(x)`y`"
    text = realistic_lock_text().replace("python 3.11 cp manylinux_2_28_x86_64", target)
    assert parse_lock(text).target == target
    lines = text.splitlines()
    spec = _spec(spec_with(VALID, "code", {"archive": {"path": "."}}))
    script = whole_boot(spec, NODE, REDIS, lock=text)
    assert "zqmark" not in script and lock_sha256(text) in script
    assert not [line for line in lines[2:] if line in script]


# --- the spec -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "value", "said"),
    [
        ("train.command", ["python", "train.py", "--x", "1\ntouch /tmp/x"], "a newline"),
        ("train.env", {"HF_HOME": "/data\x00/hf"}, "a NUL"),
        ("checkpoint.volume.path", "/fsx/ckpt\r\nExecStartPre=/bin/sh", "a carriage return"),
        ("wandb", {"project": "llm\x1b[2J"}, "the control character U+001B"),
        ("code", {"git": {"repo": "https://x/y\nz", "commit": COMMIT}}, "a newline"),
    ],
)
def test_spec_text_a_boot_cannot_carry_is_refused_in_one_line_naming_the_field(
    path: str, value: Any, said: str
) -> None:
    with pytest.raises(SpecError) as refused:
        parse_spec(yaml.safe_dump(spec_with(VALID, path, value)))
    (problem,) = refused.value.problems
    assert problem.startswith(path) and f"holds {said}" in problem, problem
    assert "\n" not in problem and "\r" not in problem and "\x1b" not in problem


def test_a_clone_url_git_would_read_as_an_option_is_refused() -> None:
    repo = "--upload-pack=touch /tmp/owned"
    with pytest.raises(SpecError) as refused:
        parse_spec(
            yaml.safe_dump(spec_with(VALID, "code", {"git": {"repo": repo, "commit": COMMIT}}))
        )
    (problem,) = refused.value.problems
    assert problem.startswith("code.git.repo") and "cannot start with a dash" in problem
    assert "upload-pack" not in problem  # a clone URL is never echoed


def test_a_git_subdir_reaches_the_shell_as_one_quoted_word() -> None:
    subdir = "src dir;$(touch owned)`id`'\""
    git = {"repo": "https://x/y", "commit": COMMIT, "subdir": subdir}
    script = whole_boot(_spec(spec_with(VALID, "code", {"git": git})), NODE, REDIS)
    path = f"/opt/job/{subdir}/requirements.txt"
    (line,) = [x for x in script.splitlines() if x.startswith("if [ -f ")]
    assert _split(shlex.split, line) == ["if", "[", "-f", path, "];", "then"]
    (pip,) = [x for x in script.splitlines() if "pip install -q -c" in x]
    assert _split(shlex.split, pip)[-1] == path


def _resolved(value: str) -> str:
    """A unit setting once systemd resolved its specifiers: each ``%`` written as ``%%``
    (any other would become the unit's name, its host's...)."""
    assert re.fullmatch(r"([^%]|%%)*", value), f"a % specifier in {value!r}"
    return value.replace("%%", "%")


def _split(split: Any, value: str) -> list[str]:
    """``split(value)``, or what made it fail (unbalanced quotes)."""
    try:
        return list(split(value))
    except ValueError as e:
        return [f"cannot be split: {e}"]


@pytest.mark.parametrize(
    "volume",
    ["/data/my ckpt", "/data/$HOME/${X}/$$", "/data/100%/%n", "/data/q\"u'o\\te", "/d/\ttab"],
)
def test_the_units_drop_in_names_the_volume_and_the_runs_directory_exactly(volume: str) -> None:
    """As systemd reads the drop-in: % is a specifier everywhere (%% a %), and an Exec line
    substitutes $NAME and ${NAME} (quoted or not; $$ is a $)."""
    systemd = _systemd()
    spec = _spec(spec_with(VALID, "checkpoint.volume.path", volume))
    job = render_job_boot(spec, "aws", NODE.run_id, REDIS, env_lock=None)
    body = job[job.index(f"cat > {UNIT_PATH}.d/job.conf <<'UNIT'\n") :].split("\n", 1)[1]
    drop_in = body[: body.index("\nUNIT\n") + 1]
    said = {a.key: _resolved(a.value) for a in systemd.parse_unit_text(drop_in, "job.conf")}
    assert _split(systemd.split_words, said["RequiresMountsFor"]) == [volume]
    env = {"HOME": "/root", "X": "x"}
    mkdir = _split(lambda v: systemd.parse_exec(v).expand(env), said["ExecStartPre"])
    assert mkdir == ["/bin/mkdir", "-p", run_ckpt_dir(spec, NODE)]


def test_a_here_document_is_never_ended_by_a_line_of_its_text(tmp_path: Path) -> None:
    from spottrain.controller.run.boot import heredoc

    text = "A=1\nENV\nENV_\n$(touch owned)\n`touch owned`\n"
    script = heredoc("cat", text, "ENV")
    assert script.startswith("cat <<'ENV__'\n")
    done = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert done.stdout == text and not (tmp_path / "owned").exists()
    with pytest.raises(ValueError, match="NUL"):
        heredoc("cat", "A=\x00\n", "ENV")

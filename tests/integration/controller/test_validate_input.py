"""``spottrain validate`` and ``spottrain up`` on hostile or mistaken spec files, as a user
runs them: secrets never printed back, binary and oversized files and alias bombs refused
with exit 2 and no traceback, and a spec parsed once per process."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from spec_samples import VALID, spec_with

from spottrain.controller.cli import main as cli
from spottrain.controller.run.create import create_run
from spottrain.controller.run.records import RunInfo
from spottrain.controller.run.run_redis import stop_embedded_redis
from spottrain.controller.run.wiring import build_controller
from spottrain.spec import load_spec

REPO = Path(__file__).resolve().parents[3]
SECRET = "sk-live-Zq8vR2mN5xT7"
# Address space for one `spottrain validate` (it needs about 200 MiB): an alias bomb that
# expanded would run out of it instead of taking the machine's memory.
MEMORY_CAP = 512 * 1024 * 1024


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


def _validate(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spottrain.controller.cli", "validate", str(path), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        preexec_fn=_cap_memory,
    )


def _write(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize(
    ("path", "value", "names"),
    [
        ("redis.password_env", SECRET, "redis.password_env (line 40): not an environment"),
        ("redis.url", f"redis://cache.internal:{SECRET}", "redis.url (line 38): Redis endpoint"),
        ("train.env", {"WANDB_API_KEY": [SECRET]}, "train.env (line 11): must be a valid string"),
        ("train.env", f"WANDB_API_KEY={SECRET}", "train.env (line 10): must be a valid dict"),
        (
            "code",
            {"git": f"https://deploy:{SECRET}@github.com/acme/train.git"},
            "code.git (line 3): must be a valid dictionary",
        ),
    ],
)
def test_validate_never_prints_a_secret_in_text_or_json(
    tmp_path: Path, path: str, value: Any, names: str
) -> None:
    spec = _write(tmp_path, spec_with(VALID, path, value))
    human = _validate(spec)
    assert human.returncode == 2, human.stderr
    assert names in human.stderr
    assert SECRET not in human.stdout + human.stderr
    as_json = _validate(spec, "--json")
    assert as_json.returncode == 2, as_json.stderr
    assert SECRET not in as_json.stdout + as_json.stderr
    (problem,) = json.loads(as_json.stdout)["problems"]
    assert problem.startswith(names)


def test_validate_on_a_binary_file_exits_2_without_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_bytes(bytes(range(256)) * 4)
    out = _validate(path)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.splitlines()[1] == (
        "  not a text file: byte 0x80 at offset 128 is not UTF-8; give the job spec's YAML file"
    )


def test_validate_refuses_a_file_past_the_cap_naming_its_size(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(VALID) + "#" * (50 * 1024 * 1024))
    out = _validate(path, "--json")
    assert out.returncode == 2
    assert json.loads(out.stdout)["problems"] == [
        f"the spec is {path.stat().st_size:,} bytes; a job spec may be at most 1 MiB "
        "(1,048,576 bytes): is this the right file?"
    ]


def test_validate_refuses_an_alias_bomb_within_a_small_memory_cap(tmp_path: Path) -> None:
    # 9**9 strings from 500 bytes: expanded, it would need tens of GiB.
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 10)]
    path = tmp_path / "job.yaml"
    path.write_text("\n".join(lines) + "\n")
    out = _validate(path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert "once its YAML aliases (*name) are expanded" in out.stderr


@pytest.fixture
def loader_count(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """How many YAML loaders (one per parse, C or Python) were made since the fixture."""
    made = [0]
    real = yaml.resolver.BaseResolver.__init__

    def counting(self: Any) -> None:
        made[0] += 1
        real(self)

    monkeypatch.setattr(yaml.resolver.BaseResolver, "__init__", counting)
    return lambda: made[0]


def test_validate_parses_the_spec_once(
    tmp_path: Path, loader_count: Callable[[], int], capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, spec_with(VALID, "checkpoint.volume.write_gbps", 8))
    before = loader_count()
    assert cli.main(["validate", str(path)]) == 0
    assert loader_count() - before == 1
    assert "valid job spec" in capsys.readouterr().out


def _local_spec(tmp_path: Path) -> dict[str, Any]:
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text("print('never runs')\n")
    return {
        "name": "once",
        "code": {"archive": {"path": str(code)}},
        "train": {"command": "train.py"},
        "nodes": {"min": 1, "max": 1, "gpus": 0},
        "resources": {"clouds": ["local"]},
        "budget": {"max_usd": 5},
        "checkpoint": {
            "volume": {"path": str(tmp_path / "vol"), "write_gbps": 1},
            "every_steps": 5,
        },
        "local": {"zones": {"local-a": {"capacity": 1}}},
    }


def test_up_parses_the_spec_once_and_records_the_text_it_validated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loader_count: Callable[[], int]
) -> None:
    monkeypatch.setenv("SPOTTRAIN_HOME", str(tmp_path / "home"))
    path = _write(tmp_path, _local_spec(tmp_path))
    text = path.read_text()
    before = loader_count()
    # What `spottrain up` does before its first controller pass, in one process.
    loaded = load_spec(path)
    path.write_text("edited: after it was validated\n")
    info = create_run(loaded)
    try:
        ctl = build_controller(info)
        assert ctl.spec is loaded.spec
        assert loader_count() - before == 1
        # The run records what was validated, not what the file says now.
        assert RunInfo.load(info.run_id).spec_text == text
    finally:
        stop_embedded_redis(info)

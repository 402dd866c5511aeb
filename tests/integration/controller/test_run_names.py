"""Naming a run on the command line: an empty name (an unset shell variable) or a name that
cannot be a run id is bad input, never "the newest run"."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from spottrain.controller.cli import main as cli
from spottrain.controller.run.records import RunError, RunInfo, find_run


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("SPOTTRAIN_HOME", str(home))
    # One run on this machine, so "the newest run" exists and an empty name could pick it.
    RunInfo(
        run_id="tiny-1732270000",
        spec_text="",
        spec_source="job.yaml",
        base_dir=str(tmp_path),
        redis_url="redis://127.0.0.1:9/0",
        embedded_redis=False,
        created_at=time.time(),
    ).save()
    return home


@pytest.mark.parametrize("name", ["", "   "])
def test_find_run_refuses_an_empty_name(home: Path, name: str) -> None:
    with pytest.raises(RunError, match="the run name is empty"):
        find_run(name)


@pytest.mark.parametrize("name", ["..", "../runs", "a/b"])
def test_find_run_refuses_a_name_that_is_no_run_id(home: Path, name: str) -> None:
    with pytest.raises(RunError, match="is not a run id or job name"):
        find_run(name)


def test_find_run_without_a_name_is_the_newest_run(home: Path) -> None:
    assert find_run(None).run_id == "tiny-1732270000"


@pytest.mark.parametrize("command", ["down", "status", "logs", "resume", "report"])
def test_every_run_command_exits_2_on_an_empty_name(
    home: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main([command, ""]) == 2
    err = capsys.readouterr().err
    assert "the run name is empty" in err
    # Nothing acted on the run that an empty name would have picked.
    assert json.loads((home / "runs" / "tiny-1732270000" / "run.json").read_text())
    assert not (home / "runs" / "tiny-1732270000" / "summary.json").exists()


def test_scale_exits_2_on_an_empty_name(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["scale", "1", ""]) == 2
    assert "the run name is empty" in capsys.readouterr().err

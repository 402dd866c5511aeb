"""An image job's agent reads the job's secret variables from the root-only file its VM's
boot wrote (JSON lines): each value exact, and a file that is not one refused in one line
that names the file and line but never a value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spottrain.agent.agent import read_secret_env


def test_values_arrive_exact_and_none_is_read_without_a_file(tmp_path: Path) -> None:
    values = {"HF_TOKEN": "a\"b'c$d\\e`f` g\t", "K2": "é ü 東京"}
    path = tmp_path / "secret-env.jsonl"
    path.write_text("".join(json.dumps({"name": k, "value": v}) + "\n" for k, v in values.items()))
    assert read_secret_env(str(path)) == values
    assert read_secret_env("") == {}


@pytest.mark.parametrize(
    "line",
    [
        '{"name": "HF_TOKEN", "value": "sk-live-123456"',  # cut short
        '{"name": "BAD NAME", "value": "sk-live-123456"}',
        '{"name": "HF_TOKEN", "value": 123456}',
        '["HF_TOKEN", "sk-live-123456"]',
        '{"name": "HF_TOKEN", "value": "sk-live\\u0000123456"}',
    ],
)
def test_a_line_that_is_not_a_variable_is_refused_without_its_value(
    line: str, tmp_path: Path
) -> None:
    path = tmp_path / "secret-env.jsonl"
    path.write_text('{"name": "OK", "value": "v"}\n' + line + "\n")
    with pytest.raises(ValueError) as refused:
        read_secret_env(str(path))
    said = str(refused.value)
    assert said.startswith(f"{path}:2: ") and "boot a new VM" in said
    assert "sk-live" not in said and "123456" not in said and "\n" not in said


def test_a_file_the_agent_cannot_read_says_why_and_the_fix(tmp_path: Path) -> None:
    missing = tmp_path / "gone.jsonl"
    with pytest.raises(ValueError) as refused:
        read_secret_env(str(missing))
    said = str(refused.value)
    assert f"cannot read the job's secret variables from {missing}" in said
    assert "as root" in said

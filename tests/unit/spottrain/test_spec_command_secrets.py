"""A credential written into ``train.command`` is refused by validation, never echoed, with the
fix (``train.secret_env``); a false positive is accepted by listing it in
``train.not_secrets``. The command travels in every VM's boot script and the run's events."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from spec_samples import VALID, spec_with

from spottrain.spec import SpecError, parse_spec
from spottrain.spec.command_secrets import find_credential

HF = "hf_" + "a1B2c3D4e5" * 4
GH = "ghp_" + "Z9y8X7w6V5" * 4
# Built here, not written whole: a made-up key id that scanners would still take for one.
AWS_KEY_ID = "AK" + "IA" + "ABCDEFGHIJKLMNOP"


def _problems(command: Any, **train: Any) -> list[str]:
    data = spec_with(VALID, "train.command", command)
    for key, value in train.items():
        data = spec_with(data, f"train.{key}", value)
    with pytest.raises(SpecError) as err:
        parse_spec(yaml.safe_dump(data), "job.yaml")
    return err.value.problems


@pytest.mark.parametrize(
    ("command", "where"),
    [
        (["train.py", "--hf-token", HF], "argument 2, the value of --hf-token"),
        (f"train.py --hf-token={HF}", "argument 1, the value of --hf-token"),
        (["train.py", "--api-key", "s3cr3t-value"], "argument 2, the value of --api-key"),
        (["train.py", "--wandb_api_key", "abcdefabcdef"], "the value of --wandb_api_key"),
        (["train.py", "--Password", "hunter2hunter2"], "the value of --Password"),
        (["train.py", "--resume", GH], "argument 2, which has the shape of a GitHub token"),
        (["train.py", "--data", f"https://hf.co/d?token={HF}"], "shape of a Hugging Face token"),
        (["train.py", AWS_KEY_ID], "the shape of an AWS access key id"),
        (["train.py", "--db", "postgres://u:pw@db:5432/x"], "a URL with credentials"),
    ],
)
def test_a_credential_in_the_command_is_refused_without_echoing_it(
    command: Any, where: str
) -> None:
    (problem,) = _problems(command)
    assert where in problem and "looks like a credential" in problem
    assert "train.secret_env" in problem and "train.not_secrets" in problem
    for secret in (HF, GH, "s3cr3t-value", "hunter2hunter2", AWS_KEY_ID, ":pw@"):
        assert secret not in problem


@pytest.mark.parametrize(
    "command",
    [
        ["train.py", "--token-file", "/run/secrets/hf"],
        ["train.py", "--password-env", "DB_PASSWORD"],
        ["train.py", "--max-tokens", "4096", "--tokenizer", "gpt2"],
        ["train.py", "--secret-name", "prod/hf"],
        ["train.py", "--use-token"],  # a switch with no value
        ["train.py", "--hf-token", "--lr", "3e-4"],  # no value follows
        ["train.py", "--data", "https://host/data?x=1"],
    ],
)
def test_what_only_names_where_a_credential_is_passes(command: list[str]) -> None:
    assert find_credential(command) is None
    parse_spec(yaml.safe_dump(spec_with(VALID, "train.command", command)), "job.yaml")


def test_a_false_positive_is_accepted_by_naming_it() -> None:
    command = ["train.py", "--eval-token", "128", "--seed", HF]
    assert _problems(command)
    spec = parse_spec(
        yaml.safe_dump(
            spec_with(
                spec_with(VALID, "train.command", command),
                "train.not_secrets",
                ["--eval-token", HF],
            )
        ),
        "job.yaml",
    ).spec
    assert spec.train.command == tuple(command)
    # Naming one is not naming the other.
    assert _problems(command, not_secrets=["--eval-token"])

"""The job spec's edge against hostile or mistaken input: numbers past any real setting,
YAML that expands or nests without bound, malformed YAML whose words would quote the file,
and secrets that an error must never print back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from spec_samples import LOCAL, VALID, spec_with

from spottrain.spec import MAX_SPEC_BYTES, SpecError, load_spec, parse_spec

SECRET = "sk-live-Zq8vR2mN5xT7"


def _problems(data: dict[str, Any]) -> list[str]:
    return _problems_of(yaml.safe_dump(data, sort_keys=False))


def _problems_of(text: str) -> list[str]:
    with pytest.raises(SpecError) as err:
        parse_spec(text, "job.yaml")
    return err.value.problems


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        (
            "resources.max_price_per_hour",
            float("inf"),
            "resources.max_price_per_hour (line 24): use a number above 0 up to 1,000 USD per "
            "VM-hour (got inf)",
        ),
        (
            "resources.max_price_per_hour",
            1e308,
            "resources.max_price_per_hour (line 24): use a number above 0 up to 1,000 USD per "
            "VM-hour (got 1e+308)",
        ),
        (
            "resources.max_price_per_hour",
            float("nan"),
            "resources.max_price_per_hour (line 24): use a number above 0 up to 1,000 USD per "
            "VM-hour (got nan)",
        ),
        (
            "budget.max_usd",
            float("inf"),
            "budget.max_usd (line 29): use a number above 0 up to 100,000,000 USD (got inf)",
        ),
        (
            "budget.max_usd",
            1e308,
            "budget.max_usd (line 29): use a number above 0 up to 100,000,000 USD (got 1e+308)",
        ),
        (
            "checkpoint.volume.write_gbps",
            float("inf"),
            "checkpoint.volume.write_gbps (line 33): use a number above 0 up to 10,000 GB/s "
            "(got inf)",
        ),
        (
            "checkpoint.volume.write_gbps",
            1e6,
            "checkpoint.volume.write_gbps (line 33): use a number above 0 up to 10,000 GB/s "
            "(got 1000000.0)",
        ),
        (
            "checkpoint.size_gb",
            1e308,
            "checkpoint.size_gb (line 37): use a number above 0 up to 1,000,000 GB (got 1e+308)",
        ),
        (
            "checkpoint.bytes_per_param",
            float("inf"),
            "checkpoint.bytes_per_param (line 37): use a number above 0 up to 64 bytes per "
            "parameter (got inf)",
        ),
        (
            "checkpoint.params",
            "9" * 400,
            "checkpoint.params (line 35): use a parameter count up to 1000T (1e15) (got "
            "'99999999999999999999999999999999999999999999999999999999...)",
        ),
        (
            "checkpoint.every_minutes",
            float("inf"),
            "checkpoint.every_minutes (line 37): use a number above 0 up to 10,080 minutes (a "
            "week) (got inf)",
        ),
        (
            "spot.fallback_after_minutes",
            float("-inf"),
            "spot.fallback_after_minutes (line 27): use a number above 0 up to 10,080 minutes "
            "(a week) (got -inf)",
        ),
        (
            "resources.move_after_minutes",
            1e308,
            "resources.move_after_minutes (line 25): use a number above 0 up to 10,080 minutes "
            "(a week) (got 1e+308)",
        ),
        (
            "nodes.max",
            float("inf"),
            "nodes.max (line 12): must be a finite number from 1 to 100,000 (got inf)",
        ),
    ],
)
def test_non_finite_and_absurd_numbers_are_refused_with_the_range(
    path: str, value: Any, expected: str
) -> None:
    assert _problems(spec_with(VALID, path, value)) == [expected]


def test_local_cloud_numbers_are_bounded_too() -> None:
    data = spec_with(LOCAL, "local.preemptions", {"rate_per_hour": float("inf")})
    assert _problems(data) == [
        "local.preemptions.rate_per_hour (line 29): use a number from 0 up to 3,600 per "
        "node-hour (got inf)"
    ]
    data = spec_with(LOCAL, "local.zones", {"local-a": {"capacity": 10**12}})
    assert _problems(data) == [
        "local.zones.local-a.capacity (line 25): must be less than or equal to 100000 "
        "(got 1000000000000)"
    ]


def test_numbers_at_their_bounds_are_accepted() -> None:
    data = spec_with(VALID, "resources.max_price_per_hour", 1000)
    data = spec_with(data, "budget.max_usd", 100_000_000)
    data = spec_with(data, "checkpoint.volume.write_gbps", 10_000)
    spec = parse_spec(yaml.safe_dump(data), "job.yaml").spec
    assert spec.resources.max_price_per_hour == 1000
    assert spec.budget.max_usd == 100_000_000
    assert spec.checkpoint.volume.write_gbps == 10_000


def _bomb(levels: int) -> str:
    """The billion-laughs spec: ``levels`` lists of nine aliases to the list before,
    9**levels strings in all, from a few hundred bytes."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels + 1):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_before_it_expands() -> None:
    text = _bomb(9)  # 387,420,489 strings
    assert len(text) < 600
    assert _problems_of(text) == [
        "the spec holds more than 100,000 values once its YAML aliases (*name) are expanded; "
        "a job spec needs a few hundred: write the values out, or drop the aliases"
    ]


def test_aliases_that_stay_small_are_allowed() -> None:
    text = yaml.safe_dump(spec_with(LOCAL, "local", ...), sort_keys=False)
    text += "local:\n  zones:\n    local-a: &zone {capacity: 2}\n    local-b: *zone\n"
    spec = parse_spec(text, "job.yaml").spec
    assert spec.local is not None
    assert {z: c.capacity for z, c in spec.local.zones.items()} == {"local-a": 2, "local-b": 2}


def test_an_alias_inside_itself_and_deep_nesting_are_refused() -> None:
    assert _problems_of("name: &loop [*loop]\n") == [
        "not valid YAML for a job spec: an alias (*name) at line 1 refers to a node that "
        "contains it"
    ]
    deep = "name: " + "[" * 200 + "]" * 200 + "\n"
    assert _problems_of(deep) == [
        "the spec is nested more than 32 levels deep; a job spec needs a few (see the "
        "README's job spec reference)"
    ]


@pytest.mark.parametrize(
    "password",
    # unterminated; unquoted, read as an alias or as a tag
    [f'"{SECRET}', f"*{SECRET}", f"!{SECRET}"],
)
def test_yaml_errors_name_the_place_but_never_quote_the_line(password: str) -> None:
    text = f"name: tiny\nredis:\n  password_env: {password}\n"
    (problem,) = _problems_of(text)
    assert problem.startswith("not valid YAML: ") and "(line " in problem
    assert SECRET not in problem


@pytest.mark.parametrize("value", ["2020-13-45", "!!int abcdefgh", "!!float abcdefgh"])
def test_a_scalar_that_is_not_its_type_is_a_clear_error(value: str) -> None:
    (problem,) = _problems_of(f"name: {value}\n")
    assert problem.startswith("not valid YAML: a value cannot be read as its type")
    assert "abcdefgh" not in problem


def test_text_past_the_size_cap_is_refused() -> None:
    text = "name: tiny\n" + "#" * MAX_SPEC_BYTES
    (problem,) = _problems_of(text)
    assert problem == (
        f"the spec is {len(text):,} characters; a job spec may be at most 1 MiB (1,048,576 "
        "bytes): is this the right file?"
    )


def test_a_file_past_the_size_cap_is_refused_after_reading_only_the_cap(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(LOCAL) + "#" * MAX_SPEC_BYTES)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert err.value.problems == [
        f"the spec is {path.stat().st_size:,} bytes; a job spec may be at most 1 MiB "
        "(1,048,576 bytes): is this the right file?"
    ]


def test_a_binary_file_is_refused_as_not_text(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_bytes(b"name: tiny\n\xff\xfe\x00\x01binary")
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert err.value.problems == [
        "not a text file: byte 0xff at offset 11 is not UTF-8; give the job spec's YAML file"
    ]


# Each place a secret may be written, the value there, and the words the error must still
# give (the key, its line, the fix).
SECRET_PLACES = [
    (
        "redis.password_env",
        SECRET,
        "redis.password_env (line 40): not an environment variable name (letters, digits and "
        "_, not starting with a digit): give the variable's name, never its value",
    ),
    (
        "redis.password_env",
        f"{SECRET} x",
        "redis.password_env (line 40): not an environment variable name (letters, digits and "
        "_, not starting with a digit): give the variable's name, never its value",
    ),
    (
        "redis.url",
        f"redis://cache.internal:{SECRET}",
        "redis.url (line 38): Redis endpoint (hidden): port (hidden) must be a number from 1 "
        "to 65535",
    ),
    ("redis.password_file", [SECRET], "redis.password_file (line 40): must be a valid string"),
    (
        "redis.token",
        SECRET,
        "redis (line 40): unknown key; allowed here: url, password_env, password_file, "
        "password_secret",
    ),
    ("redis", SECRET, "redis (line 37): must be a valid dictionary or instance of RedisSpec"),
    ("train.env", {"WANDB_API_KEY": [SECRET]}, "train.env (line 11): must be a valid string"),
    ("train.env", {"WANDB_API_KEY": 7.5e9}, "train.env (line 11): must be a valid string"),
    (
        "train.env",
        {f"WANDB_API_KEY={SECRET}": "x"},
        "train.env (line 11): not an environment variable name (letters, digits and _, not "
        "starting with a digit): give the variable's name, never its value",
    ),
    ("train.env", f"WANDB_API_KEY={SECRET}", "train.env (line 10): must be a valid dictionary"),
    ("train.env", [f"WANDB_API_KEY={SECRET}"], "train.env (line 10): must be a valid dictionary"),
    (
        "code",
        {"git": f"https://deploy:{SECRET}@github.com/acme/train.git"},
        "code.git (line 3): must be a valid dictionary or instance of GitSource (got "
        "'https://***@github.com/acme/train.git')",
    ),
    (
        "checkpoint.copy_to",
        f"https://AKIA:{SECRET}@bucket.example/ckpt",
        "checkpoint.copy_to (line 36): use s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or "
        "file:///DIR (got 'https://***@bucket.example/ckpt')",
    ),
]


@pytest.mark.parametrize(("path", "value", "expected"), SECRET_PLACES)
def test_a_secret_is_never_echoed_but_the_key_and_fix_are(
    path: str, value: Any, expected: str
) -> None:
    assert _problems(spec_with(VALID, path, value)) == [expected]

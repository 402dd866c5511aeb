"""Unit tests of the Redis key schema (spottrain.protocol.keys): pure, no Redis."""

from __future__ import annotations

import dataclasses
import fnmatch

import pytest

from spottrain.protocol import keys as keys_module
from spottrain.protocol.keys import (
    DEFAULT_PREFIX,
    RunKeys,
    make_run_id,
    parse_run_id,
    validate_job_name,
    validate_run_id,
)

EPOCH = 1732270000


def all_keys(k: RunKeys) -> list[str]:
    """Every key a run can own, with sample node ids and store keys."""
    return [
        k.rdzv_state,
        k.rdzv_presence,
        k.rdzv_gone,
        k.rdzv_members,
        k.rdzv_view,
        k.store_key("rank0/addr"),
        k.store_key("{not-a-tag}"),
        k.nodes,
        k.node("gpu-node-1"),
        k.node("10.0.0.7"),
        k.heartbeat("gpu-node-1"),
        k.events,
        k.progress,
    ]


def cluster_hash_tag(key: str) -> str:
    """The part of ``key`` Redis Cluster hashes: the text between the first '{' and the next
    '}' when it is non-empty, else the whole key."""
    start = key.find("{")
    if start == -1:
        return key
    end = key.find("}", start + 1)
    if end == -1 or end == start + 1:
        return key
    return key[start + 1 : end]


# -- job names ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["a", "7", "train-gpt", "llama3-70b", "a" * 48, "a" + "-" * 46 + "b", "0-0"],
)
def test_a_valid_job_name_is_returned_unchanged(name: str) -> None:
    assert validate_job_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("", id="empty"),
        pytest.param("Train", id="uppercase"),
        pytest.param("-train", id="leading-dash"),
        pytest.param("train-", id="trailing-dash"),
        pytest.param("train_gpt", id="underscore"),
        pytest.param("train.gpt", id="dot"),
        pytest.param("train gpt", id="space"),
        pytest.param("trän", id="non-ascii"),
        pytest.param("a" * 49, id="49-chars"),
        pytest.param("train\ngpt", id="inner-newline"),
    ],
)
def test_an_invalid_job_name_is_refused_with_the_rule_in_the_message(name: str) -> None:
    with pytest.raises(ValueError) as err:
        validate_job_name(name)
    message = str(err.value)
    assert repr(name) in message
    assert "1-48 lowercase letters, digits and dashes" in message
    assert "starting and ending with a letter or digit" in message


def test_a_job_name_with_a_trailing_newline_is_refused() -> None:
    with pytest.raises(ValueError):
        validate_job_name("train\n")


# -- run ids ------------------------------------------------------------------------------


def test_a_run_id_is_the_job_name_dash_the_launch_epoch() -> None:
    assert make_run_id("train-gpt", EPOCH) == f"train-gpt-{EPOCH}"


@pytest.mark.parametrize(
    ("name", "epoch"),
    [
        ("train-gpt", EPOCH),
        ("a", EPOCH),
        ("job-2024", EPOCH),  # a name ending in digits is still split at the last dash
        ("x" * 48, EPOCH),
        ("train", 100_000_000),  # 9 digits: the smallest epoch parse_run_id accepts
        ("train", 999_999_999_999),  # 12 digits: the largest
    ],
)
def test_parse_run_id_returns_the_name_and_epoch_make_run_id_was_given(
    name: str, epoch: int
) -> None:
    assert parse_run_id(make_run_id(name, epoch)) == (name, epoch)


def test_make_run_id_without_an_epoch_uses_the_current_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(keys_module.time, "time", lambda: EPOCH + 0.75)
    assert make_run_id("train") == f"train-{EPOCH}"


def test_a_run_id_made_now_round_trips() -> None:
    name, epoch = parse_run_id(make_run_id("train-gpt"))
    assert name == "train-gpt"
    assert epoch > 1_700_000_000


@pytest.mark.parametrize("epoch", [0, -1, -EPOCH])
def test_make_run_id_refuses_a_launch_epoch_that_is_not_unix_seconds(epoch: int) -> None:
    with pytest.raises(ValueError, match="launch epoch must be unix seconds"):
        make_run_id("train", epoch)


def test_make_run_id_refuses_an_invalid_job_name() -> None:
    with pytest.raises(ValueError, match="1-48 lowercase letters"):
        make_run_id("Train_GPT", EPOCH)


def test_every_run_id_make_run_id_returns_can_be_parsed_back() -> None:
    for epoch in (1, 5, 12_345_678, 10**12):
        try:
            run_id = make_run_id("train", epoch)
        except ValueError:
            continue  # refusing the epoch up front is also fine
        assert parse_run_id(run_id) == ("train", epoch)


@pytest.mark.parametrize(
    "run_id",
    [
        "",
        "train",
        f"train{EPOCH}",
        "train-abc",
        "train-12345678",  # 8-digit epoch
        "train-1234567890123",  # 13-digit epoch
        f"Train-{EPOCH}",
        f"-{EPOCH}",
        f"train_gpt-{EPOCH}",
        f"train-{EPOCH}-extra",
    ],
)
def test_parse_run_id_refuses_strings_make_run_id_cannot_produce(run_id: str) -> None:
    with pytest.raises(ValueError, match="is not a spottrain run id"):
        parse_run_id(run_id)


def test_a_relaunch_under_the_same_name_gets_a_different_run_id_and_disjoint_keys() -> None:
    first = RunKeys(make_run_id("train-gpt", EPOCH))
    relaunch = RunKeys(make_run_id("train-gpt", EPOCH + 60))

    assert first.run_id != relaunch.run_id
    assert set(all_keys(first)).isdisjoint(all_keys(relaunch))
    assert not any(fnmatch.fnmatchcase(key, first.pattern) for key in all_keys(relaunch))
    assert not any(fnmatch.fnmatchcase(key, relaunch.pattern) for key in all_keys(first))


def test_a_run_id_that_is_a_prefix_of_another_does_not_share_its_keys() -> None:
    short, long = RunKeys("train-1"), RunKeys("train-10")
    assert not any(fnmatch.fnmatchcase(key, short.pattern) for key in all_keys(long))


# -- RunKeys validation -------------------------------------------------------------------


@pytest.mark.parametrize("run_id", ["train-gpt-1732270000", "my_job.v2", "x" * 128, "A-b_c.9"])
def test_run_keys_accepts_any_run_id_torchrun_may_pass(run_id: str) -> None:
    assert validate_run_id(run_id) == run_id
    assert RunKeys(run_id).run_id == run_id


@pytest.mark.parametrize(
    "run_id",
    [
        pytest.param("", id="empty"),
        pytest.param("a b", id="space"),
        pytest.param("a:b", id="colon"),
        pytest.param("a{b", id="open-brace"),
        pytest.param("a}b", id="close-brace"),
        pytest.param("a*", id="glob-star"),
        pytest.param("a?", id="glob-question"),
        pytest.param("a[1]", id="glob-bracket"),
        pytest.param("a/b", id="slash"),
        pytest.param("x" * 129, id="129-chars"),
    ],
)
def test_run_keys_refuses_a_run_id_unsafe_for_keys(run_id: str) -> None:
    with pytest.raises(ValueError, match="1-128 letters, digits"):
        RunKeys(run_id)


@pytest.mark.parametrize(
    "prefix",
    [
        pytest.param("", id="empty"),
        pytest.param("a:b", id="colon"),
        pytest.param("a{", id="brace"),
        pytest.param("a b", id="space"),
        pytest.param("a*", id="glob"),
        pytest.param("x" * 65, id="65-chars"),
    ],
)
def test_run_keys_refuses_a_bad_key_prefix(prefix: str) -> None:
    with pytest.raises(ValueError, match=r"key prefix .* is not allowed: use 1-64"):
        RunKeys("train-gpt", prefix)


def test_run_keys_refuses_a_run_id_with_a_trailing_newline() -> None:
    with pytest.raises(ValueError):
        RunKeys("train\n")


def test_run_keys_is_immutable() -> None:
    k = RunKeys("train-gpt")
    with pytest.raises(dataclasses.FrozenInstanceError):
        k.run_id = "other"  # type: ignore[misc]


# -- key shape ----------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", [DEFAULT_PREFIX, "staging.v2"])
def test_every_key_of_a_run_has_the_prefix_and_the_run_id_hash_tag(prefix: str) -> None:
    run_id = make_run_id("train-gpt", EPOCH)
    k = RunKeys(run_id, prefix)
    for key in all_keys(k):
        assert key.startswith(f"{prefix}:{{{run_id}}}:"), key
        assert cluster_hash_tag(key) == run_id, key


def test_the_default_prefix_is_spottrain() -> None:
    assert RunKeys("r").base == "spottrain:{r}"


def test_every_key_of_a_run_is_distinct() -> None:
    keys = all_keys(RunKeys("train-gpt"))
    assert len(set(keys)) == len(keys)


def test_the_run_pattern_matches_every_key_of_the_run() -> None:
    k = RunKeys(make_run_id("train-gpt", EPOCH))
    for key in all_keys(k):
        assert fnmatch.fnmatchcase(key, k.pattern), key


def test_the_run_pattern_does_not_match_the_same_run_under_another_prefix() -> None:
    ours, theirs = RunKeys("train-gpt", "spottrain"), RunKeys("train-gpt", "other")
    assert not any(fnmatch.fnmatchcase(key, ours.pattern) for key in all_keys(theirs))


def test_the_store_pattern_matches_store_keys_and_nothing_else() -> None:
    k = RunKeys("train-gpt")
    assert fnmatch.fnmatchcase(k.store_key("rank0/addr"), k.store_pattern)
    others = [key for key in all_keys(k) if ":store:" not in key]
    assert others
    assert not any(fnmatch.fnmatchcase(key, k.store_pattern) for key in others)


def test_node_and_heartbeat_keys_differ_per_node() -> None:
    k = RunKeys("train-gpt")
    assert k.node("a") != k.node("b")
    assert k.heartbeat("a") != k.heartbeat("b")
    assert k.node("a") != k.heartbeat("a")

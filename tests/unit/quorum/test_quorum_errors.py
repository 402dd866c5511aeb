"""The quorum's error messages that need no Redis: which replies are a refusal for want of
Redis replicas, and what the operator is told."""

from __future__ import annotations

import pytest

from spottrain.quorum import errors

REFUSED = "NOREPLICAS Not enough good replicas to write."


@pytest.mark.parametrize(
    "reply",
    [
        REFUSED,  # a plain command
        f"{REFUSED} script: 5ecf37f1, on @user_script:1.",  # a script's redis.call
        f"Command # 2 (DEL k) of pipeline caused error: {REFUSED}",  # a pipeline's
    ],
)
def test_a_refused_write_is_told_apart_in_each_form(reply: str) -> None:
    assert errors.is_noreplicas(reply)
    message = str(errors.not_enough_replicas(reply))
    assert "min-replicas-to-write" in message and "script:" not in message


@pytest.mark.parametrize("reply", ["OOM command not allowed", "WRONGTYPE x", "ERR NOREPLICAS"])
def test_other_errors_are_not_a_refusal_for_want_of_replicas(reply: str) -> None:
    assert not errors.is_noreplicas(reply)


def test_an_unacknowledged_round_says_how_many_and_how_to_fix_it() -> None:
    err = errors.unacknowledged("quorum 7 for replica a", 1, 2, connected=1)
    assert isinstance(err, errors.QuorumTimeout)  # its callers ask again, as on a timeout
    assert str(err).startswith(
        "quorum 7 for replica a formed, but only 1 of the 2 Redis replicas it must be on "
        "(wait_replicas) acknowledged it by the request's deadline; the primary has 1 "
        "connected; it is not used"
    )
    assert "INFO replication" in str(err) and "to 0" in str(err)
    assert "connected;" not in str(errors.unacknowledged("q", 0, 1, connected=None))

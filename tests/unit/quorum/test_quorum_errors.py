"""The quorum's error messages that need no Redis: which replies are a refusal for want of
Redis replicas, and what the operator is told. Each error is built from Redis's reply the way
redis-py builds it (its parser strips ``ERR`` and the code of a reply it maps to a class; a
pipeline prefixes the failed command), so every case is one redis-py really raises."""

from __future__ import annotations

import pytest
import redis
from redis._parsers import BaseParser

from spottrain.quorum import errors

REFUSED = "NOREPLICAS Not enough good replicas to write."
SCRIPT = " script: 1c8ddd8b218861969ed05ab539e0c27f08b25e78, on @user_script:1."
WAITED = ("SET", "spottrain:{r}:quorum:waited", "1")


def _reply(line: str) -> redis.RedisError:
    """The error redis-py raises for Redis's error reply ``line`` (without its ``-``)."""
    error = BaseParser.parse_error(line)
    assert isinstance(error, redis.RedisError)  # LOADING's is a ConnectionError
    return error


def _in_pipeline(error: redis.RedisError, command: tuple[str, ...] = WAITED) -> Exception:
    """``error`` as a pipeline raises it for its first command (redis-py's own prefix)."""
    redis.Redis().pipeline().annotate_exception(error, 1, command)
    return error


@pytest.mark.parametrize(
    "error",
    [
        _reply(REFUSED),  # a plain command
        _reply(REFUSED + SCRIPT),  # a script's redis.call
        _in_pipeline(_reply(REFUSED), ("DEL", "k")),  # a pipeline's
    ],
)
def test_a_refused_write_is_told_apart_in_each_form(error: Exception) -> None:
    assert errors.refusal_code(str(error)) == "NOREPLICAS"
    message = str(errors.not_enough_replicas(str(error)))
    assert "min-replicas-to-write" in message and "script:" not in message


@pytest.mark.parametrize(
    "error",
    [
        _reply("OOM command not allowed when used memory > 'maxmemory'."),
        _reply("WRONGTYPE Operation against a key holding the wrong kind of value"),
        # Only the word: "-ERR unknown command" names it, and redis-py strips the ERR.
        _reply("ERR unknown command 'NOREPLICAS', with args beginning with: "),
    ],
)
def test_other_errors_are_not_a_refusal_for_want_of_replicas(error: Exception) -> None:
    assert errors.refusal_code(str(error)) != "NOREPLICAS"
    refused = errors.refusal(error)
    assert refused is None or refused.cause != "NOREPLICAS"


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


# Redis's replies, verbatim (Redis 7.0), as each path delivers them: a plain command, a
# script's error (its " script: ..." suffix), a pipeline's (redis-py's prefix) and the
# scripts' older QCORRUPT wrapping; redis-py's parser maps READONLY, OOM and LOADING to
# classes of their own and drops the code from the message.
READONLY = "READONLY You can't write against a read only replica."
OOM = "OOM command not allowed when used memory > 'maxmemory'."
MISCONF = (
    "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist "
    "to disk. Commands that may modify the data set are disabled, because this instance is "
    "configured to report errors during writes if RDB snapshotting fails "
    "(stop-writes-on-bgsave-error option). Please check the Redis logs for details about the "
    "RDB error."
)
BUSY = "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE."
UNBLOCKED = (
    "UNBLOCKED force unblock from blocking operation, instance state changed (master -> replica?)"
)
KEY = "spottrain:{r}:quorum:hb"


@pytest.mark.parametrize(
    ("error", "cause", "names"),
    [
        (_reply(READONLY), "READONLY", "new primary"),
        (_reply(READONLY + SCRIPT), "READONLY", "REPLICAOF NO ONE"),
        (_in_pipeline(_reply(READONLY)), "READONLY", "new primary"),
        (_reply(f"QCORRUPT {KEY} {READONLY}{SCRIPT}"), "READONLY", "new primary"),
        (_reply(UNBLOCKED), "UNBLOCKED", "new primary"),
        (_reply("LOADING Redis is loading the dataset in memory"), "LOADING", "load"),
        (_reply(BUSY), "BUSY", "SCRIPT KILL"),
        (_reply(OOM), "OOM", "maxmemory"),
        (_in_pipeline(_reply(OOM)), "OOM", "maxmemory"),
        (_reply(f"QCORRUPT {KEY} {OOM}{SCRIPT}"), "OOM", "noeviction"),
        (_reply(MISCONF + SCRIPT), "MISCONF", "persist to disk"),
        (_reply(f"QCORRUPT {KEY} {MISCONF}{SCRIPT}"), "MISCONF", "rdb_last_bgsave_status"),
        (_in_pipeline(_reply(MISCONF)), "MISCONF", "free space"),
        (
            _reply("MISCONF Errors writing to the AOF file: No space left on device"),
            "MISCONF",
            "AOF",
        ),
        (_reply(f"QCORRUPT {KEY} {REFUSED}{SCRIPT}"), "NOREPLICAS", "min-replicas-to-write"),
    ],
)
def test_each_refusal_is_named_with_its_fix_and_never_called_corruption(
    error: Exception, cause: str, names: str
) -> None:
    refused = errors.refusal(error, "10.0.0.5:6379")
    assert isinstance(refused, errors.QuorumRedisRefused)
    assert isinstance(refused, errors.QuorumTimeout)  # ridden out, then asked again
    assert refused.cause == cause
    message = str(refused)
    assert names in message
    assert f"({cause} " in message  # Redis's own reply, its code restored
    for wrong in ("QCORRUPT", "script:", "pipeline caused", "delete the keys"):
        assert wrong not in message
    if cause != "NOREPLICAS":
        assert message.startswith("the run's Redis at 10.0.0.5:6379 ")


@pytest.mark.parametrize(
    "line",
    [
        f"QCORRUPT {KEY} WRONGTYPE Operation against a key holding the wrong kind of value",
        f"QCORRUPT {KEY} field qid = x, not a number",
        "ERR value is not an integer or out of range",
        "BUSYKEY Target key name already exists.",
        "QGONE a left 12",
        "ERR unknown command 'NOREPLICAS', with args beginning with: ",
    ],
)
def test_garbage_and_other_errors_are_not_refusals(line: str) -> None:
    assert errors.refusal(_reply(line)) is None


def test_the_exact_operator_messages() -> None:
    oom = errors.refusal(_reply(OOM), "10.0.0.5:6379")
    assert str(oom) == (
        "the run's Redis at 10.0.0.5:6379 refuses the quorum's writes because its memory is "
        "full (OOM command not allowed when used memory > 'maxmemory'.): used_memory is "
        "above maxmemory and the policy evicts nothing. Raise maxmemory (CONFIG SET "
        "maxmemory, or a larger Redis) or free memory (INFO memory, MEMORY DOCTOR, "
        "redis-cli --bigkeys); keep maxmemory-policy noeviction, since an evicting policy "
        "could drop the quorum's keys. Not corruption: keep the quorum's keys"
    )
    readonly = errors.refusal(_reply(READONLY))
    assert str(readonly) == (
        "the run's Redis is a read-only replica, not the primary, and refuses the quorum's "
        "writes (READONLY You can't write against a read only replica.): after a failover, "
        "connections to the old primary get this. Point the run's Redis address at the new "
        "primary (an address that follows failovers: the agents reconnect on every retry), "
        "or promote this one (REPLICAOF NO ONE) if no primary is left"
    )


def test_a_refusal_keeps_its_kind_per_replica_and_across_the_relay_wire() -> None:
    for refused in (
        errors.refusal(_reply(MISCONF)),
        errors.not_enough_replicas(str(_reply(REFUSED))),
        errors.unacknowledged("quorum 3", 0, 1, connected=0),
    ):
        assert refused is not None
        mine = refused.for_replica("m1")
        assert type(mine) is type(refused) and mine.cause == refused.cause
        assert str(mine) == f"replica m1: {refused}"
        back = errors.from_wire(refused.cause, str(refused))
        assert type(back) is type(refused) and str(back) == str(refused)

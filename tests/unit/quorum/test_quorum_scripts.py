"""The quorum's wire formats without Redis: the answer line, the reply element, the member
record, the roster document, and the replica ids the lines can carry."""

from __future__ import annotations

import json

import pytest

from spottrain.protocol.keys import RunKeys
from spottrain.quorum import scripts
from spottrain.quorum.model import BatchItem, Member, QuorumConfig


def test_answer_line_round_trip() -> None:
    line = "12 1 4 100 0 9 2 deadbeef r:x=97 r=y=98"
    a = scripts.parse_answer(line)
    assert (a.quorum_id, a.replica_rank, a.replica_count, a.max_step) == (12, 1, 4, 100)
    assert (a.heal_from, a.roster_version, a.commit_failures, a.epoch) == (0, 9, 2, "deadbeef")
    assert a.behind == {"r:x": 97, "r=y": 98}
    assert scripts.parse_answer(b"3 0 1 5 -1 3 0 ab").heal_from is None
    assert scripts.split_reply(b"tok " + line.encode()) == ("tok", line)
    for bad in ("", "1 2 3", "1 2 3 4 5 6 x e", "1 2 3 4 5 6 7 e nonsense"):
        with pytest.raises(ValueError):
            scripts.parse_answer(bad)


def test_member_roster_and_ids() -> None:
    m = Member("r:1", address="http://h:1", store_address="h:2", world_size=8, data='{"x": 1}')
    assert json.loads(scripts.member_json(m)) == ["http://h:1", "h:2", 8, '{"x": 1}']
    doc = '{"version":4,"members":[["r:1",' + scripts.member_json(m)[1:] + "]}"
    assert scripts.parse_roster(doc) == (4, [m])
    with pytest.raises(ValueError):
        scripts.parse_roster("[]")
    for bad in ("", "a b", "a\tb", "x" * 513):
        with pytest.raises(ValueError, match="whitespace"):
            scripts.check_replica_id(bad)
    keys = RunKeys("run-1")
    assert scripts.script_keys(keys) == [keys.quorum_key("")]
    assert scripts.reply_key(keys, "r:1") == keys.quorum_key("reply:r:1")
    assert scripts.config_args(keys, QuorumConfig(), "ep") == ["1000", "250", "1", "ep"]
    assert scripts.request_args("r", 5, -1, 2, True, "t") == ["r", "5", "0", "2", "1", "t"]


def test_relay_args_and_key() -> None:
    keys = RunKeys("run-1")
    assert scripts.relay_key(keys, "r:ab") == keys.quorum_key("relayreply:r:ab")
    steady = [BatchItem("a", 5, held_qid=3), BatchItem("b", 5)]
    assert scripts.relay_args("r:t", steady, [3, 7]) == ["r:t", "U", "5", "7", "a", "b"]
    mixed = [BatchItem("a", 5), BatchItem("b", 4, commit_failures=2, shrink_only=True)]
    assert scripts.relay_args("r:t", mixed, [0, -1]) == [
        "r:t", "V", "a", "5", "0", "0", "0", "b", "4", "0", "2", "1",
    ]  # fmt: skip

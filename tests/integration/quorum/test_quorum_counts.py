"""The quorum's shortcuts against a real Redis: the counts kept in the state (``nreq``,
``nprev``, ``nhb``) that spare a steady REQUEST its calls, and the FORM that skips per-member
checks when the membership is unchanged. Scripts are called directly (no waiters), so every
round is exact and fast."""

from __future__ import annotations

import dataclasses

import redis
from quorum_harness import FAST

from spottrain.protocol.keys import RunKeys
from spottrain.quorum import scripts
from spottrain.quorum.model import Answer, Member

# Not in byte order, so ranks come from sorting, not from the order of the requests.
IDS = ["r-c", "r:b", "r-a", "r-e", "r-d"]
SLOW = dataclasses.replace(FAST, heartbeat_timeout_ms=60_000, join_timeout_ms=60_000)


class Driver:
    """Calls the scripts as one client, the way QuorumClient does, and reads the answers."""

    def __init__(self, r: redis.Redis, keys: RunKeys) -> None:
        self.r, self.keys = r, keys
        self.fns = {name: r.register_script(src) for name, src in scripts.ALL.items()}
        self.argv = scripts.config_args(keys, SLOW, "e0e0e0e0")
        self.n = 0

    def call(self, name: str, *args: str) -> object:
        return self.fns[name](keys=scripts.script_keys(self.keys), args=[*self.argv, *args])

    def join(self, *ids: str) -> None:
        for rid in ids:
            self.call("JOIN", rid, scripts.member_json(Member(rid)))
        self.call("HEARTBEAT", *ids)

    def round(self, steps: dict[str, int], cf: int = 0, shrink: str = "") -> dict[str, Answer]:
        """Every id in ``steps`` asks; returns the answers that arrived."""
        self.n += 1
        for rid, step in steps.items():
            args = scripts.request_args(rid, step, 0, cf, rid == shrink, f"t{self.n}{rid}")
            self.call("REQUEST", *args)
        answers = {}
        for rid in steps:
            got = self.r.lpop(scripts.reply_key(self.keys, rid))
            if got is not None:
                answers[rid] = scripts.parse_answer(scripts.split_reply(got)[1])
        return answers

    def counts(self) -> tuple[list[int], list[int]]:
        """(the state's counts, the keys' real counts) of req, prev and hb."""
        k = self.keys.quorum_key
        kept = self.r.hmget(k("state"), "nreq", "nprev", "nhb")
        real = [self.r.hlen(k("req")), self.r.scard(k("prev")), self.r.zcard(k("hb"))]
        return [int(x) for x in kept], real


def _expected(steps: dict[str, int]) -> dict[str, tuple[int, int, int | None]]:
    """rank, max_step and heal source per id, as torchft's compute_quorum_results has them."""
    order = sorted(steps)
    top = max(steps.values())
    up = [r for r, rid in enumerate(order) if steps[rid] == top]
    behind = [r for r, rid in enumerate(order) if steps[rid] != top]
    heal = {rank: up[i % len(up)] for i, rank in enumerate(behind)}
    return {rid: (r, top, heal.get(r)) for r, rid in enumerate(order)}


def test_steady_rounds_answer_as_torchft_and_keep_counts(redis_client, run_keys) -> None:
    d = Driver(redis_client, run_keys)
    d.join(*IDS)
    first = d.round({rid: 0 for rid in IDS})  # a membership change: the full path
    qid = first["r-a"].quorum_id
    assert d.counts() == ([0, 5, 5], [0, 5, 5])
    # Unchanged membership with diverged steps and a commit failure: the shortcut path.
    steps = {"r-c": 4, "r:b": 2, "r-a": 4, "r-e": 3, "r-d": 1}
    second = d.round(steps, cf=1)
    want = _expected(steps)
    behind = {rid: s for rid, s in steps.items() if s != 4}
    for rid, a in second.items():
        assert (a.replica_rank, a.max_step, a.heal_from) == want[rid], rid
        assert (a.replica_count, a.behind, a.commit_failures) == (5, behind, 1)
        assert a.quorum_id == qid + 1 and a.roster_version == qid  # new id, same members
    assert list(second["r-a"].behind) == ["r-d", "r-e", "r:b"]  # rank (byte) order
    # A newcomer asks with a shrink_only round: the members form alone, unchanged.
    d.join("r-f")
    third = d.round({"r-f": 5, **{rid: 5 for rid in IDS}}, shrink="r-a")
    assert set(third) == set(IDS) and {a.quorum_id for a in third.values()} == {qid + 1}
    assert d.counts() == ([1, 5, 6], [1, 5, 6])  # r-f's request waits on
    fourth = d.round({rid: 6 for rid in IDS})  # r-f joins the members: a change
    assert {a.replica_count for a in fourth.values()} == {6}
    assert d.r.lpop(scripts.reply_key(run_keys, "r-f")) is not None
    assert d.counts() == ([0, 6, 6], [0, 6, 6])
    # A leave: the membership changes although as many ask as the last quorum held.
    d.call("LEAVE", "r-e")
    d.join("r-g")
    fifth = d.round({rid: 7 for rid in ["r-g", "r-a", "r:b", "r-c", "r-d", "r-f"]})
    assert {(a.replica_count, a.roster_version) for a in fifth.values()} == {(6, qid + 3)}
    assert d.counts() == ([0, 6, 6], [0, 6, 6])
    # As many ask as the last quorum held, none was dropped, but r-h replaces r-g (the join
    # timeout let the round form without it): still a change.
    d.argv = scripts.config_args(run_keys, dataclasses.replace(SLOW, join_timeout_ms=0), "e0")
    d.join("r-h", "x1", "x2", "x3", "x4")  # 11 heartbeating: 6 asking are a majority, 5 not
    sixth = d.round({rid: 8 for rid in ["r-h", "r-a", "r:b", "r-c", "r-d", "r-f"]})
    assert {(a.replica_count, a.roster_version) for a in sixth.values()} == {(6, qid + 4)}
    roster = redis_client.get(run_keys.quorum_key("roster"))
    members = [m.replica_id for m in scripts.parse_roster(roster)[1]]
    assert members == ["r-a", "r-c", "r-d", "r-f", "r-h", "r:b"]


def test_spoiled_counts_cost_at_most_a_tick(redis_client, run_keys) -> None:
    d = Driver(redis_client, run_keys)
    d.join(*IDS)
    d.round({rid: 0 for rid in IDS})
    # Counts that say "cannot form" when it can: the round waits for the next TICK...
    redis_client.hset(run_keys.quorum_key("state"), mapping={"nhb": 1000, "nprev": 1000})
    assert d.round({rid: 1 for rid in IDS}) == {}
    assert d.call("TICK", "r-a", "t2r-a") == b"answered"
    assert d.counts() == ([0, 5, 5], [0, 5, 5])
    # ...and counts that say "maybe" when it cannot are checked on the keys: no early round.
    redis_client.hset(run_keys.quorum_key("state"), mapping={"nreq": 1000, "nhb": 0})
    assert d.round({"r-a": 2, "r:b": 2}) == {}
    assert d.counts() == ([2, 5, 5], [2, 5, 5])
    # A state without the counts (written before they were kept) is counted on first use.
    redis_client.hdel(run_keys.quorum_key("state"), "nreq", "nprev", "nhb")
    assert len(d.round({rid: 2 for rid in ["r-c", "r-d", "r-e"]})) == 3
    assert d.counts() == ([0, 5, 5], [0, 5, 5])

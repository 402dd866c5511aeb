"""Slot claims and their expected answers, shared by the pure decision's tests and the Lua's
(tests/unit/agent/test_replica_slots.py, tests/integration/agent/test_agent_replica_slots.py)."""

from __future__ import annotations

# (slots as listed, live nodes, the claiming node, nodes per replica) -> the claim (slot,
# members, generation). The records carry no "gen": each counts as generation 1, so a claim
# with no other live member starts generation 2 on a listed slot, 1 on a new one.
CASES = {
    "the first node takes replica-0": ({}, set(), "a", 1, ("replica-0", ("a",), 1)),
    "a full slot is skipped": ({"replica-0": ["a"]}, {"a"}, "b", 1, ("replica-1", ("b",), 1)),
    "a slot with room is shared": (
        {"replica-0": ["a"]},
        {"a"},
        "b",
        2,
        ("replica-0", ("a", "b"), 1),
    ),
    "a lost node's slot is taken over": (
        {"replica-0": ["a"], "replica-1": ["c"]},
        {"c"},
        "b",
        1,
        ("replica-0", ("b",), 2),
    ),
    "a lost member is dropped, a live one kept": (
        {"replica-0": ["a", "x"]},
        {"a"},
        "b",
        2,
        ("replica-0", ("a", "b"), 1),
    ),
    "the lowest gap is filled": (
        {"replica-0": ["a"], "replica-2": ["c"]},
        {"a", "c"},
        "b",
        1,
        ("replica-1", ("b",), 1),
    ),
    "a node already listed keeps its slot": (
        {"replica-0": ["a"], "replica-1": ["b"]},
        {"a", "b"},
        "b",
        1,
        ("replica-1", ("b",), 2),
    ),
    "fields that are not slots are ignored": (
        {"replica-x": ["a"], "other": ["a"]},
        {"a"},
        "b",
        1,
        ("replica-0", ("b",), 1),
    ),
}

"""Slot claims and their expected answers, shared by the pure decision's tests and the Lua's
(tests/unit/agent/test_replica_slots.py, tests/integration/agent/test_agent_replica_slots.py)."""

from __future__ import annotations

# (slots as listed, live nodes, the claiming node, nodes per replica) -> the claim.
CASES = {
    "the first node takes replica-0": ({}, set(), "a", 1, ("replica-0", ("a",))),
    "a full slot is skipped": ({"replica-0": ["a"]}, {"a"}, "b", 1, ("replica-1", ("b",))),
    "a slot with room is shared": (
        {"replica-0": ["a"]},
        {"a"},
        "b",
        2,
        ("replica-0", ("a", "b")),
    ),
    "a lost node's slot is taken over": (
        {"replica-0": ["a"], "replica-1": ["c"]},
        {"c"},
        "b",
        1,
        ("replica-0", ("b",)),
    ),
    "a lost member is dropped, a live one kept": (
        {"replica-0": ["a", "x"]},
        {"a"},
        "b",
        2,
        ("replica-0", ("a", "b")),
    ),
    "the lowest gap is filled": (
        {"replica-0": ["a"], "replica-2": ["c"]},
        {"a", "c"},
        "b",
        1,
        ("replica-1", ("b",)),
    ),
    "a node already listed keeps its slot": (
        {"replica-0": ["a"], "replica-1": ["b"]},
        {"a", "b"},
        "b",
        1,
        ("replica-1", ("b",)),
    ),
    "fields that are not slots are ignored": (
        {"replica-x": ["a"], "other": ["a"]},
        {"a"},
        "b",
        1,
        ("replica-0", ("b",)),
    ),
}

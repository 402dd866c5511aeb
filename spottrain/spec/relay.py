"""``train.replica.relay_group_size``: its values and its check (kept here, out of
:mod:`.sections`, which is at the house's module size limit)."""

from __future__ import annotations

from typing import Any, Literal

# The default: relays from 1,000 replicas on (spottrain.spec.replica.relay_group_size).
RELAY_GROUP_AUTO: Literal["auto"] = "auto"
# Replicas one relay may batch (a group of 1 would relay nothing; past 1,000 one relay VM's
# threads and one script call's arguments grow large).
RELAY_GROUP_RANGE = (2, 1000)
RELAY_GROUP_DOC = (
    "with quorum: redis, replicas per quorum relay: one VM of each group batches the group's "
    "per-step requests into one Redis call (0: off, every replica asks Redis itself; "
    "2..1000); auto (the default) is off below 1,000 replicas at nodes.max and 100 from there"
)


def check_relay_group(v: Any) -> Any:
    """The spec's value, or a ValueError saying what it may be."""
    lo, hi = RELAY_GROUP_RANGE
    if v == RELAY_GROUP_AUTO:
        return v
    if isinstance(v, bool) or not isinstance(v, int) or not (v == 0 or lo <= v <= hi):
        raise ValueError(f"use auto, 0 (no relays) or a whole number of replicas {lo}..{hi}")
    return v

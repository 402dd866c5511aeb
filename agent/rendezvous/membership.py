"""Membership operations on a run's rendezvous that need no torch: used by the agent and the
CLI to make a node leave, and by the handler."""

from __future__ import annotations

import redis

from spottrain.keys import RunKeys

# Why a member is in the run's rdzv:gone hash.
GONE_LEFT = "left"
GONE_DEAD = "dead"
GONE_FINISHED = "finished"

# Same effect as the backend's mark_gone (see backend.py): record the member as gone, bump
# the gone hash's version so peers re-read it, and drop its heartbeat.
_LEAVE = """
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], '#v', 1)
end
redis.call('ZREM', KEYS[1], ARGV[1])
return 1
"""


def member_of(client: redis.Redis, keys: RunKeys, node_id: str) -> str | None:
    """The rendezvous member that node ``node_id`` joined as most recently, if any."""
    raw = client.hget(keys.rdzv_members, node_id)
    if raw is None:
        return None
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def leave_node(client: redis.Redis, keys: RunKeys, node_id: str) -> str:
    """Make node ``node_id`` leave the run's rendezvous now; return the member that left.

    Its peers drop it at their next sync (about a second) instead of waiting for its
    heartbeat to expire, and its own torchrun stops its workers and exits. The agent calls
    this once the node's emergency checkpoint has committed.

    Raises:
        LookupError: no node with that id ever joined this run.
    """
    member = member_of(client, keys, node_id)
    if member is None:
        raise LookupError(f"node {node_id!r} has no rendezvous member in run {keys.run_id!r}")
    client.eval(_LEAVE, 2, keys.rdzv_presence, keys.rdzv_gone, member, GONE_LEFT)
    return member

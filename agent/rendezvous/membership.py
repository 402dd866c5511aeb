"""Membership operations on a run's rendezvous that need no torch: used by the agent and the
CLI to make a node leave, and by the handler."""

from __future__ import annotations

import redis

from spottrain.protocol.keys import RunKeys

# Why a member is in the run's rdzv:gone hash.
GONE_LEFT = "left"
GONE_DEAD = "dead"
GONE_FINISHED = "finished"

# KEYS: presence zset, gone hash. ARGV: reason, ttl ms, members... Records each member as
# gone (the first reason sticks), bumps the gone hash's version '#v' so peers re-read it, and
# drops the member's heartbeat. The backend and leave_node both run this one script.
MARK_GONE_LUA = """
local added = 0
for i = 3, #ARGV do
  added = added + redis.call('HSETNX', KEYS[2], ARGV[i], ARGV[1])
  redis.call('ZREM', KEYS[1], ARGV[i])
end
if added > 0 then redis.call('HINCRBY', KEYS[2], '#v', 1) end
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return added
"""

# How long a gone record outlives its last write when leave_node, which does not know the
# run's rdzv conf, writes it: the rendezvous' default TTL.
_LEAVE_TTL_MS = 24 * 3600 * 1000


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
    client.eval(
        MARK_GONE_LUA, 2, keys.rdzv_presence, keys.rdzv_gone, GONE_LEFT, _LEAVE_TTL_MS, member
    )
    return member

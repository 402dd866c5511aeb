"""Injected notices: a notice written to Redis for one node's agent.

The controller drains a node this way (a move, a budget stop, ``spottrain down``, a scale-in),
and operators and tests use ``spottrain-agent notify``. (The local cloud preempts through its
VM process instead: a signal the VM turns into the agent's SIGTERM.) The agent pops them
from ``RunKeys.notices(node)``.

Format (one JSON object per list item, unchanged since the first release)::

    {"kind": "terminate", "in": 60}      # due 60 s after it is read
    {"kind": "rebalance", "deadline": 1.7e9}  # or an absolute Unix deadline

``kind`` defaults to ``"injected"``; with neither ``in`` nor ``deadline`` a draining notice
is due :data:`DEFAULT_IN_S` seconds after it is read and a rebalance has no deadline.
"""

from __future__ import annotations

import json
from typing import Any

import redis

from spottrain.protocol.keys import RunKeys

DEFAULT_KIND = "injected"
# What the controller's own drains ask for: a node that leaves because the controller asked
# (a handover, a move, a scale-in, `down`) was not taken back by its cloud, so its drain must
# not count as a preemption, as a "terminate" (a spot interruption's kind) would.
CONTROLLER_DRAIN_KIND = "injected"
# Seconds from reading a draining injected notice that gives no time to its deadline.
DEFAULT_IN_S = 120.0


def inject_notice(
    client: redis.Redis, keys: RunKeys, node_id: str, kind: str = "injected", in_s: float = 120
) -> None:
    """Queue a notice for a node's agent (how the controller asks a node to drain)."""
    client.rpush(keys.notices(node_id), json.dumps({"kind": kind, "in": in_s}))


def decode_injected(raw: bytes | str) -> dict[str, Any]:
    """The JSON object of one injected notice as it was queued.

    Raises:
        ValueError: If it is not JSON, or not a JSON object.
    """
    body = json.loads(raw)
    if not isinstance(body, dict):
        raise ValueError("an injected notice must be a JSON object")
    return body

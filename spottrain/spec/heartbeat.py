"""``train.replica.heartbeat_timeout_s``: its values, its check, and the automatic timeout
that grows with the fleet. Kept out of :mod:`.sections` (at the house's module size limit),
and importing nothing of spottrain, so the bench computes the timeout the spec resolves."""

from __future__ import annotations

import math
from typing import Any, Literal

# The default: scaled with the fleet (auto_heartbeat_timeout_s).
HEARTBEAT_AUTO: Literal["auto"] = "auto"
HEARTBEAT_TIMEOUT_S_RANGE = (0.2, 300.0)
# The agent's timeout when its boot env names none (agent/config.py): torchft's lighthouse's
# own. Also the automatic timeout's floor, which every fleet small enough to afford it keeps
# (a silent loss costs the survivors about the timeout).
DEFAULT_QUORUM_HEARTBEAT_S = 1.0
# Each VM's quorum shim sends one heartbeat script call per fifth of the timeout
# (agent/quorum_shim/server.py), skipped only while a quorum request stands in for it.
HEARTBEATS_PER_TIMEOUT = 5
# Redis CPU per heartbeat call: 26-30 µs measured (bench/quorum_scale.py, INFO
# commandstats), so the middle.
REDIS_HEARTBEAT_US = 28
# The share of Redis's one thread the heartbeats may take, in percent: the rest serves the
# quorum rounds, the rendezvous and the events.
HEARTBEAT_REDIS_SHARE_PCT = 35
AUTO_HEARTBEAT_STEP_S = 0.5
HEARTBEAT_DOC = (
    "with quorum: redis, seconds without a heartbeat before a replica is dropped (a silent "
    "loss costs the survivors about this; 0.2 to 300); auto (the default) grows with the "
    "fleet so that heartbeats take at most ~35 % of a Redis core: max(1, replicas / 2,500) "
    "s rounded up to 0.5 s, with replicas = nodes.max / nodes_per_replica (1 s up to 2,500 "
    "replicas, 5 s at 12,500)"
)


def auto_heartbeat_timeout_s(replicas_max: int) -> float:
    """The heartbeat timeout for a fleet of up to ``replicas_max`` replicas: the shortest
    whole half-second at which their heartbeats cost Redis at most 35 % of its one core,
    never below 1 s nor past the spec's 300 s.

    Heartbeats cost Redis ``replicas x 5 / timeout`` calls a second at ~28 µs each, so the
    timeout must be at least ``replicas x 5 x 28 µs / 0.35``: ``replicas / 2,500`` s. That
    is 1 s up to 2,500 replicas, 1.5 s from 2,501, 5 s at 12,500 (the README's cost model:
    at a fixed 1 s, 12,500 replicas would take about two cores, more than Redis's one, and
    heartbeats queued behind that work arrive late and drop healthy replicas). The same
    bound keeps the timeout over 7 times Redis's time for a whole direct quorum round (54 µs
    a replica), so a round never delays a heartbeat past it. A longer timeout would only
    make a silent loss cost more.

    Args:
        replicas_max: ``nodes.max / nodes_per_replica``; below 0 counts as 0.
    """
    # In integers (µs of Redis per half-second of timeout), so 2,500 replicas give exactly 1 s.
    busy_us = 2 * max(replicas_max, 0) * HEARTBEATS_PER_TIMEOUT * REDIS_HEARTBEAT_US
    half_seconds = -(-busy_us // (HEARTBEAT_REDIS_SHARE_PCT * 10_000))  # ceil
    timeout = max(DEFAULT_QUORUM_HEARTBEAT_S, half_seconds * AUTO_HEARTBEAT_STEP_S)
    return min(HEARTBEAT_TIMEOUT_S_RANGE[1], timeout)


def check_heartbeat_timeout(v: Any) -> Any:
    """The spec's value (``auto``, or the seconds as a float), or a ValueError saying what
    it may be."""
    lo, hi = HEARTBEAT_TIMEOUT_S_RANGE
    if v == HEARTBEAT_AUTO:
        return v
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(f"use auto or a number of seconds from {lo:g} to {hi:g}")
    if not (math.isfinite(v) and lo <= v <= hi):
        raise ValueError(
            f"must be from {lo:g} to {hi:g} s (or auto): below {lo:g} s each replica would "
            f"heartbeat Redis more often than every {lo / HEARTBEATS_PER_TIMEOUT * 1000:g} ms; "
            f"past {hi:g} s a replica lost without notice stalls the others for minutes"
        )
    return float(v)

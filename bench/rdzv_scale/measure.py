"""Figures taken from the machine and from Redis: CPU time, Redis counters, the rendezvous
state, and what the workers counted."""

from __future__ import annotations

import resource
import time
from typing import Any

import redis

from spottrain.protocol.keys import RunKeys

from .common import PHASES


def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0, 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    total = sum(fields[:8])
    return total - idle, total


def snapshot(client: redis.Redis, replies: list[dict[str, Any]]) -> dict[str, Any]:
    """Counters at a phase boundary: Redis's, the machine's and the fleet's CPU."""
    stats = client.info("stats")
    cpu = client.info("cpu")
    cmd = client.info("commandstats")
    return {
        "t": time.monotonic(),
        "commands": stats["total_commands_processed"],
        "net_out": stats["total_net_output_bytes"],
        "net_in": stats["total_net_input_bytes"],
        "redis_cpu": cpu["used_cpu_user"] + cpu["used_cpu_sys"],
        "calls": {k.removeprefix("cmdstat_"): v["calls"] for k, v in cmd.items()},
        "machine": cpu_times(),
        "fleet_cpu": sum(r["cpu"] for r in replies) + own_cpu(),
        "requests": sum(r["requests"] for r in replies),
    }


def usage_between(a: dict[str, Any], b: dict[str, Any], cores: int) -> dict[str, float]:
    """Cores in use between two snapshots: ours (workers + this process), Redis's, and the
    rest of the machine (other programs; the numbers are only as good as that is small)."""
    wall = b["t"] - a["t"]
    busy, total = b["machine"][0] - a["machine"][0], b["machine"][1] - a["machine"][1]
    machine = cores * busy / total if total > 0 else float("nan")
    fleet = (b["fleet_cpu"] - a["fleet_cpu"]) / wall
    rds = (b["redis_cpu"] - a["redis_cpu"]) / wall
    return {
        "wall_s": wall,
        "fleet_cores": fleet,
        "redis_cores": rds,
        "machine_cores": machine,
        "other_cores": max(0.0, machine - fleet - rds),
    }


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def merge_cas(stats: list[dict[str, Any]]) -> dict[str, list[int]]:
    out = {p: [0, 0, 0] for p in PHASES}
    for s in stats:
        for p, v in s["cas"].items():
            out[p] = [a + b for a, b in zip(out[p], v, strict=True)]
    return out


def state_summary(client: redis.Redis, keys: RunKeys) -> dict[str, Any]:
    """What the rendezvous state in Redis says (for a phase that did not finish)."""
    import pickle

    try:
        token, raw = client.hmget(keys.rdzv_state, ["token", "state"])
        if raw is None:
            return {}
        state = pickle.loads(raw)  # torch's _RendezvousState; trusted: our fleet wrote it
    except Exception as exc:  # a diagnostic must not fail the run
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "round": state.round,
        "complete": state.complete,
        "participants": len(state.participants),
        "wait_list": len(state.wait_list),
        "redundancy_list": len(state.redundancy_list),
        "token": int(token or 0),
    }


def own_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime

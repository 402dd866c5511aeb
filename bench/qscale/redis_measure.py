"""What the bench measures on the Redis quorum at one size: steady rounds (clients' and
Redis's figures), a leave and a silent loss; and, at one size, the false drops of healthy
replicas under load (an AOF rewrite fork with data loaded, a client process paused)."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import replace
from typing import Any

from spottrain.quorum.model import QuorumConfig

from .redis_quorum import RedisQuorum, Round, check, median, pct


def _per_command(rounds: list[Round]) -> dict[str, dict[str, float]]:
    """Per command over ``rounds``: calls per round and Redis's usec per call."""
    total: dict[str, list[int]] = {}
    for r in rounds:
        for name, (calls, usec) in r.redis["cmds"].items():
            t = total.setdefault(name, [0, 0])
            t[0] += calls
            t[1] += usec
    return {
        name: {
            "calls_per_round": round(calls / len(rounds), 1),
            "usec_per_call": round(usec / calls, 2),
            "usec_per_round": round(usec / len(rounds), 1),
        }
        for name, (calls, usec) in sorted(total.items())
        if name not in ("info", "latency")  # the bench's own reads
    }


def steady(q: RedisQuorum, rounds: int, seconds: float, min_rounds: int = 5) -> dict[str, Any]:
    n = len(q.live)
    check(q.round(), n, f"{n} replicas, the first round")  # joins everyone; not counted
    assert q.calls is not None
    roster_bytes = int(q.server.r.strlen(q.calls.keys.quorum_key("roster")))
    q.server.reset_latency()
    stats0 = q.worker_stats()
    t0 = time.monotonic()
    got: list[Round] = []
    while len(got) < rounds and (len(got) < min_rounds or time.monotonic() - t0 < seconds):
        r = q.round()
        check(r, n, f"{n} replicas, round {len(got) + 1}")
        got.append(r)
    elapsed = time.monotonic() - t0
    stats1 = q.worker_stats()
    hb_bytes = sum(b["hb_bytes"] for b in stats1) - sum(b["hb_bytes"] for b in stats0)
    hb_calls = sum(b["hb_calls"] for b in stats1) - sum(b["hb_calls"] for b in stats0)
    ms = [r.round_s * 1000 for r in got]
    cpu_ms = [r.redis["cpu_s"] * 1000 for r in got]
    return {
        "n": n,
        "rounds": len(got),
        "round_ms_p50": round(median(ms), 2),
        "round_ms_p99": round(pct(ms, 99), 2),
        "send_spread_ms_p50": round(median([r.spread_s * 1000 for r in got]), 2),
        "bytes_sent_per_replica_step": round(sum(r.sent for r in got) / (n * len(got)), 1),
        "bytes_recv_per_replica_step": round(sum(r.recv for r in got) / (n * len(got)), 1),
        "redis_in_per_replica_step": round(sum(r.redis["in"] for r in got) / (n * len(got)), 1),
        "redis_out_per_replica_step": round(sum(r.redis["out"] for r in got) / (n * len(got)), 1),
        "redis_cpu_ms_per_round_p50": round(median(cpu_ms), 2),
        "redis_cpu_us_per_replica": round(median(cpu_ms) * 1000 / n, 2),
        "commands": _per_command(got),
        "latency": q.server.latency(),
        "heartbeat_calls_per_s": round(hb_calls / elapsed, 1),
        "heartbeat_bytes_per_replica_s": round(hb_bytes / (n * elapsed), 1),
        "ticks": sum(r.ticks for r in got),
        "roster_bytes": roster_bytes,
    }


def heartbeat_timeout_ms(n: int, explicit_ms: int | None = None) -> int:
    """The heartbeat timeout the silent loss and the false drops run at with ``n`` replicas:
    ``explicit_ms`` where given, else the one the product chooses for a fleet of ``n``
    (``train.replica.heartbeat_timeout_s: auto``; 1 s up to 2,500 replicas, 5 s at 12,500)."""
    if explicit_ms is not None:
        return explicit_ms
    from spottrain.spec.heartbeat import auto_heartbeat_timeout_s  # the spec: not in workers

    ms: float = auto_heartbeat_timeout_s(n) * 1000
    return round(ms)


def leave_and_loss(q: RedisQuorum, spread_ms: float, chosen: QuorumConfig) -> dict[str, Any]:
    """The last replica leaves while the others wait in a round (time from its leave to every
    other replica's answer); then the first goes silent (no request, no heartbeat) at a step
    boundary (time from then to every other replica's answer). The silent round runs at the
    ``chosen`` heartbeat timeout and a join timeout of it, or 3x the clients' own time to
    send every request (``spread_ms``) where that is longer: the waiters' TICKs (every
    max(join timeout, heartbeat timeout / 4)) notice the loss about one join timeout after
    it. Where this machine's lag fails that round (a heartbeat process starved past the
    timeout), another replica's silent loss is measured at the steady heartbeat timeout
    when that is longer, from a fresh state: the healthy replicas the first try dropped
    come back under new ids first, as a fleet's would."""
    n = len(q.live)
    leaver = q.live[-1]
    q.silence([leaver])
    sent: dict[str, float] = {}
    r = q.round(between=lambda: sent.update(leave=q.leave(leaver)))
    check(r, n - 1, f"{n} replicas, the round a replica left in")
    out: dict[str, Any] = {"leave_to_quorum_s": round(r.last_recv - sent["leave"], 4)}
    steady_config = q.config
    tries = [chosen.heartbeat_timeout_ms, steady_config.heartbeat_timeout_ms]
    out["silent_loss_rejoined"] = 0
    for k, hb_ms in enumerate(tries):
        join_ms = max(hb_ms, math.ceil(3 * spread_ms))
        out["silent_loss_join_timeout_ms"] = join_ms
        out["silent_loss_heartbeat_timeout_ms"] = hb_ms
        config = replace(chosen, heartbeat_timeout_ms=hb_ms, join_timeout_ms=join_ms)
        r, silenced, error = silent_loss(q, config, f"{n} replicas")
        out["silent_loss_to_quorum_s"] = None if error else round(r.last_recv - silenced, 4)
        if not error:
            break
        again = k + 1 < len(tries) and tries[k + 1] > hb_ms
        print(
            f"  silent loss at {n:,}, heartbeat timeout {hb_ms} ms: not measured ({error})"
            + (f"; again at {tries[k + 1]} ms" if again else ""),
            flush=True,
        )
        if not again:
            break
        # The late replicas' requests left a round open since then: one round of every live
        # replica (their retries, idempotent) closes it; then the dropped ones rejoin.
        q.round(timeout_s=max(10.0, 3 * join_ms / 1000))
        rejoined = q.rejoin_dropped()
        out["silent_loss_rejoined"] += len(rejoined)
        if rejoined:
            print(f"  {len(rejoined)} dropped replica(s) back under new ids", flush=True)
    out["silent_loss_ticks"] = r.ticks
    out["gone"] = q.gone()
    return out


def silent_loss(q: RedisQuorum, config: QuorumConfig, what: str) -> tuple[Round, float, str]:
    """The first live replica silenced at a step boundary and the round after it, at
    ``config``: returns that round, when the replica went silent, and "" or what failed."""
    steady_config = q.config
    q.set_config(config)
    expect = len(q.live) - 1
    silenced = q.silence([q.live[0]])
    r = q.round(timeout_s=max(10.0, 3 * config.join_timeout_ms / 1000))
    q.set_config(steady_config)
    try:
        check(r, expect, f"{what}, the round after a silent loss")
    except RuntimeError as e:  # this machine's lag beyond the timeouts: said, not hidden
        return r, silenced, str(e)
    return r, silenced, ""


def _said(what: str, n: int, out: dict[str, Any]) -> None:
    print(
        f"  {n:,} {what}: round p50 {out['round_ms_p50']} ms, p99 {out['round_ms_p99']} ms, "
        f"Redis CPU {out['redis_cpu_ms_per_round_p50']} ms a round, the clients' send "
        f"{out['send_spread_ms_p50']} ms",
        flush=True,
    )


def measure_size(
    n: int, procs: int, config: QuorumConfig, rounds: int, seconds: float, steady_hb_ms: int,
    relay_group: int = 0, direct: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """The steady rounds (direct, then through relays of ``relay_group`` when > 0) and the
    leave at ``steady_hb_ms`` (above this machine's own scheduling lag), the silent loss at
    ``config``'s heartbeat timeout."""
    steady_config = replace(config, heartbeat_timeout_ms=steady_hb_ms)
    with RedisQuorum(n, procs, steady_config, block=relay_group) as q:
        out = steady(q, rounds, seconds) if direct else {"n": n}
        if direct:
            _said("direct", n, out)
        if relay_group > 0:
            q.relay_group = relay_group
            out["relay"] = steady(q, rounds, seconds)
            out["relay"]["relay_group"] = relay_group
            q.relay_group = 0
            _said(f"through relays of {relay_group}", n, out["relay"])
        if not direct:
            return out
        out.update(leave_and_loss(q, out["send_spread_ms_p50"], config))
        out["processes"] = q.nprocs
        out["maxclients"] = q.server.maxclients
    return out


def _rounds_during(q: RedisQuorum, fault: threading.Thread, after_s: float) -> list[Round]:
    """Rounds back to back while ``fault`` runs and ``after_s`` after it ended."""
    got: list[Round] = []
    end: float | None = None
    while end is None or time.monotonic() < end:
        got.append(q.round())
        if end is None and not fault.is_alive():
            end = time.monotonic() + after_s
    return got


def _drops(q: RedisQuorum, got: list[Round], n: int) -> dict[str, Any]:
    dropped = sorted(k for k, v in q.gone().items() if v.startswith("dropped"))
    short = sum(1 for r in got if set(r.counts) != {n})
    return {
        "rounds": len(got),
        "false_drops": len(dropped),
        "false_drop_rate": round(len(dropped) / n, 6),
        "rounds_short_of_a_healthy_replica": short,
        "errors": sum(len(r.errors) for r in got),
        "round_ms_max": round(max(r.round_s for r in got) * 1000, 1),
    }


def false_drops(
    n: int, procs: int, config: QuorumConfig, fill_mib: int, pause_s: float
) -> dict[str, Any]:
    """Healthy replicas dropped (tombstoned) at ``config``'s heartbeat timeout while Redis
    forks for BGREWRITEAOF with ``fill_mib`` MiB loaded, and while one client process (a
    VM's heartbeats and requests) is SIGSTOPped for ``pause_s``."""
    out: dict[str, Any] = {"n": n, "heartbeat_timeout_ms": config.heartbeat_timeout_ms}
    started = time.monotonic()
    with RedisQuorum(n, procs, config) as q:
        check(q.round(), n, f"{n} replicas, the first round")
        out["setup_s"] = round(time.monotonic() - started, 1)
        t0 = time.monotonic()
        q.server.populate(fill_mib)
        out["fill_mib"] = fill_mib
        out["fill_s"] = round(time.monotonic() - t0, 2)
        q.server.reset_latency()
        took: dict[str, float] = {}
        fork = threading.Thread(target=lambda: took.update(s=q.server.rewrite_aof()))
        fork.start()
        got = _rounds_during(q, fork, after_s=2 * config.heartbeat_timeout_ms / 1000)
        fork.join()
        out["aof_rewrite"] = {**_drops(q, got, n), "rewrite_s": round(took.get("s", -1), 2)}
        out["aof_rewrite"]["latency"] = q.server.latency()
        pause = q.pause_worker(0, pause_s)
        got = _rounds_during(q, pause, after_s=2 * config.heartbeat_timeout_ms / 1000)
        out["paused_client"] = {**_drops(q, got, n), "pause_s": pause_s}
        out["paused_client"]["replicas_paused"] = len(q.ids[0 :: q.nprocs])
    out["took_s"] = round(time.monotonic() - started, 1)
    return out

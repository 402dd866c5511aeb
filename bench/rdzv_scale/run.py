"""One fleet size, phase by phase: formation, steady state, the loss of 1% and the
re-formation; then what the workers and Redis counted."""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys

from .common import TORCH_KEEP_ALIVE_S, PhaseTimeout
from .fleet import Fleet, Monitor
from .measure import merge_cas, percentile, snapshot, state_summary, usage_between


@dataclass
class _Size:
    """One fleet size's run: what each phase reads and where it writes its figures."""

    n: int
    args: argparse.Namespace
    log: Callable[[str], None]
    client: redis.Redis
    keys: RunKeys
    fleet: Fleet
    monitor: Monitor
    res: dict[str, Any]
    cores: int
    last_stats: list[dict[str, Any]] = field(default_factory=list)


def run_size(
    server: RedisServer, n: int, procs: int, args: argparse.Namespace, log: Any
) -> dict[str, Any]:
    cores = os.cpu_count() or 1
    run_id = f"bench-n{n}-{int(time.time())}-{os.getpid()}"
    keys = RunKeys(run_id)
    lost = max(1, n // 100)
    form_timeout = args.form_timeout or min(200.0, max(60.0, 0.25 * n))
    reform_timeout = args.reform_timeout or min(240.0, max(120.0, 0.5 * n))
    conf = {
        # The first round (min_nodes=1) closes at the end of the last call with whoever has
        # joined by then; give it time for all N, so the figure is "all N formed".
        "last_call_timeout": int(form_timeout),
        # So that nothing in the library waits longer than the benchmark does.
        "join_timeout": int(form_timeout + reform_timeout + 60),
    }
    res: dict[str, Any] = {"nodes": n, "procs": procs, "lost": lost, "run_id": run_id}
    res["loadavg_before"] = os.getloadavg()[0]
    client = server.client(socket_timeout=30)
    monitor = Monitor(client, keys)
    t_size = time.monotonic()
    fleet = Fleet(n, procs, server.endpoint, run_id, conf, not args.as_is)
    size = _Size(n, args, log, client, keys, fleet, monitor, res, cores)
    stats: list[dict[str, Any]] = []
    try:
        created = fleet.gather("create handlers", 60 + 0.2 * n)
        members = {int(i): m for c in created for i, m in c["members"].items()}
        res["setup_s"] = time.monotonic() - t_size
        log(f"  {n} handlers up in {len(created)} processes ({res['setup_s']:.1f} s)")
        monitor.start()
        monitor.set_phase("form")
        _form(size, created, form_timeout)
        _steady(size)
        _lose_and_reform(size, members, lost, reform_timeout)
    except (PhaseTimeout, RuntimeError) as exc:
        res["failure"] = str(exc)
        log(f"  FAILED: {exc}")
    except Exception as exc:  # report it and go on to the next size
        res["failure"] = f"{type(exc).__name__}: {exc}"
        log(f"  FAILED: {traceback.format_exc()}")
    finally:
        monitor.stop.set()
        try:
            stats = fleet.ask("stats", None, 60)
        except Exception as exc:
            res["stats_error"] = f"{exc} (figures below from the last phase's replies)"
            stats = size.last_stats
        fleet.close()
        monitor.join(2)
    if stats:
        _fold_stats(res, stats)
    _fold_gone(size)
    res["max_heartbeat_age_s"] = dict(monitor.max_age)
    res["progress"] = {p: v for p, v in monitor.progress.items() if p != "steady"}
    res["size_runtime_s"] = time.monotonic() - t_size
    res["loadavg_after"] = os.getloadavg()[0]
    client.close()
    return res


def _form(size: _Size, created: list[Any], form_timeout: float) -> None:
    """1. formation: every node's first ``next_rendezvous()``, released at once."""
    client, keys, res, n = size.client, size.keys, size.res, size.n
    snap0 = snapshot(client, created)
    try:
        formed = size.fleet.ask("form", form_timeout, form_timeout + 30)
        size.last_stats = [f["stats"] for f in formed]
    finally:
        res["form_state"] = state_summary(client, keys)
    snap1 = snapshot(client, formed)
    res["form_usage"] = usage_between(snap0, snap1, size.cores)
    go = min(f["go_t"] for f in formed)
    rows = [r for f in formed for r in f["nodes"]]
    errors = [r[3] for r in rows if r[3]]
    done = [r for r in rows if r[1] is not None]
    res["formed"] = len(done)
    res["form_world_sizes"] = dict(Counter(r[2] for r in done))
    res["form_errors"] = errors[:5]
    if len(done) < n:
        raise PhaseTimeout(
            f"formation: {len(done)} of {n} nodes formed within {form_timeout:.0f} s "
            f"({len(errors)} errors); state in Redis: {res['form_state']}"
        )
    res["form_s"] = max(r[1] for r in done) - go
    res["form_median_s"] = statistics.median(r[1] - go for r in done)
    res["state_bytes"] = int(client.hstrlen(keys.rdzv_state, "state"))
    size.log(
        f"  formed: {res['form_s']:.2f} s (median node {res['form_median_s']:.2f} s), "
        f"world sizes {res['form_world_sizes']}, state {res['state_bytes']} B"
    )


def _steady(size: _Size) -> None:
    """3. steady state: all formed, beating, polled every 0.1 s."""
    client, res, n, fleet = size.client, size.res, size.n, size.fleet
    size.monitor.set_phase("steady")
    fleet.ask("poll", None, 30)
    res["_steady_from"] = time.monotonic()
    time.sleep(size.args.warmup)
    before = snapshot(client, fleet.ask("cpu", None, 30))
    time.sleep(size.args.steady_seconds)
    after = snapshot(client, fleet.ask("cpu", None, 30))
    dt = after["t"] - before["t"]
    res["_window"] = (before["t"], after["t"])
    res["steady_usage"] = usage_between(before, after, size.cores)
    calls = {k: after["calls"].get(k, 0) - before["calls"].get(k, 0) for k in after["calls"]}
    res["commands_per_s"] = (after["commands"] - before["commands"]) / dt
    # What the clients sent, counted at the clients: a script call is one request (the
    # commands that scripts run inside Redis are in commands_per_s, not here).
    res["requests_per_s"] = (after["requests"] - before["requests"]) / dt
    res["steady_calls_per_s"] = {
        k: round(v / dt, 1) for k, v in sorted(calls.items(), key=lambda kv: -kv[1]) if v
    }
    res["redis_cpu"] = res["steady_usage"]["redis_cores"]
    res["net_out_bytes_per_s"] = (after["net_out"] - before["net_out"]) / dt
    res["net_in_bytes_per_s"] = (after["net_in"] - before["net_in"]) / dt
    res["torch_cas_writes_per_s"] = n / TORCH_KEEP_ALIVE_S
    res["torch_write_bytes_per_s"] = n / TORCH_KEEP_ALIVE_S * res["state_bytes"]
    size.log(
        f"  steady: {res['commands_per_s']:.0f} commands/s, "
        f"{res['requests_per_s']:.0f} requests/s, Redis CPU {res['redis_cpu']:.0%}, "
        f"fleet {res['steady_usage']['fleet_cores']:.2f} cores, other programs "
        f"{res['steady_usage']['other_cores']:.2f} cores"
    )


def _lose_and_reform(
    size: _Size, members: dict[int, str], lost: int, reform_timeout: float
) -> None:
    """2. loss of 1%: freeze, detect, re-form."""
    client, res, n, fleet = size.client, size.res, size.n, size.fleet
    rng = random.Random(size.args.seed * 7919 + n)
    victims = sorted(rng.sample(range(n), lost))
    size.monitor.exclude = {members[i] for i in victims}
    size.monitor.set_phase("reform")
    snap0 = snapshot(client, fleet.ask("cpu", None, 30))
    froze = fleet.ask("freeze", victims, 30)
    res["_steady_to"] = time.monotonic()
    t_freeze = max(f["freeze_t"] for f in froze if f["freeze_t"] is not None)
    res["_reform_from"] = t_freeze
    try:
        reformed = fleet.ask("await_reform", reform_timeout, reform_timeout + 30)
        size.last_stats = [f["stats"] for f in reformed]
    finally:
        res["reform_state"] = state_summary(client, size.keys)
    snap1 = snapshot(client, reformed)
    res["reform_usage"] = usage_between(snap0, snap1, size.cores)
    rows = [r for f in reformed for r in f["nodes"]]
    detected = [r[1] - t_freeze for r in rows if r[1] is not None]
    redone = [r for r in rows if r[2] is not None]
    res["survivors"] = len(rows)
    res["detected"] = len(detected)
    res["reformed"] = len(redone)
    res["reform_world_sizes"] = dict(Counter(r[3] for r in redone))
    res["reform_rounds"] = dict(Counter(r[4] for r in redone))
    res["reform_errors"] = [r[5] for r in rows if r[5]][:5]
    if detected:
        res["detect_s"] = max(detected)
        res["detect_min_s"] = min(detected)
        res["detect_median_s"] = statistics.median(detected)
    if redone:
        res["reform_s"] = max(r[2] for r in redone) - t_freeze
        res["reform_median_s"] = statistics.median(r[2] - t_freeze for r in redone)
        res["reform_after_detect_s"] = max(r[2] for r in redone) - max(
            r[1] for r in rows if r[1] is not None
        )
    if len(redone) < len(rows):
        raise PhaseTimeout(
            f"re-formation: {len(detected)} of {len(rows)} survivors detected the loss and "
            f"{len(redone)} re-formed within {reform_timeout:.0f} s; state in Redis: "
            f"{res['reform_state']}"
        )
    size.log(
        f"  lost {lost}: detected in {res['detect_s']:.2f} s "
        f"(first {res['detect_min_s']:.2f} s), re-formed in {res['reform_s']:.2f} s, "
        f"world sizes {res['reform_world_sizes']}"
    )


def _fold_stats(res: dict[str, Any], stats: list[dict[str, Any]]) -> None:
    """What the workers counted: compare-and-set calls, restarts, polls, log lines."""
    cas = merge_cas(stats)
    res["cas_by_phase"] = cas
    res["cas_total"] = sum(v[0] for v in cas.values())
    res["cas_conflicts"] = sum(v[1] for v in cas.values())
    res["spurious_restarts"] = sum(len(s["spurious"]) for s in stats)
    res["spurious_reasons"] = dict(
        Counter(str(r)[:80] for s in stats for _, r in s["spurious"]).most_common(3)
    )
    res["poll_errors"] = sum(s["poll_errors"] for s in stats)
    lo, hi = res.get("_window", (0.0, 0.0))
    sweeps = [d for s in stats for (st, d) in s["sweeps"] if lo <= st <= hi]
    res["poll_sweep_p50_s"] = percentile(sweeps, 0.5)
    res["poll_sweep_max_s"] = max(sweeps) if sweeps else float("nan")
    lo = res.get("_reform_from", float("inf"))
    sweeps = [d for s in stats for (st, d) in s["sweeps"] if st >= lo]
    res["reform_poll_sweep_max_s"] = max(sweeps) if sweeps else float("nan")
    logs: Counter[str] = Counter()
    for s in stats:
        logs.update(s["logs"])
    res["log_warnings"] = dict(logs.most_common(6))
    res["identity_changes"] = sum(s["identity_changes"] for s in stats)
    res["told_dead"] = sum(s["told_dead"] for s in stats)


def _fold_gone(size: _Size) -> None:
    """Who Redis declared dead (and whether wrongly), then the run's keys are removed."""
    client, keys, res = size.client, size.keys, size.res
    try:
        gone = {k.decode(): v.decode() for k, v in client.hgetall(keys.rdzv_gone).items()}
        res["declared_dead"] = sum(1 for r in gone.values() if r == "dead")
        res["wrongly_declared_dead"] = sum(
            1 for m, r in gone.items() if r == "dead" and m not in size.monitor.exclude
        )
        stale = list(client.scan_iter(match=keys.pattern, count=1000))
        if stale:
            client.delete(*stale)
    except redis.RedisError:
        pass

"""The Redis quorum's tables, fits and extrapolation as ``bench/quorum_scale.py`` prints them,
and the flat figures of its last JSON line."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .fit import fit_linear

TARGET_N = 12_500


def _num(x: float | None, width: int, digits: int) -> str:
    return f"{'null':>{width}}" if x is None else f"{x:>{width}.{digits}f}"


def print_sizes(sizes: list[dict[str, Any]]) -> None:
    print("\nRedis quorum: per-step round (last request sent -> every answer delivered), measured")
    print(
        f"{'replicas':>9} {'rounds':>6} {'p50 ms':>8} {'p99 ms':>8} {'send ms':>8} "
        f"{'B/rep/step':>10} {'Redis B':>8} {'CPU ms':>7} {'us/rep':>7} "
        f"{'leave s':>8} {'silent s':>8} {'at hb s':>7}"
    )
    for s in sizes:
        wire = s["bytes_sent_per_replica_step"] + s["bytes_recv_per_replica_step"]
        red = s["redis_in_per_replica_step"] + s["redis_out_per_replica_step"]
        print(
            f"{s['n']:>9,} {s['rounds']:>6} {s['round_ms_p50']:>8.1f} {s['round_ms_p99']:>8.1f} "
            f"{s['send_spread_ms_p50']:>8.1f} {wire:>10.0f} {red:>8.0f} "
            f"{s['redis_cpu_ms_per_round_p50']:>7.1f} {s['redis_cpu_us_per_replica']:>7.1f} "
            f"{s['leave_to_quorum_s']:>8.3f} {_num(s['silent_loss_to_quorum_s'], 8, 3)} "
            f"{s['silent_loss_heartbeat_timeout_ms'] / 1000:>7g}"
        )
    print(
        "B/rep/step: bytes one replica sends + receives per step (its request, BLPOP and "
        "answer; counted by the clients); Redis B: Redis's own net in+out per replica per "
        "round (INFO stats; includes the heartbeats and the bench's INFO reads). send ms: "
        "the clients' time to get all N requests out (not part of the round). silent s: "
        "a silent loss -> a quorum without it, at the heartbeat timeout 'at hb s' (the "
        "product's auto timeout for that fleet unless --heartbeat-timeout-ms)."
    )
    for s in sizes:
        cmds = ", ".join(
            f"{name} {c['calls_per_round']:g}/round at {c['usec_per_call']:.1f} us"
            for name, c in s["commands"].items()
        )
        print(f"  Redis side at {s['n']:,}: {cmds}")
        if s["latency"]:
            print(f"  LATENCY at {s['n']:,}: {s['latency']}")
        print(
            f"  heartbeats at {s['n']:,}: {s['heartbeat_calls_per_s']:g} calls/s, "
            f"{s['heartbeat_bytes_per_replica_s']:g} B per replica per s; the full roster "
            f"{s['roster_bytes']:,} B ({s['roster_bytes'] * s['n'] / 1e6:,.1f} MB if all "
            f"{s['n']:,} read it whole; a replica with a cached roster reads only the delta)"
        )


def print_relays(sizes: list[dict[str, Any]]) -> None:
    """The relayed rounds beside the direct ones of the same run."""
    rows = [s for s in sizes if "relay" in s]
    if not rows:
        return
    print(
        f"\nRedis quorum through relays of {rows[0]['relay']['relay_group']} replicas "
        "(one RELAY_REQUEST + one BLPOP per relay; last batch sent -> every relay's answer "
        "delivered), beside the direct round of the same run, measured"
    )
    print(
        f"{'replicas':>9} {'rounds':>6} {'p50 ms':>8} {'p99 ms':>8} {'CPU ms':>7} "
        f"{'B/rep/step':>10} {'direct p50':>10} {'direct CPU':>10}"
    )
    for s in rows:
        r = s["relay"]
        wire = r["bytes_sent_per_replica_step"] + r["bytes_recv_per_replica_step"]
        print(
            f"{s['n']:>9,} {r['rounds']:>6} {r['round_ms_p50']:>8.1f} {r['round_ms_p99']:>8.1f} "
            f"{r['redis_cpu_ms_per_round_p50']:>7.1f} {wire:>10.1f} "
            f"{_num(s.get('round_ms_p50'), 10, 1)} "
            f"{_num(s.get('redis_cpu_ms_per_round_p50'), 10, 1)}"
        )
    print(
        "B/rep/step: the relays' bytes to and from Redis per replica per step (the "
        "member <-> relay hop is not in it). CPU ms: Redis's CPU per round (INFO cpu)."
    )
    for s in rows:
        cmds = ", ".join(
            f"{name} {c['calls_per_round']:g}/round at {c['usec_per_call']:.1f} us"
            for name, c in s["relay"]["commands"].items()
        )
        print(f"  Redis side at {s['n']:,} (relayed): {cmds}")


def flat_relays(sizes: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for s in sizes:
        if "relay" not in s:
            continue
        n, r = s["n"], s["relay"]
        out[f"redis_relay_round_ms_p50_{n}"] = r["round_ms_p50"]
        out[f"redis_relay_round_ms_p99_{n}"] = r["round_ms_p99"]
        out[f"redis_relay_cpu_ms_round_{n}"] = r["redis_cpu_ms_per_round_p50"]
        out[f"redis_relay_bytes_per_replica_step_{n}"] = round(
            r["bytes_sent_per_replica_step"] + r["bytes_recv_per_replica_step"], 1
        )
        out[f"redis_relay_evalsha_us_round_{n}"] = (
            r["commands"].get("evalsha", {}).get("usec_per_round")
        )
    return out


def extrapolate(sizes: list[dict[str, Any]]) -> dict[str, Any]:
    """Fits over the sizes and what 12,500 replicas cost Redis: Redis is single-threaded, so
    when a fleet's requests arrive together a round takes at least its CPU for all of them."""
    ns = [s["n"] for s in sizes]
    a, b = fit_linear(ns, [s["round_ms_p50"] / 1000 for s in sizes])
    ca, cb = fit_linear(ns, [s["redis_cpu_ms_per_round_p50"] / 1000 for s in sizes])
    top = max(sizes, key=lambda s: s["n"])
    serial_ms = TARGET_N * top["redis_cpu_us_per_replica"] / 1000
    print(f"fit: round_s = {a:.3e} + {b:.3e} N (least squares, p50 at {ns})")
    print(f"fit of Redis's CPU s per round: {ca:.3e} + {cb:.3e} N")
    print(
        f"EXTRAPOLATED from Redis's side: {TARGET_N:,} x {top['redis_cpu_us_per_replica']:.1f} "
        f"us per replica (measured at {top['n']:,}) = {serial_ms:,.0f} ms of Redis CPU a round: "
        "a fleet whose requests all arrive at once waits at least that (one core; the clients' "
        "time on these 2 cores is not in it)"
    )
    return {
        "fit_a_s": a,
        "fit_b_s": b,
        "fit_cpu_a_s": ca,
        "fit_cpu_b_s": cb,
        "serial_ms_12500": round(serial_ms, 1),
        "us_per_replica_from": top["n"],
    }


def print_faults(f: dict[str, Any]) -> None:
    print(
        f"\nfalse drops of healthy replicas at {f['n']:,} replicas, heartbeat timeout "
        f"{f['heartbeat_timeout_ms']} ms (rounds back to back; {f['took_s']} s with "
        f"{f['setup_s']} s to start {f['n']:,} replicas):"
    )
    aof, paused = f["aof_rewrite"], f["paused_client"]
    print(
        f"  BGREWRITEAOF fork with {f['fill_mib']} MiB loaded ({aof['rewrite_s']} s): "
        f"{aof['false_drops']} dropped, {aof['rounds_short_of_a_healthy_replica']} of "
        f"{aof['rounds']} rounds short of a replica, longest round {aof['round_ms_max']} ms; "
        f"LATENCY {aof['latency']}"
    )
    print(
        f"  a client process ({paused['replicas_paused']} replicas) SIGSTOPped "
        f"{paused['pause_s']} s: {paused['false_drops']} dropped, "
        f"{paused['rounds_short_of_a_healthy_replica']} of {paused['rounds']} rounds short, "
        f"longest round {paused['round_ms_max']} ms"
    )


def flat(
    sizes: list[dict[str, Any]],
    extra: dict[str, Any],
    faults: list[dict[str, Any]],
    faults_failed: Sequence[int] = (),
) -> dict[str, Any]:
    """The flat figures; the false drops as ``redis_false_drops_*_N`` for each size run
    (null for the ``faults_failed``), and unsuffixed for the smallest (the 1,000 replicas
    of the default run)."""
    out: dict[str, Any] = {}
    for s in sizes:
        n = s["n"]
        out[f"redis_round_ms_p50_{n}"] = s["round_ms_p50"]
        out[f"redis_round_ms_p99_{n}"] = s["round_ms_p99"]
        out[f"redis_bytes_per_replica_step_{n}"] = round(
            s["bytes_sent_per_replica_step"] + s["bytes_recv_per_replica_step"], 1
        )
        out[f"redis_leave_to_quorum_s_{n}"] = s["leave_to_quorum_s"]
        out[f"redis_silent_loss_to_quorum_s_{n}"] = s["silent_loss_to_quorum_s"]
        out[f"redis_silent_loss_heartbeat_timeout_ms_{n}"] = s["silent_loss_heartbeat_timeout_ms"]
        out[f"redis_cpu_ms_per_round_{n}"] = s["redis_cpu_ms_per_round_p50"]
        out[f"redis_cpu_us_per_replica_{n}"] = s["redis_cpu_us_per_replica"]
    out["redis_serial_round_ms_extrapolated_12500"] = extra["serial_ms_12500"]
    runs: dict[int, dict[str, Any] | None] = {f["n"]: f for f in faults}
    runs.update(dict.fromkeys(faults_failed))
    for k, n in enumerate(sorted(runs)):
        figures = _fault_figures(runs[n])
        if k == 0:
            out.update(figures)
            out["redis_false_drop_replicas"] = n
        out.update({f"{key}_{n}": v for key, v in figures.items()})
    return out


def _fault_figures(f: dict[str, Any] | None) -> dict[str, Any]:
    """One false-drop run's flat figures (``None``: its keys, each null)."""
    keys = (
        "redis_false_drops_aof_rewrite",
        "redis_false_drops_paused_client",
        "redis_false_drop_rate",
        "redis_false_drop_heartbeat_timeout_ms",
    )
    if f is None:
        return dict.fromkeys(keys)
    aof, paused = f["aof_rewrite"]["false_drops"], f["paused_client"]["false_drops"]
    rate = round((aof + paused) / (2 * f["n"]), 6)
    return dict(zip(keys, (aof, paused, rate, f["heartbeat_timeout_ms"]), strict=True))


def shim_costs(ns: list[int]) -> dict[str, Any]:
    """The lighthouse shim's local work (``agent/quorum_shim``): what the O(1) answer costs
    each VM in CPU to rebuild torchft's full participant list, per step, and to pre-serialize
    a changed roster, per membership change; measured here, beside Redis's figures."""
    try:
        from spottrain.agent.quorum_shim.roster import load_cost, rebuild_cost
    except ImportError as e:  # the shim is not in this tree
        print(f"\nthe shim's local rebuild cost: not measured ({e})")
        return {}
    print("\nthe lighthouse shim's local work per VM (agent/quorum_shim/roster.py), measured")
    print(f"{'replicas':>9} {'rebuild ms/step':>16} {'roster load ms/change':>22}")
    out: dict[str, Any] = {}
    for n in ns:
        rebuild_ms = rebuild_cost(n) * 1000
        load_ms = load_cost(n) * 1000
        print(f"{n:>9,} {rebuild_ms:>16.3f} {load_ms:>22.2f}")
        out[f"shim_rebuild_ms_{n}"] = round(rebuild_ms, 4)
        out[f"shim_roster_load_ms_{n}"] = round(load_ms, 3)
    print(
        "Redis carries O(1) bytes a step per replica; the participant list torchft's manager "
        "expects is rebuilt on each VM from its cached roster (the rebuild column)."
    )
    return out

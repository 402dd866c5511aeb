"""The report: a table per fleet size, and the one JSON line of figures."""

from __future__ import annotations

import math
from typing import Any

from .common import HEARTBEAT_TIMEOUT_S, POLL_INTERVAL_S


def _f(value: Any, fmt: str = "{:.2f}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def _bytes(v: float | None) -> str:
    if v is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(v) < 1000:
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1000
    return f"{v:.1f} TB"


def print_report(results: list[dict[str, Any]], runtime: float, cores: int, as_is: bool) -> None:
    _print_overview(results, cores)
    _print_write_load(results)
    print()
    print("Details")
    for r in results:
        _print_phases(r)
        _print_health(r)
    _print_caveats(runtime, cores, as_is)


def _print_overview(results: list[dict[str, Any]], cores: int) -> None:
    print()
    print(f"Redis rendezvous at scale: simulated nodes on {cores} cores, one local Redis")
    print("=" * 100)
    head = (
        f"{'nodes':>6} {'procs':>5} {'form s':>8} {'lost':>5} {'detect s':>9} "
        f"{'re-form s':>10} {'cmds/s':>8} {'reqs/s':>8} {'CAS conflicts/total':>22} "
        f"{'wrongly dead':>12}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        cas = f"{r['cas_conflicts']}/{r['cas_total']}" if "cas_total" in r else "-"
        print(
            f"{r['nodes']:>6} {r['procs']:>5} {_f(r.get('form_s')):>8} {r['lost']:>5} "
            f"{_f(r.get('detect_s')):>9} {_f(r.get('reform_s')):>10} "
            f"{_f(r.get('commands_per_s'), '{:.0f}'):>8} "
            f"{_f(r.get('requests_per_s'), '{:.0f}'):>8} {cas:>22} "
            f"{_f(r.get('wrongly_declared_dead'), '{}'):>12}"
        )


def _print_write_load(results: list[dict[str, Any]]) -> None:
    print()
    print("Steady-state write load: ours vs torch's keep-alive (whole state by CAS every 5 s)")
    head = (
        f"{'nodes':>6} {'state size':>11} {'our CAS/s':>10} {'torch CAS/s':>12} "
        f"{'torch writes':>13} {'our Redis out':>14} {'Redis CPU':>10}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        steady = r.get("cas_by_phase", {}).get("steady", [0])[0]
        span = r.get("_steady_to", 0.0) - r.get("_steady_from", 0.0)
        ours = steady / span if span > 0 else None
        print(
            f"{r['nodes']:>6} {_bytes(r.get('state_bytes')):>11} {_f(ours, '{:.1f}'):>10} "
            f"{_f(r.get('torch_cas_writes_per_s'), '{:.1f}'):>12} "
            f"{_bytes(r.get('torch_write_bytes_per_s')) + '/s':>13} "
            f"{_bytes(r.get('net_out_bytes_per_s')) + '/s':>14} "
            f"{_f(r.get('redis_cpu'), '{:.0%}'):>10}"
        )


def _print_phases(r: dict[str, Any]) -> None:
    """One size's formation and loss: times, CPU, how the state progressed."""
    print(f"  N={r['nodes']} (run id {r['run_id']}, {_f(r['size_runtime_s'], '{:.0f}')} s)")
    if "failure" in r:
        print(f"    FAILURE: {r['failure']}")
    print(
        f"    form: median node {_f(r.get('form_median_s'))} s, world sizes "
        f"{r.get('form_world_sizes')}; {_usage_text(r.get('form_usage'))}"
    )
    if "failure" in r:
        print(f"    state in Redis after formation: {r.get('form_state')}")
    print(
        f"    loss: detect first/median/last {_f(r.get('detect_min_s'))}/"
        f"{_f(r.get('detect_median_s'))}/{_f(r.get('detect_s'))} s (includes the "
        f"{HEARTBEAT_TIMEOUT_S} s heartbeat timeout), re-form median "
        f"{_f(r.get('reform_median_s'))} s, last re-form "
        f"{_f(r.get('reform_after_detect_s'))} s after the last detection; world sizes "
        f"{r.get('reform_world_sizes')}, rounds {r.get('reform_rounds')}"
    )
    print(
        f"    loss: {_usage_text(r.get('reform_usage'))}; slowest poll sweep "
        f"{_f(r.get('reform_poll_sweep_max_s'))} s"
    )
    if "failure" in r and "reform_state" in r:
        print(f"    state in Redis after re-formation: {r.get('reform_state')}")
    for phase, samples in r.get("progress", {}).items():
        if samples and ("failure" in r or phase == "reform"):
            print(f"    {phase} progress (s since start: participants/waiting, round, token):")
            print("      " + _timeline(samples))
    if "cas_by_phase" in r:
        parts = ", ".join(
            f"{p} {v[1]}/{v[0]}" + (f" ({v[2]} none)" if v[2] else "")
            for p, v in r["cas_by_phase"].items()
        )
        print(f"    CAS conflicts/calls by phase: {parts}")


def _print_health(r: dict[str, Any]) -> None:
    """One size's steady state, heartbeats, deaths, log lines and errors."""
    print(
        f"    steady: {_usage_text(r.get('steady_usage'))}; poll sweep p50 "
        f"{_f(r.get('poll_sweep_p50_s'), '{:.3f}')} s / max "
        f"{_f(r.get('poll_sweep_max_s'), '{:.3f}')} s (target period {POLL_INTERVAL_S} s), "
        f"Redis in {_bytes(r.get('net_in_bytes_per_s'))}/s"
    )
    if r.get("steady_calls_per_s"):
        top = list(r["steady_calls_per_s"].items())[:8]
        print("    steady calls/s: " + ", ".join(f"{k} {v}" for k, v in top))
    print(
        f"    oldest live heartbeat (dead after {HEARTBEAT_TIMEOUT_S} s): "
        + ", ".join(f"{p} {v:.2f} s" for p, v in r["max_heartbeat_age_s"].items())
    )
    print(
        f"    declared dead {r.get('declared_dead')} (frozen {r['lost']}), wrongly "
        f"{r.get('wrongly_declared_dead')}; spurious restarts before the loss "
        f"{r.get('spurious_restarts')} {r.get('spurious_reasons') or ''}; poll errors "
        f"{r.get('poll_errors')}"
    )
    if r.get("stats_error"):
        print(f"    stats: {r['stats_error']}")
    if r.get("wrongly_declared_dead"):
        print(
            f"    -> live nodes were declared dead: their heartbeat threads went up to "
            f"{max(r['max_heartbeat_age_s'].values()):.1f} s without running on this "
            "oversubscribed machine."
        )
        if r.get("told_dead") is not None:
            print(
                f"       {r['told_dead']} of them learned it from their own heartbeat while "
                "inside next_rendezvous() and went on joining under the dead identity "
                f"(identities renewed: {r.get('identity_changes')})."
            )
    if r.get("log_warnings"):
        for msg, count in r["log_warnings"].items():
            print(f"    log x{count}: {msg[:90]}")
    for err in r.get("form_errors", []) + r.get("reform_errors", []):
        print(f"    error: {err[:160]}")


def _print_caveats(runtime: float, cores: int, as_is: bool) -> None:
    print()
    print(
        f"Caveat: {cores} cores simulate the CPU of N machines (each node's pickling of the "
        "rendezvous state, its threads, and Redis itself share them); times at large N are "
        "bounded by this machine's CPU, not by the rendezvous protocol alone."
    )
    print(
        "torch's event naming (inspect.stack() on every sync) was "
        + (
            "kept as is (--as-is)."
            if as_is
            else "replaced by an equivalent costing microseconds (see --as-is): each real "
            "node pays those milliseconds on its own CPU, not on the simulator's."
        )
    )
    print(f"Total runtime: {runtime:.0f} s")


def _timeline(samples: list[tuple[float, dict[str, Any]]], points: int = 8) -> str:
    step = max(2.0, samples[-1][0] / points)
    out, next_t = [], 0.0
    for t, st in samples:
        if t >= next_t or (t, st) == samples[-1]:
            out.append(
                f"{t:.0f}s {st.get('participants')}/{st.get('wait_list')} "
                f"r{st.get('round')}{'c' if st.get('complete') else ''} t{st.get('token')}"
            )
            next_t = t + step
    return ", ".join(out)


def _usage_text(u: dict[str, float] | None) -> str:
    if not u:
        return "CPU -"
    return (
        f"CPU over {u['wall_s']:.1f} s: fleet {u['fleet_cores']:.2f} + Redis "
        f"{u['redis_cores']:.2f} + other programs {u['other_cores']:.2f} cores "
        f"(machine {u['machine_cores']:.2f})"
    )


def summary_figures(
    results: list[dict[str, Any]], runtime: float, cores: int, as_is: bool
) -> dict[str, Any]:
    keys = (
        "form_s",
        "detect_s",
        "reform_s",
        "commands_per_s",
        "requests_per_s",
        "cas_conflicts",
        "cas_total",
        "lost",
        "procs",
        "state_bytes",
        "torch_cas_writes_per_s",
        "torch_write_bytes_per_s",
        "net_out_bytes_per_s",
        "redis_cpu",
        "wrongly_declared_dead",
        "spurious_restarts",
        "formed",
        "survivors",
        "detected",
        "reformed",
        "failure",
    )
    out: dict[str, Any] = {}
    for r in results:
        row = {}
        for k in keys:
            v = r.get(k)
            if isinstance(v, float):
                v = None if math.isnan(v) else round(v, 3)
            row[k] = v
        if "failure" in r:
            row["state_at_failure"] = r.get("reform_state") or r.get("form_state")
        row["max_heartbeat_age_s"] = {k: round(v, 2) for k, v in r["max_heartbeat_age_s"].items()}
        for phase in ("form", "steady", "reform"):
            usage = r.get(f"{phase}_usage")
            if usage:
                row[f"{phase}_cores_fleet_redis_other"] = [
                    round(usage[k], 2) for k in ("fleet_cores", "redis_cores", "other_cores")
                ]
        out[str(r["nodes"])] = row
    return {
        "nodes": out,
        "runtime_s": round(runtime, 1),
        "cores": cores,
        "torch_event_naming": "as-is" if as_is else "cheap",
    }

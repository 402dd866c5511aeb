"""``spottrain down``: end a run. Every node drains (an emergency checkpoint each), then
every VM is terminated and checked gone, the controller stopped, the run archived."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import time
from dataclasses import asdict, replace
from pathlib import Path

import redis

from spottrain.cloud.base import Instance, InstanceState, Provider, ProviderError
from spottrain.controller.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_OK,
    err,
    run_state,
    say,
)
from spottrain.controller.reconcile.execute import end_run_vms
from spottrain.controller.reconcile.state import RunState
from spottrain.controller.reconcile.summary import summarize
from spottrain.controller.run.archive import archive_run
from spottrain.controller.run.providers import build_providers
from spottrain.controller.run.records import RunError, RunInfo, find_run
from spottrain.controller.run.run_lighthouse import end_lighthouse
from spottrain.controller.run.run_redis import stop_embedded_redis
from spottrain.controller.run.wiring import build_controller
from spottrain.protocol.states import TERMINAL, RunPhase
from spottrain.spec import JobSpec


def down(args: argparse.Namespace) -> int:
    try:
        info = find_run(args.run)
    except RunError as e:
        err(str(e))
        return EXIT_BAD_INPUT
    now = bool(getattr(args, "now", False))
    drain_s = getattr(args, "drain_timeout", None)
    if drain_s is not None and drain_s < 0:
        err(f"--drain-timeout {drain_s:g}: give seconds >= 0 (or --now to skip the drain)")
        return EXIT_BAD_INPUT
    _stop_controller(info)
    spec = info.spec()
    if spec.fleet is not None:
        return _down_fleet(info, args.timeout, now=now)
    providers = build_providers(
        spec, local_state_dir=Path(info.local_state_dir) if info.local_state_dir else None
    )
    state = run_state(info)
    try:
        if state is None:
            err(f"run {info.run_id}: its Redis does not answer: its VMs end without a drain")
        elif not now:
            try:
                wait_s = drain_timeout(spec) if drain_s is None else drain_s
                _drain_launched(info, spec, providers, state, wait_s)
            except redis.RedisError as e:
                err(f"run {info.run_id}: its Redis failed during the drain ({e}): VMs end now")
        left = end_run_vms(info.run_id, providers, state, args.timeout)
    except ProviderError as e:
        err(f"cannot end the run's VMs: {e}")
        return EXIT_FAILED
    if state is not None:
        with contextlib.suppress(Exception):
            state.set_ctl(stopped="down", phase=RunPhase.DOWN)
            state.event("down", left=len(left), drained=int(not now))
            archive_run(info, state.client, asdict(summarize(state, time.time())))
    end_lighthouse(info)
    if info.embedded_redis:
        stop_embedded_redis(info)
    if left:
        err(f"run {info.run_id}: still there after {args.timeout:.0f} s: {', '.join(left)}")
        return EXIT_FAILED
    say(f"run {info.run_id}: every VM is gone; nothing of it runs")
    return EXIT_OK


def drain_timeout(spec: JobSpec) -> float:
    """How long ``down`` waits for the nodes' drains by default: the notice window a drain
    gets, and time for the copy out and the leave."""
    return min(60.0, *spec.notice_windows.values()) + 30.0


def _drain_launched(
    info: RunInfo, spec: JobSpec, providers: dict[str, Provider], state: RunState, timeout: float
) -> list[str]:
    """Ask every running node of the run to drain (emergency checkpoint, leave), as the
    controller does when it stops a run, and wait until each has left, its VM is gone, or
    ``timeout`` passed. Returns the nodes that did not drain in time."""
    from spottrain.protocol.notices import CONTROLLER_DRAIN_KIND, inject_notice

    alive = _alive_vms(info, providers)
    agents = state.node_records(sorted(alive))
    beats = state.heartbeats(sorted(alive))
    # A node whose agent has not registered, or no longer beats, has nobody to ask.
    asked = sorted(
        n for n in alive if agents.get(n, {}).get("state") not in {None, *TERMINAL} and beats.get(n)
    )
    if not state.ctl().get("stopping"):
        state.set_ctl(stopping="down", stopping_since=str(time.time()))
        state.event("stopping", why="down", error=0)
    window = min(60.0, *spec.notice_windows.values())
    for node in asked:
        inject_notice(state.client, state.keys, node, CONTROLLER_DRAIN_KIND, window)
        state.event("drain", vm=alive[node].id, node_name=node, why="down")
    if asked:
        say(f"run {info.run_id}: draining {len(asked)} node(s) (up to {timeout:.0f} s)")
    deadline = time.monotonic() + timeout
    while asked and time.monotonic() < deadline:
        time.sleep(1.0)
        alive = _alive_vms(info, providers)
        records = state.node_records(asked)
        beats = state.heartbeats(asked)
        asked = [
            n
            for n in asked
            if n in alive and records.get(n, {}).get("state") not in TERMINAL and beats.get(n)
        ]
    last = state.ckpt_last()
    if asked:
        err(
            f"run {info.run_id}: {', '.join(asked)} did not drain within {timeout:.0f} s; "
            "their VMs end without waiting further (`--drain-timeout` waits longer)"
        )
    elif last.get("drain") == "1":
        say(f"  every node drained: emergency checkpoint at step {last.get('step')}")
    return asked


def _alive_vms(info: RunInfo, providers: dict[str, Provider]) -> dict[str, Instance]:
    return {
        i.node: i
        for prov in providers.values()
        for i in prov.list(info.run_id)
        if i.state is not InstanceState.TERMINATED
    }


def _down_fleet(info: RunInfo, timeout: float, *, now: bool = False) -> int:
    """End a run on a Terraform fleet: every node drains (an emergency checkpoint each), then
    the controller removes every VM by name and the group is left at size 0. The group, its
    template and volume stay: `terraform destroy` removes them. ``now``: no drain."""
    from spottrain.controller.groups.controller import GroupController

    try:
        ctl = build_controller(info)
    except (RunError, ProviderError, ValueError, ImportError) as e:
        err(f"cannot reach run {info.run_id}'s group: {e}")
        return EXIT_FAILED
    assert isinstance(ctl, GroupController)
    if now:
        ctl.policy = replace(ctl.policy, drain_timeout_s=0.0)
    if not ctl.state.ctl().get("stopping"):
        ctl.state.set_ctl(stopping="down", stopping_since=str(time.time()))
        ctl.state.event("stopping", why="down", error=0)
    deadline = time.monotonic() + timeout
    try:
        while not ctl.done():
            if time.monotonic() > deadline:
                # Past the drains' grace: whatever still runs goes now, checkpoint or not.
                ctl.policy = replace(ctl.policy, drain_timeout_s=0.0)
                ctl.step()
                break
            ctl.step()
            time.sleep(2.0)
        left = [m.id for m in ctl.group.describe().alive]
    except ProviderError as e:
        err(f"cannot end the run's VMs: {e}")
        return EXIT_FAILED
    with contextlib.suppress(Exception):
        ctl.state.set_ctl(stopped="down", phase=RunPhase.DOWN)
        ctl.state.event("down", left=len(left))
        archive_run(info, ctl.state.client, asdict(summarize(ctl.state, time.time())))
    end_lighthouse(info)
    if left:
        err(f"run {info.run_id}: still leaving after {timeout:.0f} s: {', '.join(left)}")
        return EXIT_FAILED
    say(f"run {info.run_id}: every VM of group {ctl.group.name} is gone; the group is at size 0")
    return EXIT_OK


def _stop_controller(info: RunInfo) -> None:
    pid = info.controller_pid
    if not pid or pid == os.getpid():
        return
    with contextlib.suppress(ProcessLookupError, PermissionError, FileNotFoundError):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        if "spottrain" not in cmdline:
            return  # the pid was reused by something else
        os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            os.kill(pid, 0)
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)

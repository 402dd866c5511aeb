"""``spottrain down``: end a run. Every node drains (an emergency checkpoint each), then
every VM is terminated and checked gone, the controller stopped, the run archived."""

from __future__ import annotations

import argparse
import contextlib
import os
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING

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
from spottrain.controller.run.processes import ProcessMark, end_process
from spottrain.controller.run.providers import build_providers
from spottrain.controller.run.records import RunError, RunInfo, find_run
from spottrain.controller.run.run_lighthouse import end_lighthouse
from spottrain.controller.run.run_redis import stop_embedded_redis
from spottrain.controller.run.wiring import RunHeld, build_controller, held_line, lease_owner
from spottrain.protocol.states import TERMINAL, RunPhase
from spottrain.spec import JobSpec

if TYPE_CHECKING:
    from spottrain.controller.groups.controller import GroupController


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
    stop_controller(info)
    spec = info.spec()
    if spec.fleet is not None:
        return _down_fleet(info, args.timeout, now=now)
    providers = build_providers(
        spec, local_state_dir=Path(info.local_state_dir) if info.local_state_dir else None
    )
    state = run_state(info)
    try:
        lease = DownLease.take(info, state) if state is not None else None
    except RunHeld as e:
        err(str(e))
        return EXIT_FAILED
    try:
        return _end_vms(info, args, spec, providers, state, now=now, drain_s=drain_s)
    finally:
        if lease is not None:
            lease.close()


def _end_vms(
    info: RunInfo,
    args: argparse.Namespace,
    spec: JobSpec,
    providers: dict[str, Provider],
    state: RunState | None,
    *,
    now: bool,
    drain_s: float | None,
) -> int:
    """Drain (unless ``now``), end every VM, record and archive the run, stop its Redis."""
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

    owner = lease_owner("down")
    try:
        ctl = build_controller(info, owner=owner)
    except (RunError, ProviderError, ValueError, ImportError) as e:
        err(f"cannot reach run {info.run_id}'s group: {e}")
        return EXIT_FAILED
    assert isinstance(ctl, GroupController)
    try:
        lease = DownLease.take(info, ctl.state, owner)
    except RunHeld as e:
        err(str(e))
        return EXIT_FAILED
    try:
        return _end_group(info, ctl, timeout, now=now)
    finally:
        lease.close()


def _end_group(info: RunInfo, ctl: GroupController, timeout: float, *, now: bool) -> int:
    """Drain and remove every VM of the group (``now``: no drain); record the run."""
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


def stop_controller(info: RunInfo) -> None:
    """Stop the run's controller: the very process run.json's mark names (pid, start time,
    boot, marker), never another that took its pid or shares a name. SIGTERM lets it go of
    the lease; SIGKILL after 5 s."""
    mark = ProcessMark.from_dict(info.controller)
    if mark is None or mark.pid == os.getpid():
        return
    if not end_process(mark):
        err(f"run {info.run_id}: its controller ({mark.describe()}) did not end")


# How long down's hold of the lease lasts between renewals, and how long it waits at most
# for a controller's lease to lapse (one that down could not stop renews it).
DOWN_LEASE_TTL_S = 10.0
DOWN_LEASE_WAIT_S = 60.0


class DownLease:
    """The run's lease held by ``down`` from before its first write to its end, renewed from
    a thread: no controller (a ``resume``) drives the run in the middle of its end."""

    def __init__(self, state: RunState, owner: str) -> None:
        self.state, self.owner = state, owner
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, daemon=True)
        self._thread.start()

    @classmethod
    def take(cls, info: RunInfo, state: RunState, owner: str | None = None) -> DownLease:
        """Take the lease, stopping a controller that recorded itself meanwhile, and waiting
        for the lease of one that ended without letting go to lapse.

        Raises:
            RunHeld: another controller (one down cannot stop) or another down holds it.
        """
        owner = owner or lease_owner("down")
        deadline: float | None = None
        while not state.acquire(owner, DOWN_LEASE_TTL_S):
            with contextlib.suppress(RunError):
                stop_controller(RunInfo.load(info.run_id))
            if deadline is None:
                left_s = max(0, int(state.client.pttl(state.keys.ctl_lease))) / 1000
                deadline = time.monotonic() + min(DOWN_LEASE_WAIT_S, left_s + 1.0)
            elif time.monotonic() > deadline:
                raise RunHeld(_held_for_down(info.run_id, state.lease_holder()))
            time.sleep(0.2)
        return cls(state, owner)

    def _renew(self) -> None:
        while not self._stop.wait(DOWN_LEASE_TTL_S / 4):
            with contextlib.suppress(redis.RedisError):
                self.state.renew(self.owner, DOWN_LEASE_TTL_S)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(redis.RedisError):
            self.state.release(self.owner)


def _held_for_down(run_id: str, holder: str | None) -> str:
    if holder and holder.startswith("down-"):
        return held_line(run_id, holder)
    return (
        f"run {run_id} is driven by a controller that down cannot stop from here ({holder}); "
        f"nothing was changed: stop that controller, then `spottrain down {run_id}` again"
    )

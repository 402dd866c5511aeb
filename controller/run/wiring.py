"""A run's controller wired from its record: providers (or a Terraform fleet's group), its
state in Redis, local preemptions, boot scripts; and the controller started in the
background."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from spottrain.cloud.base import Provider
from spottrain.controller.groups.controller import (
    GROUP_TUNABLES,
    GroupController,
    group_policy_from_spec,
)
from spottrain.controller.reconcile.controller import Controller, policy_from_spec
from spottrain.controller.reconcile.state import RunState, new_owner
from spottrain.controller.run.code import boot_renderer
from spottrain.controller.run.providers import (
    Endpoints,
    build_group,
    build_providers,
    preemption_injector,
)
from spottrain.controller.run.records import RunInfo
from spottrain.controller.run.run_redis import open_redis
from spottrain.protocol.keys import RunKeys
from spottrain.protocol.states import RunPhase


def build_controller(
    info: RunInfo,
    *,
    interval_s: float = 1.0,
    endpoints: Endpoints | None = None,
    policy: dict[str, float] | None = None,
) -> Controller | GroupController:
    """The controller of a run, with its providers, state and local preemptions; for a
    Terraform fleet, the controller that adopts its group.

    Raises:
        RunError: Redis unreachable or refusing.
    """
    spec = info.spec()
    client = open_redis(info, spec)
    keys = RunKeys(info.run_id)
    state = RunState(client, keys)
    if spec.fleet is not None:
        if not state.ctl().get("started_at"):
            state.set_ctl(started_at=str(time.time()), phase=RunPhase.RUNNING)
        return GroupController(
            spec=spec,
            run_id=info.run_id,
            group=build_group(spec, endpoints=endpoints),
            state=state,
            policy=group_policy_from_spec(
                spec, **{k: v for k, v in (policy or {}).items() if k in GROUP_TUNABLES}
            ),
            interval_s=max(interval_s, 5.0),
            notice_window_s=min(60.0, *spec.notice_windows.values()),
            owner=new_owner(),
            region=spec.fleet.region or "",
        )
    providers: dict[str, Provider] = build_providers(
        spec,
        local_state_dir=Path(info.local_state_dir) if info.local_state_dir else None,
        endpoints=endpoints,
    )
    ctl = state.ctl()
    started = float(ctl.get("started_at") or time.time())
    if not ctl.get("started_at"):
        state.set_ctl(started_at=str(started), phase=RunPhase.RUNNING)
    tick = None
    if "local" in providers:
        injector = preemption_injector(
            spec, providers["local"], info.run_id, started_at=started, base_dir=Path(info.base_dir)
        )
        if injector is not None:

            def tick(now: float) -> None:
                for vm, notice in injector.tick(now):
                    state.event("inject-preemption", vm=vm, notice=int(notice))

    return Controller(
        spec=spec,
        run_id=info.run_id,
        providers=providers,
        state=state,
        boot=boot_renderer(spec, info),
        policy=policy_from_spec(spec, **(policy or {})),
        interval_s=interval_s,
        tick=tick,
        owner=new_owner(),
    )


def spawn_controller(info: RunInfo) -> int:
    """Run the controller of ``info`` in the background; returns its pid."""
    log = open(info.dir / "controller.log", "ab")  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen(
        [sys.executable, "-m", "spottrain.controller.run.daemon", info.run_id],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    log.close()
    info.controller_pid = proc.pid
    info.save()
    return proc.pid

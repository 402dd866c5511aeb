"""A run's controller wired from its record: providers (or a Terraform fleet's group), its
state in Redis, local preemptions, boot scripts; the run's lease claimed before any of it
writes; and the controller started in the background."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
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
from spottrain.controller.run.processes import ProcessMark, boot_id, carries_marker, start_ticks
from spottrain.controller.run.providers import (
    Endpoints,
    build_group,
    build_providers,
    preemption_injector,
)
from spottrain.controller.run.records import RunError, RunInfo
from spottrain.controller.run.run_redis import open_redis
from spottrain.protocol.keys import RunKeys
from spottrain.protocol.states import RunPhase

# The lease a claim takes before the controller's first pass renews it with its own TTL
# (controller/reconcile/drive.py: at least 10 s).
CLAIM_TTL_S = 10.0


class RunHeld(RunError):
    """Another controller (or a ``spottrain down``) holds the run's lease, or the run was
    ended by ``down``; nothing was written."""


def lease_owner(kind: str = "ctl") -> str:
    """A lease owner that says who holds the run: ``ctl-1a2b3c4d5e6f pid 4242 on host``."""
    tag = new_owner().replace("ctl-", f"{kind}-", 1)
    return f"{tag} pid {os.getpid()} on {socket.gethostname()}"


def held_line(run_id: str, holder: str | None) -> str:
    """The one line a command refused by the run's lease prints: who holds it, the fix."""
    who = holder or "a controller whose lease has just lapsed"
    if holder and holder.startswith("down-"):
        return (
            f"run {run_id} is being ended by `spottrain down` ({holder}); nothing was "
            "changed: wait for it to finish"
        )
    return (
        f"run {run_id} is driven by another controller ({who}); nothing was changed: "
        f"`spottrain status {run_id} -f` follows it, `spottrain down {run_id}` ends it, or "
        "stop that controller and resume again"
    )


def claim_run(info: RunInfo, owner: str, ttl_s: float = CLAIM_TTL_S) -> RunState:
    """Take the run's lease for ``owner`` before anything of the run is written: a run
    someone else holds, or that ``down`` ended, is refused with nothing changed.

    Raises:
        RunHeld: another controller or a ``down`` holds the lease, or the run is down.
        RunError: Redis unreachable or refusing.
    """
    state = RunState(open_redis(info, info.spec()), RunKeys(info.run_id))
    if state.ctl().get("phase") == RunPhase.DOWN:
        raise RunHeld(ended_line(info.run_id))
    if not state.acquire(owner, ttl_s):
        raise RunHeld(held_line(info.run_id, state.lease_holder()))
    return state


def ended_line(run_id: str) -> str:
    return (
        f"run {run_id} was ended by `spottrain down`: nothing to resume; "
        "`spottrain up JOB.yaml` starts a new run"
    )


def record_controller(info: RunInfo, owner: str) -> None:
    """Write this process, the run's controller now (its lease held), into run.json, so
    ``down`` can stop it and nothing else; read afresh so no other field goes back."""
    pid = os.getpid()
    marker = info.run_id if carries_marker(pid, info.run_id) else ""
    mark = ProcessMark(pid, start_ticks(pid) or 0, boot_id(), marker, socket.gethostname())
    fresh = RunInfo.load(info.run_id)
    for rec in (info, fresh):
        rec.controller_pid = pid
        rec.controller = {**mark.as_dict(), "owner": owner}
    fresh.save()


def build_controller(
    info: RunInfo,
    *,
    interval_s: float = 1.0,
    endpoints: Endpoints | None = None,
    policy: dict[str, float] | None = None,
    owner: str | None = None,
) -> Controller | GroupController:
    """The controller of a run, with its providers, state and local preemptions; for a
    Terraform fleet, the controller that adopts its group. ``owner``: the lease owner it
    drives as (one that :func:`claim_run` took the lease for).

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
            owner=owner or new_owner(),
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
        owner=owner or new_owner(),
    )


def spawn_controller(info: RunInfo) -> int:
    """Run the controller of ``info`` in the background, once it holds the run's lease;
    returns its pid. It has recorded itself in run.json by then.

    Raises:
        RunHeld: another controller or a ``down`` holds the run (the daemon wrote nothing).
        RunError: the daemon ended before it held the lease (its log says why).
    """
    read_end, write_end = os.pipe()
    log = open(info.dir / "controller.log", "ab")  # noqa: SIM115 - the child owns it
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "spottrain.controller.run.daemon", info.run_id, str(write_end)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            pass_fds=(write_end,),
        )
    finally:
        log.close()
        os.close(write_end)
    # The daemon writes one line once it holds the lease or was refused; EOF: it ended.
    with os.fdopen(read_end, "rb") as ready:
        said = ready.read().decode(errors="replace").strip()
    if said == READY:
        return proc.pid
    proc.wait()
    if said:
        raise RunHeld(said)
    raise RunError(
        f"the run's controller ended at its start (exit {proc.returncode}); see "
        f"{info.dir / 'controller.log'}"
    )


# What the daemon says on its ready pipe once it holds the run's lease.
READY = "held"


def ready_reporter(fd: int | None) -> Callable[[str], None]:
    """What the daemon calls once it holds the lease (:data:`READY`) or is refused (the
    line): written to ``spawn_controller``'s pipe, which is closed after."""

    def report(line: str) -> None:
        if fd is None:
            return
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)

    return report

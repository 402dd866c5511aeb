"""The fleet commands of ``spottrain``: up, resume, status, logs, scale, down."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import redis

from spottrain.cloud.base import Instance, InstanceState, Provider, ProviderError
from spottrain.keys import RunKeys
from spottrain.spec import JobSpec, SpecError, WindowCheck, check_notice_windows, load_spec

from .drive import drive_run, format_summary
from .env_lock import clouds_to_lock, env_lock_lines, parse_lock_args
from .loop import summarize
from .providers import build_providers
from .runs import (
    RunError,
    RunInfo,
    archive_run,
    build_controller,
    create_run,
    find_run,
    open_redis,
    restart_embedded_redis,
    spawn_controller,
    stop_embedded_redis,
)
from .state import RunState

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_WINDOW = 0, 1, 2, 3


def _err(msg: str) -> None:
    print(f"spottrain: {msg}", file=sys.stderr)


def _say(line: str) -> None:
    print(line, flush=True)


def up(args: argparse.Namespace) -> int:
    try:
        loaded = load_spec(args.spec)
    except SpecError as e:
        print(str(e), file=sys.stderr)
        return EXIT_BAD_INPUT
    short = _windows_short(loaded.spec)
    if short and not args.force:
        _err(f"{loaded.source}: an emergency checkpoint does not fit every notice window:")
        for line in short:
            print(f"  {line}", file=sys.stderr)
        _err("nothing launched; fix the spec (`spottrain validate` checks it) or pass --force")
        return EXIT_WINDOW
    try:
        given = parse_lock_args(getattr(args, "env_lock", None) or [], clouds_to_lock(loaded.spec))
    except ValueError as e:
        _err(str(e))
        return EXIT_BAD_INPUT
    try:
        info = create_run(loaded, env_locks=given)
    except RunError as e:
        _err(str(e))
        return EXIT_FAILED
    if short:
        _record_forced(info, short)
    _say(
        f"run {info.run_id}: Redis {info.redis_url}"
        + (" (embedded)" if info.embedded_redis else "")
    )
    if info.code_url:
        _say(f"  code {info.code_url}")
    for line in env_lock_lines(info.env_locks):
        _say(f"  {line}")
    if args.detach:
        pid = spawn_controller(info)
        _say(f"  controller in the background (pid {pid}): {info.dir / 'controller.log'}")
        _say(f"  follow: spottrain logs {info.run_id} -f    end: spottrain down {info.run_id}")
        return EXIT_OK
    return _drive(info, args.interval)


def _windows_short(spec: JobSpec) -> list[str]:
    """The notice windows (``validate``'s lines) an emergency checkpoint does not fit."""
    size, gbps = spec.checkpoint.estimated_gb, spec.checkpoint.volume.write_gbps
    checks: list[WindowCheck] = check_notice_windows(spec)
    return [c.describe(size or 0.0, gbps) for c in checks if not c.fits]


def _record_forced(info: RunInfo, short: list[str]) -> None:
    """``up --force`` launched past a notice window: said now, and kept in the run's events
    (a preemption there may lose the steps since the last periodic checkpoint)."""
    for line in short:
        _err(f"warning (--force): {line}")
    state = _state(info)
    if state is not None:
        for line in short:
            state.event("warning", why="notice-window", message=line)


def _drive(info: RunInfo, interval: float) -> int:
    info.controller_pid = os.getpid()
    info.save()
    try:
        return drive_run(info, view=_say, interval_s=interval)
    except KeyboardInterrupt:
        _say(
            f"\ncontroller stopped; the run's VMs keep training without backfill (a VM whose "
            "training stops ends itself after controller.orphan_timeout_minutes). "
            f"`spottrain resume {info.run_id}` restarts the controller, "
            f"`spottrain down {info.run_id}` ends the run"
        )
        return EXIT_FAILED


def resume(args: argparse.Namespace) -> int:
    try:
        info = find_run(args.run)
        restart_embedded_redis(info)
    except RunError as e:
        _err(str(e))
        return EXIT_BAD_INPUT
    if args.detach:
        pid = spawn_controller(info)
        _say(f"run {info.run_id}: controller running in the background (pid {pid})")
        return EXIT_OK
    return _drive(info, args.interval)


def _state(info: RunInfo) -> RunState | None:
    try:
        return RunState(open_redis(info, info.spec()), RunKeys(info.run_id))
    except RunError:
        return None


def status(args: argparse.Namespace) -> int:
    try:
        info = find_run(args.run)
    except RunError as e:
        _err(str(e))
        return EXIT_BAD_INPUT
    state = _state(info)
    refused: dict[str, str] = {}
    if state is not None:
        summary: dict[str, Any] = asdict(summarize(state, time.time()))
        refused = state.ckpt_refused()
    elif (info.dir / "summary.json").exists():
        summary = json.loads((info.dir / "summary.json").read_text())
    else:
        _err(f"run {info.run_id}: its Redis ({info.redis_url}) is down and it left no summary")
        return EXIT_FAILED
    if args.json:
        locks = {"env_locks": info.env_locks} if info.env_locks else {}
        print(json.dumps({"run_id": info.run_id, **summary, "ckpt_refused": refused, **locks}))
        return EXIT_OK
    from .loop import Summary

    _say(f"run {info.run_id}")
    for line in format_summary(Summary(**summary)):
        _say(f"  {line}")
    if refused:
        _say(f"  {_refused_line(refused)}")
    for line in env_lock_lines(info.env_locks):
        _say(f"  {line}")
    return EXIT_OK


def _refused_line(refused: dict[str, str]) -> str:
    """A refused checkpoint commit must not pass unseen: the trainers went on training."""
    return (
        f"{refused.get('count', '?')} checkpoint commits refused (newest: step "
        f"{refused.get('step', '?')} by {refused.get('node') or '?'}: {refused.get('reason', '')})"
    )


def _format_event(row: dict[str, str]) -> str:
    at = float(row.pop("at", "0") or 0)
    kind = row.pop("type", "?")
    node = row.pop("node", "")
    row.pop("id", None)
    rest = " ".join(f"{k}={v}" for k, v in row.items())
    return f"{time.strftime('%H:%M:%S', time.localtime(at))} {node:<10} {kind:<22} {rest}"


def logs(args: argparse.Namespace) -> int:
    try:
        info = find_run(args.run)
    except RunError as e:
        _err(str(e))
        return EXIT_BAD_INPUT
    if args.node:
        return _node_log(info, args.node, args.follow)
    state = _state(info)
    if state is None:
        archived = info.dir / "events.jsonl"
        if not archived.exists():
            _err(f"run {info.run_id}: its Redis does not answer and it left no event log")
            return EXIT_FAILED
        for line in archived.read_text().splitlines():
            _say(_format_event(json.loads(line)))
        return EXIT_OK
    last = "0-0"
    while True:
        for entry_id, fields in state.client.xrange(
            state.keys.events, min=f"({last}" if last != "0-0" else "-"
        ):
            last = entry_id.decode()
            _say(_format_event({k.decode(): v.decode() for k, v in fields.items()}))
        if not args.follow:
            return EXIT_OK
        try:
            time.sleep(1.0)
            if state.ctl().get("phase") in ("done", "failed") and not args.follow:
                return EXIT_OK
        except KeyboardInterrupt:
            return EXIT_OK


def _node_log(info: RunInfo, node: str, follow: bool) -> int:
    """A node's training output: the local cloud keeps each VM's console log on disk."""
    state = _state(info)
    vm = ""
    if state is not None:
        rec = state.ledger().records.get(node)
        vm = rec.instance_id if rec else ""
    if not vm and info.local_state_dir:
        for p in (Path(info.local_state_dir) / "instances").glob("*.json"):
            rec_json = json.loads(p.read_text())
            tags = rec_json.get("tags", {})
            if tags.get("spottrain-job") == info.run_id and tags.get("spottrain-node") == node:
                vm = rec_json["id"]
    if not vm or not info.local_state_dir:
        _err(
            f"no output kept for node {node!r} of run {info.run_id} (the local cloud keeps each "
            "VM's console; on AWS and GCP read the VM's journal: journalctl -u spottrain-agent)"
        )
        return EXIT_FAILED
    path = Path(info.local_state_dir) / "logs" / f"{vm}.log"
    with open(path, errors="replace") as f:
        while True:
            chunk = f.read()
            if chunk:
                sys.stdout.write(chunk)
                sys.stdout.flush()
            if not follow:
                return EXIT_OK
            try:
                time.sleep(0.5)
            except KeyboardInterrupt:
                return EXIT_OK


def down(args: argparse.Namespace) -> int:
    try:
        info = find_run(args.run)
    except RunError as e:
        _err(str(e))
        return EXIT_BAD_INPUT
    now = bool(getattr(args, "now", False))
    drain_s = getattr(args, "drain_timeout", None)
    if drain_s is not None and drain_s < 0:
        _err(f"--drain-timeout {drain_s:g}: give seconds >= 0 (or --now to skip the drain)")
        return EXIT_BAD_INPUT
    _stop_controller(info)
    spec = info.spec()
    if spec.fleet is not None:
        return _down_fleet(info, args.timeout, now=now)
    providers = build_providers(
        spec, local_state_dir=Path(info.local_state_dir) if info.local_state_dir else None
    )
    state = _state(info)
    try:
        if state is None:
            _err(f"run {info.run_id}: its Redis does not answer: its VMs end without a drain")
        elif not now:
            try:
                wait_s = drain_timeout(spec) if drain_s is None else drain_s
                _drain_launched(info, spec, providers, state, wait_s)
            except redis.RedisError as e:
                _err(f"run {info.run_id}: its Redis failed during the drain ({e}): VMs end now")
        left = _end_vms(info, providers, state, args.timeout)
    except ProviderError as e:
        _err(f"cannot end the run's VMs: {e}")
        return EXIT_FAILED
    if state is not None:
        with contextlib.suppress(Exception):
            state.set_ctl(stopped="down", phase="down")
            state.event("down", left=len(left), drained=int(not now))
            archive_run(info, state.client, asdict(summarize(state, time.time())))
    if info.embedded_redis:
        stop_embedded_redis(info)
    if left:
        _err(f"run {info.run_id}: still there after {args.timeout:.0f} s: {', '.join(left)}")
        return EXIT_FAILED
    _say(f"run {info.run_id}: every VM is gone; nothing of it runs")
    return EXIT_OK


def drain_timeout(spec: JobSpec) -> float:
    """How long ``down`` waits for the nodes' drains by default: the notice window a drain
    gets, and time for the copy out and the leave."""
    return min(60.0, *spec.notice_windows.values()) + 30.0


_DRAINED = ("left", "failed")


def _drain_launched(
    info: RunInfo, spec: JobSpec, providers: dict[str, Provider], state: RunState, timeout: float
) -> list[str]:
    """Ask every running node of the run to drain (emergency checkpoint, leave), as the
    controller does when it stops a run, and wait until each has left, its VM is gone, or
    ``timeout`` passed. Returns the nodes that did not drain in time."""
    from spottrain.agent.agent import inject_notice

    alive = _alive_vms(info, providers)
    agents = state.node_records(sorted(alive))
    beats = state.heartbeats(sorted(alive))
    # A node whose agent has not registered, or no longer beats, has nobody to ask.
    asked = sorted(
        n for n in alive if agents.get(n, {}).get("state") not in (None, *_DRAINED) and beats.get(n)
    )
    if not state.ctl().get("stopping"):
        state.set_ctl(stopping="down", stopping_since=str(time.time()))
        state.event("stopping", why="down", error=0)
    window = min(60.0, *spec.notice_windows.values())
    for node in asked:
        inject_notice(state.client, state.keys, node, "terminate", window)
        state.event("drain", vm=alive[node].id, node_name=node, why="down")
    if asked:
        _say(f"run {info.run_id}: draining {len(asked)} node(s) (up to {timeout:.0f} s)")
    deadline = time.monotonic() + timeout
    while asked and time.monotonic() < deadline:
        time.sleep(1.0)
        alive = _alive_vms(info, providers)
        records = state.node_records(asked)
        beats = state.heartbeats(asked)
        asked = [
            n
            for n in asked
            if n in alive and records.get(n, {}).get("state") not in _DRAINED and beats.get(n)
        ]
    last = state.ckpt_last()
    if asked:
        _err(
            f"run {info.run_id}: {', '.join(asked)} did not drain within {timeout:.0f} s; "
            "their VMs end without waiting further (`--drain-timeout` waits longer)"
        )
    elif last.get("drain") == "1":
        _say(f"  every node drained: emergency checkpoint at step {last.get('step')}")
    return asked


def _alive_vms(info: RunInfo, providers: dict[str, Provider]) -> dict[str, Instance]:
    return {
        i.node: i
        for prov in providers.values()
        for i in prov.list(info.run_id)
        if i.state is not InstanceState.TERMINATED
    }


def _end_vms(
    info: RunInfo, providers: dict[str, Provider], state: RunState | None, timeout: float
) -> list[str]:
    """Terminate every VM of the run and wait, up to ``timeout``, until the clouds list
    each as terminated. Returns what is still there."""
    deadline = time.monotonic() + timeout
    asked: set[str] = set()
    first = True
    while True:
        left = []
        for prov in providers.values():
            listed = prov.list(info.run_id)
            alive = [i for i in listed if i.state is not InstanceState.TERMINATED]
            # The first round ends what is listed as ended too: a GCP VM that shut itself
            # down (its dead man's switch, a STOP preemption) is stopped, its disks billed,
            # until it is deleted. Ending an ended VM again is harmless on every cloud.
            ending = listed if first else alive
            if ending:
                prov.terminate([i.id for i in ending])
                left += [f"{i.cloud}:{i.id} ({i.state})" for i in alive]
            for i in alive:
                if i.id not in asked and state is not None:
                    with contextlib.suppress(Exception):
                        state.event("terminate", vm=i.id, node_name=i.node, why="down")
                asked.add(i.id)
        first = False
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(1.0)


def _down_fleet(info: RunInfo, timeout: float, *, now: bool = False) -> int:
    """End a run on a Terraform fleet: every node drains (an emergency checkpoint each), then
    the controller removes every VM by name and the group is left at size 0. The group, its
    template and volume stay: `terraform destroy` removes them. ``now``: no drain."""
    from .group_loop import GroupController

    try:
        ctl = build_controller(info)
    except (RunError, ProviderError, ValueError, ImportError) as e:
        _err(f"cannot reach run {info.run_id}'s group: {e}")
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
        _err(f"cannot end the run's VMs: {e}")
        return EXIT_FAILED
    with contextlib.suppress(Exception):
        ctl.state.set_ctl(stopped="down", phase="down")
        ctl.state.event("down", left=len(left))
        archive_run(info, ctl.state.client, asdict(summarize(ctl.state, time.time())))
    if left:
        _err(f"run {info.run_id}: still leaving after {timeout:.0f} s: {', '.join(left)}")
        return EXIT_FAILED
    _say(f"run {info.run_id}: every VM of group {ctl.group.name} is gone; the group is at size 0")
    return EXIT_OK


def scale(args: argparse.Namespace) -> int:
    try:
        info = find_run(args.run)
    except RunError as e:
        _err(str(e))
        return EXIT_BAD_INPUT
    nodes = info.spec().nodes
    if not nodes.min <= args.nodes <= nodes.max:
        _err(
            f"run {info.run_id} keeps between {nodes.min} and {nodes.max} nodes (the spec's "
            f"nodes.min and nodes.max), not {args.nodes}; `spottrain down {info.run_id}` "
            "ends the run"
        )
        return EXIT_BAD_INPUT
    state = _state(info)
    if state is None:
        _err(f"run {info.run_id}: its Redis ({info.redis_url}) does not answer")
        return EXIT_FAILED
    before = state.ctl().get("target_nodes") or str(nodes.max)
    state.set_ctl(target_nodes=str(args.nodes))
    state.event("scale", nodes=args.nodes, before=int(before))
    _say(
        f"run {info.run_id}: {before} -> {args.nodes} nodes (the controller acts on its next pass)"
    )
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

"""The fleet commands of ``spottrain``: up, resume, status, logs, scale (``down``: its own
module)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from dataclasses import asdict
from typing import Any

from spottrain.controller.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_WINDOW,
    err,
    run_state,
    say,
)
from spottrain.controller.reconcile.summary import BootLines, boot_lines, summarize
from spottrain.controller.run.create import create_run
from spottrain.controller.run.daemon import exit_on_sigterm
from spottrain.controller.run.drive import drive_run, format_summary
from spottrain.controller.run.env_lock import clouds_to_lock, env_lock_lines, parse_lock_args
from spottrain.controller.run.records import RunError, RunInfo, find_run
from spottrain.controller.run.replica_view import ReplicaStatus, replica_status
from spottrain.controller.run.run_redis import restart_embedded_redis
from spottrain.controller.run.wiring import READY, ended_line, spawn_controller
from spottrain.controller.view.collect import refused_line
from spottrain.controller.view.follow import follow, status_doc, summary_of
from spottrain.controller.view.live import LiveView
from spottrain.protocol import events as stream
from spottrain.protocol.states import RunPhase
from spottrain.safetext import escape_controls
from spottrain.spec import JobSpec, SpecError, WindowCheck, check_notice_windows, load_spec


def up(args: argparse.Namespace) -> int:
    try:
        loaded = load_spec(args.spec)
    except SpecError as e:
        print(str(e), file=sys.stderr)
        return EXIT_BAD_INPUT
    short = _windows_short(loaded.spec)
    if short and not args.force:
        err(f"{loaded.source}: an emergency checkpoint does not fit every notice window:")
        for line in short:
            print(f"  {line}", file=sys.stderr)
        err("nothing launched; fix the spec (`spottrain validate` checks it) or pass --force")
        return EXIT_WINDOW
    try:
        given = parse_lock_args(getattr(args, "env_lock", None) or [], clouds_to_lock(loaded.spec))
    except ValueError as e:
        err(str(e))
        return EXIT_BAD_INPUT
    try:
        info = create_run(loaded, env_locks=given)
    except RunError as e:
        err(str(e))
        return EXIT_FAILED
    if short:
        _record_forced(info, short)
    say(
        f"run {info.run_id}: Redis {info.redis_url}"
        + (" (embedded)" if info.embedded_redis else "")
    )
    if info.code_url:
        say(f"  code {info.code_url}")
    for line in env_lock_lines(info.env_locks):
        say(f"  {line}")
    if args.detach:
        try:
            pid = spawn_controller(info)
        except RunError as e:
            err(str(e))
            return EXIT_FAILED
        say(f"  controller in the background (pid {pid}): {info.dir / 'controller.log'}")
        say(f"  follow: spottrain logs {info.run_id} -f    end: spottrain down {info.run_id}")
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
        err(f"warning (--force): {line}")
    state = run_state(info)
    if state is not None:
        for line in short:
            state.event("warning", why="notice-window", message=line)


def _drive(info: RunInfo, interval: float) -> int:
    # run.json names this process only once it holds the run's lease (drive_run): a
    # refused controller writes nothing. SIGTERM (`down`) lets go of the lease on the way.
    main = threading.current_thread() is threading.main_thread()
    before = exit_on_sigterm() if main else None
    try:
        return _drive_here(info, interval)
    finally:
        if main:
            signal.signal(signal.SIGTERM, before)


def _drive_here(info: RunInfo, interval: float) -> int:
    # A terminal gets one view redrawn in place; anything else the plain lines.
    live = LiveView.for_stdout()
    try:
        return drive_run(
            info,
            view=live.say if live else say,
            interval_s=interval,
            live=live,
            on_claim=_tell_refusal,
        )
    except KeyboardInterrupt:
        say(
            f"\ncontroller stopped; the run's VMs keep training without backfill (a VM whose "
            "training stops ends itself after controller.orphan_timeout_minutes). "
            f"`spottrain resume {info.run_id}` restarts the controller, "
            f"`spottrain down {info.run_id}` ends the run"
        )
        return EXIT_FAILED


def _tell_refusal(line: str) -> None:
    """What drive_run says of its claim on the lease: only a refusal is news here."""
    if line != READY:
        err(line)


def resume(args: argparse.Namespace) -> int:
    try:
        info = find_run(args.run)
    except RunError as e:
        err(str(e))
        return EXIT_BAD_INPUT
    if _ended_by_down(info):
        # Its Redis is stopped: starting it again would bring back a run that is over.
        err(ended_line(info.run_id))
        return EXIT_FAILED
    try:
        restart_embedded_redis(info)
    except RunError as e:
        err(str(e))
        return EXIT_BAD_INPUT
    if args.detach:
        try:
            pid = spawn_controller(info)
        except RunError as e:
            err(str(e))
            return EXIT_FAILED
        say(f"run {info.run_id}: controller running in the background (pid {pid})")
        return EXIT_OK
    return _drive(info, args.interval)


def _ended_by_down(info: RunInfo) -> bool:
    """Whether the run's archive says ``spottrain down`` ended it."""
    try:
        summary = json.loads((info.dir / "summary.json").read_text())
        return bool(summary.get("phase") == RunPhase.DOWN)
    except (OSError, ValueError, AttributeError):
        return False


def status(args: argparse.Namespace) -> int:
    try:
        info = find_run(args.run)
    except RunError as e:
        err(str(e))
        return EXIT_BAD_INPUT
    if args.follow:
        return follow(info, as_json=args.json, interval_s=args.interval)
    state = run_state(info)
    refused: dict[str, str] = {}
    replicas: ReplicaStatus | None = None
    boot = BootLines()
    if state is not None:
        now = summarize(state, time.time())
        summary: dict[str, Any] = asdict(now)
        refused = state.ckpt_refused()
        replicas = replica_status(info, state.client)
        boot = boot_lines(state, now)
    elif (info.dir / "summary.json").exists():
        summary = json.loads((info.dir / "summary.json").read_text())
    else:
        err(f"run {info.run_id}: its Redis ({info.redis_url}) is down and it left no summary")
        return EXIT_FAILED
    if args.json:
        print(json.dumps(status_doc(info, summary, refused, replicas, boot)))
        return EXIT_OK
    say(f"run {info.run_id}")
    for line in format_summary(summary_of(summary), boot):
        say(f"  {line}")
    if replicas:
        for line in replicas.lines(time.time()):
            say(f"  {line}")
    if refused:
        say(f"  {refused_line(refused)}")
    for line in env_lock_lines(info.env_locks):
        say(f"  {line}")
    return EXIT_OK


def _format_event(row: dict[str, str]) -> str:
    """One event as a line, control characters escaped (any node may write the stream)."""
    try:
        at = float(row.pop("at", "0") or 0)
    except ValueError:
        at = 0.0
    kind = row.pop("type", "?")
    node = row.pop("node", "")
    row.pop("id", None)
    rest = " ".join(f"{k}={v}" for k, v in row.items())
    line = f"{time.strftime('%H:%M:%S', time.localtime(at))} {node:<10} {kind:<22} {rest}"
    return escape_controls(line)


def logs(args: argparse.Namespace) -> int:
    try:
        info = find_run(args.run)
    except RunError as e:
        err(str(e))
        return EXIT_BAD_INPUT
    if args.node or args.vm:
        if not args.node:
            err("--vm picks one VM of a node: give --node too")
            return EXIT_BAD_INPUT
        from spottrain.controller.cli import node_logs

        return node_logs.node_log(
            info,
            args.node,
            vm=args.vm,
            follow=args.follow,
            interval=args.interval,
            tail=args.tail,
        )
    if args.tail is not None and args.tail < 0:
        err(f"--tail {args.tail} must be a number of events, 0 or more")
        return EXIT_BAD_INPUT
    # Slicing what was read: the stream is capped (``EVENTS_MAXLEN``), so a run's whole
    # event log is one bounded read.
    keep = (lambda rows: rows[max(0, len(rows) - args.tail) :]) if args.tail is not None else list
    state = run_state(info)
    if state is None:
        archived = info.dir / "events.jsonl"
        if not archived.exists():
            err(f"run {info.run_id}: its Redis does not answer and it left no event log")
            return EXIT_FAILED
        for line in keep(archived.read_text().splitlines()):
            say(_format_event(stream.from_archive_line(line)))
        return EXIT_OK
    last, rows = stream.START, keep(stream.read(state.client, state.keys.events))
    while True:
        for row in rows:
            last = row["id"]
            say(_format_event(row))
        if not args.follow:
            return EXIT_OK
        try:
            time.sleep(1.0)
        except KeyboardInterrupt:
            return EXIT_OK
        rows = stream.read(state.client, state.keys.events, after=last)


def scale(args: argparse.Namespace) -> int:
    try:
        info = find_run(args.run)
    except RunError as e:
        err(str(e))
        return EXIT_BAD_INPUT
    nodes = info.spec().nodes
    if not nodes.min <= args.nodes <= nodes.max:
        err(
            f"run {info.run_id} keeps between {nodes.min} and {nodes.max} nodes (the spec's "
            f"nodes.min and nodes.max), not {args.nodes}; `spottrain down {info.run_id}` "
            "ends the run"
        )
        return EXIT_BAD_INPUT
    state = run_state(info)
    if state is None:
        err(f"run {info.run_id}: its Redis ({info.redis_url}) does not answer")
        return EXIT_FAILED
    before = state.ctl().get("target_nodes") or str(nodes.max)
    state.set_ctl(target_nodes=str(args.nodes))
    state.event("scale", nodes=args.nodes, before=int(before))
    say(f"run {info.run_id}: {before} -> {args.nodes} nodes (the controller acts on its next pass)")
    return EXIT_OK

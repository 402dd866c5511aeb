"""``spottrain status -f``: a run's figures again and again until it ends, as the live view
(a terminal), the plain lines (anything else) or one JSON object per refresh (``--json``),
then the final lines."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis

from spottrain.controller.reconcile.state import RunState
from spottrain.controller.reconcile.summary import (
    BootLines,
    ReplicaFigures,
    Summary,
    boot_lines,
    replica_summary,
    summarize,
)
from spottrain.controller.run.drive import EXIT_FAILED, EXIT_OK, PlainLines, final_report
from spottrain.controller.run.records import RunError, RunInfo
from spottrain.controller.run.replica_view import ReplicaStatus, replica_status
from spottrain.controller.run.run_redis import open_redis
from spottrain.protocol.keys import RunKeys
from spottrain.protocol.states import RunPhase
from spottrain.safetext import escape_controls, escape_lines

from .collect import Collector
from .live import LiveView

# The phases a run ends in: `status -f` prints the final lines and returns.
ENDED = frozenset({RunPhase.DONE, RunPhase.FAILED, RunPhase.DOWN})


def status_doc(
    info: RunInfo,
    summary: Mapping[str, Any],
    refused: Mapping[str, str],
    replicas: ReplicaStatus | None,
    boot: BootLines | None = None,
) -> dict[str, Any]:
    """``status --json``'s object; ``boot`` (what the VMs say of their boot) only when a
    VM says something."""
    locks = {"env_locks": info.env_locks} if info.env_locks else {}
    extra = replicas.to_json() if replicas else {}
    boots = {"boot": boot.to_json()} if boot is not None and boot.lines() else {}
    return {
        "run_id": info.run_id,
        **summary,
        "ckpt_refused": refused,
        **locks,
        **extra,
        **boots,
    }


def summary_of(record: Mapping[str, Any]) -> Summary:
    """A :class:`Summary` from its record (``summary.json``; a replica run's adds
    ``replica``, which is not a field of it), its text made safe to show
    (:func:`shown_summary`)."""
    names = {f.name for f in dataclasses.fields(Summary)}
    return shown_summary(Summary(**{k: v for k, v in record.items() if k in names}))


def shown_summary(s: Summary) -> Summary:
    """``s`` with every text a node could have written (the phase and reason in the run's
    control hash, node names and states, the at-risk lines) control characters escaped, for
    a terminal; ``status --json`` and the archive keep the record as it is."""
    return dataclasses.replace(
        s,
        phase=escape_controls(str(s.phase)),
        reason=escape_controls(str(s.reason)),
        nodes={escape_controls(k): escape_controls(str(v)) for k, v in s.nodes.items()},
        at_risk=[escape_controls(str(x)) for x in s.at_risk],
    )


def _replica_of(record: Mapping[str, Any]) -> ReplicaFigures | None:
    r = record.get("replica")
    if not isinstance(r, dict):
        return None
    names = {f.name for f in dataclasses.fields(ReplicaFigures)}
    return ReplicaFigures(**{k: v for k, v in r.items() if k in names})


def _open(info: RunInfo) -> RunState | None:
    try:
        return RunState(open_redis(info, info.spec()), RunKeys(info.run_id))
    except RunError:
        return None


def _nodes_max(info: RunInfo) -> int:
    """The nodes the run keeps unless scaled; 0 (never short) for a spec that no longer
    parses: an archived run's record still prints."""
    try:
        return info.spec().nodes.max
    except Exception:
        return 0


def _print(line: str) -> None:
    print(escape_lines(line), flush=True)


def follow(
    info: RunInfo,
    *,
    as_json: bool,
    interval_s: float = 2.0,
    say: Callable[[str], object] = _print,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Follow run ``info`` until it ends (or Ctrl-C).

    Returns:
        0 when training finished (or on Ctrl-C), 1 when the run ended before.
    """
    live = None if as_json else LiveView.for_stdout()
    speak = live.say if live is not None else say
    state: RunState | None = None
    plain = PlainLines(speak, lambda: state, _nodes_max(info))
    collector: Collector | None = None
    told_down = False
    if live is None and not as_json:
        say(f"run {info.run_id}")

    def end(s: Summary, replica: ReplicaFigures | None) -> int:
        if live is not None:
            live.stop()
        if not as_json:
            for line in final_report(shown_summary(s), replica):
                speak(line)
        return EXIT_OK if s.final_step is not None else EXIT_FAILED

    try:
        while True:
            if state is None:
                state = _open(info)
                if state is not None and live is not None:
                    collector = Collector(info, state, info.spec().nodes.max)
            if state is None:
                archived = info.dir / "summary.json"
                if archived.exists():
                    record = json.loads(archived.read_text())
                    if as_json:
                        say(json.dumps(status_doc(info, record, {}, None)))
                    return end(summary_of(record), _replica_of(record))
                if not told_down:
                    speak(
                        f"run {info.run_id}: its Redis ({info.redis_url}) does not answer; "
                        "waiting for it (Ctrl-C stops)"
                    )
                    told_down = True
            else:
                try:
                    s = summarize(state, time.time())
                    if as_json:
                        refused = state.ckpt_refused()
                        replicas = replica_status(info, state.client)
                        boot = boot_lines(state, s)
                        doc = status_doc(info, dataclasses.asdict(s), refused, replicas, boot)
                        say(json.dumps(doc))
                    elif collector is not None and live is not None:
                        live.show(collector.frame(s))
                    else:
                        plain(shown_summary(s))
                    if s.phase in ENDED:
                        return end(s, replica_summary(state))
                except redis.RedisError:
                    state = None  # gone: the run may have ended and archived itself
            sleep(interval_s)
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        if live is not None:
            live.stop()

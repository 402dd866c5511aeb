"""A report's inputs, read from the run's Redis or from the files its archive left, and
written at archive time (the launch ledger and the progress hash)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from spottrain.controller.report.model import ReportInputs
from spottrain.protocol import events as stream
from spottrain.protocol.keys import RunKeys

if TYPE_CHECKING:
    import redis

# The controller's modules (state, loop) are imported where they are used: `spottrain --help`
# builds the report command's parser and should stay quick.


def read_redis_inputs(client: redis.Redis, keys: RunKeys, now: float) -> ReportInputs:
    """The report's inputs from the run's Redis."""
    from spottrain.controller.reconcile.state import RunState
    from spottrain.controller.reconcile.summary import replica_summary, summarize, summary_record

    state = RunState(client, keys)
    events = state.events()
    ledger = state.ledger()
    launches = list(ledger.records.values()) or None
    progress = state.progress()
    summary = None
    if events or launches or progress or state.ctl():
        summary = summary_record(summarize(state, now), replica_summary(state))
    return ReportInputs(events, launches, progress, summary)


def read_archive_inputs(run_dir: Path) -> ReportInputs:
    """The report's inputs from what the run left on disk: ``events.jsonl``,
    ``summary.json`` and, when kept, ``launches.json`` and ``progress.json``."""
    events: list[dict[str, str]] = []
    path = run_dir / "events.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                events.append(stream.from_archive_line(line))
    from spottrain.controller.reconcile.records import LaunchRecord

    launches = None
    path = run_dir / "launches.json"
    if path.exists():
        raw = json.loads(path.read_text())
        launches = [LaunchRecord.from_json(json.dumps(d)) for d in raw.values()]
    progress: dict[str, str] = {}
    path = run_dir / "progress.json"
    if path.exists():
        progress = {str(k): str(v) for k, v in json.loads(path.read_text()).items()}
    summary = None
    path = run_dir / "summary.json"
    if path.exists():
        summary = json.loads(path.read_text())
    return ReportInputs(events, launches, progress, summary)


def write_report_inputs(run_dir: Path, client: redis.Redis, keys: RunKeys) -> None:
    """Keep what the report needs beyond events and summary: the launch ledger
    (``launches.json``, node -> launch record) and the progress hash (``progress.json``).
    Meant to be called by ``archive_run``."""
    launches = {k.decode(): json.loads(v) for k, v in client.hgetall(keys.ctl_launches).items()}
    (run_dir / "launches.json").write_text(json.dumps(launches, indent=1, sort_keys=True))
    progress = {k.decode(): v.decode() for k, v in client.hgetall(keys.progress).items()}
    (run_dir / "progress.json").write_text(json.dumps(progress, indent=1, sort_keys=True))

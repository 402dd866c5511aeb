"""What a run leaves on disk when it ends (events, summary, the report's inputs), and its
report read back from its Redis or from that archive."""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from spottrain.controller.reconcile.state import RunState
from spottrain.controller.report.build import build_report
from spottrain.controller.report.inputs import (
    read_archive_inputs,
    read_redis_inputs,
    write_report_inputs,
)
from spottrain.controller.report.model import NoReportData, ReportData
from spottrain.controller.run.records import RunError, RunInfo
from spottrain.controller.run.run_redis import open_redis
from spottrain.protocol import events as stream
from spottrain.protocol.keys import RunKeys


def archive_run(info: RunInfo, client: redis.Redis, summary: dict[str, Any]) -> None:
    """Keep the run's events and summary on disk (its Redis may go away)."""
    keys = RunKeys(info.run_id)
    with open(info.dir / "events.jsonl", "w") as f:
        for row in RunState(client, keys).events():
            f.write(stream.to_archive_line(row) + "\n")
    (info.dir / "summary.json").write_text(json.dumps(summary, indent=1))
    write_report_inputs(info.dir, client, keys)


def load_report_data(
    info: RunInfo, *, client: redis.Redis | None = None, now: float | None = None
) -> ReportData:
    """The report of a run: from its Redis when it answers and holds the run, else from its
    archive.

    Args:
        info: the run.
        client: a client of the run's Redis (opened from ``info`` when None).
        now: the end of a running run's timeline (the clock when None). A run that ended
            (phase done, failed or down) ends at its last record instead.

    Raises:
        NoReportData: neither holds anything about the run.
    """
    clock = time.time() if now is None else now
    keys = RunKeys(info.run_id)
    if client is None:
        try:
            spec = info.spec()
        except Exception:
            spec = None
        try:
            client = open_redis(info, spec)
        except (RunError, redis.RedisError):
            client = None
    if client is not None:
        try:
            inputs = read_redis_inputs(client, keys, clock)
        except redis.RedisError:
            inputs = None
        if inputs is not None and not inputs.empty:
            return build_report(
                info.run_id, inputs, start=info.created_at, now=clock, source="redis"
            )
    inputs = read_archive_inputs(info.dir)
    if inputs.empty:
        where = "holds nothing about it" if client is not None else "does not answer"
        raise NoReportData(
            f"run {info.run_id}: its Redis ({info.redis_url}) {where} and it left no archive "
            f"(events.jsonl, summary.json) in {info.dir}: nothing to report"
        )
    return build_report(info.run_id, inputs, start=info.created_at, now=clock, source="archive")

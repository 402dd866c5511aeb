"""`spottrain logs --tail N`: a node's last N lines, read newest chunk first from moto's S3
and the GCS fake (across a node's VMs, from inside a chunk, with a lost chunk inside and
outside the tail), then `-f` from there; the local cloud's console file read backwards; and
the run's last N events, from its real Redis and from the archive."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import pytest
from test_node_logs_cli import (  # noqa: F401  (fixtures, used by name)
    EXAMPLES,
    NEW,
    OLD,
    RUN,
    Cloud,
    _logs,
    _save_run,
    gcs_server,
    moto_endpoint,
)
from test_node_logs_cli import cloud as cloud  # the fixture, which tests name as a parameter

from spottrain.controller.cli import main as cli
from spottrain.controller.cli import node_log_reader, node_logs
from spottrain.controller.cli.node_logs import last_lines_offset
from spottrain.controller.reconcile.state import RunState
from spottrain.controller.run.records import RunInfo


def test_the_last_lines_of_a_node_across_its_vms(
    cloud: Cloud, capsys: pytest.CaptureFixture[str]
) -> None:
    cloud.chunk(OLD, 0, "o1\no2\n")
    cloud.chunk(OLD, 1, "o3\n")
    cloud.chunk(OLD, 3, "o4\n")  # chunk 2 was lost with the VM
    cloud.chunk(NEW, 0, "n1\nn2\nn3\n")

    code, out, err = _logs(capsys, "n0", "--tail", "4")  # from OLD's last chunk: no gap in it
    assert (code, out) == (0, "o4\nn1\nn2\nn3\n")
    assert "missing" not in err
    head = next(ln for ln in err.splitlines() if f"vm {OLD[0]}:" in ln)
    assert head.endswith("; its last 4 lines follow") and "1 chunk, " in head

    code, out, err = _logs(capsys, "n0", "--tail", "6")  # from inside OLD's chunk 0
    assert (code, out) == (0, "o2\no3\no4\nn1\nn2\nn3\n")
    assert "[spottrain] chunk 2 of vm i-0bbb is missing (lost or not yet shipped)" in err

    assert _logs(capsys, "n0", "--tail", "2")[:2] == (0, "n2\nn3\n")
    assert _logs(capsys, "n0", "--tail", "100")[:2] == (0, "o1\no2\no3\no4\nn1\nn2\nn3\n")
    code, out, err = _logs(capsys, "n0", "--tail", "0")
    assert (code, out) == (0, "") and "vm " not in err
    assert _logs(capsys, "n0", "--tail", "2", "--vm", OLD[0])[:2] == (0, "o3\no4\n")

    code, out, err = _logs(capsys, "n0", "--tail", "-1")
    assert code == 2 and out == "" and "--tail -1 must be a number of lines" in err


def test_a_corrupt_chunk_in_the_tail_is_reported_and_not_counted(
    cloud: Cloud, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(node_log_reader, "FETCHERS", 1)  # newest first, one chunk at a time
    cloud.chunk(NEW, 0, "n1\n")
    cloud.corrupt(NEW, 1)
    cloud.chunk(NEW, 2, "n3\n")
    code, out, err = _logs(capsys, "n0", "--tail", "2")
    assert (code, out) == (1, "n1\nn3\n")
    assert "chunk 1 of vm i-0aaa" in err and "is corrupt" in err


def test_follow_from_the_tail(
    cloud: Cloud, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cloud.chunk(OLD, 0, "a0\na1\n")
    polls: list[float] = []

    def pause(seconds: float) -> None:
        polls.append(seconds)
        if len(polls) == 1:
            cloud.chunk(OLD, 1, "a2\n")

    monkeypatch.setattr(node_logs, "_pause", pause)
    monkeypatch.setattr(node_logs, "_ended_probe", lambda info: lambda: len(polls) >= 2)
    code, out, _ = _logs(capsys, "n0", "-f", "--tail", "1", "--interval", "5")
    assert (code, out) == (0, "a1\na2\n")


def test_the_local_consoles_last_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SPOTTRAIN_HOME", str(tmp_path / "home"))
    state = tmp_path / "local-state"
    tags = {"spottrain-job": RUN, "spottrain-node": "n0"}
    (state / "instances").mkdir(parents=True)
    (state / "instances" / "local-1.json").write_text(json.dumps({"id": "local-1", "tags": tags}))
    (state / "logs").mkdir()
    (state / "logs" / "local-1.log").write_text("".join(f"line {i}\n" for i in range(50_000)))
    _save_run((EXAMPLES / "local_job.yaml").read_text(), EXAMPLES, local_state_dir=str(state))
    assert _logs(capsys, "n0", "--tail", "2")[:2] == (0, "line 49998\nline 49999\n")
    assert _logs(capsys, "n0", "--tail", "0")[:2] == (0, "")


@pytest.mark.parametrize(
    ("data", "lines", "tail"),
    [
        (b"a\nb\nc\n", 2, b"b\nc\n"),
        (b"a\nb\nc", 1, b"c"),  # a last line without its newline counts
        (b"a\nb\nc\n", 3, b"a\nb\nc\n"),
        (b"a\nb\nc\n", 9, b"a\nb\nc\n"),
        (b"a\n\n\nb\n", 2, b"\nb\n"),  # empty lines are lines
        (b"", 3, b""),
    ],
)
def test_last_lines_offset(data: bytes, lines: int, tail: bytes) -> None:
    for block in (1, 2, 7, 1 << 16):  # across block boundaries
        assert data[last_lines_offset(io.BytesIO(data), lines, block) :] == tail


def test_the_runs_last_events(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    redis_server: Any,
    run_keys: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("SPOTTRAIN_HOME", str(tmp_path / "home"))
    info = RunInfo(
        run_id=run_keys.run_id,
        spec_text=(EXAMPLES / "local_job.yaml").read_text(),
        spec_source="job.yaml",
        base_dir=str(EXAMPLES),
        redis_url=f"redis://{redis_server.host}:{redis_server.port}/0",
        embedded_redis=False,
        created_at=time.time(),
    )
    info.save()
    state = RunState(redis_server.client(), run_keys)
    for i in range(5):
        state.event("scale", nodes=i)

    def tail(n: str) -> list[str]:
        assert cli.main(["logs", info.run_id, "--tail", n]) == 0
        return capsys.readouterr().out.splitlines()

    assert [ln.split()[-1] for ln in tail("2")] == ["nodes=3", "nodes=4"]
    assert len(tail("99")) == 5 and tail("0") == []
    assert cli.main(["logs", info.run_id, "--tail", "-3"]) == 2
    assert "--tail -3 must be a number of events" in capsys.readouterr().err

    # Archived (its Redis gone): the same from events.jsonl.
    archived = [json.dumps({"type": "scale", "at": "0", "nodes": str(i)}) for i in range(5)]
    (info.dir / "events.jsonl").write_text("\n".join(archived) + "\n")
    monkeypatch.setattr("spottrain.controller.cli.commands.run_state", lambda info: None)
    assert [ln.split()[-1] for ln in tail("1")] == ["nodes=4"]

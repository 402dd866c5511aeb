"""``spottrain status`` and ``spottrain logs --node N`` of a run whose VM failed at boot, through
the real CLI entry and a real Redis: the node's boot line is there, and a terminal escape in
the VM's reason reaches neither stdout nor stderr as a control character."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from spec_samples import LOCAL

from spottrain.cloud.base import Market, Offer
from spottrain.controller.reconcile.records import LaunchRecord
from spottrain.controller.reconcile.state import RunState
from spottrain.controller.run.records import RunInfo
from spottrain.protocol import events as stream
from spottrain.protocol.boot import STAGE_ENV, STAGE_FETCH, BootReport, BootState
from spottrain.protocol.keys import RunKeys
from spottrain.protocol.states import LedgerStatus

OFFER = Offer("local", "local", "local-a", "local-cpu", 0, "", Market.SPOT, 0.1, 0.0)
# The reason as a hostile (or merely broken) VM could write it: a retitle, a bell, a clear.
EVIL = "pip: \x1b]0;owned\x07no matching distribution \x1b[2J\x9b1m"
SHOWN = "pip: \\e]0;owned\\x07no matching distribution \\e[2J\\x9b1m"


def _run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_server: Any, run_id: str
) -> RunInfo:
    monkeypatch.setenv("SPOTTRAIN_HOME", str(tmp_path / "home"))
    info = RunInfo(
        run_id=run_id,
        spec_text=yaml.safe_dump(LOCAL),
        spec_source="job.yaml",
        base_dir=str(tmp_path),
        redis_url=redis_server.endpoint,
        embedded_redis=False,
        created_at=time.time(),
    )
    info.save()
    return info


def _no_controls(text: str) -> None:
    for c in ("\x1b", "\x07", "\x9b"):
        assert c not in text, f"{c!r} reached the output"


def _fleet(client: redis.Redis, keys: RunKeys) -> RunState:
    state = RunState(client, keys)
    for i, node in enumerate(("n0", "n1", "n2")):
        state.put_launch(
            LaunchRecord(node, f"r{i}", OFFER, 1000.0 + i, LedgerStatus.LAUNCHED, f"vm-{i}")
        )
    state.set_ctl(phase="running", reason="1 of 1 node(s): launching")
    state.put_boot(BootReport("n1", "vm-1", STAGE_ENV, BootState.FAILED, EVIL, 1100.0))
    state.put_boot(BootReport("n2", "vm-2", STAGE_FETCH, BootState.BOOTING, "", 1100.0))
    return state


def test_status_shows_the_failed_boot_escaped_and_the_booting_stage(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    redis_server: Any,
    redis_client: redis.Redis,
    run_keys: RunKeys,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from spottrain.controller.cli import main as cli

    info = _run(tmp_path, monkeypatch, redis_server, run_keys.run_id)
    _fleet(redis_client, run_keys)
    assert cli.main(["status", info.run_id]) == 0
    out = capsys.readouterr()
    _no_controls(out.out + out.err)
    lines = out.out.splitlines()
    assert f"    n1: boot failed in 'install the environment': {SHOWN}" in lines
    assert "    n2: booting: fetch the boot files" in lines
    assert cli.main(["status", info.run_id, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["boot"] == {
        "failed": [f"n1: boot failed in 'install the environment': {SHOWN}"],
        "booting": ["n2: booting: fetch the boot files"],
    }


def test_logs_of_a_node_whose_boot_failed_says_so_first_escaped(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    redis_server: Any,
    redis_client: redis.Redis,
    run_keys: RunKeys,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from spottrain.controller.cli import main as cli

    info = _run(tmp_path, monkeypatch, redis_server, run_keys.run_id)
    _fleet(redis_client, run_keys)
    cli.main(["logs", info.run_id, "--node", "n1"])  # nothing shipped: exits 1, says why
    out = capsys.readouterr()
    _no_controls(out.out + out.err)
    first = out.err.splitlines()[0]
    assert first == f"spottrain: n1: boot failed in 'install the environment': {SHOWN}"
    # A node whose boot did not fail gets no such line.
    cli.main(["logs", info.run_id, "--node", "n2"])
    assert "boot failed" not in capsys.readouterr().err


def test_logs_of_an_ended_run_read_the_boot_failure_from_its_archived_events(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    redis_server: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from spottrain.controller.cli import main as cli

    info = _run(tmp_path, monkeypatch, redis_server, "ended-run-1795000000")
    rows = [
        stream.envelope("boot", "n3", at=1.0, vm="vm-3", stage=STAGE_ENV, state="booting"),
        stream.envelope(
            "boot", "n3", at=2.0, vm="vm-3", stage=STAGE_ENV, state="failed", reason=EVIL
        ),
        stream.envelope("boot", "n4", at=3.0, vm="vm-4", stage=STAGE_ENV, state="booted"),
    ]
    (info.dir / "events.jsonl").write_text(
        "".join(stream.to_archive_line({**r, "id": f"{i}-0"}) + "\n" for i, r in enumerate(rows))
    )
    cli.main(["logs", info.run_id, "--node", "n3"])
    err = capsys.readouterr().err
    _no_controls(err)
    assert (
        err.splitlines()[0] == f"spottrain: n3: boot failed in 'install the environment': {SHOWN}"
    )

"""Nothing a node writes reaches an operator's terminal raw. A worker holds a login to the
run's Redis, so it can write the run's phase, its node's state and any event; a VM writes its
own output. `status`, `status -f` (plain lines and the live view), `logs` and the live view
show every control character such text holds as a visible escape (``\\e]0;pwned\\x07``);
`logs --node` on a terminal keeps only the node's colours (SGR), and through a pipe keeps
its bytes. `logs --node N --vm X` reads only a VM of that node in that run."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pexpect
import pytest
import redis
import yaml
from rich.console import Console
from spec_samples import LOCAL

from spottrain.cloud.base import Market, Offer
from spottrain.controller.cli import main as cli
from spottrain.controller.reconcile.records import LaunchRecord
from spottrain.controller.reconcile.state import RunState
from spottrain.controller.reconcile.summary import Summary, summarize
from spottrain.controller.run.records import RunInfo
from spottrain.controller.view.collect import Collector
from spottrain.controller.view.follow import follow
from spottrain.controller.view.live import LiveView
from spottrain.controller.view.model import EventRow, NodeRow, ViewData
from spottrain.controller.view.render import render
from spottrain.protocol.keys import RunKeys
from spottrain.protocol.states import LedgerStatus

# Retitle the window, ring the bell, clear the screen, and CSI in its one-byte (C1) form.
EVIL = "\x1b]0;pwned\x07\x1b[2J\x9b1m"
SHOWN = "\\e]0;pwned\\x07\\e[2J\\x9b1m"
# What rich itself writes: colours and styles only.
SGR = re.compile(r"\x1b\[[0-9;]*m")


def _no_controls(text: str) -> None:
    for c in ("\x1b", "\x07", "\x9b"):
        assert c not in text, f"{c!r} reached the terminal: {text!r}"


@pytest.fixture
def hostile(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    redis_server: Any,
    redis_client: redis.Redis,
    run_keys: RunKeys,
) -> tuple[RunInfo, RunState]:
    """A run whose Redis a worker wrote escapes into: the phase, a node's state, an event."""
    monkeypatch.setenv("SPOTTRAIN_HOME", str(tmp_path / "home"))
    info = RunInfo(
        run_id=run_keys.run_id,
        spec_text=yaml.safe_dump(LOCAL),
        spec_source="job.yaml",
        base_dir=str(tmp_path),
        redis_url=redis_server.endpoint,
        embedded_redis=False,
        created_at=time.time(),
    )
    info.save()
    state = RunState(redis_client, run_keys)
    offer = Offer("local", "local", "local-a", "local-cpu", 0, "", Market.SPOT, 0.1, 0.05)
    state.put_launch(
        LaunchRecord("n0", "r0", offer, time.time() - 60, LedgerStatus.LAUNCHED, "vm-0")
    )
    state.set_ctl(phase="running" + EVIL, reason="waiting" + EVIL)
    redis_client.hset(run_keys.node("n0"), mapping={"state": "training" + EVIL})
    redis_client.xadd(run_keys.events, {"type": "note", "node": "n0", "detail": EVIL})
    return info, state


def test_status_escapes_what_a_node_wrote(
    hostile: tuple[RunInfo, RunState], capsys: pytest.CaptureFixture[str]
) -> None:
    info, _ = hostile
    assert cli.main(["status", info.run_id]) == 0
    out = capsys.readouterr()
    _no_controls(out.out + out.err)
    assert f"running{SHOWN}: waiting{SHOWN}" in out.out
    assert f"n0 training{SHOWN}" in out.out


def test_logs_escapes_an_events_fields(
    hostile: tuple[RunInfo, RunState], capsys: pytest.CaptureFixture[str]
) -> None:
    info, _ = hostile
    assert cli.main(["logs", info.run_id]) == 0
    out = capsys.readouterr()
    _no_controls(out.out + out.err)
    assert f"detail={SHOWN}" in out.out


def test_status_follow_plain_lines_escape_what_a_node_wrote(
    hostile: tuple[RunInfo, RunState],
) -> None:
    info, _ = hostile
    said: list[str] = []

    def stop(_: float) -> None:
        raise KeyboardInterrupt  # one refresh is enough

    assert follow(info, as_json=False, say=said.append, sleep=stop) == 0
    text = "\n".join(said)
    _no_controls(text)
    assert f"running{SHOWN}: waiting{SHOWN}" in text


def test_the_runs_summary_escapes_what_a_node_wrote(hostile: tuple[RunInfo, RunState]) -> None:
    """`up`'s plain lines, the archive and the report all start from the summary."""
    _, state = hostile
    state.put_launch(
        LaunchRecord(
            "n1" + EVIL,
            "r1",
            Offer("local", "local", "local-a", "local-cpu", 0, "", Market.SPOT, 0.1, 0.05),
            time.time() - 30,
            LedgerStatus.LAUNCHED,
            "vm-1",
        )
    )
    s = summarize(state, time.time())
    _no_controls(json.dumps([s.phase, s.reason, list(s.nodes.items())], ensure_ascii=False))
    assert s.phase == "running" + SHOWN and s.nodes["n0"] == "training" + SHOWN
    assert "n1" + SHOWN in s.nodes


def _drawn(data: ViewData) -> str:
    console = Console(file=io.StringIO(), force_terminal=True, width=160, height=40)
    console.print(render(data, 160, 40))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    return str(out)


def test_the_live_view_escapes_what_a_node_wrote(hostile: tuple[RunInfo, RunState]) -> None:
    info, state = hostile
    drawn = _drawn(Collector(info, state, 1).frame())
    _no_controls(SGR.sub("", drawn))
    plain = SGR.sub("", drawn)
    assert f"running{SHOWN}" in plain and f"training{SHOWN}" in plain
    assert f"detail={SHOWN}" in plain


def test_the_live_view_escapes_its_data_whoever_built_it() -> None:
    """render() is the last step before the terminal: it escapes every text it draws,
    including rows built without the collector."""
    summary = Summary(EVIL, 1, None, 1, {"n0" + EVIL: EVIL}, 0, 0, 0.0, 0.0, EVIL)
    data = ViewData(
        run_id="r" + EVIL,
        summary=summary,
        nodes=[NodeRow("n0" + EVIL, "local", "z" + EVIL, "t" + EVIL, "spot", EVIL)],
        events=[EventRow(0.0, "n0" + EVIL, "k" + EVIL, "d" + EVIL)],
        short="short" + EVIL,
        replica=["replica" + EVIL],
        notes=["note" + EVIL],
        boot_failed=["boot" + EVIL],
    )
    plain = SGR.sub("", _drawn(data))
    _no_controls(plain)
    assert f"d{SHOWN}" in plain and f"note{SHOWN}" in plain and f"local/z{SHOWN}" in plain


def test_a_line_said_above_the_live_view_is_escaped() -> None:
    console = Console(file=io.StringIO(), force_terminal=True, width=160)
    LiveView(console).say("said " + EVIL)
    out = SGR.sub("", console.file.getvalue())  # type: ignore[attr-defined]
    _no_controls(out)
    assert f"said {SHOWN}" in out


# --- a node's own output ---------------------------------------------------------------------

RUN = "escapes-1732270000"
OUTPUT = b"\x1b[31mred\x1b[0m then \x1b]0;pwned\x07\x1b[2J\xc2\x9b1m\n"


def _local_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vms: dict[str, tuple[str, str]]
) -> Path:
    """A local run with no Redis whose local cloud kept ``vms`` (id -> (run, node)) with
    their console files; returns $SPOTTRAIN_HOME."""
    home, state = tmp_path / "home", tmp_path / "local-state"
    monkeypatch.setenv("SPOTTRAIN_HOME", str(home))
    (state / "instances").mkdir(parents=True)
    (state / "logs").mkdir()
    for vm, (run, node) in vms.items():
        tags = {"spottrain-job": run, "spottrain-node": node}
        (state / "instances" / f"{vm}.json").write_text(json.dumps({"id": vm, "tags": tags}))
        (state / "logs" / f"{vm}.log").write_bytes(OUTPUT if vm == "local-1" else b"secret\n")
    RunInfo(
        run_id=RUN,
        spec_text=yaml.safe_dump(LOCAL),
        spec_source="job.yaml",
        base_dir=str(tmp_path),
        redis_url="redis://127.0.0.1:9/0",  # gone: the local cloud's files must do
        embedded_redis=False,
        created_at=time.time(),
        local_state_dir=str(state),
    ).save()
    return home


def _logs_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "spottrain.controller.cli", "logs", RUN, "--node", *args]


def test_a_nodes_output_keeps_its_colours_on_a_terminal_and_its_bytes_through_a_pipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = _local_run(tmp_path, monkeypatch, {"local-1": (RUN, "n0")})
    env = {**os.environ, "SPOTTRAIN_HOME": str(home), "TERM": "xterm-256color"}
    child = pexpect.spawn(sys.executable, _logs_cmd("n0")[1:], env=env, timeout=30)
    try:
        child.expect(pexpect.EOF)
        shown = (child.before or b"").decode()
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, shown
    assert "\x1b[31mred\x1b[0m then " in shown  # the node's colours
    assert "\\e]0;pwned\\x07\\e[2J\\x9b1m" in shown
    _no_controls(SGR.sub("", shown))

    piped = subprocess.run(_logs_cmd("n0"), env=env, capture_output=True, timeout=30)
    assert (piped.returncode, piped.stdout) == (0, OUTPUT)


def test_logs_reads_only_a_vm_of_that_node_in_that_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _local_run(
        tmp_path,
        monkeypatch,
        {"local-1": (RUN, "n0"), "local-2": (RUN, "n1"), "local-9": ("other-run", "n0")},
    )
    for vm in ("local-2", "local-9"):
        assert cli.main(["logs", RUN, "--node", "n0", "--vm", vm]) == 2
        out = capsys.readouterr()
        assert out.out == "" and "secret" not in out.err
        line = out.err.strip()
        assert "\n" not in line and f"has no VM '{vm}'" in line and "local-1" in line
    # A path is refused before anything is read.
    (tmp_path / "outside.log").write_text("secret\n")
    assert cli.main(["logs", RUN, "--node", "n0", "--vm", "../../outside"]) == 2
    assert "secret" not in capsys.readouterr().out

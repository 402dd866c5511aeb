"""``spottrain report``: the data behind each panel of a run's timeline, rebuilt from what the
real writers (the controller's RunState, the agents' NodeRecord, the SDK's request poller)
put in a real Redis, and from the files an archived run leaves; the PNG and the command.

The scripted run (seconds after T0): n0 and n1 launched at 0 (spot $0.60/h, on-demand
$2.00/h), joined at 14 and 15; training restores step 0 at 20 with 2 ranks, 60 steps/min;
n1 is preempted without notice at 60 (last commit: step 30; progress had reached 38); the
survivor restores step 30 at 65 with 1 rank, 45 steps/min; n2 is launched at 70 ($0.90/h),
joins at 90; an emergency commit at step 48 at 89; 2 ranks restore it at 95, 60 steps/min;
final commit at step 103 at 150; both nodes leave at 152, their VMs end at 155.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from spec_samples import LOCAL

import spottrain.agent.node_record as node_record_mod
import spottrain.agent.sdk.channel as sdk_mod
import spottrain.controller.reconcile.state as state_mod
from spottrain.agent.checkpoint.dcp_io import SaveResult
from spottrain.agent.checkpoint.manifest import FileSum, Manifest
from spottrain.agent.node_record import NodeInfo, NodeRecord
from spottrain.agent.notices import Notice, NoticeKind
from spottrain.agent.sdk import ENV_NODE
from spottrain.agent.sdk.channel import RequestChannel as _RequestPoller
from spottrain.cloud.base import Market, Offer
from spottrain.controller import report
from spottrain.controller.cli import report as report_cli
from spottrain.controller.reconcile.records import LaunchRecord
from spottrain.controller.reconcile.state import RunState
from spottrain.controller.reconcile.summary import summarize
from spottrain.controller.run.archive import archive_run, load_report_data
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.controller.run.records import RunInfo
from spottrain.ports import free_port
from spottrain.protocol.keys import RunKeys
from spottrain.protocol.states import LedgerStatus

T0 = 1_700_000_000.0
SPOT_A = Offer("local", "local", "local-a", "local-cpu", 0, "cpu", Market.SPOT, 0.60, 0.05)
SPOT_B = replace(SPOT_A, price_per_hour=0.90)
OD = 2.00
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class FakeClock:
    """Stands in for the ``time`` module of the writers, so each event lands at a scripted
    time (``monotonic`` and ``sleep`` stay real: threads and timeouts use them)."""

    def __init__(self, t: float) -> None:
        self.t = t

    def time(self) -> float:
        return self.t

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, s: float) -> None:
        time.sleep(s)


@dataclass
class Run:
    info: RunInfo
    keys: RunKeys
    state: RunState
    clock: FakeClock


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPOTTRAIN_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(autouse=True)
def no_progress_events(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scripted run's step timeline is checked from its commits and restores; rank 0's
    thinned progress events are added only where a test asks for them."""
    if "progress_events" not in request.keywords:
        monkeypatch.setattr(_RequestPoller, "_progress_event_due", lambda self, p: False)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    c = FakeClock(T0)
    for mod in (state_mod, node_record_mod, sdk_mod):
        monkeypatch.setattr(mod, "time", c)
    return c


def _info(keys: RunKeys, redis_url: str) -> RunInfo:
    info = RunInfo(
        run_id=keys.run_id,
        spec_text=yaml.safe_dump(LOCAL),
        spec_source="job.yaml",
        base_dir="/tmp",
        redis_url=redis_url,
        embedded_redis=False,
        created_at=T0,
    )
    info.save()
    jobs = info.dir.parent.parent / "jobs"
    jobs.mkdir(parents=True, exist_ok=True)
    (jobs / "tiny").write_text(keys.run_id)
    return info


class Script:
    """The scripted run, written by the real writers."""

    def __init__(
        self, run: Run, client: redis.Redis, url: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        self.run, self.client = run, client
        self.agents: dict[str, NodeRecord] = {}
        # Rank 0's link to Redis, as the SDK makes it (polling every 10 ms here).
        self.poller = _RequestPoller(url, run.keys.run_id, 0.01, active=True)
        self.monkeypatch = monkeypatch

    def at(self, t: float) -> None:
        self.run.clock.t = T0 + t

    # --- the controller ---
    def launch(self, node: str, vm: str, offer: Offer) -> None:
        st = self.run.state
        rec = LaunchRecord(
            node=node,
            request_id=f"r-{node}",
            offer=offer,
            launched_at=self.run.clock.t,
            od_price=OD,
        )
        st.record_intent(rec, int(node[1:]) + 1)
        st.update_launch(node, status=LedgerStatus.LAUNCHED, instance_id=vm)
        st.event(
            "launched",
            node_name=node,
            vm=vm,
            zone=offer.zone,
            itype=offer.instance_type,
            market=offer.market.value,
            price=round(offer.price_per_hour, 4),
        )

    def vm_gone(self, node: str, *, interrupted: bool) -> None:
        st = self.run.state
        rec = st.update_launch(
            node,
            status=LedgerStatus.ENDED,
            ended_at=self.run.clock.t,
            interrupted=interrupted,
            reason="spot interruption" if interrupted else "agent left",
        )
        assert rec is not None
        if interrupted:
            st.count((rec.offer.cloud, rec.offer.zone, rec.offer.instance_type), "preemptions")
            st.event("preempted", vm=rec.instance_id, node_name=node, zone=rec.offer.zone,
                     reason="spot interruption")  # fmt: skip
        else:
            st.event("vm-ended", vm=rec.instance_id, node_name=node, reason=rec.reason)

    # --- the agents ---
    def agent(self, node: str) -> NodeRecord:
        rec = NodeRecord(self.client, self.run.keys, NodeInfo(node, "local", "local-a", "cpu"))
        rec.register("booting")
        self.agents[node] = rec
        return rec

    def agent_state(self, node: str, state: str) -> None:
        self.agents[node].set_state(state, "")

    # --- the SDK (rank 0 runs on n0) ---
    def restore(self, step: int, world: int, round_: int) -> None:
        self.monkeypatch.setenv(ENV_NODE, "n0")
        self.poller.report_restore(step, world, round_)

    def progress(self, step: int, world: int, round_: int) -> None:
        self.poller.report_progress(step, world, round_, {"loss": 1.0 / (1 + step)})
        deadline = time.monotonic() + 5
        while self.client.hget(self.run.keys.progress, "step") != str(step).encode():
            assert time.monotonic() < deadline, "the SDK's poller did not report progress"
            time.sleep(0.01)

    def commit(self, step: int, round_: int, kind: str = "periodic") -> None:
        manifest = Manifest(step, 2, round_, kind, self.run.clock.t, {"0.distcp": FileSum(10, 1)})
        result = SaveResult(step, Path(f"/ckpt/step-{step}"), manifest, None, 0.1, 0.01)
        self.poller.report_commit(result, kind, kind == "emergency", 0)


# Rank 0's progress events in the script: the first report, then each world-size change (89 s
# and 100 s); the one at 150 s comes less than a minute after the last and is thinned out.
PROGRESS_POINTS: list[tuple[float, int, str]] = [
    (58, 38, "progress"),
    (89, 48, "progress"),
    (100, 53, "progress"),
]


def play(script: Script, until: float = 1e9) -> None:
    """Run the script's steps up to ``until`` seconds after T0."""
    steps: list[tuple[float, Any]] = [
        (0, lambda: script.launch("n0", "vm-0", SPOT_A)),
        (0, lambda: script.launch("n1", "vm-1", SPOT_A)),
        (10, lambda: script.agent("n0")),
        (10, lambda: script.agent("n1")),
        (12, lambda: script.agent_state("n0", "healthy")),
        (12, lambda: script.agent_state("n1", "healthy")),
        (14, lambda: script.agent_state("n0", "joined")),
        (15, lambda: script.agent_state("n1", "joined")),
        (20, lambda: script.restore(0, 2, 1)),
        (30, lambda: script.commit(10, 1)),
        (50, lambda: script.commit(30, 1)),
        (58, lambda: script.progress(38, 2, 1)),
        (60, lambda: script.vm_gone("n1", interrupted=True)),
        (65, lambda: script.restore(30, 1, 2)),
        (70, lambda: script.launch("n2", "vm-2", SPOT_B)),
        (80, lambda: script.agent("n2")),
        (85, lambda: script.agent_state("n2", "healthy")),
        (85, lambda: script.commit(45, 2)),
        (89, lambda: script.progress(48, 1, 2)),
        (89, lambda: script.commit(48, 2, "emergency")),
        (90, lambda: script.agent_state("n2", "joined")),
        (95, lambda: script.restore(48, 2, 3)),
        (100, lambda: script.progress(53, 2, 3)),
        (120, lambda: script.commit(73, 3)),
        (150, lambda: script.progress(103, 2, 3)),
        (150, lambda: script.commit(103, 3, "final")),
        (150, lambda: script.poller.report_finished(103)),
        (152, lambda: script.agent_state("n0", "left")),
        (152, lambda: script.agent_state("n2", "left")),
        (155, lambda: script.vm_gone("n0", interrupted=False)),
        (155, lambda: script.vm_gone("n2", interrupted=False)),
        (155, lambda: script.run.state.set_ctl(phase="done")),
    ]
    for t, step in steps:
        if t > until:
            break
        script.at(t)
        step()


@pytest.fixture
def scripted(
    home: Path,
    clock: FakeClock,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    run_keys: RunKeys,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Script]:
    info = _info(run_keys, redis_server.url)
    state = RunState(redis_client, run_keys)
    state.set_ctl(started_at=str(T0), phase="running")
    script = Script(Run(info, run_keys, state, clock), redis_client, redis_server.url, monkeypatch)
    yield script
    script.poller.stop()


def _rel(points: list[Any], *fields: str) -> list[tuple[Any, ...]]:
    return [(round(p.at - T0, 3), *(getattr(p, f) for f in fields)) for p in points]


def _hours(*spans: float) -> float:
    return sum(spans) / 3600.0


# --- the panels ------------------------------------------------------------------------------


@pytest.mark.progress_events
def test_progress_events_add_points_to_the_step_timeline(scripted: Script) -> None:
    play(scripted)
    data = load_report_data(scripted.run.info, now=T0 + 999)
    progress = [p for p in _rel(data.steps, "step", "source") if p[2] == "progress"]
    assert progress == PROGRESS_POINTS
    # They refine the rate between commits without changing what the commits say.
    commits = [p for p in _rel(data.steps, "step", "source") if p[2] == "checkpoint"]
    assert commits == [(30, 10, "checkpoint"), (50, 30, "checkpoint"), (85, 45, "checkpoint"),
                       (89, 48, "checkpoint"), (120, 73, "checkpoint"),
                       (150, 103, "checkpoint")]  # fmt: skip


def test_finished_run_panels_from_redis(scripted: Script) -> None:
    play(scripted)
    data = load_report_data(scripted.run.info, now=T0 + 999)
    assert data.source == "redis"
    assert data.start == T0
    assert data.end == T0 + 155  # an ended run ends at its last record, not at "now"

    # World size: nodes training (agent states, the controller's preemption) and ranks
    # (one restore per rendezvous round).
    assert _rel(data.nodes, "nodes") == [(0, 0), (14, 1), (15, 2), (60, 1), (90, 2), (152, 0)]
    assert _rel(data.world, "world_size", "round") == [
        (20, 2, 1),
        (65, 1, 2),
        (95, 2, 3),
        (152, 0, None),
    ]
    assert [data.nodes_at(T0 + t) for t in (59.9, 60, 89.9, 90, 151)] == [2, 1, 1, 2, 2]

    # Step rate: between commits and restores; a restart shows the step reached, then the
    # step restored.
    assert _rel(data.steps, "step", "source") == [
        (20, 0, "restored"),
        (30, 10, "checkpoint"),
        (50, 30, "checkpoint"),
        (65, 38, "reached"),
        (65, 30, "restored"),
        (85, 45, "checkpoint"),
        (89, 48, "checkpoint"),
        (95, 48, "reached"),
        (95, 48, "restored"),
        (120, 73, "checkpoint"),
        (150, 103, "checkpoint"),
    ]
    segs = [(s.start - T0, s.end - T0, s.steps, round(s.per_minute, 9)) for s in data.rate]
    assert segs == (
        [
            (20, 30, 10, 60.0),
            (30, 50, 20, 60.0),
            (50, 65, 8, 32.0),  # 2 ranks until the loss at 60, then the stall
            (65, 85, 15, 45.0),  # 1 rank
            (85, 89, 3, 45.0),
            (89, 95, 0, 0.0),  # the restart for the new round
            (95, 120, 25, 60.0),  # 2 ranks again
            (120, 150, 30, 60.0),
        ]
    )
    assert data.rate_at(T0 + 70) == pytest.approx(45.0)

    # Preemptions: when and where.
    assert [(p.at - T0, p.node, p.zone, p.vm, p.notice_at) for p in data.preemptions] == [
        (60, "n1", "local-a", "vm-1", None)
    ]

    # Cost: each VM's price x hours, and the same hours on demand.
    assert data.cost_source == "ledger"
    assert [round(p.at - T0, 3) for p in data.cost] == [0, 60, 70, 155]
    checks = {
        30: (0.60 * _hours(30, 30), OD * _hours(30, 30)),
        60: (0.60 * _hours(60, 60), OD * _hours(60, 60)),
        100: (0.60 * _hours(100, 60) + 0.90 * _hours(30), OD * _hours(100, 60, 30)),
        155: (0.60 * _hours(155, 60) + 0.90 * _hours(85), OD * _hours(155, 60, 85)),
    }
    for t, (spent, od) in checks.items():
        c = data.cost_at(T0 + t)
        assert (c.spent_usd, c.on_demand_usd) == pytest.approx((spent, od)), t
    ledger = scripted.run.state.ledger()
    assert data.cost[-1].spent_usd == pytest.approx(ledger.spent(T0 + 155))

    f = data.figures
    assert f.phase == "done"
    assert (f.step, f.final_step, f.steps_lost) == (103, 103, 8)
    assert (f.preemptions, f.preemptions_with_notice) == (1, 0)
    assert f.spent_usd == pytest.approx(checks[155][0])
    assert f.on_demand_usd == pytest.approx(checks[155][1])
    assert f.saved_usd == pytest.approx(ledger.saved(T0 + 155))
    assert (f.max_nodes, f.max_world_size) == (2, 2)
    assert f.mean_steps_per_minute == pytest.approx(111 * 60 / 130)
    assert data.notes == []


def test_running_run_ends_now_and_uses_the_live_progress(scripted: Script) -> None:
    play(scripted, until=100)
    data = load_report_data(scripted.run.info, now=T0 + 110)
    assert data.figures.phase == "running"
    assert data.end == T0 + 110
    assert _rel(data.nodes, "nodes")[-1] == (90, 2)
    # The progress hash (step 53 at 100) is ahead of the last event (restore of 48 at 95).
    assert _rel(data.steps, "step", "source")[-1] == (100, 53, "progress")
    assert data.rate[-1].per_minute == pytest.approx(60.0)
    # n0 and n2 still run: their cost accrues to "now".
    spent = 0.60 * _hours(110, 60) + 0.90 * _hours(40)
    assert data.figures.spent_usd == pytest.approx(spent)
    assert data.figures.final_step is None
    assert data.figures.step == 53


def test_preemption_with_notice(
    home: Path,
    clock: FakeClock,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    run_keys: RunKeys,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    info = _info(run_keys, redis_server.url)
    state = RunState(redis_client, run_keys)
    script = Script(Run(info, run_keys, state, clock), redis_client, redis_server.url, monkeypatch)
    try:
        script.at(0)
        script.launch("n0", "vm-0", SPOT_A)
        script.agent("n0")
        script.agent_state("n0", "healthy")
        script.at(5)
        script.agent_state("n0", "joined")
        script.at(30)
        notice = Notice("aws-imds:spot", NoticeKind.TERMINATE, T0 + 150, seen_at=T0 + 30)
        script.agents["n0"].event("notice", **notice.to_dict())
        script.agent_state("n0", "draining")
        script.at(31)
        script.commit(20, 1, "emergency")
        script.at(33)
        script.agent_state("n0", "left")
        script.at(40)
        script.vm_gone("n0", interrupted=True)
    finally:
        script.poller.stop()
    data = load_report_data(info, now=T0 + 50)
    assert _rel(data.nodes, "nodes") == [(0, 0), (5, 1), (30, 0)]
    assert [(p.at - T0, p.notice_at) for p in data.preemptions] == [(40, T0 + 30)]
    assert data.figures.preemptions_with_notice == 1
    assert "1 (1 with notice)" in report.text_summary(data)
    assert "no restore event" in " ".join(data.notes)


# --- archived runs ---------------------------------------------------------------------------


def _comparable(data: report.ReportData) -> dict[str, Any]:
    d = data.to_json()
    d.pop("source")
    return d


def _redis_gone(info: RunInfo) -> RunInfo:
    gone = replace(info, redis_url=f"redis://127.0.0.1:{free_port()}/0")
    gone.save()
    return gone


def test_archived_run_gives_the_same_data(scripted: Script, redis_client: redis.Redis) -> None:
    play(scripted)
    info = scripted.run.info
    live = load_report_data(info, now=T0 + 999)
    archive_run(info, redis_client, asdict(summarize(scripted.run.state, T0 + 155)))
    assert {p.name for p in info.dir.iterdir()} >= {
        "events.jsonl",
        "summary.json",
        "launches.json",
        "progress.json",
    }
    archived = load_report_data(_redis_gone(info), now=T0 + 999)
    assert archived.source == "archive"
    assert _comparable(archived) == _comparable(live)


def test_archive_without_ledger_costs_from_events(
    scripted: Script, redis_client: redis.Redis
) -> None:
    play(scripted)
    info = scripted.run.info
    live = load_report_data(info, now=T0 + 999)
    archive_run(info, redis_client, asdict(summarize(scripted.run.state, T0 + 155)))
    (info.dir / "launches.json").unlink()  # an archive made before the ledger was kept
    data = load_report_data(_redis_gone(info), now=T0 + 999)
    assert data.cost_source == "events"
    assert [(v.node, v.price, v.start - T0, v.end and v.end - T0) for v in data.vms] == [
        ("n0", 0.60, 0, 155),
        ("n1", 0.60, 0, 60),
        ("n2", 0.90, 70, 155),
    ]
    assert [p.spent_usd for p in data.cost] == pytest.approx([p.spent_usd for p in live.cost])
    assert all(p.on_demand_usd is None for p in data.cost)
    assert data.figures.on_demand_usd is None
    # Saved comes from the archived summary then.
    assert data.figures.saved_usd == pytest.approx(live.figures.saved_usd)
    assert any("launches.json" in n for n in data.notes)
    # Every other panel is the same.
    for name in ("nodes", "world", "steps", "rate", "preemptions"):
        assert getattr(data, name) == getattr(live, name), name


# --- the PNG and the text --------------------------------------------------------------------


def test_png_and_text_summary(scripted: Script, tmp_path: Path) -> None:
    play(scripted)
    data = load_report_data(scripted.run.info)
    path = report.render_png(data, tmp_path / "r.png")
    raw = path.read_bytes()
    assert raw[:8] == PNG_MAGIC
    assert len(raw) > 20_000
    width, height = int.from_bytes(raw[16:20], "big"), int.from_bytes(raw[20:24], "big")
    assert (width, height) == (1000, 1000)

    text = report.text_summary(data)
    assert f"run {scripted.run.keys.run_id} (done, from its Redis)" in text
    assert "103 trained, finished; 8 lost to restarts" in text
    assert "1 (0 with notice): n1 in local-a at +1m00s" in text
    assert "$0.06 spent, $0.17 on-demand, $0.11 saved (66%)" in text
    assert "2m35s" in text
    assert "51.2/min on average, 60.0/min at best" in text


def test_empty_run_still_draws(
    home: Path, redis_server: RedisServer, run_keys: RunKeys, tmp_path: Path
) -> None:
    info = _info(run_keys, redis_server.url)
    (info.dir / "summary.json").write_text(json.dumps({"phase": "down", "step": 0}))
    data = load_report_data(_redis_gone(info), now=T0 + 10)
    assert data.source == "archive"
    assert data.figures.step == 0 and data.preemptions == [] and data.rate == []
    assert report.render_png(data, tmp_path / "e.png").read_bytes()[:8] == PNG_MAGIC
    assert "0 (0 with notice)" in report.text_summary(data)


# --- the command -----------------------------------------------------------------------------


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="spottrain")
    report_cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["report", *argv])


def test_parser() -> None:
    args = _args("tiny", "--png", "x.png", "--json")
    assert (args.run, args.png, args.json, args.func) == ("tiny", "x.png", True, report_cli.command)
    assert _args().run is None


def test_command_no_run(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report_cli.command(_args()) == 2
    assert "no runs on this machine yet" in capsys.readouterr().err
    assert report_cli.command(_args("nope")) == 2
    assert "no run or job named 'nope' on this machine" in capsys.readouterr().err


def test_command_nothing_to_report(
    home: Path, run_keys: RunKeys, capsys: pytest.CaptureFixture[str]
) -> None:
    _info(run_keys, f"redis://127.0.0.1:{free_port()}/0")
    assert report_cli.command(_args(run_keys.run_id)) == 1
    err = capsys.readouterr().err
    assert "does not answer and it left no archive" in err
    assert "nothing to report" in err


def test_command_writes_png_and_prints(
    scripted: Script, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    play(scripted)
    assert report_cli.command(_args("tiny")) == 0  # by job name
    out = capsys.readouterr().out
    png = scripted.run.info.dir / "report.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert "103 trained" in out and f"timeline      {png}" in out

    assert (
        report_cli.command(
            _args(scripted.run.keys.run_id, "--json", "--png", str(tmp_path / "j.png"))
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert doc["png"] == str(tmp_path / "j.png")
    assert [p["nodes"] for p in doc["nodes"]] == [0, 1, 2, 1, 2, 0]
    assert doc["preemptions"][0]["zone"] == "local-a"
    assert doc["figures"]["steps_lost"] == 8

    assert report_cli.command(_args("tiny", "--png", str(tmp_path / "missing" / "r.png"))) == 2
    assert "does not exist" in capsys.readouterr().err


def test_command_reads_the_archive_when_redis_is_gone(
    scripted: Script, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    play(scripted)
    archive_run(scripted.run.info, redis_client, asdict(summarize(scripted.run.state, T0 + 155)))
    _redis_gone(scripted.run.info)
    assert report_cli.command(_args("tiny")) == 0
    assert "(done, from its archive)" in capsys.readouterr().out

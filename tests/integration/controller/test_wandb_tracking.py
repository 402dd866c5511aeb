"""Experiment tracking with the real wandb, offline: what rank 0 and the controller write.

Every test runs wandb with ``WANDB_MODE=offline`` under a temporary ``WANDB_DIR`` and then
reads back the run's transaction log (``wandb/offline-run-*/run-<id>.wandb``) with wandb's
own reader, ``wandb leet inspect --json`` (one JSON object per record), so the assertions are
on what a ``wandb sync`` would send: history rows, artifact manifests, summaries.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
import yaml
from spec_samples import VALID, spec_with

from spottrain import tracking
from spottrain.agent.sdk import ModelState, RngState, TrainSession
from spottrain.controller.reconcile.state import RunState
from spottrain.controller.reconcile.summary import Summary
from spottrain.controller.run import drive
from spottrain.controller.run.boot import NodeIdentity, agent_env
from spottrain.controller.tracking import TABLE_COLUMNS, FleetTracker
from spottrain.protocol.keys import RunKeys
from spottrain.spec import JobSpec, parse_spec
from spottrain.tracking import Tracker, WandbSettings

pytest.importorskip("wandb")

PROJECT = "spottrain-tests"
TOKENS = 4096  # per step, all ranks together
COPY_TO = "s3://ckpt-bucket/copies"

# Variables of the developer's own wandb setup that must not reach these tests.
_WANDB_VARS = (
    "WANDB_API_KEY",
    "WANDB_ENTITY",
    "WANDB_PROJECT",
    "WANDB_RUN_GROUP",
    "WANDB_RUN_ID",
    "WANDB_RESUME",
    "WANDB_NAME",
    "WANDB_CONSOLE",
    "WANDB_BASE_URL",
)


# -- reading a run back ---------------------------------------------------------------------
@dataclass
class Records:
    """A run's transaction log, as ``wandb leet inspect --json`` prints it."""

    path: Path
    all: list[dict[str, Any]] = field(default_factory=list)

    def of(self, type_: str) -> list[dict[str, Any]]:
        return [r[type_] for r in self.all if r.get("type") == type_]

    @property
    def run(self) -> dict[str, Any]:
        (run,) = self.of("run")
        return run

    @property
    def history(self) -> list[dict[str, Any]]:
        return [h["item"] for h in self.of("history")]

    @property
    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for s in self.of("summary"):
            out.update(s.get("update", {}))
        return out


def offline_runs(wandb_dir: Path, run_id: str) -> list[Path]:
    """The transaction logs of ``run_id`` under ``WANDB_DIR``, oldest first. wandb names a
    run's folder ``offline-run-<second>-<id>`` and adds ``-1``, ``-2`` when a resumed run
    starts within the same second; the log's own name is exact."""
    found = wandb_dir.glob(f"wandb/offline-run-*-{run_id}*/run-{run_id}.wandb")
    return sorted(found, key=lambda p: (p.parent.name.rsplit(run_id, 1)[0], len(p.parent.name)))


def read_run(path: Path) -> Records:
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return Records(path, [json.loads(line) for line in out.stdout.splitlines() if line.strip()])


# -- an offline wandb for the whole module ----------------------------------------------------
@pytest.fixture(scope="module")
def wandb_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("wandb")
    with pytest.MonkeyPatch.context() as mp:
        for name in _WANDB_VARS:
            mp.delenv(name, raising=False)
        for name in ("SPOTTRAIN_CKPT_COPY_TO", "SPOTTRAIN_RDZV_ROUND", "TORCHELASTIC_RUN_ID"):
            mp.delenv(name, raising=False)
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_DIR", str(root))
        mp.setenv("WANDB_CACHE_DIR", str(root / "cache"))
        mp.setenv("WANDB_DATA_DIR", str(root / "data"))
        mp.setenv("WANDB_CONFIG_DIR", str(root / "config"))
        mp.setenv("WANDB_SILENT", "true")
        yield root


def _state() -> tuple[dict[str, Any], torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return {"model": ModelState(model, opt), "rng": RngState()}, model


@dataclass
class Trained:
    run_id: str
    ckpt_dir: Path
    losses: dict[int, float]
    records: Records


@pytest.fixture(scope="module")
def trained(wandb_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """Ten steps of rank 0 with wandb configured from the environment, saving every four
    steps (in the background) and at the end; the agent copies checkpoints to S3."""
    run_id = f"wbt-{uuid.uuid4().hex[:8]}"
    ckpt = tmp_path_factory.mktemp("ckpt")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_PROJECT", PROJECT)
        mp.setenv("SPOTTRAIN_RDZV_ROUND", "3")
        mp.setenv("SPOTTRAIN_CKPT_COPY_TO", COPY_TO)
        session = TrainSession(
            ckpt,
            every_steps=4,
            redis_url="",
            run_id=run_id,
            install_signal_handlers=False,
        )
        state, model = _state()
        step = session.restore(state)
        losses = {}
        while step < 10:
            loss = model(torch.ones(2, 8)).pow(2).sum()
            state["model"].optimizer.zero_grad()
            loss.backward()
            state["model"].optimizer.step()
            step += 1
            losses[step] = loss.item()
            session.step(step, state, loss=losses[step], tokens=TOKENS)
        session.finish(step, state)
    (path,) = offline_runs(wandb_dir, f"{run_id}-r3")
    return Trained(run_id, Path(ckpt), losses, read_run(path))


# -- rank 0 -----------------------------------------------------------------------------------
def test_rank0_run_is_one_per_rendezvous_round_in_the_job_group(trained: Trained) -> None:
    run = trained.records.run
    assert run["run_id"] == f"{trained.run_id}-r3"
    assert run["run_group"] == trained.run_id
    assert run["job_type"] == "train"
    assert run["project"] == PROJECT
    config = run["config"]["update"]
    assert (config["spottrain_run"], config["round"], config["world_size"]) == (
        trained.run_id,
        3,
        1,
    )
    # Every metric is plotted against the training step, so the rounds of a job line up.
    metrics = trained.records.of("metric")
    assert {"glob_name": "*", "step_metric": "step"}.items() <= {
        k: v for m in metrics for k, v in m.items() if k in ("glob_name", "step_metric")
    }.items()


def test_rank0_logs_loss_step_time_world_size_and_tokens_per_second(trained: Trained) -> None:
    rows = [r for r in trained.records.history if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 11))
    for r in rows:
        assert r["loss"] == pytest.approx(trained.losses[r["step"]])
        assert r["world_size"] == 1
        assert r["tokens"] == TOKENS
        assert r["step_time_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(TOKENS / r["step_time_s"])
    assert trained.records.of("exit")[0]["exit_code"] == 0


def _checkpoints(records: Records) -> list[dict[str, Any]]:
    return [a for a in records.of("artifact") if a.get("type") == "checkpoint"]


def test_each_commit_is_a_reference_artifact_to_the_volume_and_the_copy(
    trained: Trained,
) -> None:
    arts = _checkpoints(trained.records)
    meta = [json.loads(a["metadata"]) for a in arts]
    assert [(m["step"], m["kind"]) for m in meta] == [
        (4, "periodic"),
        (8, "periodic"),
        (10, "final"),
    ]
    for art, m in zip(arts, meta, strict=True):
        name = f"step-{m['step']:09d}"
        volume = (trained.ckpt_dir / name).absolute()
        assert art["name"] == f"{trained.run_id}-ckpt"
        assert {"latest", f"step-{m['step']}", m["kind"]} <= set(art["aliases"])
        assert m["world_size"] == 1 and m["bytes"] > 0
        assert m["volume_uri"] == volume.as_uri()
        assert m["copy_uri"] == f"{COPY_TO}/{trained.run_id}/{name}"
        entries = {e["path"]: e for e in art["manifest"]["contents"]}
        # The volume's files, each a reference to where it lies ...
        on_volume = {p for p in entries if p.startswith("volume/")}
        assert on_volume == {
            f"volume/{f.relative_to(volume)}" for f in volume.rglob("*") if f.is_file()
        }
        assert "volume/MANIFEST.json" in on_volume
        for p in on_volume:
            assert entries[p]["ref"] == f"{volume.as_uri()}/{p.removeprefix('volume/')}"
        # ... and the object-storage copy the agent makes, as one reference.
        assert entries["copy"]["ref"] == m["copy_uri"]
        # Nothing is uploaded: no entry has a local file staged for upload.
        assert all("ref" in e and not e.get("local_path") for e in entries.values())


def test_no_checkpoint_byte_lands_in_the_wandb_run(trained: Trained) -> None:
    run_dir = trained.records.path.parent
    uploaded = [p.name for p in run_dir.rglob("*") if p.is_file()]
    assert not [n for n in uploaded if n.endswith(".distcp") or n == "MANIFEST.json"]
    for files in trained.records.of("files"):
        assert all("step-" not in f["path"] for f in files.get("files", []))


# -- rank 0 in a process of its own -------------------------------------------------------------
_WORKER = textwrap.dedent(
    """
    import json, os, signal, sys
    import torch
    from spottrain.agent.sdk import ModelState, RngState, TrainSession

    mode, ckpt = sys.argv[1], sys.argv[2]
    model = torch.nn.Linear(4, 2)
    state = {"model": ModelState(model, torch.optim.SGD(model.parameters(), lr=0.1)),
             "rng": RngState()}
    if mode == "unconfigured":
        out = {}
        for label in ("unconfigured", "disabled"):
            if label == "disabled":
                os.environ["WANDB_PROJECT"] = "p"
                os.environ["WANDB_MODE"] = "disabled"
            os.makedirs(os.path.join(ckpt, label))
            s = TrainSession(os.path.join(ckpt, label), every_steps=2, redis_url="",
                             run_id="quiet-run", install_signal_handlers=False)
            for step in range(1, 4):
                s.step(step, state, loss=1.0, tokens=64)
            s.finish(3, state)
            out[label] = {"tracking": s._tracker.active, "wandb": "wandb" in sys.modules}
        print(json.dumps(out))
    else:
        s = TrainSession(ckpt, every_steps=100, redis_url="", run_id=sys.argv[3])
        for step in range(1, 100):
            if step == 5:
                os.kill(os.getpid(), signal.SIGTERM)  # what a VM shutting down sends
            s.step(step, state, loss=1.0 / step, tokens=64)
        print("never reached: SIGTERM must end the worker after its emergency save")
        sys.exit(3)
    """
)


def _run_worker(
    tmp_path: Path, *args: str, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    (tmp_path / "ckpt").mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, str(script), args[0], str(tmp_path / "ckpt"), *args[1:]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_emergency_checkpoint_is_recorded_before_the_worker_exits(
    wandb_dir: Path, tmp_path: Path
) -> None:
    run_id = f"wbt-emg-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "WANDB_PROJECT": PROJECT, "TORCHELASTIC_RESTART_COUNT": "2"}
    proc = _run_worker(tmp_path, "sigterm", run_id, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stopping after the emergency checkpoint at step 5" in proc.stderr
    # No rendezvous round (plain torchrun): the run is named by torchrun's restart count.
    (path,) = offline_runs(wandb_dir, f"{run_id}-t2")
    records = read_run(path)
    (art,) = _checkpoints(records)
    meta = json.loads(art["metadata"])
    assert (meta["step"], meta["kind"], meta["drain"]) == (5, "emergency", True)
    assert "emergency" in art["aliases"]
    assert [r["step"] for r in records.history if "loss" in r] == [1, 2, 3, 4, 5]
    assert records.of("exit"), "the run was not finished before os._exit"


def test_unconfigured_or_disabled_tracking_never_imports_wandb(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["WANDB_DIR"] = str(tmp_path)
    proc = _run_worker(tmp_path, "unconfigured", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {
        "unconfigured": {"tracking": False, "wandb": False},
        "disabled": {"tracking": False, "wandb": False},
    }
    assert not (tmp_path / "wandb").exists()


def test_configured_without_wandb_installed_warns_once_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails as if absent
    monkeypatch.setattr(tracking, "_missing_warned", False)
    monkeypatch.setenv("WANDB_PROJECT", PROJECT)
    caplog.set_level(logging.WARNING, logger="spottrain.tracking")
    state, _ = _state()
    for i in range(2):
        (tmp_path / str(i)).mkdir()
        s = TrainSession(tmp_path / str(i), redis_url="", install_signal_handlers=False)
        assert not s._tracker.active
        s.step(1, state, loss=1.0, tokens=8)
        s.finish(1, state)
    warnings = [r.getMessage() for r in caplog.records if r.name == "spottrain.tracking"]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert "pip install 'spottrain[wandb]'" in warnings[0]
    assert PROJECT in warnings[0]


def test_a_failing_wandb_is_logged_once_and_never_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken:
        def log(self, data: dict[str, Any]) -> None:
            raise RuntimeError("wandb-core went away")

        def finish(self, exit_code: int = 0) -> None:
            raise RuntimeError("still away")

    caplog.set_level(logging.WARNING, logger="spottrain.tracking")
    t = Tracker(Broken)
    for i in range(5):
        t.log({"loss": float(i)})
    assert t.flush(5)
    assert t.finish(timeout=5)
    t.log({"loss": 0.0})  # after the end: dropped, not an error
    messages = [r.getMessage() for r in caplog.records if r.name == "spottrain.tracking"]
    assert messages == ["wandb tracking failed (wandb-core went away); training goes on"]

    def refuse() -> Any:
        raise RuntimeError("no API key")

    caplog.clear()
    t = Tracker(refuse)
    t.log({"loss": 1.0})
    assert t.flush(5) and t.finish(timeout=5)
    assert [r.getMessage() for r in caplog.records if r.name == "spottrain.tracking"] == [
        "wandb could not start a run (no API key): going on without tracking"
    ]


def test_online_without_credentials_is_refused_rather_than_prompted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[dict[str, Any]] = []

    class FakeWandb:
        @staticmethod
        def login(**kwargs: Any) -> bool:
            asked.append(kwargs)
            return False

    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(RuntimeError, match="set WANDB_API_KEY or run `wandb login`"):
        tracking._check_credentials(FakeWandb, WandbSettings(PROJECT))
    assert asked == [{"prompt": False, "verify": False}]  # never a prompt on the terminal
    tracking._check_credentials(FakeWandb, WandbSettings(PROJECT, mode="offline"))
    assert len(asked) == 1


# -- the controller ---------------------------------------------------------------------------
def _spec(wandb: dict[str, Any] | None) -> JobSpec:
    data = spec_with(VALID, "wandb", wandb) if wandb is not None else VALID
    return parse_spec(yaml.safe_dump(data)).spec


def _summary(step: int, world: int, nodes: int, preemptions: int, spent: float) -> Summary:
    return Summary(
        phase="running",
        step=step,
        loss=2.0 / (1 + step),
        world_size=world,
        nodes={f"node-{i}": "joined" for i in range(nodes)},
        preemptions=preemptions,
        steps_lost=3 * preemptions,
        spent_usd=spent,
        saved_usd=2 * spent,
        reason="steady",
    )


@pytest.fixture
def fleet_state(redis_client: redis.Redis) -> Iterator[RunState]:
    keys = RunKeys(f"fleet-{uuid.uuid4().hex[:8]}-1795000000")
    yield RunState(redis_client, keys)
    stale = list(redis_client.scan_iter(match=keys.pattern, count=1000))
    if stale:
        redis_client.delete(*stale)


def test_controller_logs_fleet_figures_and_events_each_pass(
    wandb_dir: Path, fleet_state: RunState
) -> None:
    state, run_id = fleet_state, fleet_state.keys.run_id
    spec = _spec({"project": PROJECT, "mode": "offline"})
    fleet = FleetTracker.start(run_id, spec, state)
    assert fleet.active
    state.event("launched", node_name="node-0", vm="i-0", zone="us-east-1a")
    state.event("launched", node_name="node-1", vm="i-1", zone="us-east-1a")
    state.event("plan", reason="not a fleet event")
    fleet.on_pass(_summary(10, 16, 2, 0, 1.5))
    state.event("preempted", node_name="node-1", vm="i-1", zone="us-east-1a", reason="spot")
    state.event("capacity", node_name="node-2", zone="us-east-1a", itype="p4d.24xlarge")
    state.event("adopted", node_name="node-3", vm="i-3")
    state.event("move", to="us-east-1b", why="zone cannot hold the minimum")
    fleet.on_pass(_summary(20, 8, 1, 1, 3.0))
    fleet.on_pass(_summary(25, 8, 1, 1, 3.5))
    state.event("stopping", why="budget", error=0)
    final = _summary(30, 8, 1, 1, 4.0)
    fleet.on_pass(final)
    fleet.finish(final)

    (path,) = offline_runs(wandb_dir, f"{run_id}-fleet")
    records = read_run(path)
    run = records.run
    assert (run["run_group"], run["job_type"]) == (run_id, "fleet")
    assert run["config"]["update"]["job"] == "gpt-small"
    rows = [r for r in records.history if "fleet/step" in r]
    assert [r["fleet/step"] for r in rows] == [10, 20, 25, 30]
    assert [r["fleet/world_size"] for r in rows] == [16, 8, 8, 8]
    assert [r["fleet/nodes"] for r in rows] == [2, 1, 1, 1]
    assert [r["fleet/nodes_training"] for r in rows] == [2, 1, 1, 1]
    assert [r["fleet/preemptions"] for r in rows] == [0, 1, 1, 1]
    assert [r["fleet/spent_usd"] for r in rows] == [1.5, 3.0, 3.5, 4.0]
    assert [r["fleet/saved_usd"] for r in rows] == [3.0, 6.0, 7.0, 8.0]
    counts = [
        {k.removeprefix("events/"): v for k, v in r.items() if k.startswith("events/") and v}
        for r in rows
    ]
    assert counts == [
        {"launched": 2, "backfills": 2},
        {"preempted": 1, "capacity": 1, "adopted": 1, "backfills": 1, "move": 1},
        {},
        {"stopping": 1},
    ]
    summary = records.summary
    assert (summary["final_step"], summary["preemptions"], summary["spent_usd"]) == (30, 1, 4.0)
    # The whole stream's fleet events, as a table file of the run.
    (table_file,) = path.parent.glob("files/media/table/fleet_events_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == list(TABLE_COLUMNS)
    kinds = [row[1] for row in table["data"]]
    assert kinds == ["launched", "launched", "preempted", "capacity", "adopted", "move", "stopping"]
    preempted = table["data"][2]
    assert preempted[2:5] == ["node-1", "i-1", "us-east-1a"]
    assert json.loads(preempted[5]) == {"reason": "spot"}

    # A controller that restarts resumes the run and goes on after the events logged.
    again = FleetTracker.start(run_id, spec, state)
    again.on_pass(final)
    state.event("preempted", node_name="node-0", vm="i-0")
    again.on_pass(final)
    again.tracker.finish(timeout=30)
    first, second = offline_runs(wandb_dir, f"{run_id}-fleet")
    assert first == path
    resumed = read_run(second)
    assert resumed.run["resume"] is True
    rows = [r for r in resumed.history if "fleet/step" in r]
    assert [r["events/preempted"] for r in rows] == [0, 1]
    assert [r["events/launched"] for r in rows] == [0, 0]


def test_controller_without_a_wandb_section_tracks_nothing(fleet_state: RunState) -> None:
    fleet = FleetTracker.start(fleet_state.keys.run_id, _spec(None), fleet_state)
    assert not fleet.active
    fleet_state.event("preempted", node_name="node-0")
    fleet.on_pass(_summary(1, 8, 1, 1, 1.0))
    fleet.finish(None)
    assert "tracking_events_id" not in fleet_state.ctl()  # not even the stream is read


def test_drive_run_hands_every_pass_and_the_end_to_the_fleet_tracker(
    monkeypatch: pytest.MonkeyPatch, fleet_state: RunState
) -> None:
    seen: list[Any] = []

    class Recorder:
        def on_pass(self, s: Summary) -> None:
            seen.append(("pass", s.step))

        def finish(self, s: Summary | None) -> None:
            seen.append(("finish", s.step if s else None))

    final = _summary(3, 8, 1, 0, 0.5)
    final.final_step = 3

    class Ctl:
        """Three passes of a controller (what drive_passes drives), then the end."""

        spec, state = _spec(None), fleet_state
        run_id, owner, interval_s = fleet_state.keys.run_id, "test-controller", 0.0
        passes = 0

        def step(self) -> None:
            self.passes += 1

        def summary(self) -> Summary:
            n = self.passes
            return final if n >= 3 else _summary(n, 8, 1, 0, 0.1 * n)

        def done(self) -> bool:
            return self.passes >= 3

        def live_vms(self) -> list[Any]:
            return []

    monkeypatch.setattr(drive, "claim_run", lambda info, owner: fleet_state)
    monkeypatch.setattr(drive, "record_controller", lambda info, owner: None)
    monkeypatch.setattr(drive, "build_controller", lambda info, **kw: Ctl())
    monkeypatch.setattr(drive, "archive_run", lambda *a, **kw: None)
    monkeypatch.setattr(drive.FleetTracker, "start", lambda *a: Recorder())
    info = drive.RunInfo(fleet_state.keys.run_id, "", "", "", "", False, 0.0)
    assert drive.drive_run(info, view=lambda line: None) == drive.EXIT_OK
    assert seen == [("pass", 1), ("pass", 2), ("pass", 3), ("finish", 3)]


# -- the trainers' environment ------------------------------------------------------------------
def test_the_wandb_section_reaches_the_trainers_environment() -> None:
    node = NodeIdentity("gpt-small-1795000000", "node-3", "aws", "us-east-1a", "p4d.24xlarge")
    env = agent_env(_spec({"project": PROJECT, "entity": "acme"}), node, "redis://r:6379")
    assert {k: v for k, v in env.items() if k.startswith("WANDB_")} == {
        "WANDB_PROJECT": PROJECT,
        "WANDB_ENTITY": "acme",
        "WANDB_RUN_GROUP": node.run_id,
    }  # no WANDB_MODE: the spec left it to the environment
    settings = WandbSettings.from_env(env)
    assert settings == WandbSettings(PROJECT, "acme", None, node.run_id)

    spec = parse_spec(
        yaml.safe_dump(
            spec_with(
                spec_with(VALID, "wandb", {"project": PROJECT, "mode": "offline"}),
                "train.env",
                {"WANDB_PROJECT": "my-own"},
            )
        )
    ).spec
    env = agent_env(spec, node, "redis://r:6379")
    assert (env["WANDB_MODE"], env["WANDB_PROJECT"]) == ("offline", "my-own")
    assert not any(k.startswith("WANDB_") for k in agent_env(_spec(None), node, "redis://r"))

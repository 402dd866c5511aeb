"""Our own commands never hurt a live run: a ``resume`` refused by the run's lease writes
nothing (run.json, the run's Redis records and its embedded Redis stay as they were); ``down``
signals only the run's own processes, known by the mark recorded when each started, never a
pid that changed hands or a process that merely says "spottrain"; two ``up`` of one job at
once make two runs; ``resume`` during ``down`` and ``down`` during ``up`` each finish or are
refused in one line, and the run's records stay whole.

Everything here is real: the run's embedded redis-server, the ``spottrain`` command's code,
the background controller process, the local cloud.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import redis
import yaml
from spec_samples import LOCAL, spec_with

from spottrain.agent.node_record import NodeInfo, NodeRecord
from spottrain.cloud.base import LaunchRequest, OfferQuery
from spottrain.cloud.local.compute import LocalProvider
from spottrain.controller.cli import main as cli
from spottrain.controller.reconcile.state import RunState
from spottrain.controller.run.create import create_run
from spottrain.controller.run.providers import build_providers
from spottrain.controller.run.records import RunError, RunInfo
from spottrain.controller.run.run_redis import open_redis, stop_embedded_redis
from spottrain.protocol.keys import RunKeys
from spottrain.spec import load_spec

if TYPE_CHECKING:
    from spottrain.controller.run.processes import ProcessMark

LIVE_OWNER = "ctl-0123456789ab pid 4242 on otherhost"
SLEEP_BOOT = '{"argv": ["sleep", "600"]}'


def _spec(tmp_path: Path, capacity: int = 0) -> Path:
    """A local job with an embedded Redis; ``capacity`` 0: its controller launches nothing."""
    (tmp_path / "code").mkdir(exist_ok=True)
    (tmp_path / "code" / "train.py").write_text("print('hi')\n")
    data = spec_with(LOCAL, "code", {"archive": {"path": "code"}})
    data = spec_with(data, "nodes", {"min": 1, "max": 1, "gpus": 0})
    data = spec_with(data, "local", {"zones": {"local-a": {"capacity": capacity}}, "notice_s": 2})
    data = spec_with(data, "checkpoint.volume.path", str(tmp_path / "vol"))
    data = spec_with(data, "budget", {"max_usd": 1000})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPOTTRAIN_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def run(tmp_path: Path, home: Path) -> Iterator[RunInfo]:
    info = create_run(load_spec(_spec(tmp_path)))
    try:
        yield info
    finally:
        stop_embedded_redis(info)


def _snapshot(info: RunInfo, client: redis.Redis) -> dict[str, Any]:
    """What a command must leave as it was: run.json's bytes and the run's Redis records."""
    keys = RunKeys(info.run_id)
    return {
        "run.json": (info.dir / "run.json").read_bytes(),
        "redis": {
            k: client.dump(k) for k in sorted(client.scan_iter(match=keys.pattern)) if k != b""
        },
        "lease": client.get(keys.ctl_lease),
        # A refused background controller may say why in its log; nothing else is written.
        "files": sorted(p.name for p in info.dir.iterdir() if p.name != "controller.log"),
    }


def _sleeper(*argv: str) -> subprocess.Popen[bytes]:
    """A process that is not the run's: ``argv`` rides on its command line."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", *argv])


def _until(what: str, ok: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _mark(raw: Any) -> ProcessMark | None:
    # Imported here: the other tests run (and fail by their assertions) on a tree without it.
    from spottrain.controller.run.processes import ProcessMark

    return ProcessMark.from_dict(raw)


def _running(mark: ProcessMark) -> bool:
    from spottrain.controller.run.processes import is_running

    return is_running(mark)


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def _set_record(info: RunInfo, **fields: Any) -> None:
    path = info.dir / "run.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


# --- 1. a refused resume ---------------------------------------------------------------------


@pytest.mark.parametrize("detach", [False, True], ids=["foreground", "detach"])
def test_a_resume_refused_by_the_lease_leaves_the_live_run_untouched(
    run: RunInfo, detach: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    client = open_redis(run, run.spec())
    state = RunState(client, RunKeys(run.run_id))
    # The live controller: it holds the lease and has started the run.
    assert state.acquire(LIVE_OWNER, 600)
    state.set_ctl(started_at=str(time.time()), phase="running")
    state.event("launch", vm="vm-1", node_name="n0")
    before = _snapshot(run, client)
    capsys.readouterr()

    assert cli.main(["resume", run.run_id, *(["--detach"] if detach else [])]) != 0

    assert (run.dir / "run.json").read_bytes() == before["run.json"]
    assert not (run.dir / "summary.json").exists()  # not archived
    assert _answers(client)  # its embedded Redis still runs
    assert _snapshot(run, client) == before
    assert state.ctl()["phase"] == "running" and "error" not in state.ctl()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert LIVE_OWNER in err[0] and f"spottrain down {run.run_id}" in err[0]


def test_a_controller_that_lost_the_lease_to_another_writes_nothing_more(run: RunInfo) -> None:
    from spottrain.controller.run.drive import drive_run

    client = open_redis(run, run.spec())
    keys = RunKeys(run.run_id)
    lines: list[str] = []
    code: list[int] = []
    driver = threading.Thread(
        target=lambda: code.append(drive_run(run, view=lines.append, interval_s=0.2))
    )
    driver.start()
    _until("the controller's first pass", lambda: bool(lines))
    # Another controller takes the run over (this one's lease lapsed while it was stopped).
    client.set(keys.ctl_lease, LIVE_OWNER, px=600_000)
    driver.join()
    assert code == [1]
    assert _answers(client)  # the new holder's Redis still runs
    ctl = RunState(client, keys).ctl()
    assert ctl.get("phase") == "running" and "error" not in ctl
    assert not (run.dir / "summary.json").exists()
    assert client.get(keys.ctl_lease) == LIVE_OWNER.encode()


# --- 2. down signals only the run's own processes --------------------------------------------


def test_down_spares_a_process_that_only_has_spottrain_in_its_command_line(
    run: RunInfo, capsys: pytest.CaptureFixture[str]
) -> None:
    editor = _sleeper("spottrain-ideas.md")
    try:
        # A controller that ended long ago; its pid is an editor's now.
        _set_record(run, controller_pid=editor.pid)
        assert cli.main(["down", run.run_id, "--now"]) == 0
        assert editor.poll() is None
    finally:
        editor.kill()
        editor.wait()


def test_down_never_signals_a_stale_redis_pid_that_another_process_took(
    run: RunInfo, capsys: pytest.CaptureFixture[str]
) -> None:
    # The run's Redis went away (a crash) and its pid file stayed; the pid is another's now.
    open_redis(run, run.spec()).shutdown(nosave=True)
    later = _sleeper("spottrain", run.run_id)
    try:
        (run.dir / "redis" / "redis.pid").write_text(f"{later.pid}\n")
        cli.main(["down", run.run_id, "--now"])
        assert later.poll() is None
    finally:
        later.kill()
        later.wait()


def test_down_never_signals_a_pid_whose_start_time_differs_from_the_record(
    run: RunInfo, capsys: pytest.CaptureFixture[str]
) -> None:
    later = _sleeper("-m", "spottrain.controller.run.daemon", run.run_id)
    try:
        from spottrain.controller.run.processes import start_ticks

        start = start_ticks(later.pid)
        assert start is not None
        mark = _mark({"pid": later.pid, "start": start - 1, "boot": "", "marker": run.run_id})
        assert mark is not None and not _running(mark)
        _set_record(run, controller_pid=later.pid, controller=mark.as_dict())
        assert cli.main(["down", run.run_id, "--now"]) == 0
        assert later.poll() is None
    finally:
        later.kill()
        later.wait()


def test_down_stops_the_runs_own_background_controller_and_redis(
    run: RunInfo, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["resume", run.run_id, "--detach"]) == 0
    info = RunInfo.load(run.run_id)
    mark = _mark(info.controller)
    assert mark is not None and mark.pid == info.controller_pid and _running(mark)
    redis_mark = _mark(json.loads((run.dir / "redis" / "process.json").read_text()))
    assert redis_mark is not None and _running(redis_mark)
    assert cli.main(["down", run.run_id, "--now"]) == 0
    assert not _running(mark) and not _running(redis_mark)
    assert json.loads((run.dir / "summary.json").read_text())["phase"] == "down"


# --- 3. commands at once ---------------------------------------------------------------------


def test_two_ups_of_one_job_at_once_make_two_whole_runs(tmp_path: Path, home: Path) -> None:
    spec = _spec(tmp_path)
    start = threading.Barrier(2)
    made: list[RunInfo] = []
    failed: list[BaseException] = []

    def up() -> None:
        loaded = load_spec(spec)
        start.wait()
        try:
            made.append(create_run(loaded))
        except BaseException as e:
            failed.append(e)

    threads = [threading.Thread(target=up) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not failed, failed
        assert len({i.run_id for i in made}) == 2
        for info in made:
            on_disk = RunInfo.load(info.run_id)
            assert on_disk.run_id == info.run_id and on_disk.redis_url == info.redis_url
            client = open_redis(on_disk, on_disk.spec())  # its own password opens its own Redis
            assert client.ping()
        assert made[0].redis_url != made[1].redis_url
    finally:
        for info in made:
            stop_embedded_redis(info)


class Agent:
    """A node's agent reduced to its record: joined, and leaves on a drain notice once
    ``release`` is set (until then ``down`` waits on it)."""

    def __init__(self, client: redis.Redis, keys: RunKeys, node: str) -> None:
        self.client, self.keys, self.node = client, keys, node
        self.record = NodeRecord(client, keys, NodeInfo(node_id=node, cloud="local"))
        self.record.register("joined")
        self.release = threading.Event()
        self.asked = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            if self.client.llen(self.keys.notices(self.node)):
                self.asked.set()
                if self.release.wait(0.05):
                    self.record.set_state("left", "drained")
                    return
            time.sleep(0.05)


def test_a_resume_during_down_is_refused_in_one_line_and_down_finishes(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    info = create_run(load_spec(_spec(tmp_path, capacity=1)))
    cloud = build_providers(info.spec(), local_state_dir=Path(info.local_state_dir))["local"]
    assert isinstance(cloud, LocalProvider)
    client, keys = open_redis(info, info.spec()), RunKeys(info.run_id)
    offer = next(o for o in cloud.offers(OfferQuery()) if o.zone == "local-a")
    cloud.launch(LaunchRequest("req-n0", info.run_id, "n0", offer, SLEEP_BOOT))
    agent = Agent(client, keys, "n0")
    result: list[int] = []
    down = threading.Thread(
        target=lambda: result.append(cli.main(["down", info.run_id, "--drain-timeout", "120"]))
    )
    try:
        down.start()
        _until("down to ask the node to drain", agent.asked.is_set)
        before = (info.dir / "run.json").read_bytes()
        capsys.readouterr()
        assert cli.main(["resume", info.run_id, "--detach"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is being ended by `spottrain down`" in err[0], err
        assert (info.dir / "run.json").read_bytes() == before
        agent.release.set()
        down.join()
        assert result == [0]
        assert json.loads((info.dir / "summary.json").read_text())["phase"] == "down"
        assert [r["type"] for r in map(json.loads, _lines(info, "events.jsonl"))].count("down") == 1
        # After the down, a resume is refused too, and brings no Redis back.
        assert cli.main(["resume", info.run_id]) == 1
        assert "was ended by `spottrain down`" in capsys.readouterr().err
        with pytest.raises(RunError):
            open_redis(info, info.spec())
    finally:
        agent.release.set()
        down.join()
        for rec in cloud.store.all():
            if rec["state"] != "terminated":
                cloud.preempt(rec["id"], notice=False)
        stop_embedded_redis(info)


def _lines(info: RunInfo, name: str) -> list[str]:
    return (info.dir / name).read_text().splitlines()


def test_a_down_during_up_ends_the_run_or_is_refused_and_leaves_it_whole(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = _spec(tmp_path)
    ups: list[int] = []
    up = threading.Thread(target=lambda: ups.append(cli.main(["up", str(spec), "--detach"])))
    up.start()
    runs = home / "runs"
    _until("up to make its run", lambda: any(runs.glob("*/run.json")))
    (run_json,) = runs.glob("*/run.json")
    info = RunInfo.load(run_json.parent.name)
    code = cli.main(["down", info.run_id, "--now"])
    up.join()
    try:
        err = capsys.readouterr().err.strip()
        assert code == 0 or len(err.splitlines()) == 1, err
        after = RunInfo.load(info.run_id)  # run.json is whole
        mark = _mark(after.controller)
        if code == 0:
            # Whichever came first, no controller of the run runs on after its down.
            assert mark is None or not _running(mark)
            assert json.loads((info.dir / "summary.json").read_text())["phase"] == "down"
    finally:
        mark = _mark(RunInfo.load(info.run_id).controller)
        if mark is not None and _running(mark):
            cli.main(["down", info.run_id, "--now"])
        stop_embedded_redis(info)

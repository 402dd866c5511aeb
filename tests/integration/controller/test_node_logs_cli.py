"""``spottrain logs --node N [-f] [--vm ID]`` reads a node's shipped chunks back through the
real CLI entry, from moto's S3 and the GCS fake as from a local directory: two successive VMs
in order, one VM picked, a lost chunk and a corrupt one reported while the rest prints, `-f`
picking up a new chunk, a late one and a replacement VM, and the local cloud's console files
when nothing was shipped."""

from __future__ import annotations

import gzip
import hashlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from fakes.gcs_server import GcsServer
from moto.server import ThreadedMotoServer

from spottrain.agent.logship.settings import ShipSettings
from spottrain.agent.logship.shipper import LogShipper
from spottrain.cloud.storage import SHA256_METADATA, LocalStore, ObjectStore
from spottrain.cloud.stores import open_store
from spottrain.controller.cli import main as cli
from spottrain.controller.cli import node_log_reader, node_logs
from spottrain.controller.reconcile.state import RunState
from spottrain.controller.run.records import RunInfo
from spottrain.protocol.node_logs import ChunkName
from spottrain.protocol.states import RunPhase

BUCKET = "spottrain-logs-test"
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
RUN = "llama-7b-ft-1732270000"
# The older VM's id sorts after the newer one's: order must come from started_ms.
OLD, NEW = ("i-0bbb", 1_732_270_100_000), ("i-0aaa", 1_732_270_900_000)


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    _s3_client(endpoint).create_bucket(Bucket=BUCKET)
    yield endpoint
    server.stop()


@pytest.fixture(scope="module")
def gcs_server() -> Iterator[GcsServer]:
    with GcsServer() as server:
        server.create_bucket(BUCKET)
        yield server


def _s3_client(endpoint: str) -> Any:
    session = boto3.Session(
        aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
    )
    return session.client("s3", endpoint_url=endpoint)


class Cloud:
    """A run whose spec ships its logs to a bucket of a fake, and the fake's levers."""

    def __init__(self, url: str, put_raw: Callable[[str, bytes, str], None]) -> None:
        self.url = url  # the logs go to <url>/logs
        self._put_raw = put_raw
        self.store: ObjectStore = open_store(url + "/logs")

    def chunk(self, vm: tuple[str, int], seq: int, text: str, node: str = "n0") -> bytes:
        data = text.encode()
        self.store.put_bytes(ChunkName(vm[1], vm[0], seq, RUN, node).key(), gzip.compress(data))
        return data

    def corrupt(self, vm: tuple[str, int], seq: int) -> None:
        """A chunk whose bytes do not match the sha256 recorded with them."""
        key = ChunkName(vm[1], vm[0], seq, RUN, "n0").key()
        self._put_raw(key, gzip.compress(b"rot\n"), hashlib.sha256(b"other").hexdigest())


@pytest.fixture(params=["s3", "gcs"])
def cloud(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Cloud:
    monkeypatch.setenv("SPOTTRAIN_HOME", str(tmp_path / "home"))
    prefix = f"t-{tmp_path.name[-24:]}".replace("_", "-")
    if request.param == "s3":
        endpoint = request.getfixturevalue("moto_endpoint")
        for k, v in {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL_S3": endpoint,
        }.items():
            monkeypatch.setenv(k, v)
        raw = _s3_client(endpoint)

        def put_s3(key: str, data: bytes, sha: str) -> None:
            key = f"{prefix}/logs/{key}"
            raw.put_object(Bucket=BUCKET, Key=key, Body=data, Metadata={SHA256_METADATA: sha})

        url, put_raw = f"s3://{BUCKET}/{prefix}", put_s3
        example = "aws_job.yaml"
    else:
        server: GcsServer = request.getfixturevalue("gcs_server")
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)

        def put_gcs(key: str, data: bytes, sha: str) -> None:
            server.put_object(BUCKET, f"{prefix}/logs/{key}", data, {SHA256_METADATA: sha})

        url, put_raw = f"gs://{BUCKET}/{prefix}", put_gcs
        example = "gcp_job.yaml"
    text = (EXAMPLES / example).read_text()
    if request.param == "s3":  # <checkpoint.copy_to>/logs
        old_copy = next(ln for ln in text.splitlines() if ln.strip().startswith("copy_to:"))
        text = text.replace(old_copy, f"  copy_to: {url}")
    else:  # logs.to, which wins over the example's copy_to
        text += f"logs:\n  to: {url}/logs\n"
    _save_run(text, tmp_path)
    return Cloud(url, put_raw)


def _save_run(spec_text: str, base: Path, local_state_dir: str = "") -> None:
    RunInfo(
        run_id=RUN,
        spec_text=spec_text,
        spec_source="job.yaml",
        base_dir=str(base),
        redis_url="redis://127.0.0.1:9/0",  # gone: the run record alone must do
        embedded_redis=False,
        created_at=time.time(),
        local_state_dir=local_state_dir,
    ).save()


def _logs(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["logs", RUN, "--node", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_nodes_vms_read_back_in_order_with_gaps_and_corruption_reported(
    cloud: Cloud, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    a0 = cloud.chunk(OLD, 0, "old vm: step 1\n")
    a1 = cloud.chunk(OLD, 1, "old vm: step 2\nold vm: notice, draining\n")
    a3 = cloud.chunk(OLD, 3, "old vm: drained\n")  # chunk 2 was lost with the VM
    b0 = cloud.chunk(NEW, 0, "new vm: restored step 2\n")
    cloud.corrupt(NEW, 1)
    b2 = cloud.chunk(NEW, 2, "new vm: step 3\n")
    cloud.chunk(OLD, 0, "another node's line\n", node="n1")
    cloud.store.put_bytes(f"{RUN}/n0/{OLD[0]}/notes.txt", b"not a chunk")

    code, out, err = _logs(capsys, "n0")
    assert out == (a0 + a1 + a3 + b0 + b2).decode()  # stdout: the raw output, nothing else
    assert code == 1, "a corrupt chunk is a failure a script must see"
    lines = err.splitlines()
    old_head = next(i for i, ln in enumerate(lines) if f"vm {OLD[0]}:" in ln)
    new_head = next(i for i, ln in enumerate(lines) if f"vm {NEW[0]}:" in ln)
    assert old_head < new_head
    assert "started 2024-11-22 10:08:20 UTC, 3 chunks" in lines[old_head]
    assert "[spottrain] chunk 2 of vm i-0bbb is missing (lost or not yet shipped)" in lines
    corrupt = [ln for ln in lines if "chunk 1 of vm i-0aaa" in ln]
    assert len(corrupt) == 1 and "is corrupt" in corrupt[0] and "00000001-" in corrupt[0]

    monkeypatch.setattr(node_log_reader, "WINDOW", 2)  # fetched and printed 2 chunks at a time
    code, out, err = _logs(capsys, "n0", "--vm", OLD[0])
    assert (code, out) == (0, (a0 + a1 + a3).decode()) and NEW[0] not in err
    assert "3 chunks, " in err and " bytes gzip in the first 2\n" in err and "chunk 2 " in err

    code, out, err = _logs(capsys, "n0", "--vm", "i-nope")
    assert code == 2 and out == ""
    assert "has no VM 'i-nope'" in err and OLD[0] in err and NEW[0] in err

    code, out, err = _logs(capsys, "n7")
    assert code == 1 and out == ""
    assert f"nothing under {cloud.url}/logs/{RUN}/n7/" in err
    assert "nodes with shipped output: n0, n1" in err


def test_what_the_agents_shipper_shipped_reads_back_across_a_killed_vm(
    cloud: Cloud, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The writer is the agent's own: the first VM dies with a chunk half filled (never
    closed), its replacement drains and closes; the read-back is exactly what was shipped."""
    shipped = b""
    for (vm, started_ms), lines, killed in ((OLD, range(0, 50), True), (NEW, range(50, 65), False)):
        out = tmp_path / f"{vm}.log"
        out.touch()
        clock = [started_ms / 1000]
        settings = ShipSettings(
            url=cloud.url + "/logs",
            file=str(out),
            run_id=RUN,
            node="n0",
            vm=vm,
            chunk_bytes=420,  # 20 lines of 21 bytes
            backlog_bytes=100_000,
        )
        shipper = LogShipper(settings, store=cloud.store, clock=lambda c=clock: c[0])
        with out.open("ab") as f:
            f.write(b"".join(f"line {i:05d} of {vm}\n".encode() for i in lines))
        shipper.poll()
        while shipper.ship_one():
            pass
        if killed:  # 50 lines: two whole chunks shipped, ten lines lost with the VM
            shipped += out.read_bytes()[:840]
        else:
            assert shipper.close(5.0)
            shipped += out.read_bytes()
    code, text, err = _logs(capsys, "n0")
    assert (code, text) == (0, shipped.decode())
    assert "2 chunks" in err and "missing" not in err


def test_follow_picks_up_new_chunks_a_late_one_and_a_replacement_vm(
    cloud: Cloud, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    polls: list[float] = []
    listed: list[tuple[int, str]] = []  # (poll, prefix) of every listing

    def pause(seconds: float) -> None:
        polls.append(seconds)
        if len(polls) == 1:  # the node had shipped nothing when `-f` started
            for q in (0, 1, 3):  # 2 not yet: held a poll
                cloud.chunk(OLD, q, f"a{q}\n")
        elif len(polls) == 2:
            cloud.chunk(OLD, 4, "a4\n")
        elif len(polls) == 3:
            cloud.chunk(NEW, 0, "b0\n")  # the replacement VM: seen by the next whole listing
            cloud.chunk(OLD, 2, "a2\n")  # after it was called missing: late

    def opened(url: str) -> Any:
        store = open_store(url)

        class Spy:
            def __getattr__(self, name: str) -> Any:
                return getattr(store, name)

            def list(self, prefix: str = "") -> list[str]:
                listed.append((len(polls), prefix))
                return store.list(prefix)

        return Spy()

    monkeypatch.setattr(node_logs, "open_store", opened)
    monkeypatch.setattr(node_logs, "_pause", pause)
    monkeypatch.setattr(node_logs, "_ended_probe", lambda info: lambda: len(polls) >= 4)
    code, out, err = _logs(capsys, "n0", "-f", "--interval", "7")
    assert code == 0
    assert out == "a0\na1\na3\na4\na2\nb0\n"
    # The run ended before poll 4, which still brought a chunk; polls 5 and 6 (10 s at
    # least) brought none: stop.
    assert polls == [7.0] * 6
    assert "node 'n0' has shipped nothing yet" in err and "waiting for its first chunk" in err
    assert "[spottrain] chunk 2 of vm i-0bbb is missing (lost or not yet shipped)" in err
    assert "[spottrain] chunk 2 of vm i-0bbb arrived late, out of order:" in err
    assert err.index("missing") < err.index("arrived late") < err.index(f"vm {NEW[0]}:")
    # Between whole listings (no VM yet, then the end), only the followed VM's next chunks.
    whole = f"{RUN}/n0/"
    assert [n for n, p in listed if p == whole] == [0, 1, 4, 5, 6]
    narrow = [f"{RUN}/n0/{OLD[0]}/00000{b}" for b in (0, 1)]
    assert [p for _, p in listed if p != whole] == narrow * 2

    # Read again, the late chunk is in its place; Ctrl-C ends a follow quietly.
    def interrupted(seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(node_logs, "_pause", interrupted)
    code, out, err = _logs(capsys, "n0", "-f")
    assert (code, out) == (0, "a0\na1\na2\na3\na4\nb0\n") and "missing" not in err


def test_no_store_named_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SPOTTRAIN_HOME", str(tmp_path / "home"))
    text = (EXAMPLES / "aws_job.yaml").read_text()
    _save_run("\n".join(ln for ln in text.splitlines() if "copy_to:" not in ln), tmp_path)
    code, out, err = _logs(capsys, "n0")
    assert code == 1 and out == ""
    assert "names neither logs.to nor checkpoint.copy_to" in err
    assert cli.main(["logs", RUN, "--vm", "i-1"]) == 2
    assert "give --node too" in capsys.readouterr().err
    assert _logs(capsys, "n0", "-f", "--interval", "0")[0] == 2


def test_the_local_cloud_reads_shipped_chunks_else_its_console_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("SPOTTRAIN_HOME", str(home))
    state = tmp_path / "local-state"
    for vm, node in (("local-1", "n0"), ("local-2", "n1"), ("local-3", "n0")):
        tags = {"spottrain-job": RUN, "spottrain-node": node}
        (state / "instances").mkdir(parents=True, exist_ok=True)
        (state / "instances" / f"{vm}.json").write_text(json.dumps({"id": vm, "tags": tags}))
        (state / "logs").mkdir(exist_ok=True)
        (state / "logs" / f"{vm}.log").write_text(f"console of {vm}\n")
    spec = (EXAMPLES / "local_job.yaml").read_text()
    _save_run(spec, EXAMPLES, local_state_dir=str(state))

    assert _logs(capsys, "n0")[:2] == (0, "console of local-1\n")
    assert _logs(capsys, "n0", "--vm", "local-3")[:2] == (0, "console of local-3\n")
    assert _logs(capsys, "n0", "--vm", "local-2")[:2] == (2, "")  # n1's VM
    code, _, err = _logs(capsys, "n5")
    assert code == 1 and "no output kept for node 'n5'" in err

    # Once the node ships (to $SPOTTRAIN_HOME/store/checkpoints/logs), the chunks win.
    store = LocalStore(home / "store" / "checkpoints" / "logs", create=True)
    store.put_bytes(ChunkName(5, "local-1", 0, RUN, "n0").key(), gzip.compress(b"shipped\n"))
    assert _logs(capsys, "n0")[:2] == (0, "shipped\n")
    assert _logs(capsys, "n0", "--vm", "local-3")[:2] == (0, "console of local-3\n")


def test_follow_stops_when_the_runs_redis_says_it_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_server: Any, run_keys: Any
) -> None:
    monkeypatch.setenv("SPOTTRAIN_HOME", str(tmp_path / "home"))
    info = RunInfo(
        run_id=run_keys.run_id,
        spec_text=(EXAMPLES / "aws_job.yaml").read_text(),
        spec_source="job.yaml",
        base_dir=str(tmp_path),
        redis_url=f"redis://{redis_server.host}:{redis_server.port}/0",
        embedded_redis=False,
        created_at=time.time(),
    )
    ended = node_logs._ended_probe(info)
    client = redis_server.client()
    state = RunState(client, run_keys)
    state.set_ctl(phase=RunPhase.RUNNING)
    assert not ended()
    state.set_ctl(phase=RunPhase.DOWN)
    assert ended()
    state.set_ctl(phase=RunPhase.RUNNING)
    info.save()
    (info.dir / "summary.json").write_text("{}")  # archived: over, whatever Redis says
    assert ended()
    client.close()

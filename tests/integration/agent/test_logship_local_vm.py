"""A real agent on a local-cloud VM ships its node's output: the VM names its console file
and its id, the boot script says nothing about logs (the agent finds the store beside the
checkpoint copies, as a Terraform fleet's would), and the last flush after training ends
puts every line in the store: the agent's, torchrun's and the workers'. A VM preempted with
notice ships what its drain wrote too, before its notice window ends."""

from __future__ import annotations

import gzip
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import yaml
from spec_samples import LOCAL, spec_with

from spottrain.cloud.base import LaunchRequest, Market, OfferQuery
from spottrain.cloud.local.compute import LocalProvider
from spottrain.cloud.local.settings import LocalSettings
from spottrain.cloud.storage import LocalStore
from spottrain.controller.run.boot import NodeIdentity, render_local_boot
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol import env as env_names
from spottrain.protocol.node_logs import node_prefix, parse_chunk_key
from spottrain.spec import parse_spec

TRAIN = "import os\nfor i in range(3):\n    print(f'worker {os.environ[\"RANK\"]} step {i}')\n"


STEPPING = """import os, signal, sys, time
rank, step = os.environ["RANK"], 0
def stop(*_):
    print(f"worker {rank} got SIGTERM: stopping at step {step}", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
while True:
    print(f"worker {rank} step {step} " + "." * 200, flush=True)
    step += 1
    time.sleep(0.2)
"""
NOTICE_S = 12  # the drain waits for a checkpoint until 5 s before its end, then stops


def _launch(
    redis_server: RedisServer, tmp_path: Path, run: str, train: str, logs: Mapping[str, object]
) -> tuple[LocalProvider, str, Path]:
    """A local VM running node-0 of ``run``, whose training is ``train``; its VM id and
    the directory its logs are shipped to."""
    (tmp_path / "train.py").write_text(train)
    data = spec_with(LOCAL, "train.command", [str(tmp_path / "train.py")])
    data = spec_with(data, "checkpoint.volume.path", str(tmp_path / "volume"))
    data = spec_with(data, "controller", {"orphan_timeout_minutes": 0})
    data = spec_with(data, "local.notice_s", NOTICE_S)
    if logs:
        data = spec_with(data, "logs", logs)
    spec = parse_spec(yaml.safe_dump(data)).spec
    copies = tmp_path / "store" / "checkpoints"
    copies.mkdir(parents=True)
    settings = LocalSettings(tmp_path / "cloud", zones={"local-a": 1}, notice_s=NOTICE_S)
    cloud = LocalProvider(settings)
    offer = next(o for o in cloud.offers(OfferQuery()) if o.market is Market.SPOT)
    node = NodeIdentity(run, "node-0", "local", offer.zone, offer.instance_type)
    boot = render_local_boot(
        spec, node, redis_server.endpoint, workdir=tmp_path / "work", copy_to=f"file://{copies}"
    )
    assert env_names.ENV_LOGS_TO not in boot and env_names.ENV_LOGS_FILE not in boot
    vm = cloud.launch(LaunchRequest("r-logs", "job-1", "node-0", offer, boot)).id
    return cloud, vm, copies / "logs"


def _wait(cloud: LocalProvider, vm: str, what: Callable[[], bool], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, cloud.log_path(vm).read_text()
        time.sleep(0.1)


def _shipped_chunks(logs: Path, run: str, vm: str) -> list[bytes]:
    store = LocalStore(str(logs))
    keys = store.list(node_prefix(run, "node-0"))
    names = sorted(n for n in map(parse_chunk_key, keys) if n)
    assert len(names) == len(keys) and {n.vm for n in names} == {vm}, keys
    assert [n.seq for n in names] == list(range(len(names))), "a gap in the chunks"
    return [gzip.decompress(store.get_bytes(n.key())) for n in names]


@pytest.mark.slow  # torchrun's start and end: ~15 s
def test_a_local_vms_agent_ships_its_whole_console_to_the_copy_stores_logs(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    cloud, vm, logs = _launch(redis_server, tmp_path, "run-logs-1", TRAIN, {})
    try:
        _wait(cloud, vm, lambda: "boot_exit" in cloud.store.read(vm))
        console = cloud.log_path(vm).read_bytes()
        assert cloud.store.read(vm)["boot_exit"] == 0, console.decode()
    finally:
        cloud.preempt(vm, notice=False)
    shipped = b"".join(_shipped_chunks(logs, "run-logs-1", vm))
    # Everything the VM's console holds, in order: shipped before the agent exited.
    assert console.startswith(shipped) and console[len(shipped) :].strip() == b""
    text = shipped.decode()
    assert "spottrain-agent[node-0] INFO log shipping:" in text  # the agent's own lines
    assert "OMP_NUM_THREADS" in text  # torchrun's
    assert "worker 0 step 2" in text and "worker 1 step 2" in text  # the workers'


@pytest.mark.slow  # torchrun's start, then the notice window: ~30 s
def test_a_vm_preempted_with_notice_ships_what_its_drain_wrote(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    run = "run-logs-drain"  # a rendezvous of its own: the other test's run is closed
    # Chunks cut by size only (10 KB, a few seconds of training): what the drain wrote after
    # the last of them reaches the store only through the agent's last flush.
    cut = {"chunk_seconds": 3600, "chunk_mb": 0.01}
    cloud, vm, logs = _launch(redis_server, tmp_path, run, STEPPING, cut)
    try:
        stepping = (b"worker 0 step 3", b"worker 1 step 3")
        _wait(cloud, vm, lambda: all(s in cloud.log_path(vm).read_bytes() for s in stepping))
        _wait(cloud, vm, lambda: (logs / run).is_dir())  # a chunk was shipped
        assert cloud.preempt(vm)  # SIGTERM to the agent, SIGKILL to all NOTICE_S later
        _wait(cloud, vm, lambda: cloud.store.read(vm)["state"] == "terminated")
        rec, console = cloud.store.read(vm), cloud.log_path(vm).read_bytes()
    finally:
        cloud.preempt(vm, notice=False)
    # The agent drained and exited inside the notice window: nothing was SIGKILLed.
    assert rec["interrupted"] and rec.get("boot_exit") == 0, console.decode()
    chunks = _shipped_chunks(logs, run, vm)
    assert b"".join(chunks) == console  # all of it, the VM's last line included
    drain = console[console.index(b"WARNING notice:") :].decode()
    for line in (
        "ERROR no checkpoint committed before the deadline margin: leaving anyway",
        "worker 0 got SIGTERM: stopping at step",
        "worker 1 got SIGTERM: stopping at step",
    ):
        assert line in drain, drain
    # The last flush came after the workers had stopped: the last chunk ends with the
    # console's last line, written after the notice.
    last_line = console.rstrip(b"\n").rsplit(b"\n", 1)[-1] + b"\n"
    assert chunks[-1].endswith(last_line) and last_line.decode() in drain

"""A real agent on a local-cloud VM ships its node's output: the VM names its console file
and its id, the boot script says nothing about logs (the agent finds the store beside the
checkpoint copies, as a Terraform fleet's would), and the last flush after training ends
puts every line in the store: the agent's, torchrun's and the workers'."""

from __future__ import annotations

import gzip
import time
from pathlib import Path

import pytest
import yaml
from spec_samples import LOCAL, _with

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


@pytest.mark.slow  # torchrun's start and end: ~15 s
def test_a_local_vms_agent_ships_its_whole_console_to_the_copy_stores_logs(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    data = _with(LOCAL, "train.command", [str(tmp_path / "train.py")])
    data = _with(data, "checkpoint.volume.path", str(tmp_path / "volume"))
    data = _with(data, "controller", {"orphan_timeout_minutes": 0})
    spec = parse_spec(yaml.safe_dump(data)).spec
    copies = tmp_path / "store" / "checkpoints"
    copies.mkdir(parents=True)
    cloud = LocalProvider(LocalSettings(tmp_path / "cloud", zones={"local-a": 1}, notice_s=5))
    offer = next(o for o in cloud.offers(OfferQuery()) if o.market is Market.SPOT)
    node = NodeIdentity("run-logs-1", "node-0", "local", offer.zone, offer.instance_type)
    boot = render_local_boot(
        spec, node, redis_server.endpoint, workdir=tmp_path / "work", copy_to=f"file://{copies}"
    )
    assert env_names.ENV_LOGS_TO not in boot and env_names.ENV_LOGS_FILE not in boot
    vm = cloud.launch(LaunchRequest("r-logs", "job-1", "node-0", offer, boot)).id
    try:
        deadline = time.monotonic() + 90
        while "boot_exit" not in cloud.store.read(vm):
            assert time.monotonic() < deadline, cloud.log_path(vm).read_text()
            time.sleep(0.1)
        console = cloud.log_path(vm).read_bytes()
        assert cloud.store.read(vm)["boot_exit"] == 0, console.decode()
    finally:
        cloud.preempt(vm, notice=False)
    store = LocalStore(str(copies / "logs"))
    keys = store.list(node_prefix("run-logs-1", "node-0"))
    names = [parse_chunk_key(k) for k in keys]
    assert {n.vm for n in names if n} == {vm}, keys
    assert sorted(n.seq for n in names if n) == list(range(len(keys)))
    shipped = b"".join(gzip.decompress(store.get_bytes(k)) for k in sorted(keys))
    # Everything the VM's console holds, in order: shipped before the agent exited.
    assert console.startswith(shipped) and console[len(shipped) :].strip() == b""
    text = shipped.decode()
    assert "spottrain-agent[node-0] INFO log shipping:" in text  # the agent's own lines
    assert "OMP_NUM_THREADS" in text  # torchrun's
    assert "worker 0 step 2" in text and "worker 1 step 2" in text  # the workers'

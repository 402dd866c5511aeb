"""A checkpoint copy's pull says how far it got in the agent's output: the copy's size from
its manifest, the bytes done read from the download's temporary directory."""

from __future__ import annotations

import logging
import os
import time
import zlib
from pathlib import Path

import fakeredis
import pytest

from spottrain.agent.checkpoint import copy
from spottrain.agent.checkpoint.copy import CheckpointCopier
from spottrain.agent.checkpoint.directory import CheckpointDir
from spottrain.agent.checkpoint.manifest import FileSum, Manifest
from spottrain.agent.node_record import NodeInfo, NodeRecord
from spottrain.cloud.storage import LocalStore, upload_dir
from spottrain.protocol.keys import RunKeys


def test_a_pull_says_its_size_and_how_far_it_got(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = RunKeys("t-pull")
    store = LocalStore(tmp_path / "store", create=True)
    (tmp_path / "zone-a").mkdir()
    old = CheckpointDir(str(tmp_path / "zone-a"))
    tmp = old.tmp_path(10, 0)
    tmp.mkdir()
    sums = {}
    for name, size in (
        (".metadata", 100),
        ("__0_0.distcp", 1_500_000),
        ("__1_0.distcp", 1_000_000),
    ):
        data = os.urandom(size)
        (tmp / name).write_bytes(data)
        sums[name] = FileSum(size, zlib.crc32(data))
    path = old.commit(tmp, Manifest(10, 2, 0, "periodic", time.time(), sums))
    upload_dir(store, path, f"{keys.run_id}/{path.name}")

    client = fakeredis.FakeRedis()
    record = NodeRecord(client, keys, NodeInfo("n-new", "local"))
    copier = CheckpointCopier(
        store.url(), str(tmp_path / "zone-b"), client, keys, "n-new", record, store=store
    )
    with caplog.at_level(logging.INFO, logger="spottrain.agent.ckpt_copy"):
        assert copier.pull_newest().step == 10
    lines = [r.getMessage() for r in caplog.records]
    assert "pulling checkpoint copy step-000000010: 0 B of 2.5 MB (0%)" in lines

    # Bytes done: whatever the download's temporary directory holds so far.
    parent = tmp_path / "zone-c"
    partial = parent / "..tmp-step-000000020-r-1-pull.download-0123" / "sub"
    partial.mkdir(parents=True)
    (partial / "a").write_bytes(b"x" * 300)
    progress = copy._PullProgress("step-000000020", 1000, parent, ".tmp-step-000000020-r-1-pull")
    assert progress.done_bytes() == 300
    assert progress.line(300) == "pulling checkpoint copy step-000000020: 300 B of 1000 B (30%)"
    unknown = copy._PullProgress("step-000000020", None, parent, "x")
    assert unknown.line(2_000_000) == "pulling checkpoint copy step-000000020: 2.0 MB"

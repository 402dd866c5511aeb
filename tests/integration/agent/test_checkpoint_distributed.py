"""Saves from two real ranks (gloo): a replicated tensor is written once, each rank writes
its own items, both ranks get the same result, a failure on one rank fails the save on both
and leaves nothing behind, and one process restores all of it.

One two-rank job (``tests/ckpt_dist_worker.py``) runs for the whole module; each test checks
one property of what it left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from ckpt_dist_worker import PER_RANK_ELEMS, REPLICATED_ELEMS, state_for
from ckpt_state import assert_bitwise_equal
from torch.distributed.checkpoint.filesystem import FileSystemReader

from spottrain.agent.checkpoint import dcp_io
from spottrain.agent.checkpoint.directory import CheckpointDir
from spottrain.agent.checkpoint.manifest import Manifest
from spottrain.ports import free_port

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

WORKER = Path(__file__).resolve().parents[2] / "ckpt_dist_worker.py"
WORLD = 2


@dataclass(frozen=True)
class Job:
    ckdir: CheckpointDir
    reports: list[dict[str, Any]]  # by rank


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    root = tmp_path_factory.mktemp("dist")
    ckpt, out = root / "ckpt", root / "out"
    ckpt.mkdir()
    out.mkdir()
    port = str(free_port())
    procs = []
    for rank in range(WORLD):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "RANK": str(rank),
            "WORLD_SIZE": str(WORLD),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), str(ckpt), str(out)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, p in enumerate(procs):
        assert p.returncode == 0, f"rank {rank} failed:\n{logs[rank][-4000:]}"
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return Job(CheckpointDir(ckpt), reports)


def manifest_of(report: dict[str, Any], save: str) -> Manifest:
    return Manifest.from_bytes(report[save]["manifest"].encode())


def test_both_ranks_get_the_same_save_result(job: Job) -> None:
    r0, r1 = job.reports
    for save in ("save1", "save3"):
        assert r0[save] == r1[save]
        assert r0[save]["refused"] is None
        assert r0[save]["path"] == str(job.ckdir.root / f"step-00000000{save[-1]}")
    m = manifest_of(r0, "save1")
    assert (m.step, m.world_size, m.round) == (1, WORLD, 4)


def test_replicated_tensor_is_written_once_and_each_rank_writes_its_own_items(job: Job) -> None:
    path = job.ckdir.step_path(1)
    storage = FileSystemReader(path).read_metadata().storage_data
    files_of: dict[str, list[str]] = {}
    for index, info in storage.items():
        files_of.setdefault(index.fqn, []).append(info.relative_path)
    assert len(files_of["replicated"]) == 1  # one copy, not one per rank
    assert files_of["rank0.w"][0].startswith("__0_")
    assert files_of["rank1.w"][0].startswith("__1_")

    one_copy = REPLICATED_ELEMS * 4 + WORLD * PER_RANK_ELEMS * 4
    total = manifest_of(job.reports[0], "save1").total_bytes
    assert one_copy <= total < one_copy + REPLICATED_ELEMS * 4 // 2  # not two copies
    # The manifest names files from both ranks, and nothing else is in the directory.
    assert {n[:4] for n in manifest_of(job.reports[0], "save1").files if n.endswith(".distcp")} == {
        "__0_",
        "__1_",
    }


def test_one_process_restores_what_two_ranks_saved(job: Job) -> None:
    found = job.ckdir.find_restorable()
    assert found is not None and found.manifest.step == 3 and found.skipped == []
    want = {**state_for(0, 3), **state_for(1, 3)}
    loaded: dict[str, Any] = {
        "replicated": want["replicated"] * 0,
        "rank0": {"w": want["rank0"]["w"] * 0},
        "rank1": {"w": want["rank1"]["w"] * 0},
        "meta": {"step": None},
    }
    dcp_io.load(loaded, found.path)
    assert_bitwise_equal(loaded, want)


def test_a_write_failure_on_one_rank_fails_the_save_on_both_and_leaves_nothing(job: Job) -> None:
    for report in job.reports:
        error = report["error2"]
        assert error is not None, f"rank {report['rank']} saw step 2 succeed"
        assert "saving step 2" in error
        assert "rank 1: RuntimeError: rank 1 holds an object that refuses to be pickled" in error
        assert "the previous checkpoint is intact" in error
    assert [s for s, _ in job.ckdir.committed()] == [1, 3]  # and step 3 saved after it
    assert sorted(p.name for p in job.ckdir.root.iterdir()) == [
        "latest",
        "step-000000001",
        "step-000000003",
    ]

"""examples/fsdp_train.py (FSDP2, sharded DCP checkpoints) under real torchrun on the CPU
with gloo: a run killed after a periodic save and restored at the same world size ends with
parameters bitwise equal to an uninterrupted run; a checkpoint saved by two ranks restores,
resharded, into three, and training continues at the same step with the same global batch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from spottrain.ports import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "examples" / "fsdp_train.py")
STEPS = 8
EVERY = 3
DIE_AT = 7  # after the save at 6 waited for the one at 3: at least step 3 is committed
GLOBAL_BATCH = 12  # micro batch 2 x world 2 x 3 accumulation, or x world 3 x 2


@dataclass(frozen=True)
class Run:
    returncode: int
    log: str
    progress: list[dict[str, float]]


def torchrun(tmp: Path, ckpt: Path, world: int, *args: str) -> Run:
    """One torchrun job of ``world`` workers; no restarts (a killed worker ends the job)."""
    tmp.mkdir(parents=True, exist_ok=True)
    ckpt.mkdir(exist_ok=True)  # the volume: the SDK refuses a missing one
    progress = tmp / f"progress-{len(list(tmp.glob('progress-*')))}.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        "--max-restarts=0",
        SCRIPT,
        "--steps",
        str(STEPS),
        "--every-steps",
        str(EVERY),
        "--global-batch",
        str(GLOBAL_BATCH),
        "--ckpt-dir",
        str(ckpt),
        "--progress",
        str(progress),
        "--log-every",
        "0",
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    env.pop("SPOTTRAIN_REDIS", None)
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = progress.read_text().splitlines() if progress.exists() else []
    return Run(proc.returncode, log, [json.loads(line) for line in lines])


def restored_step(log: str) -> tuple[int, int]:
    """(step, world size that saved it) from the script's first line."""
    m = re.search(r"starting at step (\d+) \(saved by world size (\d+)\)", log)
    assert m, f"no restore in the log:\n{log[-3000:]}"
    return int(m.group(1)), int(m.group(2))


def shard_counts(checkpoint: Path) -> set[int]:
    """How many pieces a weight matrix and its Adam moment were saved in: one per rank when
    the state dicts are sharded (DTensors), one in all when a replicated copy was saved."""
    meta = FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    keys = ["model.model.blocks.0.mlp.0.weight", "model.optim.state.blocks.0.mlp.0.weight.exp_avg"]
    counts = set()
    for key in keys:
        item = meta[key]
        assert isinstance(item, TensorStorageMetadata), key
        counts.add(len(item.chunks))
    return counts


def load_params(path: Path) -> dict[str, torch.Tensor]:
    params: dict[str, torch.Tensor] = torch.load(path, weights_only=True)
    return params


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, dict[str, torch.Tensor]]:
    """An uninterrupted run of STEPS steps at world size 2."""
    tmp = tmp_path_factory.mktemp("reference")
    run = torchrun(tmp, tmp / "ckpt", 2, "--dump-params", str(tmp / "params.pt"))
    assert run.returncode == 0, run.log[-4000:]
    assert [r["step"] for r in run.progress] == list(range(1, STEPS + 1))
    return run, load_params(tmp / "params.pt")


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A world-2 run whose workers all die (SIGKILL) at step DIE_AT, after periodic saves:
    its checkpoint directory, as a VM that vanished leaves it."""
    tmp = tmp_path_factory.mktemp("killed")
    ckpt = tmp / "ckpt"
    run = torchrun(tmp, ckpt, 2, "--die-at", str(DIE_AT))
    assert run.returncode != 0, "the workers were to kill themselves"
    assert run.progress[-1]["step"] == DIE_AT
    assert shard_counts(ckpt / f"step-{EVERY:09d}") == {2}
    return ckpt


def test_killed_run_restored_at_same_world_size_is_bitwise_equal_to_uninterrupted(
    tmp_path: Path, reference: tuple[Run, dict[str, torch.Tensor]], killed: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(killed, ckpt)
    # Recomputing the blocks in the backward (activation checkpointing) repeats the same
    # float operations, so it too must leave the parameters bitwise the same.
    args = ["--dump-params", str(tmp_path / "params.pt"), "--activation-checkpointing"]
    run = torchrun(tmp_path, ckpt, 2, *args)
    assert run.returncode == 0, run.log[-4000:]
    step, saved_by = restored_step(run.log)
    assert step in (EVERY, 2 * EVERY) and saved_by == 2
    assert [r["step"] for r in run.progress] == list(range(step + 1, STEPS + 1))
    ref_run, ref_params = reference
    ref_loss = {r["step"]: r["loss"] for r in ref_run.progress}
    assert all(r["loss"] == ref_loss[r["step"]] for r in run.progress)
    params = load_params(tmp_path / "params.pt")
    assert params.keys() == ref_params.keys()
    different = [k for k in params if not torch.equal(params[k], ref_params[k])]
    assert not different, f"parameters differ from the uninterrupted run: {different}"


def test_checkpoint_of_two_ranks_restores_resharded_into_three_and_training_continues(
    tmp_path: Path, reference: tuple[Run, dict[str, torch.Tensor]], killed: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(killed, ckpt)
    run = torchrun(tmp_path, ckpt, 3, "--dump-params", str(tmp_path / "params.pt"))
    assert run.returncode == 0, run.log[-4000:]
    step, saved_by = restored_step(run.log)
    assert step in (EVERY, 2 * EVERY) and saved_by == 2
    # The step goes on from the checkpoint, and the global batch is the same: three ranks
    # accumulate two micro-batches where two ranks accumulated three.
    assert [r["step"] for r in run.progress] == list(range(step + 1, STEPS + 1))
    assert {(r["world"], r["accum"]) for r in run.progress} == {(3, 2)}
    # Same samples, same weights: the loss is the uninterrupted run's up to the order of
    # float sums (a wrongly resharded tensor would be far off, and a fresh start higher).
    ref_run, ref_params = reference
    ref_loss = {r["step"]: r["loss"] for r in ref_run.progress}
    for r in run.progress:
        assert r["loss"] == pytest.approx(ref_loss[r["step"]], abs=1e-4), r
    params = load_params(tmp_path / "params.pt")
    for k, v in params.items():
        torch.testing.assert_close(v, ref_params[k], atol=1e-4, rtol=1e-3, msg=k)
    committed = sorted(p.name for p in ckpt.glob("step-*"))
    assert committed[-1] == f"step-{STEPS:09d}"
    manifest = json.loads((ckpt / committed[-1] / "MANIFEST.json").read_text())
    assert manifest["world_size"] == 3
    assert shard_counts(ckpt / committed[-1]) == {3}


BF16_PROBE = """
import importlib.util, json, sys, torch
spec = importlib.util.spec_from_file_location("fsdp_train", sys.argv[1])
m = importlib.util.module_from_spec(spec)
sys.modules["fsdp_train"] = m
spec.loader.exec_module(m)
device = m.setup_device()
model, opt, sched, cfg = m.build(m.parse_args(["--precision", "bf16"]), device)
x, y = m.sample(range(2), cfg, 1, device)
model(x).float().sum().backward()
p = next(model.parameters())
print(json.dumps([str(model(x).dtype), str(p.dtype), str(p.grad.dtype)]))
"""


def test_bf16_computes_in_bf16_and_keeps_fp32_weights_and_gradients() -> None:
    """The mixed-precision policy the GPU path uses, on the CPU (gloo, one rank): FSDP2
    gathers bf16 parameters for the forward, and the sharded weights and their reduced
    gradients stay fp32."""
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "OMP_NUM_THREADS": "1",
    }
    out = subprocess.run(
        [sys.executable, "-c", BF16_PROBE, SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    logits, weight, grad = json.loads(out.stdout.strip().splitlines()[-1])
    assert (logits, weight, grad) == ("torch.bfloat16", "torch.float32", "torch.float32")

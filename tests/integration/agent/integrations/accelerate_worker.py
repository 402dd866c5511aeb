"""A tiny model trained by an Accelerate loop with spottrain's SpotAccelerate, one torchrun
worker of tests/integration/agent/integrations/test_accelerate_helper.py.

Usage: accelerate_worker.py REPORT_DIR [--gate-step K]

64 samples, shuffled by a seedable sampler, per-device batch 2, global batch 8 (gradient
accumulation 2 at two ranks), 12 optimizer steps: one and a half epochs. Every rank writes
REPORT_DIR/rank<R>.jsonl: ``{"resumed": step}`` first, then one line per optimizer step
with the sample ids it consumed (``{"step": s, "ids": [...]}``), and ``{"end": step}``;
rank 0 writes REPORT_DIR/final.pt, the final weights. ``--gate-step K``: every rank waits
at step K, after spottrain reported and agreed on it, until rank 0's session has read a
checkpoint request from Redis (the test writes it once it sees step K): a meeting point,
not a pace; the request is acted on at step K + 2.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration

from spottrain.agent.sdk.integrations.accelerate import SpotAccelerate

SAMPLES = 64
PER_DEVICE = 2
GLOBAL_BATCH = 8
MAX_STEPS = 12


class Numbers(torch.utils.data.Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    """Sample i is (i, x_i, y_i), the same in every process."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(SAMPLES, 4, generator=g)
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


def write(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def gate(spot: SpotAccelerate) -> None:
    if spot.session.rank == 0:
        deadline = time.monotonic() + 120
        while spot.session.channel.newest_id() == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("report_dir", type=Path)
    parser.add_argument("--gate-step", type=int)
    opts = parser.parse_args()
    torch.manual_seed(0)
    accelerator = Accelerator(
        cpu=True,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=7),
    )
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = torch.utils.data.DataLoader(Numbers(), batch_size=PER_DEVICE, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    # Every step agrees; the rank that was not SIGTERM'd holds until the test's agent stops it.
    spot = SpotAccelerate(
        accelerator,
        global_batch=GLOBAL_BATCH,
        per_device=PER_DEVICE,
        agree_interval=0.0,
        hold_timeout=120.0,
    )
    report = opts.report_dir / f"rank{accelerator.process_index}.jsonl"
    step = spot.resume()
    write(report, {"resumed": step})
    ids: list[int] = []
    while step < MAX_STEPS:
        for index, x, y in spot.batches(loader):
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
            ids += index.tolist()
            if not accelerator.sync_gradients:
                continue
            step += 1
            write(report, {"step": step, "ids": ids})
            ids = []
            spot.step(step, loss=float(loss.item()))
            if step == opts.gate_step:
                gate(spot)
            if step == MAX_STEPS:
                break
    spot.finish(step)
    write(report, {"end": step})
    if accelerator.is_main_process:
        weights = accelerator.unwrap_model(model).state_dict()
        torch.save(weights, opts.report_dir / "final.pt")


if __name__ == "__main__":
    main()

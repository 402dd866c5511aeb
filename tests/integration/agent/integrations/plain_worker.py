"""A tiny model trained by a plain torchrun loop (DDP on gloo) with spottrain's
SpotCheckpoints around its own save and load, one torchrun worker of
tests/integration/agent/integrations/test_plain_checkpoints.py.

Usage: plain_worker.py REPORT_DIR [--gate-step K]

64 samples, shuffled per epoch by a DistributedSampler, 4 per rank per step, 12 steps (one
and a half epochs); the data position follows from the restored step. Rows as in
accelerate_worker.py: ``{"resumed": step}``, ``{"step": s, "ids": [...]}``, ``{"end": s}``;
rank 0 writes REPORT_DIR/final.pt. ``--gate-step K``: every rank waits at step K until rank
0's session has read a checkpoint request (acted on at step K + 2). ``--sigterm-gate K``:
every rank waits at step K until it got its SIGTERM (the test sends it to torchrun).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from spottrain.agent.sdk.integrations.plain import SpotCheckpoints

SAMPLES = 64
PER_RANK = 4
MAX_STEPS = 12


def write(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def gate(until: Callable[[], bool], here: bool) -> None:
    """Every rank waits (where ``here``) until ``until()``, then meets the others."""
    deadline = time.monotonic() + 120
    while here and not until() and time.monotonic() < deadline:
        time.sleep(0.02)
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("report_dir", type=Path)
    parser.add_argument("--gate-step", type=int)
    parser.add_argument("--sigterm-gate", type=int)
    opts = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 4, generator=g)
    data = TensorDataset(torch.arange(SAMPLES), x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]))
    sampler: DistributedSampler[int] = DistributedSampler(data, shuffle=True, seed=7)
    loader = DataLoader(data, batch_size=PER_RANK, sampler=sampler)
    per_epoch = len(loader)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    report = opts.report_dir / f"rank{rank}.jsonl"

    def save(directory: Path) -> None:
        if rank == 0:
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}
            torch.save(state, directory / "state.pt")

    def load(directory: Path) -> int:
        state = torch.load(directory / "state.pt", weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        return int(state["step"])

    with SpotCheckpoints(save=save, load=load, agree_interval=0.0, hold_timeout=120.0) as spot:
        step = spot.resume()
        session = spot.session
        assert session is not None
        write(report, {"resumed": step})
        while step < MAX_STEPS:
            epoch, skip = divmod(step, per_epoch)
            sampler.set_epoch(epoch)
            for i, (ids, xb, yb) in enumerate(loader):
                if i < skip:
                    continue
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                write(report, {"step": step, "ids": ids.tolist()})
                spot.step(step, loss=float(loss.item()))
                if step == opts.gate_step:
                    gate(lambda: session.channel.newest_id() != 0, rank == 0)
                if step == opts.sigterm_gate:
                    gate(lambda: session.sigterm, True)
                if step == MAX_STEPS:
                    break
    write(report, {"end": step})
    if rank == 0:
        torch.save(model.module.state_dict(), opts.report_dir / "final.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

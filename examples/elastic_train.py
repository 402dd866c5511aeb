"""A tiny elastic training script for torchrun on the CPU (gloo).

Each step averages gradients across every worker, rank 0 saves a checkpoint after each step
(temporary file, then an atomic rename), and a restarted worker resumes from it, so a job
whose membership changes keeps its progress. Every worker appends one JSON line per step to
``--progress`` (time, node, rank, world size, rendezvous round, step, loss): the tests, the
demo and the benchmarks read those lines.

The trainer-side checkpoint SDK (emergency saves, manifests, DCP) replaces the naive saving
here in a later step; this script exercises the rendezvous.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-time", type=float, default=0.2, help="seconds of fake compute a step")
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--progress", required=True, help="JSON-lines file every worker appends to")
    p.add_argument("--dim", type=int, default=32)
    return p.parse_args()


def append_line(path: str, record: dict[str, object]) -> None:
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)  # one write under PIPE_BUF bytes: lines never interleave
    finally:
        os.close(fd)


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo", timeout=timedelta(minutes=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    rdzv_round = int(os.environ.get("SPOTTRAIN_RDZV_ROUND", "-1"))
    node = os.environ.get("SPOTTRAIN_NODE_ID", os.uname().nodename)

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(args.dim, args.dim), torch.nn.Tanh(), torch.nn.Linear(args.dim, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ckpt = Path(args.ckpt_dir) / "state.pt"
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
    # Everyone resumes from what rank 0 loaded: the file may have moved on between reads.
    agreed = torch.tensor([start])
    dist.broadcast(agreed, src=0)
    start = int(agreed.item())
    for param in model.parameters():
        dist.broadcast(param.data, src=0)

    target = torch.nn.Linear(args.dim, 1)
    for step in range(start, args.steps):
        gen = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(16, args.dim, generator=gen)
        with torch.no_grad():
            y = target(x)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        if rank == 0:
            tmp = ckpt.with_suffix(".tmp")
            torch.save(
                {"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, tmp
            )
            os.replace(tmp, ckpt)
        append_line(
            args.progress,
            {
                "t": time.time(),
                "node": node,
                "rank": rank,
                "world": world,
                "round": rdzv_round,
                "step": step + 1,
                "loss": round(loss.item(), 6),
            },
        )
        time.sleep(args.step_time)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

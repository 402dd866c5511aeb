"""A small training loop that can be made to stall, for the dead man's switch tests.

Run under torchrun. Each step all-reduces a small model's gradient and calls the trainer SDK.
While ``--stall-file`` exists (any rank seeing it stalls every rank, agreed by an
all-reduce), each step first waits ``--stall-step-time`` seconds, as a loop starved of data
does: longer than the orphan timeout, it is a training that no longer progresses, yet its
workers still answer a checkpoint request at their next step. Global rank 0 appends each
step it trains to ``--progress``.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from spottrain.agent.sdk import ModelState, TrainSession


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--stall-file", required=True)
    p.add_argument("--progress", default="")
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--stall-step-time", type=float, default=4.0)
    p.add_argument("--every-steps", type=int, default=10_000)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = TrainSession(every_steps=args.every_steps)
    state = {"model": ModelState(model, opt)}
    step = session.restore(state)
    x = torch.ones(4, 8)
    while True:
        stall = torch.tensor([1 if os.path.exists(args.stall_file) else 0])
        dist.all_reduce(stall, op=dist.ReduceOp.MAX)
        time.sleep(args.stall_step_time if stall.item() else args.step_time)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        for param in model.parameters():
            assert param.grad is not None
            dist.all_reduce(param.grad)
        opt.step()
        step += 1
        if rank == 0 and args.progress:
            with open(args.progress, "a") as f:
                f.write(f"{step}\n")
        session.step(step, state)


if __name__ == "__main__":
    main()

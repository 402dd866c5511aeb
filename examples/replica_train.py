"""A tiny deterministic model trained in replica mode (``train.fault_tolerance: replica``).

Each replica (its own torchrun; one process here) trains a full copy; replicas sum their
gradients through spottrain's fault-tolerant all-reduce, driven by the trainer SDK's
``TrainSession(fault_tolerance="replica")`` (:mod:`spottrain.agent.sdk.replica_mode`): the
loop is the SDK's mode-neutral one (``begin_step``, ``commit``, ``end_step``).
Sample ``i`` is made from ``(seed, i)`` alone, and step ``s`` consumes samples
``[s * G, (s + 1) * G)`` split over the replicas taking part, so a step that is discarded
(a peer lost mid-step) and redone re-consumes the same samples, and the loss curve does not
depend on how many replicas computed it.

Every replica appends one JSON line per attempted step to ``--progress`` (committed or
discarded, participants, quorum id, the sample ids it computed, a digest of its parameters
after the step), and a line per event (start, restore, heal, leave).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import os
import signal
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from spottrain.agent.sdk import GlobalBatch, ModelState, RngState, TrainSession
from spottrain.protocol.env import ENV_REPLICA_ID


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every-steps", type=int, default=0, help="periodic checkpoint interval")
    p.add_argument("--ckpt-dir", default=os.environ.get("SPOTTRAIN_CKPT_DIR"))
    p.add_argument("--global-batch", type=int, default=32, help="samples per step")
    p.add_argument("--micro-batch", type=int, default=8, help="samples per forward pass")
    p.add_argument("--progress", help="JSON-lines file this replica appends to")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    p.add_argument("--ddp", action="store_true", help="wrap the model in DDP (comm hook)")
    p.add_argument(
        "--freeze-after-steps",
        type=int,
        default=-1,
        help="(tests) SIGSTOP this process just before the all-reduce of its Nth step taken "
        "part in (a VM that vanishes mid-step without closing its sockets)",
    )
    args = p.parse_args(argv)
    for flag in ("steps", "global_batch", "micro_batch"):
        if getattr(args, flag) <= 0:
            raise SystemExit(f"--{flag.replace('_', '-')} must be positive")
    return args


@functools.lru_cache(maxsize=4)
def teacher(seed: int, dim: int) -> torch.Tensor:
    """The map the targets come from (made once: it is the same for every sample)."""
    w = torch.Generator().manual_seed(seed)
    return torch.randn(dim, dim, generator=w) / dim**0.5


def sample(seed: int, index: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``index``: an input and its target, from ``(seed, index)`` alone."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    x = torch.randn(dim, generator=g)
    return x, torch.tanh(teacher(seed, dim) @ x)


def batch(seed: int, ids: range, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [sample(seed, i, dim) for i in ids]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def backward(net: nn.Module, args: argparse.Namespace, ids: range) -> float:
    """Forward and backward of one micro-batch; every sample weighs 1 / global batch. A
    replica with no share runs one sample at weight 0 (DDP's hooks must still fire)."""
    x, y = batch(args.seed, ids if len(ids) else range(1), args.dim)
    per_sample = ((net(x) - y) ** 2).mean(dim=1)
    loss = per_sample.sum() / args.global_batch * (1.0 if len(ids) else 0.0)
    loss.backward()
    return float(loss.detach())


def param_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


class Progress:
    def __init__(self, path: str | None, replica: str) -> None:
        self.path, self.replica = path, replica

    def write(self, **row: Any) -> None:
        if not self.path:
            return
        row = {"replica": self.replica, "t": time.time(), **row}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def build(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """The model, optimizer and LR schedule; the same initial weights on every replica."""
    torch.manual_seed(args.seed)
    model = nn.Sequential(
        nn.Linear(args.dim, args.hidden), nn.Tanh(), nn.Linear(args.hidden, args.dim)
    )
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)
    # Momentum buffers exist from the start, so a checkpoint's template has them.
    for p in model.parameters():
        opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return model, opt, sched


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    model, opt, sched = build(args)
    t_start = time.monotonic()
    # The mode comes from the job (train.fault_tolerance, $SPOTTRAIN_FAULT_TOLERANCE); this
    # example is replica mode's, so it asks for it.
    session = TrainSession(args.ckpt_dir, every_steps=args.every_steps, fault_tolerance="replica")
    state = {"model": ModelState(model, opt, sched), "rng": RngState()}
    replica = os.environ.get(ENV_REPLICA_ID, "replica")
    progress = Progress(args.progress if session.rank == 0 else None, replica)
    t0 = time.monotonic()
    step = session.restore(state)
    progress.write(
        event="start",
        step=step,
        pid=os.getpid(),
        digest=param_digest(model),
        restore_s=time.monotonic() - t0,  # 0 unless it loaded a disk checkpoint
        state_bytes=sum(p.numel() * p.element_size() for p in model.parameters()) * 2,
    )
    net = session.wrap_ddp(model) if args.ddp else model
    batch = GlobalBatch(args.global_batch, args.micro_batch, world=session.world, rank=session.rank)
    first_full = False
    taken_part = 0
    while step < args.steps:
        work = session.begin_step(batch)
        if work.healed:
            # The quorum's wait includes fetching and loading the live peer's state.
            progress.write(
                event="healed",
                step=work.step,
                since_start_s=time.monotonic() - t_start,
                heal_s=work.wait_s,
            )
        opt.zero_grad(set_to_none=False)
        loss_sum = 0.0
        micro = list(work) or [range(0)]
        for k, ids in enumerate(micro):
            # Under DDP only the last micro-batch's backward may reduce: every replica must
            # run the same collectives, however many micro-batches its share has.
            last = k == len(micro) - 1
            sync = contextlib.nullcontext() if last or not args.ddp else net.no_sync()
            with sync, session.compute():
                loss_sum += backward(net, args, ids)
        taken_part += int(work.participating)
        if work.participating and args.freeze_after_steps == taken_part:
            progress.write(event="freezing", step=work.step, pid=os.getpid())
            os.kill(os.getpid(), signal.SIGSTOP)
        # The loss crosses replicas with the gradients (under DDP: alone, after them).
        loss_t = torch.tensor([loss_sum])
        committed = session.commit([] if args.ddp else model.parameters(), extra=[loss_t])
        if committed:
            opt.step()
            sched.step()
        if args.step_time:
            time.sleep(args.step_time)
        if committed and not first_full and work.participating:
            first_full = True
            progress.write(
                event="first-step", step=work.step, since_start_s=time.monotonic() - t_start
            )
        progress.write(
            step=work.step,
            committed=committed,
            participants=work.participants,
            participant_rank=work.participant_rank,
            quorum_id=work.quorum_id,
            samples=work.samples,
            loss=float(loss_t[0]),
            discarded=session.discarded,
            quorum_wait_s=work.wait_s,
            digest=param_digest(model),
        )
        step = session.end_step(state, loss=float(loss_t[0]), participants=work.participants)
    progress.write(event="finished", step=step, digest=param_digest(model))
    session.finish(step, state)  # exits 0


if __name__ == "__main__":
    main()

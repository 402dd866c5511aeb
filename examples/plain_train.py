"""A plain torchrun training script that imports nothing of spottrain and still survives
preemptions: it catches SIGTERM and saves on its own, atomically.

With ``train.integration: plain`` the agent sends SIGTERM to the workers as soon as a
preemption notice comes, and they have the whole notice window less the agent's margin
to save. Only the workers of the preempted VM get the signal, so every step the ranks
agree (a one-integer all-reduce) on whether any of them got it; then all stop at the same
step, rank 0 writes the checkpoint to a temporary name, flushes it to disk, renames it
over the last one (atomic: a crash leaves the previous checkpoint whole), and the ranks that
got the signal exit 0. The others wait until their torchrun stops them for the next round
(it restarts its workers when the membership changes): had they exited 0 too, their
torchrun would count the training as done and wait minutes in its exit barrier for the
gone node before the job could go on. On start, it resumes from that file: the model, the
optimizer, and the data position (the step, from which the epoch and the batch follow).

Run it under torchrun (gloo on the CPU, NCCL on GPUs); on the local cloud:
``spottrain up examples/plain_job.yaml``. Checkpoints go to ``$SPOTTRAIN_CKPT_DIR``, the
shared checkpoint volume the agent sets on every VM. ``--sample-log DIR`` logs which
samples each rank trained on in each step (examples/sample_log.py; the end-to-end tests
read it).
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist
from sample_log import SampleLog
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

DIM = 32
STOP = {"sigterm": False}


def on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Only raise a flag: the loop saves at a step boundary, where the state is consistent.
    STOP["sigterm"] = True


def hold_until_stopped(timeout: float) -> None:
    """A rank whose node stays: wait for torchrun's SIGTERM (a new round), at most
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not STOP["sigterm"] and time.monotonic() < deadline:
        time.sleep(0.1)


def save_atomically(state: dict[str, object], path: Path) -> None:
    """Write ``state`` to ``path`` so that a crash at any instant leaves either the old
    file or the new one, whole: a temporary name, fsync, rename, fsync of the directory."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself reaches the disk
    finally:
        os.close(fd)


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is set on any rank (every rank calls it, every step)."""
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--save-every", type=int, default=25)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--step-time", type=float, default=0.0, help="sleep per step (demo)")
    parser.add_argument("--sample-log", type=Path, default=None)
    parser.add_argument("--hold-timeout", type=float, default=300.0, help="see hold_until_stopped")
    opts = parser.parse_args()
    signal.signal(signal.SIGTERM, on_sigterm)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    ckpt = Path(os.environ.get("SPOTTRAIN_CKPT_DIR", "checkpoints")) / "plain" / "state.pt"
    ckpt.parent.mkdir(parents=True, exist_ok=True)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(opts.samples, DIM, generator=g)
    # Each item carries its index, for the sample log only.
    data = TensorDataset(torch.arange(opts.samples), x, x @ torch.randn(DIM, 1, generator=g))
    sampler: DistributedSampler[int] = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=opts.batch, sampler=sampler, drop_last=True)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(DIM, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    samples = SampleLog(opts.sample_log, rank, dist.get_world_size())

    step = 0
    if ckpt.exists():  # only ever a whole file: see save_atomically
        state = torch.load(ckpt, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = int(state["step"])
    if rank == 0:
        print(f"starting at step {step}", flush=True)

    def save() -> None:
        if rank == 0:
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}
            save_atomically(state, ckpt)
        dist.barrier()

    while step < opts.steps:
        epoch, skip = divmod(step, len(loader))
        sampler.set_epoch(epoch)  # the same order as the run that saved
        for i, (ids, xb, yb) in enumerate(loader):
            if i < skip:
                continue  # the batches the checkpoint already trained on
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            samples.add(ids.tolist(), loss.item())
            samples.step_done(step)
            if opts.step_time > 0:
                time.sleep(opts.step_time)
            if any_rank(STOP["sigterm"]):
                save()
                if rank == 0:
                    print(f"SIGTERM: saved step {step}, exiting", flush=True)
                hold_until_stopped(opts.hold_timeout)
                dist.destroy_process_group()
                return
            if step % opts.save_every == 0 or step == opts.steps:
                save()
            if step == opts.steps:
                break
    if rank == 0:
        # No loss when it started at the last step (a node launched after the end).
        print(f"done at step {step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

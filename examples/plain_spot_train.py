"""A plain torchrun training loop of your own, protected by spottrain's ``SpotCheckpoints``.

The loop, the save and the load are the script's; spottrain adds one context manager around
them (docs/integrations.md, "Plain torchrun scripts"): on a notice every rank saves at the
same step into a directory that is then committed atomically (``step-N`` on the checkpoint
volume, with checksums), resume loads the newest complete one, and step, loss and world size
show in ``spottrain status``. Run it under torchrun (any world size; gloo on the CPU, NCCL on
GPUs); on the local cloud: ``spottrain up examples/plain_spot_job.yaml``.

The global batch is the same at every world size (a fixed batch of ``--global-batch``
samples per step, shared by the ranks in micro-batches of ``--per-device``, gradients
accumulated), and which samples a step trains on follows from the step alone: a run that
resumes after a node was lost, at any world size, trains on exactly the samples and batches
the uninterrupted run would have. ``--sample-log DIR`` logs which samples each rank trained
on in each step (examples/sample_log.py; the end-to-end tests read it).
"""

from __future__ import annotations

import argparse
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from sample_log import SampleLog
from torch.nn.parallel import DistributedDataParallel

from spottrain.agent.sdk.integrations.plain import SpotCheckpoints

DIM = 32


def epoch_order(epoch: int, samples: int) -> torch.Tensor:
    """The epoch's shuffled sample order, the same in every process (what
    ``DistributedSampler.set_epoch`` does, before it deals the order to the ranks)."""
    return torch.randperm(samples, generator=torch.Generator().manual_seed(1000 + epoch))


def micro_batches(
    step: int, rank: int, world: int, global_batch: int, per_device: int, samples: int
) -> list[torch.Tensor]:
    """The sample indices rank ``rank`` of ``world`` trains on in step ``step`` (counted
    from 0), one tensor per micro-batch.

    The step's global batch is a fixed slice of the epoch's order, and its micro-batches are
    dealt round-robin to the ranks. DistributedSampler deals the epoch itself by world size,
    so a position counted in its batches means other samples after a shrink; a fixed global
    batch split here means the same samples at every world size.
    """
    per_epoch = samples // global_batch  # the last partial batch of an epoch is dropped
    epoch, k = divmod(step, per_epoch)
    batch = epoch_order(epoch, samples)[k * global_batch : (k + 1) * global_batch]
    chunks = [batch[i : i + per_device] for i in range(0, global_batch, per_device)]
    return chunks[rank::world]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--per-device", type=int, default=2, help="samples per micro-batch")
    parser.add_argument("--save-every", type=int, default=25)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--step-time", type=float, default=0.0, help="sleep per step (demo)")
    parser.add_argument("--sample-log", type=Path, default=None)
    opts = parser.parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if opts.global_batch % (opts.per_device * world):
        parser.error(
            f"--global-batch {opts.global_batch} is not a multiple of --per-device "
            f"{opts.per_device} x world size {world}: choose one that every allowed world "
            "size divides"
        )

    g = torch.Generator().manual_seed(1)
    x = torch.randn(opts.samples, DIM, generator=g)
    y = torch.tanh(x @ torch.randn(DIM, 1, generator=g))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    model = DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    samples = SampleLog(opts.sample_log, rank, world)
    step = 0

    def save(directory: Path) -> None:  # every rank, the same empty directory on the volume
        if rank == 0:
            state = {"model": net.state_dict(), "opt": opt.state_dict(), "step": step}
            torch.save(state, directory / "state.pt")

    def load(directory: Path) -> int:  # every rank; return the step it restored
        state = torch.load(directory / "state.pt", weights_only=True)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        return int(state["step"])

    with SpotCheckpoints(save=save, load=load, save_every=opts.save_every) as spot:
        step = spot.resume()  # 0 when there is no complete checkpoint
        if rank == 0:
            print(f"starting at step {step} at world size {world}", flush=True)
        while step < opts.steps:
            parts = micro_batches(
                step, rank, world, opts.global_batch, opts.per_device, opts.samples
            )
            opt.zero_grad()
            losses = []
            for i, ids in enumerate(parts):
                # DDP averages the gradients over the ranks when the last micro-batch's
                # backward runs; the loss is scaled so the sum is the global batch's mean.
                last = i == len(parts) - 1
                with nullcontext() if last else model.no_sync():
                    loss = torch.nn.functional.mse_loss(model(x[ids]), y[ids])
                    (loss / len(parts)).backward()
                losses.append(loss.item())
                samples.add(ids.tolist(), losses[-1])
            opt.step()
            step += 1
            samples.step_done(step)
            if opts.step_time > 0:
                time.sleep(opts.step_time)
            spot.step(step, loss=sum(losses) / len(losses))
        spot.finish(step, save=True)  # the final weights, committed as step-N
    if rank == 0:
        print(f"done at step {step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

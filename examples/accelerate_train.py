"""A small regression model trained by an ordinary Accelerate loop, protected by spottrain.

spottrain adds one helper (``SpotAccelerate``): ``resume()`` loads the newest COMPLETE
checkpoint with ``accelerator.load_state`` (a torn one is skipped), ``batches()`` resumes
the epoch at the sample where the checkpoint stopped, ``step()`` reports progress and makes
every rank save at the same step on a notice (``accelerator.save_state``, committed
atomically), and ``global_batch`` keeps the samples per optimizer step the same at any
world size (gradient accumulation). Run it under torchrun (gloo on the CPU, NCCL on GPUs);
on the local cloud: ``spottrain up examples/accelerate_job.yaml``. ``--sample-log DIR``
logs which samples each rank trained on in each optimizer step (examples/sample_log.py; the
end-to-end tests read it).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from sample_log import SampleLog

from spottrain.agent.sdk.integrations.accelerate import SpotAccelerate

DIM = 32


class Regression(torch.utils.data.Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    """Sample ``i`` is the same in every process: a noisy linear target to learn; each item
    carries its index ``i`` for the sample log."""

    def __init__(self, samples: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(samples, DIM, generator=g)
        w = torch.randn(DIM, 1, generator=g)
        self.y = self.x @ w + 0.01 * torch.randn(samples, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--per-device", type=int, default=4)
    parser.add_argument("--save-every", type=int, default=25)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--step-time", type=float, default=0.0, help="sleep per step (demo)")
    parser.add_argument("--sample-log", type=Path, default=None)
    opts = parser.parse_args()

    torch.manual_seed(0)
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),  # on the CPU, one process per torchrun worker
        # An epoch's order from (seed, epoch) alone: a resumed run draws the same order.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=0),
    )
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = torch.utils.data.DataLoader(
        Regression(opts.samples), batch_size=opts.per_device, shuffle=True
    )
    model, opt, loader = accelerator.prepare(model, opt, loader)

    spot = SpotAccelerate(
        accelerator,
        global_batch=opts.global_batch,
        per_device=opts.per_device,
        save_every=opts.save_every,
    )
    samples = SampleLog(opts.sample_log, accelerator.process_index, accelerator.num_processes)
    step = spot.resume()  # 0 when there is no complete checkpoint
    while step < opts.steps:
        for ids, x, y in spot.batches(loader):  # the rest of this epoch, from where it stopped
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
            # Logged from the batch just trained on: the prepared loader fetches one batch
            # ahead, so a log in the dataset or sampler would name the next one.
            samples.add(ids.tolist(), loss.item())
            if not accelerator.sync_gradients:
                continue
            step += 1
            # Before spot.step: a rank that saves there on a notice exits at once.
            samples.step_done(step)
            spot.step(step, loss=float(loss.item()))
            if opts.step_time > 0:
                time.sleep(opts.step_time)
            if step == opts.steps:
                break
    spot.finish(step, save=True)
    accelerator.print(f"done at step {step}")


if __name__ == "__main__":
    main()

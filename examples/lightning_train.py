"""A tiny MLP regression trained by PyTorch Lightning on the CPU, protected by spottrain.

The script is an ordinary Lightning script: spottrain adds one callback
(``SpotTrainCallback``, which also keeps the global batch through
``accumulate_grad_batches`` and commits a checkpoint every ``--every-steps``), the resume
call (``last_checkpoint``, the newest COMPLETE checkpoint), and ``ResumableDataLoader`` (the
data position is in the checkpoint, so a resumed run sees no sample twice). Run it under
torchrun (any world size; gloo on the CPU); on the local cloud:
``spottrain up examples/lightning_job.yaml``.

The data is made here, deterministically (sample ``i`` the same in every process).
``--sample-log DIR`` logs which samples each rank trained on in each optimizer step
(examples/sample_log.py; the end-to-end tests read it).
Checkpoints are Lightning's own files, committed by spottrain as
``$SPOTTRAIN_CKPT_DIR/step-N/lightning.ckpt``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from sample_log import SampleLog

from spottrain.agent.sdk.integrations.lightning import (
    ResumableDataLoader,
    SpotTrainCallback,
    last_checkpoint,
)

FEATURES = 16


class Points(torch.utils.data.Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    """A smooth function of 16 inputs with a little noise, sample ``i`` seeded by ``i``; each
    item carries its index ``i`` for the sample log."""

    def __init__(self, samples: int) -> None:
        self.samples = samples
        self.w = torch.linspace(-1.0, 1.0, FEATURES)

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(FEATURES, generator=g)
        y = torch.sin(x @ self.w) + 0.05 * torch.randn((), generator=g)
        return i, x, y


class Regressor(pl.LightningModule):
    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch  # the indices are for the sample log only
        loss = torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Pace(pl.Callback):
    """Sleeps after each batch, so that a demo on a fast CPU lasts long enough to watch a
    preemption (``--step-time``)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, *args: Any) -> None:
        time.sleep(self.seconds)


class LogSamples(pl.Callback):
    """``--sample-log``: each micro-batch's indices and loss, written when the optimizer step
    they belong to has run. Listed before SpotTrainCallback, so that a step is logged before
    a drain's checkpoint at that step lets the rank exit."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self.log = SampleLog(None, 0, 1)
        self.step = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.log = SampleLog(self.directory, trainer.global_rank, trainer.world_size)
        self.step = trainer.global_step  # the step resumed from

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Lightning hands over the loss divided by the accumulation (what backward saw).
        loss = float(outputs["loss"]) * trainer.accumulate_grad_batches
        self.log.add(batch[0].tolist(), loss)
        if trainer.global_step != self.step:  # this micro-batch ended an optimizer step
            self.step = trainer.global_step
            self.log.step_done(self.step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--per-device", type=int, default=2)
    parser.add_argument("--every-steps", type=int, default=25)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--step-time", type=float, default=0.0)
    parser.add_argument("--sample-log", type=Path, default=None)
    opts = parser.parse_args()
    pl.seed_everything(0, workers=True)
    callbacks: list[pl.Callback] = [
        LogSamples(opts.sample_log),
        # The same global batch at any world size (accumulate_grad_batches follows it),
        # and a committed checkpoint every --every-steps steps for a VM lost without notice.
        SpotTrainCallback(global_batch=opts.global_batch, every_steps=opts.every_steps),
    ]
    if opts.step_time > 0:
        callbacks.append(Pace(opts.step_time))
    root = os.environ.get("SPOTTRAIN_CKPT_DIR", "checkpoints")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("WORLD_SIZE", "1"))
        // int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_steps=opts.steps,
        # Lightning's logs (and any ModelCheckpoint of its own) on the volume too.
        default_root_dir=os.path.join(root, "lightning"),
        enable_checkpointing=False,  # spottrain's commits are the checkpoints
        enable_progress_bar=False,
        log_every_n_steps=5,
        callbacks=callbacks,
    )
    loader = ResumableDataLoader(
        Points(opts.samples), batch_size=opts.per_device, shuffle=True, seed=0
    )
    # The newest COMPLETE checkpoint (None: start fresh).
    trainer.fit(Regressor(opts.steps), train_dataloaders=loader, ckpt_path=last_checkpoint())


if __name__ == "__main__":
    main()

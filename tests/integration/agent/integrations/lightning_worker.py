"""A tiny regression trained by PyTorch Lightning with spottrain's callback, one torchrun
worker of a test (tests/integration/agent/integrations/test_lightning.py).

Usage: lightning_worker.py REPORT_DIR [--gate-step K | --sigterm-step K] [--resume]
       [--every-steps N]

Every rank writes REPORT_DIR/rank<R>.jsonl: ``{"start": step}`` (the step Lightning
restored), one line per checkpoint Lightning writes (``{"save": step}``) and
``{"end": step}``; REPORT_DIR/seen<R>.json holds the sample ids each rank trained on; rank 0
writes REPORT_DIR/final.pt, the final weights.

With ``--gate-step K`` every rank waits at step K, after spottrain's callback reported and
agreed on it, until rank 0's session has read a checkpoint request from Redis (the test
writes it once it sees step K): a deterministic meeting point, not a pace. The request then
reaches the agreement started at step K + 1 and is acted on at step K + 2.
``--sigterm-step K`` is the same with no request: at step K rank 0 sends SIGTERM to
torchrun, which passes it on to every worker, and every rank waits until spottrain's session
has seen it (a VM stopped with no notice). With ``--resume``, ``fit`` resumes from
``last_checkpoint()``; ``--every-steps N`` is the callback's ``every_steps``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

from spottrain.agent.sdk.integrations.lightning import (
    ResumableDataLoader,
    SpotTrainCallback,
    last_checkpoint,
)

SAMPLES = 64
PER_DEVICE = 2
GLOBAL_BATCH = 8  # 2 per device x 2 ranks x accumulate 2
MAX_STEPS = 12  # 16 batches an epoch per rank, 8 steps: the run crosses an epoch


class Rows(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(SAMPLES, 4, generator=g)
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(
            SAMPLES, generator=g
        )

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class Regression(pl.LightningModule):
    def __init__(self, seen: list[int]) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.seen = seen

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, ids = batch
        self.seen.extend(int(i) for i in ids)
        return torch.nn.functional.mse_loss(self.layer(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.05)


class Report(pl.Callback):
    """Records what this rank did, and holds every rank at the gate step (after
    spottrain's callback reported and agreed on it)."""

    def __init__(self, out: Path, spot: SpotTrainCallback, gate: int | None, sigterm: bool) -> None:
        self.path = out / f"rank{int(os.environ.get('RANK', '0'))}.jsonl"
        self.spot = spot
        self.gate = gate
        self.sigterm = sigterm

    def write(self, row: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.write({"start": trainer.global_step, "accumulate": trainer.accumulate_grad_batches})

    def on_save_checkpoint(self, trainer: pl.Trainer, *args: Any) -> None:
        # Lightning asks every rank for its callbacks' state as it writes a checkpoint: the
        # drain's commit that follows never returns to this callback's next hook.
        self.write({"save": trainer.global_step})

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        session = self.spot.session
        assert session is not None
        if trainer.global_step == self.gate and self.spot.last_step == self.gate:
            self.gate = None
            if self.sigterm:
                dist.barrier()  # every rank has started its step-K agreement without it
                if session.rank == 0:
                    os.kill(os.getppid(), signal.SIGTERM)
            deadline = time.monotonic() + 120
            while not self.arrived(session) and time.monotonic() < deadline:
                time.sleep(0.02)
            if not self.sigterm:
                dist.barrier()

    def arrived(self, session: Any) -> bool:
        if self.sigterm:
            return bool(session.sigterm)
        return bool(session.rank != 0 or session.channel.newest_id() > 0)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.write({"end": trainer.global_step})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("report_dir", type=Path)
    parser.add_argument("--gate-step", type=int)
    parser.add_argument("--sigterm-step", type=int)
    parser.add_argument("--every-steps", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    opts = parser.parse_args()
    pl.seed_everything(0, workers=True)
    seen: list[int] = []
    model = Regression(seen)
    # Every step agrees (a request is acted on at the next step).
    spot = SpotTrainCallback(
        global_batch=GLOBAL_BATCH,
        every_steps=opts.every_steps,
        agree_interval=0.0,
        hold_timeout=60.0,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_steps=MAX_STEPS,
        deterministic=True,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[
            spot,
            Report(
                opts.report_dir,
                spot,
                opts.gate_step or opts.sigterm_step,
                opts.sigterm_step is not None,
            ),
        ],
    )
    loader = ResumableDataLoader(Rows(), batch_size=PER_DEVICE, shuffle=True, seed=0)
    ckpt = last_checkpoint() if opts.resume else None
    trainer.fit(model, train_dataloaders=loader, ckpt_path=ckpt)
    rank = trainer.global_rank
    (opts.report_dir / f"seen{rank}.json").write_text(json.dumps(seen))
    if rank == 0:
        torch.save(model.state_dict(), opts.report_dir / "final.pt")


if __name__ == "__main__":
    main()

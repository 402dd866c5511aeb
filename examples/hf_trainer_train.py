"""A tiny GPT-2 trained by the Hugging Face ``Trainer`` on the CPU, protected by spottrain.

The script is an ordinary ``Trainer`` script: spottrain adds one callback
(``SpotTrainCallback``), the resume call (``last_checkpoint``, which never picks a torn
``checkpoint-N``), and ``accumulation_steps`` (the global batch stays the same whatever the
world size torchrun gives). Run it under torchrun (any world size; gloo on the CPU); on the
local cloud: ``spottrain up examples/hf_job.yaml``.

The model is built from a small config (no download) and the data is made here,
deterministically: token rows with a pattern to learn, sample ``i`` the same in every
process. Checkpoints are the Trainer's own, in ``$SPOTTRAIN_CKPT_DIR``. ``--sample-log DIR``
logs which samples each rank trained on in each optimizer step (examples/sample_log.py; the
end-to-end tests read it).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch
from sample_log import SampleLog
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from spottrain.agent.sdk.integrations.hf import (
    SpotTrainCallback,
    accumulation_steps,
    last_checkpoint,
)

VOCAB = 64
SEQ = 32


class Patterns(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Rows of an arithmetic pattern (start and stride from the sample's index) with a
    little noise: a causal LM learns to continue them. Each item carries its index ``i``
    for the sample log."""

    def __init__(self, samples: int) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        start, stride = i % VOCAB, 1 + (i // VOCAB) % 7
        row = (start + stride * torch.arange(SEQ)) % VOCAB
        noise = torch.rand(SEQ, generator=g) < 0.05
        row = torch.where(noise, torch.randint(0, VOCAB, (SEQ,), generator=g), row)
        return {"input_ids": row, "labels": row, "index": torch.tensor(i)}


class SampleLoggingTrainer(Trainer):
    """A ``Trainer`` that logs each micro-batch it trains on (``--sample-log``): a callback
    gets no batch, and the batches the dataloader fetches run ahead of training (a step's
    micro-batches all at once, and accelerate one more), so the log is kept where the
    micro-batch is trained. The index leaves the batch before the model sees it."""

    def __init__(self, *args: Any, sample_log: SampleLog, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.sample_log = sample_log

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        index = inputs.pop("index")
        loss = super().training_step(model, inputs, num_items_in_batch)
        # The Trainer returns the micro-batch's share of the rank's step loss (its summed
        # token losses over the rank's tokens in the step); rows are of one length, so
        # times the micro-batches per step this is the micro-batch's mean.
        mean = float(loss) * self.current_gradient_accumulation_steps
        self.sample_log.add(index.tolist(), mean)
        return loss


class StepDone(TrainerCallback):
    """Writes the step's sample-log line once its optimizer step is done (every micro-batch
    trained; a save, on a notice too, comes after ``on_step_end``)."""

    def __init__(self, sample_log: SampleLog) -> None:
        self.sample_log = sample_log

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.sample_log.step_done(state.global_step)


class Pace(TrainerCallback):
    """Sleeps after each step, so that a demo on a fast CPU lasts long enough to watch a
    preemption (``--step-time``)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        time.sleep(self.seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--per-device", type=int, default=2)
    parser.add_argument("--save-steps", type=int, default=25)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--step-time", type=float, default=0.0)
    parser.add_argument("--sample-log", type=Path, default=None)
    parser.add_argument(
        "--output-dir",
        type=Path,
        # On the checkpoint volume (any folder under it): what is saved elsewhere is lost
        # with the VM.
        default=Path(os.environ.get("SPOTTRAIN_CKPT_DIR", "checkpoints")),
    )
    opts = parser.parse_args()
    args = TrainingArguments(
        output_dir=str(opts.output_dir),
        per_device_train_batch_size=opts.per_device,
        # The same global batch at any world size: a resumed run continues the same
        # optimisation from the same sample.
        gradient_accumulation_steps=accumulation_steps(opts.global_batch, opts.per_device),
        max_steps=opts.steps,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=10,
        logging_steps=5,
        save_strategy="steps",
        save_steps=opts.save_steps,
        save_total_limit=3,
        report_to="none",
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        # Keep the items' "index" (not a model input) for SampleLoggingTrainer to take out.
        remove_unused_columns=False,
    )
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    sample_log = SampleLog(opts.sample_log, args.process_index, args.world_size)
    callbacks: list[TrainerCallback] = [StepDone(sample_log), SpotTrainCallback()]
    if opts.step_time > 0:
        callbacks.append(Pace(opts.step_time))
    trainer = SampleLoggingTrainer(
        model=GPT2LMHeadModel(config),  # type: ignore[no-untyped-call]
        args=args,
        train_dataset=Patterns(opts.samples),
        callbacks=callbacks,
        sample_log=sample_log,
    )
    # The newest COMPLETE checkpoint (None: start fresh); transformers' own
    # resume_from_checkpoint=True could pick one a preemption left half written.
    trainer.train(resume_from_checkpoint=last_checkpoint(args.output_dir))


if __name__ == "__main__":
    main()

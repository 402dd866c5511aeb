"""A tiny GPT-2 trained by the Hugging Face Trainer with spottrain's callback, one torchrun
worker of a test (tests/integration/agent/integrations/test_hf_trainer.py).

Usage: hf_worker.py OUTPUT_DIR REPORT_DIR [--gate-step K] [--resume]

Every rank writes REPORT_DIR/rank<R>.jsonl: one line per save (``{"save": step}``), per
logged loss (``{"step": step, "loss": loss}``) and, at the end, ``{"end": step}``; rank 0
writes REPORT_DIR/final.pt, the final weights. With ``--gate-step K`` every rank waits at
step K, after spottrain's callback reported it and agreed, until rank 0's session has read a
checkpoint request from Redis (the test writes it once it sees step K): a deterministic
meeting point, not a pace. The request then reaches the agreement started at step K + 1 and
is acted on at step K + 2. With ``--resume`` the Trainer resumes from
``last_checkpoint(OUTPUT_DIR)``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
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

SEQ = 16
VOCAB = 64
SAMPLES = 64
MAX_STEPS = 12
GLOBAL_BATCH = 8
PER_DEVICE = 2
SAVE_STEPS = 5


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)  # type: ignore[no-untyped-call]


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Deterministic token rows: sample i is the same in every process."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.rows = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class Report(TrainerCallback):
    """Records what this rank did (before spottrain's callback: after a drain commit, its
    ``on_save`` does not return)."""

    def __init__(self, out: Path) -> None:
        self.path = out / f"rank{int(os.environ.get('RANK', '0'))}.jsonl"

    def write(self, row: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.write({"save": state.global_step})

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.write({"end": state.global_step})

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kw: Any,
    ) -> None:
        if logs and "loss" in logs:
            self.write({"step": state.global_step, "loss": logs["loss"]})


class Gate(TrainerCallback):
    """Holds every rank at the gate step (after spottrain's callback reported and agreed on
    it) until rank 0's spottrain session has read the test's checkpoint request."""

    def __init__(self, spot: SpotTrainCallback, gate: int | None) -> None:
        self.spot = spot
        self.gate = gate

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if state.global_step != self.gate:
            return
        session = self.spot.session
        assert session is not None
        if session.rank == 0:
            deadline = time.monotonic() + 120
            while session.channel.newest_id() == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
        dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("report_dir", type=Path)
    parser.add_argument("--gate-step", type=int)
    parser.add_argument("--resume", action="store_true")
    opts = parser.parse_args()
    args = TrainingArguments(
        output_dir=str(opts.output_dir),
        per_device_train_batch_size=PER_DEVICE,
        gradient_accumulation_steps=accumulation_steps(GLOBAL_BATCH, PER_DEVICE),
        max_steps=MAX_STEPS,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        report_to="none",
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    # Every step agrees (a request is acted on at the next step), and the rank that was not
    # SIGTERM'd waits long enough for the test's agent to stop it after a drain.
    spot = SpotTrainCallback(agree_interval=0.0, hold_timeout=120.0)
    trainer = Trainer(
        model=tiny_gpt2(),
        args=args,
        train_dataset=Tokens(),
        callbacks=[Report(opts.report_dir), spot, Gate(spot, opts.gate_step)],
    )
    resume = last_checkpoint(opts.output_dir) if opts.resume else None
    trainer.train(resume_from_checkpoint=resume)
    if trainer.is_world_process_zero():
        assert trainer.model is not None
        torch.save(trainer.model.state_dict(), opts.report_dir / "final.pt")


if __name__ == "__main__":
    main()

"""The Hugging Face ``Trainer`` integration: one callback and one resume call.

::

    from spottrain.agent.sdk.integrations.hf import (
        SpotTrainCallback, accumulation_steps, last_checkpoint,
    )

    args = TrainingArguments(
        output_dir=os.path.join(os.environ["SPOTTRAIN_CKPT_DIR"], "hf"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulation_steps(global_batch=32, per_device=4),
        ...,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[SpotTrainCallback()])
    trainer.train(resume_from_checkpoint=last_checkpoint(args.output_dir))

**On a notice.** The agent's checkpoint request (or a SIGTERM on any rank) is agreed on by
every rank at one step (see :mod:`.core`); at that step the callback sets
``control.should_save``, so the Trainer's own ``_save_checkpoint`` writes
``checkpoint-N`` in its own format (model, optimizer, scheduler, RNG states, and
``trainer_state.json`` with the step, from which it finds its data position), and
``on_save`` commits it in place: every file's CRC32 in a ``MANIFEST.json`` written durably
last, fenced like the SDK's commits and reported to Redis, where the agent's drain waits for
it. The Trainer's own periodic saves are committed the same way. After a drain save, ranks
that got SIGTERM exit 0 and the others hold until torchrun restarts them.

**Resume.** ``trainer.train(resume_from_checkpoint=True)`` takes transformers'
``get_last_checkpoint``, the ``checkpoint-N`` with the highest N, even one a crash left half
written. :func:`last_checkpoint` takes the newest one whose manifest verifies and sets the
newer torn ones aside (``.torn-checkpoint-N-*``). The step reported to the run
(``steps lost``) is the one the Trainer restored (its ``state.global_step``).

**The global batch.** The Trainer's global batch is ``per_device_train_batch_size x
gradient_accumulation_steps x world size``, fixed when the ``Trainer`` is made: when the
world changes it changes with it, and the data position it resumes (skipping ``step x
gradient_accumulation_steps`` batches on every rank) then points elsewhere. It reads
``gradient_accumulation_steps`` before any callback runs, so the callback cannot change it
safely; :func:`accumulation_steps` computes it from the global batch wanted and the world
size torchrun gives, and with it a resumed run continues the same optimisation from the same
sample (Accelerate deals batch ``j`` to rank ``j mod world``, so step ``s`` consumes samples
``[s x global, (s + 1) x global)`` of the epoch's order at any world size). The callback
warns, with the figures, when a resumed run's global batch differs from its checkpoint's.

**Elastic only**: the Trainer owns its loop and process group, so replica mode's torchft
wrappers cannot run in it (``validate`` refuses ``integration: hf`` with replica mode).
"""

from __future__ import annotations

import logging
import os
import weakref
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from spottrain.protocol.env import ENV_CKPT_DIR

from ...checkpoint.manifest import Manifest, ManifestError
from .core import (
    FrameworkSession,
    SaveOrder,
    accumulation_for,
    check_inside,
    find_complete,
    resolve_root,
    warn_version,
)

log = logging.getLogger("spottrain.sdk.integrations.hf")

PREFIX = "checkpoint-"  # transformers' PREFIX_CHECKPOINT_DIR
OUTPUT_DIR_SETTING = "TrainingArguments(output_dir=...)"

# The trainings (by their TrainerState, made anew by each train() call; unhashable, so by
# id with a weak reference to tell a reused id) that already have a spottrain callback: a
# second one would agree, save and commit twice.
_ATTACHED: dict[int, tuple[weakref.ref[TrainerState], SpotTrainCallback]] = {}


def claim_training(state: TrainerState, callback: SpotTrainCallback) -> SpotTrainCallback | None:
    """Mark ``state``'s training as having ``callback``; the callback it already had, if
    any (then nothing changes)."""
    for key in [k for k, (ref, _) in _ATTACHED.items() if ref() is None]:
        del _ATTACHED[key]
    held = _ATTACHED.get(id(state))
    if held is not None and held[0]() is state:
        return held[1]
    _ATTACHED[id(state)] = (weakref.ref(state), callback)
    return None


class CallbackAttachedTwiceError(RuntimeError):
    """Two spottrain callbacks (or one added twice) on one Trainer."""


def accumulation_steps(global_batch: int, per_device: int, world: int | None = None) -> int:
    """``gradient_accumulation_steps`` that keep the global batch at ``global_batch`` with
    ``per_device`` samples per device and ``world`` ranks (default ``$WORLD_SIZE``, which
    torchrun sets, else 1). Pass it to ``TrainingArguments`` (see the module docstring).

    Raises:
        ValueError: a size is not positive, or ``global_batch`` is not a multiple of
            ``per_device x world`` (the message gives the figures and the nearest fits).
    """
    w = world if world is not None else int(os.environ.get("WORLD_SIZE", "1"))
    return accumulation_for(global_batch, per_device, w, "gradient_accumulation_steps")


def last_checkpoint(output_dir: str | os.PathLike[str]) -> str | None:
    """The newest COMPLETE ``checkpoint-N`` in ``output_dir`` (its manifest and every
    file's checksum verify), for ``trainer.train(resume_from_checkpoint=...)``; None when
    there is none (start fresh). Newer incomplete ones are set aside as
    ``.torn-checkpoint-N-*``, where transformers' own ``get_last_checkpoint`` would have
    picked them.

    Decided by rank 0 and the same on every rank when torch.distributed is initialized
    (call it after making ``TrainingArguments``, which sets it up under torchrun); before,
    every process reads the same directory and comes to the same answer.

    Raises:
        CheckpointPathError: ``$SPOTTRAIN_CKPT_DIR`` is set and ``output_dir`` is outside it.
    """
    root = os.environ.get(ENV_CKPT_DIR)
    if root:
        check_inside(output_dir, Path(root), OUTPUT_DIR_SETTING)
    found = find_complete(output_dir, PREFIX)
    if found is None:
        return None
    for name, why in found.skipped:
        log.warning("resume skipped %s: %s", name, why)
    return str(found.path)


def output_dir_of(args: TrainingArguments) -> Path:
    """Where the Trainer writes its ``checkpoint-N`` (its ``output_dir``; transformers'
    default when unset)."""
    return Path(args.output_dir or "trainer_output")


class SpotTrainCallback(TrainerCallback):
    """spottrain's checkpoint on a notice, commit, resume check and progress for a
    ``Trainer`` (see the module docstring). Add it once: ``callbacks=[SpotTrainCallback()]``
    or ``trainer.add_callback(SpotTrainCallback())``.

    Args:
        ckpt_dir: The checkpoint volume (default ``$SPOTTRAIN_CKPT_DIR``); the Trainer's
            ``output_dir`` must be inside it.
        **options: Passed to :class:`~.core.FrameworkSession` (``hold_timeout``,
            ``agree_interval``, ``stuck_grace``, ``redis_url``, ``run_id``, ...).

    Raises (when training starts):
        CallbackAttachedTwiceError: it is on the Trainer twice.
        CheckpointPathError: ``output_dir`` is outside the checkpoint volume.
    """

    def __init__(self, ckpt_dir: str | os.PathLike[str] | None = None, **options: Any) -> None:
        self.ckpt_dir = ckpt_dir
        self.options = options
        self.session: FrameworkSession | None = None
        self.order: SaveOrder | None = None
        self.global_batch = 0

    # -- start and end ------------------------------------------------------------------------
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        first = claim_training(state, self)
        if first is not None:
            if first.session is not None:  # stop the first one's threads: training ends here
                first.session.close()
            raise CallbackAttachedTwiceError(
                "spottrain's SpotTrainCallback is attached to this Trainer twice: every save "
                "would be agreed and committed twice; pass it once (in callbacks=[...] or one "
                "trainer.add_callback(...), not both)"
            )
        warn_version("transformers", "hf")
        if args.save_only_model:
            log.warning(
                "TrainingArguments(save_only_model=True): checkpoints hold no optimizer, "
                "scheduler or data position, so a resume after a preemption does not continue "
                "the same training; unset save_only_model"
            )
        # Before the session: a bad output_dir stops training with nothing started.
        root = resolve_root(self.ckpt_dir)
        check_inside(output_dir_of(args), root, OUTPUT_DIR_SETTING)
        session = FrameworkSession("hf", root, **self.options)
        self.session = session
        self.global_batch = (
            args.per_device_train_batch_size * args.gradient_accumulation_steps * session.world
        )
        manifest = None
        if state.global_step > 0:
            manifest = self._restored_manifest(args, state.global_step)
        # The step the Trainer restored (its own state), not our reading of the directory.
        session.report_restore(state.global_step, manifest)

    def _restored_manifest(self, args: TrainingArguments, step: int) -> Manifest | None:
        try:
            manifest = Manifest.read(output_dir_of(args) / f"{PREFIX}{step}")
        except ManifestError as exc:
            log.warning(
                "the Trainer resumed step %d from a checkpoint without a valid manifest (%s): "
                "resume with last_checkpoint(output_dir), which never picks a torn one",
                step,
                exc,
            )
            return None
        before = manifest.extra.get("global_batch")
        if before and before != self.global_batch:
            log.warning(
                "global batch changed from %s (world size %d) to %d (world size %d): the "
                "Trainer continues another optimisation, and its data position is off; pass "
                "gradient_accumulation_steps=accumulation_steps(global_batch=%s, "
                "per_device=...) to TrainingArguments",
                before,
                manifest.world_size,
                self.global_batch,
                self.session.world if self.session else 0,
                before,
            )
        return manifest

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self.session is not None:
            self.session.finish(state.global_step)
            self.session = None
        _ATTACHED.pop(id(state), None)

    # -- every step ---------------------------------------------------------------------------
    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> TrainerControl:
        session = self.session
        if session is None:
            return control
        order = session.step(state.global_step)
        if order is not None:
            self.order = order
            control.should_save = True  # the Trainer writes checkpoint-N right after this
        if control.should_save:
            session.begin_save()
        return control

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kw: Any,
    ) -> None:
        if self.session is None:
            return
        self.session.touch()
        if logs and isinstance(logs.get("loss"), int | float):
            self.session.report_metrics(state.global_step, loss=float(logs["loss"]))

    def on_prediction_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self.session is not None:
            self.session.touch()  # evaluation is progress: after SIGTERM, not a stuck loop

    # -- the commit ---------------------------------------------------------------------------
    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        session = self.session
        if session is None:
            return
        step = state.global_step
        order = self.order if self.order is not None and self.order.step == step else None
        self.order = None
        if order is None:  # the Trainer's own schedule, which saves the last step too
            order = SaveOrder(step, "final" if step >= state.max_steps > 0 else "periodic")
        path = output_dir_of(args) / f"{PREFIX}{step}"
        result = session.commit_in_place(path, order, extra={"global_batch": self.global_batch})
        session.after_commit(result)

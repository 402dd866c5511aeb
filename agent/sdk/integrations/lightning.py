"""The PyTorch Lightning integration: one callback and one resume call.

::

    from spottrain.agent.sdk.integrations.lightning import (
        ResumableDataLoader, SpotTrainCallback, last_checkpoint,
    )

    loader = ResumableDataLoader(dataset, batch_size=4, shuffle=True, seed=0)
    spot = SpotTrainCallback(global_batch=32, every_steps=500)
    trainer = Trainer(strategy="ddp", callbacks=[spot], ...)
    trainer.fit(model, train_dataloaders=loader, ckpt_path=last_checkpoint())

**On a notice.** The agent's checkpoint request (or a SIGTERM on any rank) is agreed on by
every rank at one optimizer step (see :mod:`.core`); at that step every rank calls
Lightning's own ``trainer.save_checkpoint`` into a temporary directory of the checkpoint
volume (Lightning's format: weights, optimizers, schedulers, loops' progress, callbacks'
and the data position of a stateful dataloader), and the callback commits it as
``step-N/lightning.ckpt`` with a manifest of checksums, fenced and reported to Redis, where
the agent's drain waits for it. After a drain save, ranks that got SIGTERM exit 0 and the
others hold until torchrun restarts them. Lightning's own SIGTERM handling (a broadcast
from inside the signal handler, then the end of ``fit``) is set aside while training runs:
a SIGTERM becomes an emergency checkpoint instead.

**Resume.** :func:`last_checkpoint` is the newest ``step-N`` whose manifest and files
verify (a torn newer one is skipped), for ``trainer.fit(ckpt_path=...)``; ``steps lost`` is
counted from the step Lightning restored (``trainer.global_step`` once it loaded).

**Data position.** Lightning restores its loops' progress, but a plain ``DataLoader``
starts its epoch again from the first batch: the epoch's first batches are seen twice and
its last ones never. :class:`ResumableDataLoader` keeps the position in Lightning's
checkpoint (Lightning saves and restores a dataloader that has ``state_dict`` /
``load_state_dict``), as a count of the epoch's samples consumed by all ranks, and its
sampler deals the rest of the epoch's order (the same order as Lightning's
``DistributedSampler``) to the ranks of the new world.

**The global batch** is ``per-device batch x devices x nodes x accumulate_grad_batches``.
With ``SpotTrainCallback(global_batch=...)`` the callback sets ``accumulate_grad_batches``
from the world size before the first batch, so a resumed run on fewer nodes continues the
same optimisation; without it, it warns with the figures when a resumed run's global batch
differs from its checkpoint's.

**Elastic only**: Lightning owns its loop and process group, so replica mode's torchft
wrappers cannot run in it.
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from collections.abc import Iterator, Sized
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ...checkpoint import dcp_io
from ...checkpoint.directory import CheckpointDir
from ...checkpoint.files import CheckpointDirError
from ...checkpoint.manifest import Manifest, ManifestError
from .core import (
    CheckpointPathError,
    CommitResult,
    FrameworkSession,
    SaveOrder,
    accumulation_for,
    outside_root,
    resolve_root,
    warn_version,
)

log = logging.getLogger("spottrain.sdk.integrations.lightning")

CKPT_FILE = "lightning.ckpt"  # Lightning's checkpoint inside a committed step-N


class CallbackAttachedTwiceError(RuntimeError):
    """Two spottrain callbacks (or one added twice) on one Trainer."""


# -- pure parts ---------------------------------------------------------------------------------


def batch_change_warning(before: int, before_world: int, now: int, world: int) -> str | None:
    """What to say when a resumed run's global batch (``now`` at ``world`` ranks) differs
    from its checkpoint's (``before`` at ``before_world``); None when the same."""
    if not before or before == now:
        return None
    return (
        f"global batch changed from {before} (world size {before_world}) to {now} (world size "
        f"{world}): Lightning continues another optimisation; pass "
        f"SpotTrainCallback(global_batch={before}) so that accumulate_grad_batches keeps it"
    )


def count_spottrain_callbacks(callbacks: list[Any]) -> int:
    """How many spottrain callbacks a Trainer holds (one object listed twice counts twice)."""
    return sum(isinstance(c, SpotTrainCallback) for c in callbacks)


def loss_of(outputs: Any, metrics: dict[str, Any]) -> float | None:
    """The step's loss: ``training_step``'s output (a tensor or ``{"loss": ...}``), else a
    logged ``loss`` / ``train_loss`` in ``trainer.callback_metrics``; None when neither."""
    value = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if value is None:
        value = metrics.get("loss", metrics.get("train_loss"))
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach().item())
    if isinstance(value, int | float):
        return float(value)
    return None


def order_at(step: int, agreed: SaveOrder | None, every_steps: int) -> SaveOrder | None:
    """The save to make at ``step``: the agreed one, else a periodic one every
    ``every_steps`` steps (0: never), the same on every rank."""
    if agreed is not None:
        return agreed
    if every_steps and step % every_steps == 0:
        return SaveOrder(step, "periodic")
    return None


def epoch_order(size: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The epoch's sample order, as ``DistributedSampler`` draws it."""
    if not shuffle:
        return list(range(size))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(size, generator=g).tolist()


def rank_share(order: list[int], start: int, rank: int, world: int, drop_last: bool) -> list[int]:
    """``rank``'s samples of what is left of ``order`` after the first ``start`` (consumed by
    all ranks together): the rest dealt round-robin, padded (or cut) to a multiple of
    ``world`` as ``DistributedSampler`` does, so that at ``start`` 0 it deals the same."""
    rest = order[start:]
    if drop_last:
        rest = rest[: len(rest) - len(rest) % world]
    elif rest and len(rest) % world:
        pad = world - len(rest) % world
        rest += (rest * math.ceil(pad / len(rest)))[:pad]
    return rest[rank::world]


# -- the data position --------------------------------------------------------------------------
class ResumableSampler(DistributedSampler[int]):
    """``DistributedSampler``'s order, resumable at a position in the epoch (the samples all
    ranks consumed), at any world size. Lightning keeps a ``DistributedSampler`` it is given
    (it replaces only the default samplers), and calls ``set_epoch`` every epoch."""

    def __init__(
        self,
        dataset: Sized,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_replicas is None:
            num_replicas = world_now()
        if rank is None:
            rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        super().__init__(
            dataset,  # type: ignore[arg-type]
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.start = 0  # the epoch's samples consumed before this iteration, by all ranks

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.start = 0  # a new epoch starts at its first sample
        super().set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        order = epoch_order(len(self.dataset), self.epoch, self.seed, self.shuffle)  # type: ignore[arg-type]
        return iter(rank_share(order, self.start, self.rank, self.num_replicas, self.drop_last))


def world_now() -> int:
    """The world size: torch.distributed's, else ``$WORLD_SIZE`` (torchrun sets it)."""
    return (
        dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    )


class ResumableDataLoader(DataLoader[Any]):
    """A ``DataLoader`` whose position in the epoch is saved in Lightning's checkpoint and
    restored on resume (Lightning calls ``state_dict`` / ``load_state_dict`` of a training
    dataloader that has them), so that no sample is skipped or seen twice. It samples with a
    :class:`ResumableSampler` (``shuffle``, ``seed``, ``drop_last`` are its own); every other
    argument is ``DataLoader``'s (not ``sampler`` / ``batch_sampler``).

    Make it before ``trainer.fit`` (under torchrun, ``$WORLD_SIZE`` and ``$RANK`` give the
    world) or in ``train_dataloader()``. Lightning calls its sampler's ``set_epoch`` every
    epoch, which starts a new epoch at its first sample; outside Lightning, call
    ``loader.resumable.set_epoch(epoch)`` before each epoch.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        batch_size: int = 1,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        **kwargs: Any,
    ) -> None:
        kwargs.pop("sampler", None)  # Lightning re-instantiating passes ours back
        sampler = ResumableSampler(
            dataset,  # type: ignore[arg-type]
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, **kwargs)
        self.resumable = sampler
        self.yielded = 0  # batches handed to the loop in this iteration

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self.yielded = 0
        for batch in super().__iter__():
            self.yielded += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The epoch and its samples consumed by all ranks (Lightning saves it at a step's end,
        when every batch handed out was trained on: it fetches ahead only unsized data)."""
        s = self.resumable
        done = s.start + self.yielded * (self.batch_size or 1) * s.num_replicas
        return {
            "epoch": s.epoch,
            "consumed": min(done, len(s.dataset)),  # type: ignore[arg-type]
            "samples": len(s.dataset),  # type: ignore[arg-type]
            "seed": s.seed,
            "shuffle": s.shuffle,
            "world": s.num_replicas,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = self.resumable
        was = (state.get("samples"), state.get("seed"), state.get("shuffle"))
        if was != (len(s.dataset), s.seed, s.shuffle):  # type: ignore[arg-type]
            log.warning(
                "the checkpoint's data position is for another dataset or order (samples, seed, "
                "shuffle = %s, now %s): the epoch starts again from its first sample",
                was,
                (len(s.dataset), s.seed, s.shuffle),  # type: ignore[arg-type]
            )
            return
        s.epoch = int(state["epoch"])
        s.start = int(state["consumed"])


# -- resume -------------------------------------------------------------------------------------
def last_checkpoint(ckpt_dir: str | os.PathLike[str] | None = None) -> str | None:
    """The newest COMPLETE checkpoint's Lightning file (``step-N/lightning.ckpt`` whose
    manifest and every file's checksum verify; newer torn ones are skipped), for
    ``trainer.fit(ckpt_path=...)``; None when there is none (start fresh).

    Decided by rank 0 and broadcast when torch.distributed is initialized; before (the usual
    call, before ``fit``) every process reads the same directory and comes to the same
    answer.

    Raises:
        ValueError: neither ``ckpt_dir`` nor ``$SPOTTRAIN_CKPT_DIR`` is set.
    """
    root = resolve_root(ckpt_dir)
    on = dist.is_available() and dist.is_initialized()
    found = None
    if not on or dist.get_rank() == 0:
        try:
            found = CheckpointDir(root).find_restorable()
        except CheckpointDirError as exc:
            log.warning("no checkpoint to resume: %s", exc)
    if on:
        found = dcp_io.broadcast_from_first(found, None)
    if found is None:
        return None
    for name, why in found.skipped:
        log.warning("resume skipped %s: %s", name, why)
    return str(found.path / CKPT_FILE)


def check_resumed_from(ckpt_path: str | os.PathLike[str] | None, root: Path) -> None:
    """Refuse a resume from a file outside the checkpoint volume (such as a ModelCheckpoint's
    ``last.ckpt`` on the VM's own disk): after a preemption it is gone, or older than the
    volume's newest, and nothing checked it is complete.

    Raises:
        CheckpointPathError: it is outside; the message names the fix.
    """
    if ckpt_path and outside_root(Path(ckpt_path), root):
        raise CheckpointPathError(
            f"trainer.fit(ckpt_path=...) is {ckpt_path}, outside the checkpoint volume {root}: "
            "it is lost with the VM and never checked complete; resume with "
            "trainer.fit(ckpt_path=last_checkpoint()) from "
            "spottrain.agent.sdk.integrations.lightning"
        )


def manifest_beside(ckpt_path: str | os.PathLike[str] | None) -> Manifest | None:
    """The manifest of the committed checkpoint that holds Lightning's file ``ckpt_path``
    (None: not one of ours)."""
    if not ckpt_path:
        return None
    try:
        return Manifest.read(Path(ckpt_path).parent)
    except (ManifestError, OSError):
        return None


# -- the callback -------------------------------------------------------------------------------
class SpotTrainCallback(Callback):
    """spottrain's checkpoint on a notice, commit, resume report and progress for a Lightning
    ``Trainer`` (see the module docstring). Add it once: ``Trainer(callbacks=[...])``.

    Args:
        ckpt_dir: The checkpoint volume (default ``$SPOTTRAIN_CKPT_DIR``).
        global_batch: Keep the global batch at this many samples through
            ``accumulate_grad_batches`` (set from the world size when training starts).
        every_steps: Also commit a checkpoint every this many optimizer steps, and one
            when training ends (0: only on a notice or request): what a VM lost without
            notice resumes from.
        **options: Passed to :class:`~.core.FrameworkSession` (``hold_timeout``,
            ``agree_interval``, ``stuck_grace``, ``redis_url``, ``run_id``, ...).

    Raises (when ``fit`` starts):
        CallbackAttachedTwiceError: it is on the Trainer twice.
        CheckpointPathError: ``fit`` resumed from a file outside the checkpoint volume.
        ValueError: ``global_batch`` cannot be kept at this world size.
    """

    def __init__(
        self,
        ckpt_dir: str | os.PathLike[str] | None = None,
        *,
        global_batch: int | None = None,
        every_steps: int = 0,
        **options: Any,
    ) -> None:
        if every_steps < 0:
            raise ValueError(f"every_steps is {every_steps}: give 0 (never) or a step count")
        self.every_steps = every_steps
        self.ckpt_dir = ckpt_dir
        self.wanted_batch = global_batch
        self.options = options
        self.session: FrameworkSession | None = None
        self.global_batch = 0
        self.last_step = -1

    # -- start ---------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if count_spottrain_callbacks(trainer.callbacks) > 1:  # type: ignore[attr-defined]
            raise CallbackAttachedTwiceError(
                "spottrain's SpotTrainCallback is on this Trainer twice: every save would be "
                "agreed and committed twice; pass it once in Trainer(callbacks=[...])"
            )
        warn_version("lightning", "lightning")
        resolve_root(self.ckpt_dir)  # no volume: say so before any training

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Made here, after Lightning installed its SIGTERM handler: ours sits on top of it
        # while training runs and gives it back when the session closes.
        session = FrameworkSession("lightning", self.ckpt_dir, **self.options)
        self.session = session
        check_resumed_from(trainer.ckpt_path, session.root)
        self.warn_outside(trainer, session.root)
        self.global_batch = self.fix_global_batch(trainer, session.world)
        step = trainer.global_step
        if step > 0:
            self.realign_batch_count(trainer)
        manifest = manifest_beside(trainer.ckpt_path) if step > 0 else None
        if manifest is not None:
            text = batch_change_warning(
                int(manifest.extra.get("global_batch") or 0),
                manifest.world_size,
                self.global_batch,
                session.world,
            )
            if text is not None:
                warnings.warn(text, stacklevel=2)
                log.warning("%s", text)
        # The step Lightning restored (its own state), not our reading of the directory.
        session.report_restore(step, manifest)
        self.last_step = step

    @staticmethod
    def realign_batch_count(trainer: pl.Trainer) -> None:
        """Make Lightning's count of the epoch's batches the one this world size would have
        reached. Lightning steps the optimizer when that count (restored from the checkpoint)
        is a multiple of ``accumulate_grad_batches``: resumed at another world size, the count
        is the old world's, and the first step would accumulate fewer batches and shift every
        later step by part of a global batch. The four counters move together, so Lightning's
        own restart logic sees a consistent state; at the same world size nothing moves."""
        loader = trainer.train_dataloader
        if not isinstance(loader, ResumableDataLoader):
            return
        s = loader.resumable
        current = trainer.fit_loop.epoch_loop.batch_progress.current
        shift = s.start // ((loader.batch_size or 1) * s.num_replicas) - current.ready
        for name in ("ready", "started", "processed", "completed"):
            setattr(current, name, getattr(current, name) + shift)

    @staticmethod
    def warn_outside(trainer: pl.Trainer, root: Path) -> None:
        """Lightning's own checkpoints outside the volume are lost with the VM: say so."""
        for cb in trainer.checkpoint_callbacks:
            where = getattr(cb, "dirpath", None)
            if where and outside_root(Path(where), root):
                text = (
                    f"{type(cb).__name__} saves to {where}, outside the checkpoint volume "
                    f"{root}: those checkpoints are lost with the VM (spottrain's own are in the "
                    f"volume); set Trainer(default_root_dir=...) or ModelCheckpoint(dirpath=...) "
                    "to a directory under it to keep them"
                )
                warnings.warn(text, stacklevel=3)
                log.warning("%s", text)

    def fix_global_batch(self, trainer: pl.Trainer, world: int) -> int:
        """Set ``accumulate_grad_batches`` for the wanted global batch; return the global
        batch this run trains with (0: unknown)."""
        loader = trainer.train_dataloader
        per_device = getattr(loader, "batch_size", None)
        if isinstance(loader, ResumableDataLoader):
            s = loader.resumable
            if (s.num_replicas, s.rank) != (world, trainer.global_rank):
                raise ValueError(
                    f"ResumableDataLoader was made for world size {s.num_replicas}, rank "
                    f"{s.rank}, but the Trainer runs world size {world}, rank "
                    f"{trainer.global_rank}: make it under torchrun (or in train_dataloader())"
                )
        if not isinstance(per_device, int):
            return 0
        if self.wanted_batch is not None:
            accumulate = accumulation_for(
                self.wanted_batch, per_device, world, "accumulate_grad_batches"
            )
            if any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks):  # type: ignore[attr-defined]
                log.warning(
                    "GradientAccumulationScheduler sets accumulate_grad_batches itself: "
                    "SpotTrainCallback(global_batch=%d) leaves it alone",
                    self.wanted_batch,
                )
            else:
                trainer.accumulate_grad_batches = accumulate
        return per_device * world * trainer.accumulate_grad_batches

    # -- every step ---------------------------------------------------------------------------
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        session = self.session
        if session is None:
            return
        step = trainer.global_step
        if step == self.last_step:  # a batch of an accumulation: no optimizer step yet
            session.touch()
            return
        self.last_step = step
        loss = loss_of(outputs, trainer.callback_metrics) if session.rank == 0 else None
        agreed = session.step(step, **({"loss": loss} if loss is not None else {}))
        order = order_at(step, agreed, self.every_steps)
        if order is not None:
            self.save(trainer, order)

    def save(self, trainer: pl.Trainer, order: SaveOrder) -> CommitResult:
        """Every rank: Lightning's own checkpoint write at this step into the staging
        directory, committed as ``step-N``; then the drain's exit or hold."""
        session = self.session
        assert session is not None
        try:
            tmp = session.staging_path(order)
        except CheckpointDirError as exc:
            result = CommitResult(order, None, error=str(exc))
        else:
            trainer.save_checkpoint(tmp / CKPT_FILE)  # rank 0 writes; every rank waits
            result = session.commit_staged(
                order, extra={"global_batch": self.global_batch, "file": CKPT_FILE}
            )
        session.after_commit(result)
        return result

    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any, **kw: Any) -> None:
        if self.session is not None:
            self.session.touch()  # evaluation is progress: after SIGTERM, not a stuck loop

    # -- the end -------------------------------------------------------------------------------
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        session = self.session
        if session is None:
            return
        step = trainer.global_step
        last = session.last_commit
        if self.every_steps and (last is None or last.order.step != step):
            self.save(trainer, SaveOrder(step, "final"))
        session.finish(step)
        self.session = None

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if self.session is not None:
            self.session.close()  # no collective: a peer may be gone
            self.session = None


__all__ = [
    "CKPT_FILE",
    "CallbackAttachedTwiceError",
    "CheckpointPathError",
    "ResumableDataLoader",
    "ResumableSampler",
    "SpotTrainCallback",
    "last_checkpoint",
]

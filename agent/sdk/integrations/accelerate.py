"""The Accelerate integration: one helper around the user's ``Accelerator``.

::

    from spottrain.agent.sdk.integrations.accelerate import SpotAccelerate

    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(
        use_seedable_sampler=True))                 # an epoch's order from (seed, epoch)
    model, opt, train_dl = accelerator.prepare(model, opt, train_dl)
    spot = SpotAccelerate(accelerator, global_batch=32, per_device=4)
    step = spot.resume()                            # 0 when there is no complete checkpoint
    while step < max_steps:
        for batch in spot.batches(train_dl):        # the rest of this epoch, resumed
            with accelerator.accumulate(model):
                ...forward, accelerator.backward(loss), opt.step(), opt.zero_grad()...
            if accelerator.sync_gradients:
                step += 1
                spot.step(step, loss=loss.item())
                if step == max_steps:
                    break
    spot.finish(step)

**On a notice.** The agent's checkpoint request (or a SIGTERM on any rank) is agreed on by
every rank at one step (see :mod:`.core`); at that step :meth:`SpotAccelerate.step` runs
``accelerator.save_state`` on every rank into a staging directory of the checkpoint volume
(Accelerate's own format: model, optimizer, scheduler, scaler, every rank's RNG state, the
registered objects), and commits it as ``step-N`` (manifest with every file's CRC32, atomic
rename, fenced, reported to Redis, where the agent's drain waits for it). After a drain
save, ranks that got SIGTERM exit 0 and the others hold until torchrun restarts them.

**Resume.** :meth:`SpotAccelerate.resume` loads the newest ``step-N`` whose manifest and
files verify (a torn newer one is skipped) with ``accelerator.load_state``. The helper
registers a small :class:`PositionState` with ``accelerator.register_for_checkpointing``,
so the step and data position come back through Accelerate's own load, and the step
reported to the run (``steps lost``) is the one Accelerate restored.

**The data position.** :meth:`SpotAccelerate.batches` counts the batches each rank took in
the epoch; a resumed run skips as many with ``accelerator.skip_first_batches`` in the same
epoch (``set_epoch`` first, so a seedable sampler draws the same order). At a fixed world
size no sample is skipped or seen twice. Across a world size change it skips the same
number of SAMPLES (Accelerate deals batch ``j`` to rank ``j mod world``, so the first ``k x
per_device x world`` samples of the epoch's order are exactly those consumed), exact when
that count divides by ``per_device x`` the new world size and the sampler's order does not
depend on the world size (``use_seedable_sampler=True``, or no shuffle); otherwise it
rounds down and warns how many samples are seen twice. A ``StatefulDataLoader``
(``use_stateful_dataloader=True``) restores its own position in ``load_state``; it is
per rank, so only at a fixed world size.

**The global batch** is ``per_device x gradient_accumulation_steps x world``. Given
``global_batch`` (and ``per_device``), the helper sets
``accelerator.gradient_accumulation_steps`` to ``global_batch / (per_device x world)`` at
every start, so the global batch stays the same when torchrun restarts with another world
size; without it, a resume at another world size warns with the old and new figures.

**Elastic only**: Accelerate owns the process group, so replica mode's torchft wrappers
cannot run in it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from spottrain.protocol.env import ENV_CKPT_DIR

from .core import (
    CommitResult,
    FrameworkSession,
    SaveOrder,
    accumulation_for,
    check_inside,
    resolve_root,
    warn_version,
)
from .plain import (
    AttachedTwiceError,
    check_save_every,
    committed_at,
    save_order,
    save_staged,
)

log = logging.getLogger("spottrain.sdk.integrations.accelerate")

PROJECT_DIR_SETTING = "Accelerator(project_dir=...)"
CKPT_DIR_SETTING = "SpotAccelerate(ckpt_dir=...)"

__all__ = [
    "AttachedTwiceError",
    "Position",
    "PositionState",
    "SpotAccelerate",
    "global_batch_change",
    "resume_skip",
]


# -- pure decisions -------------------------------------------------------------------------
@dataclass(frozen=True)
class Position:
    """Where a training was when it saved: ``step`` optimizer steps done, ``batch`` batches
    taken by each rank in epoch ``epoch``, at ``world`` ranks of ``per_device`` samples
    (0: unknown) with ``accumulation`` micro-batches per step."""

    step: int = 0
    epoch: int = 0
    batch: int = 0
    world: int = 1
    per_device: int = 0
    accumulation: int = 1

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step (0 when ``per_device`` is unknown)."""
        return self.per_device * self.accumulation * self.world


def resume_skip(saved: Position, world: int, per_device: int) -> tuple[int, str | None]:
    """Batches each of ``world`` ranks (``per_device`` samples each) skips in
    ``saved.epoch`` to resume after the samples ``saved`` consumed, and why that is not
    exact (None: exact). At the saved world size and batch it is ``saved.batch``."""
    if saved.world == world and saved.per_device in (0, per_device):
        return saved.batch, None
    if saved.per_device == 0:
        return saved.batch, (
            f"the world size changed from {saved.world} to {world} and the checkpoint does not "
            f"say its per-device batch: skipping {saved.batch} batches per rank as before, so "
            "samples may be skipped or repeated; iterate with spot.batches(dataloader)"
        )
    samples = saved.batch * saved.per_device * saved.world
    per_round = per_device * world
    skip, rest = divmod(samples, per_round)
    if not rest:
        return skip, None
    return skip, (
        f"{samples} samples of epoch {saved.epoch} were consumed at world size {saved.world}; "
        f"at world size {world} x per-device batch {per_device} = {per_round} per round, "
        f"resuming after {skip * per_round} of them: {rest} samples are seen twice"
    )


def global_batch_change(saved: Position, now: Position) -> str | None:
    """Why a resumed run at ``now`` optimises differently from the checkpoint at ``saved``
    (another global batch), with the figures; None when it is the same or unknown."""
    if not saved.global_batch or not now.global_batch:
        return None
    if saved.global_batch == now.global_batch:
        return None
    return (
        f"global batch changed from {saved.global_batch} (world size {saved.world} x "
        f"per-device {saved.per_device} x accumulation {saved.accumulation}) to "
        f"{now.global_batch} (world size {now.world} x per-device {now.per_device} x "
        f"accumulation {now.accumulation}): the resumed run continues another optimisation; "
        f"pass SpotAccelerate(accelerator, global_batch={saved.global_batch}, "
        f"per_device={now.per_device or saved.per_device}) to keep it"
    )


class PositionState:
    """The training position, checkpointed by Accelerate itself
    (``register_for_checkpointing``: ``custom_checkpoint_<i>.pkl``)."""

    def __init__(self) -> None:
        self.position = Position()

    def state_dict(self) -> dict[str, int]:
        return asdict(self.position)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = Position(**state)


# -- the helper -----------------------------------------------------------------------------
# Accelerators that already have a SpotAccelerate: a second would agree and commit twice.
_ATTACHED: weakref.WeakSet[Any] = weakref.WeakSet()


def check_paths(accelerator: Any, ckpt_dir: str | os.PathLike[str] | None) -> None:
    """Refuse checkpoint locations outside the checkpoint volume.

    Raises:
        CheckpointPathError: ``ckpt_dir`` is outside ``$SPOTTRAIN_CKPT_DIR``, or the
            accelerator's ``project_dir`` is outside the checkpoint volume.
        ValueError: there is no checkpoint volume.
    """
    env_root = os.environ.get(ENV_CKPT_DIR)
    if ckpt_dir is not None and env_root:
        check_inside(ckpt_dir, resolve_root(env_root), CKPT_DIR_SETTING)
    root = resolve_root(ckpt_dir)
    project_dir = getattr(accelerator, "project_dir", None)
    if project_dir:
        check_inside(project_dir, root, PROJECT_DIR_SETTING)


def check_processes(accelerator: Any) -> None:
    """Refuse an Accelerator that sees fewer processes than torchrun started (on the CPU,
    Accelerate runs one process per worker unless told ``cpu=True``).

    Raises:
        ValueError: the counts differ.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != world:
        raise ValueError(
            f"the Accelerator sees {accelerator.num_processes} process(es) but torchrun started "
            f"{world}: every worker would save alone; on the CPU pass Accelerator(cpu=True), "
            "else check that the workers have their GPUs"
        )


@contextlib.contextmanager
def explicit_save_dir(accelerator: Any) -> Iterator[None]:
    """``save_state(path)`` writes into ``path`` (with automatic checkpoint naming it would
    write ``project_dir/checkpoints/checkpoint_<i>`` instead), and the user's own numbering
    is left as it was."""
    config = accelerator.project_configuration
    automatic, iteration = config.automatic_checkpoint_naming, config.iteration
    config.automatic_checkpoint_naming = False
    try:
        yield
    finally:
        config.automatic_checkpoint_naming, config.iteration = automatic, iteration


class SpotAccelerate:
    """spottrain's checkpoint on a notice, commit, resume (data position included) and
    progress for an Accelerate loop (see the module docstring). Make one per training,
    after ``accelerator.prepare`` and before :meth:`resume`, on every rank.

    Args:
        accelerator: The training's ``Accelerator``.
        global_batch: Samples per optimizer step to keep at every world size (with
            ``per_device``): sets ``accelerator.gradient_accumulation_steps``.
        per_device: Samples per batch on each rank (the dataloader's batch size).
        save_every: Also save every this many steps (None: on a notice, on request, and
            at :meth:`finish` with ``save=True``).
        ckpt_dir: The checkpoint volume (default ``$SPOTTRAIN_CKPT_DIR``).
        **options: Passed to :class:`~.core.FrameworkSession` (``keep``, ``hold_timeout``,
            ``agree_interval``, ``redis_url``, ...).

    Raises:
        AttachedTwiceError: the accelerator already has one.
        CheckpointPathError: ``ckpt_dir`` or ``accelerator.project_dir`` is outside the
            checkpoint volume.
        ValueError: ``global_batch`` without ``per_device`` or not a multiple of
            ``per_device x world``; ``save_every`` below 1; the accelerator sees fewer
            processes than torchrun started.
    """

    def __init__(
        self,
        accelerator: Any,
        *,
        global_batch: int | None = None,
        per_device: int | None = None,
        save_every: int | None = None,
        ckpt_dir: str | os.PathLike[str] | None = None,
        **options: Any,
    ) -> None:
        if accelerator in _ATTACHED:
            raise AttachedTwiceError(
                "this Accelerator already has a SpotAccelerate: every save would be agreed and "
                "committed twice; make one SpotAccelerate per training and keep it"
            )
        warn_version("accelerate", "accelerate")
        check_save_every(save_every)
        check_paths(accelerator, ckpt_dir)
        check_processes(accelerator)
        world = accelerator.num_processes
        if global_batch is not None:
            if not per_device:
                raise ValueError(
                    f"global_batch={global_batch} needs per_device=<the dataloader's batch "
                    "size> to compute the gradient accumulation"
                )
            steps = accumulation_for(global_batch, per_device, world, "gradient_accumulation_steps")
            accelerator.gradient_accumulation_steps = steps
            log.warning(
                "global batch %d = per-device %d x world size %d x gradient accumulation %d",
                global_batch,
                per_device,
                world,
                steps,
            )
        self.accelerator = accelerator
        self.save_every = save_every
        self.per_device = per_device or 0
        self.state = PositionState()
        self.session = FrameworkSession("accelerate", ckpt_dir, **options)
        _ATTACHED.add(accelerator)
        accelerator.register_for_checkpointing(self.state)
        self.epoch = 0
        self.batch = 0
        self._skip = 0
        self.last_step = 0

    # -- positions ----------------------------------------------------------------------------
    def position(self, step: int) -> Position:
        """Where the training is after ``step`` steps, as a checkpoint records it."""
        return Position(
            step,
            self.epoch,
            self.batch,
            self.accelerator.num_processes,
            self.per_device,
            self.accelerator.gradient_accumulation_steps,
        )

    def batches(self, dataloader: Iterable[Any]) -> Iterator[Any]:
        """The rest of the current epoch's batches of a prepared ``dataloader``: after
        :meth:`resume`, from the restored position (the batches before it skipped with
        ``accelerator.skip_first_batches``), else the whole epoch. Call it once per epoch;
        the helper counts epochs and batches for the next checkpoint."""
        set_epoch = getattr(dataloader, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(self.epoch)  # the order of this epoch, and skip_first_batches' too
        skip, self._skip = self._skip, 0
        if getattr(dataloader, "use_stateful_dataloader", False):
            skip = 0  # load_state restored its position
        if not self.per_device:
            total = getattr(dataloader, "total_batch_size", 0) or 0
            self.per_device = total // self.accelerator.num_processes
        source = self.accelerator.skip_first_batches(dataloader, skip) if skip else dataloader
        self.batch = skip
        for batch in source:
            self.batch += 1
            yield batch
        self.epoch += 1
        self.batch = 0

    # -- resume -------------------------------------------------------------------------------
    def resume(self) -> int:
        """Load the newest complete checkpoint with ``accelerator.load_state`` and return
        the step Accelerate restored (0 when there is none). Collective: every rank."""
        session = self.session
        found = session.resume_staged()
        if found is None:
            return 0
        with session.saving():
            self.accelerator.load_state(str(found.path))
        saved = self.state.position
        now = Position(
            saved.step,
            saved.epoch,
            saved.batch,
            self.accelerator.num_processes,
            self.per_device or saved.per_device,
            self.accelerator.gradient_accumulation_steps,
        )
        skip, inexact = resume_skip(saved, now.world, now.per_device)
        for problem in (inexact, global_batch_change(saved, now)):
            if problem:
                warnings.warn(problem, stacklevel=2)
                log.warning("%s", problem)
        self.epoch, self.batch, self._skip = saved.epoch, skip, skip
        # Micro-batches since the epoch began, as accumulate() counts them to sync.
        self.accelerator.step = skip
        session.report_restore(saved.step, found)
        self.last_step = saved.step
        return saved.step

    # -- every step ---------------------------------------------------------------------------
    def step(self, step: int, **metrics: float) -> SaveOrder | None:
        """``step`` optimizer steps are done (every rank, after every optimizer step, the
        same ``step``): progress and ``metrics`` (``loss=...``) to the run, and the save
        every rank agreed on, made here. Returns the save made (None: none)."""
        self.last_step = step
        order = save_order(self.session.step(step, **metrics), step, self.save_every)
        if order is not None:
            self._save(order)
        return order

    def save(self, step: int, kind: str = "periodic") -> CommitResult:
        """Save and commit a checkpoint of ``step`` now (every rank): the way to make the
        training's own periodic saves resumable."""
        return self._save(SaveOrder(step, kind))

    def _save(self, order: SaveOrder) -> CommitResult:
        self.state.position = self.position(order.step)

        def write(directory: Any) -> None:
            with explicit_save_dir(self.accelerator):
                self.accelerator.save_state(str(directory))

        extra = {"global_batch": self.state.position.global_batch}
        return save_staged(self.session, order, write, extra=extra)

    # -- the end ------------------------------------------------------------------------------
    def finish(self, step: int, *, save: bool = False) -> None:
        """Training is over at ``step`` (every rank): with ``save``, commit a final
        checkpoint first; tell the run it finished."""
        if save and not committed_at(self.session, step):
            self._save(SaveOrder(step, "final"))
        self.session.finish(step)
        _ATTACHED.discard(self.accelerator)

    def close(self) -> None:
        """Stop without the collective end (after an error on this rank)."""
        self.session.close()
        _ATTACHED.discard(self.accelerator)

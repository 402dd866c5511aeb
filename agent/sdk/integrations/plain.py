"""A plain torchrun script that keeps its own loop and its own checkpoint format: one
context manager for spottrain's checkpoint on a notice, resume and progress.

::

    from spottrain.agent.sdk.integrations.plain import SpotCheckpoints

    def save(directory: Path) -> None:      # every rank; write whatever you resume from
        if dist.get_rank() == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "step": step}, directory / "state.pt")

    def load(directory: Path) -> int:       # every rank; return the step you restored
        state = torch.load(directory / "state.pt")
        model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"])
        return state["step"]

    with SpotCheckpoints(save=save, load=load, save_every=500) as spot:
        step = spot.resume()                # 0 when there is no complete checkpoint
        while step < max_steps:
            ...one optimizer step...
            step += 1
            spot.step(step, loss=loss.item())

**On a notice.** The agent's checkpoint request (or a SIGTERM on any rank) is agreed on by
every rank at one step (see :mod:`.core`); at that step :meth:`SpotCheckpoints.step` calls
``save`` on every rank with the same empty directory in the checkpoint volume, then commits
it (every file's CRC32 in a manifest, the atomic rename to ``step-N``, fenced and reported
to Redis, where the agent's drain waits for it). After a drain save, ranks that got SIGTERM
exit 0 and the others hold until torchrun restarts them.

**Resume.** :meth:`SpotCheckpoints.resume` picks the newest ``step-N`` whose manifest and
files verify (a torn newer one is skipped), calls ``load`` with it on every rank and reports
the step ``load`` returned (the step the script itself restored) to the run.

A script that imports nothing of spottrain's gets only the agent's SIGTERM at the notice
(``train.integration: plain``) and must save atomically itself; see ``docs/integrations.md``.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from .core import CommitResult, FrameworkSession, SaveOrder

log = logging.getLogger("spottrain.sdk.integrations.plain")


class AttachedTwiceError(RuntimeError):
    """Two spottrain integrations on one training: each would agree, save and commit."""


def save_order(order: SaveOrder | None, step: int, save_every: int | None) -> SaveOrder | None:
    """The save at ``step``: the agreed ``order`` if any, else a periodic one every
    ``save_every`` steps (None: no save)."""
    if order is not None:
        return order
    if save_every and step > 0 and step % save_every == 0:
        return SaveOrder(step, "periodic")
    return None


def committed_at(session: FrameworkSession, step: int) -> bool:
    """Whether the session's last commit holds ``step`` (a final save there would repeat
    it)."""
    last = session.last_commit
    return last is not None and last.committed and last.order.step == step


def check_save_every(save_every: int | None) -> None:
    """Refuse a ``save_every`` that is not a positive number of steps.

    Raises:
        ValueError: it is below 1.
    """
    if save_every is not None and save_every < 1:
        raise ValueError(
            f"save_every={save_every}: give a number of steps >= 1, or None for no periodic "
            "checkpoints"
        )


def all_ranks_ok(session: FrameworkSession, ok: bool) -> bool:
    """Whether every rank's write succeeded (a MIN on the session's group; collective)."""
    if not session.distributed:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=session.group)
    return bool(flag.item())


def save_staged(
    session: FrameworkSession,
    order: SaveOrder,
    write: Callable[[Path], object],
    *,
    extra: dict[str, Any] | None = None,
) -> CommitResult:
    """Every rank: ``write`` the checkpoint into a staging directory, commit it as
    ``step-N`` and then :meth:`~.core.FrameworkSession.after_commit` (which does not return
    on a SIGTERM'd rank after a drain save). Collective.

    A ``write`` that raises on any rank commits nothing, on every rank (a checkpoint with
    one rank's files missing would pass its checksums): the result carries the error.

    Raises:
        CheckpointDirError: the staging directory could not be made (on every rank).
    """
    tmp = session.staging_path(order)
    error = None
    try:
        write(tmp)
    except Exception as exc:  # the other ranks wait in the commit: tell them, never hang
        error = f"rank {session.rank} could not write the checkpoint: {exc!r}"
        log.exception("%s checkpoint at step %d: %s", order.kind, order.step, error)
    if all_ranks_ok(session, error is None):
        result = session.commit_staged(order, extra=extra)
    else:
        result = CommitResult(order, None, error=error or "another rank could not write it")
        if session.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        session.touch()
        session.phase = "training"
    session.after_commit(result)
    return result


# The SpotCheckpoints of this process that is open (one per training).
_OPEN: list[SpotCheckpoints] = []


class SpotCheckpoints:
    """spottrain's checkpoints for a plain torchrun script's own save and load (see the
    module docstring). Use it as a context manager on every rank, after
    ``dist.init_process_group``.

    Args:
        save: ``save(directory)``, called on every rank with the same empty directory:
            write everything the script resumes from (each rank may write its own files).
        load: ``load(directory)``, called on every rank with the newest complete
            checkpoint: restore from it and return the step restored (None: the
            checkpoint's step).
        save_every: Also save every this many steps (None: only on a notice, on request
            and in :meth:`finish` with ``save=True``).
        ckpt_dir: The checkpoint volume (default ``$SPOTTRAIN_CKPT_DIR``).
        **options: Passed to :class:`~.core.FrameworkSession` (``keep``, ``hold_timeout``,
            ``agree_interval``, ``redis_url``, ...).

    Raises:
        ValueError: ``save_every`` below 1, or no checkpoint volume.
        AttachedTwiceError (on entering): another one is open in this process.
    """

    framework = "plain"

    def __init__(
        self,
        save: Callable[[Path], object],
        load: Callable[[Path], int | None],
        *,
        save_every: int | None = None,
        ckpt_dir: str | os.PathLike[str] | None = None,
        **options: Any,
    ) -> None:
        check_save_every(save_every)
        self.save_fn = save
        self.load_fn = load
        self.save_every = save_every
        self.ckpt_dir = ckpt_dir
        self.options = options
        self.session: FrameworkSession | None = None
        self.last_step = 0

    def __enter__(self) -> SpotCheckpoints:
        if _OPEN:
            raise AttachedTwiceError(
                "a spottrain SpotCheckpoints is already open in this process: every save would "
                "be agreed and committed twice; open one, once, around the whole training"
            )
        _OPEN.append(self)
        try:
            self.session = FrameworkSession(self.framework, self.ckpt_dir, **self.options)
        except BaseException:
            _OPEN.remove(self)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None and self.session is not None:
            self.finish(self.last_step)
        else:
            self.close()  # another rank may be gone: no collective here

    def _live(self) -> FrameworkSession:
        if self.session is None:
            raise RuntimeError(
                "SpotCheckpoints is not open: use it as `with SpotCheckpoints(...) as spot:`"
            )
        return self.session

    def resume(self) -> int:
        """Load the newest complete checkpoint with ``load`` on every rank and return the
        step it restored (0, and ``load`` not called, when there is none). Collective."""
        session = self._live()
        found = session.resume_staged()
        if found is None:
            return 0
        with session.saving():
            restored = self.load_fn(found.path)
        step = found.step if restored is None else int(restored)
        session.report_restore(step, found)
        self.last_step = step
        return step

    def step(self, step: int, **metrics: float) -> SaveOrder | None:
        """``step`` optimizer steps are done (every rank, every step, the same ``step``):
        progress and ``metrics`` (``loss=...``) to the run, and the save every rank agreed
        on, made here. Returns the save made (None: none)."""
        session = self._live()
        self.last_step = step
        order = save_order(session.step(step, **metrics), step, self.save_every)
        if order is not None:
            save_staged(session, order, self.save_fn)
        return order

    def save(self, step: int, kind: str = "periodic") -> CommitResult:
        """Save and commit a checkpoint of ``step`` now (every rank)."""
        return save_staged(self._live(), SaveOrder(step, kind), self.save_fn)

    def finish(self, step: int, *, save: bool = False) -> None:
        """Training is over at ``step`` (every rank): with ``save``, commit a final
        checkpoint first; tell the run it finished. Leaving the ``with`` block does this
        (without the save) for the last step given."""
        session = self._live()
        if save and not committed_at(session, step):
            save_staged(session, SaveOrder(step, "final"), self.save_fn)
        session.finish(step)
        self._release()

    def close(self) -> None:
        """Stop without the collective end (after an error)."""
        if self.session is not None:
            self.session.close()
        self._release()

    def _release(self) -> None:
        self.session = None
        if self in _OPEN:
            _OPEN.remove(self)

"""What every framework integration shares: one per-rank :class:`FrameworkSession` that
agrees with the other ranks on the step of an emergency save, commits the checkpoint
directory the framework wrote, finds the newest complete one for resume, and reports
progress, commits and restores to the run's Redis, the way :class:`~..session.TrainSession`
does for scripts on spottrain's own loop.

It is made of the SDK's own parts: the agreement (:mod:`..agreement`, a tiny all-reduce on
a gloo group of its own, started at one agreement step and waited for at the next), rank 0's
request channel to Redis (:mod:`..channel`), SIGTERM handling (:mod:`..signals`), the hold
or exit after a drain save (:mod:`..saving`), the step timer (:mod:`..timing`), the node's
progress file for the agent's dead man's switch, and the checkpoint directory's commit
protocol and fencing epochs (:mod:`spottrain.agent.checkpoint`). The framework keeps its own
wandb run: the session starts none.

**Two layouts.** (a) *Staged*: the integration asks for :meth:`FrameworkSession.staging_path`
(a temporary directory in the checkpoint root), the framework saves into it, and
:meth:`FrameworkSession.commit_staged` writes the manifest and renames it to ``step-N``, as
the SDK commits (Lightning, Accelerate, plain scripts). (b) *In place*: the framework writes
a directory under its own name (the Hugging Face Trainer's ``checkpoint-N``) and
:meth:`FrameworkSession.commit_in_place` makes its manifest, written durably last, the
commit point. Either way the manifest names every file with its CRC32; the framework's files
are read back once to get them, the reading spread over the ranks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from importlib import metadata
from pathlib import Path
from typing import Any

import torch.distributed as dist

from spottrain.protocol.env import (
    ENV_CKPT_DIR,
    ENV_INTEGRATION,
    ENV_NODE,
    ENV_REDIS,
    ENV_ROUND,
    ENV_RUN_ID,
)
from spottrain.tracking import Tracker

from ...checkpoint import dcp_io
from ...checkpoint.directory import CheckpointDir
from ...checkpoint.files import CheckpointDirError, StaleCommitError
from ...checkpoint.in_place import Complete, scan_complete
from ...checkpoint.manifest import Manifest, list_files, sum_files
from ...local_progress import ProgressFile
from .. import saving
from ..agreement import Agreement, agreed_save, local_flags
from ..channel import RequestChannel
from ..signals import SignalWatch
from ..timing import StepTimer

log = logging.getLogger("spottrain.sdk.integrations")


class CheckpointPathError(ValueError):
    """A framework was told to save outside the checkpoint volume; the message names the
    fix."""


@dataclass(frozen=True)
class SaveOrder:
    """A save every rank makes at the same step.

    Attributes:
        step: The step (optimizer steps done) the checkpoint holds.
        kind: ``emergency`` (a drain: the agent's notice or a rank's SIGTERM), ``requested``
            (an early checkpoint the agent asked for), ``periodic`` (the framework's own
            schedule, or spottrain's by time) or ``final``.
        drain: After it commits, SIGTERM'd ranks exit 0 and the others hold
            (:meth:`FrameworkSession.after_commit`).
        request_id: The newest checkpoint request in Redis it answers (0: none).
    """

    step: int
    kind: str
    drain: bool = False
    request_id: int = 0


@dataclass(frozen=True)
class CommitResult:
    """What became of a save, the same on every rank: ``path`` is the committed checkpoint
    (None when refused or failed), ``refused`` why a newer generation fenced it off,
    ``error`` why the disk refused."""

    order: SaveOrder
    path: Path | None
    manifest: Manifest | None = None
    refused: str | None = None
    error: str | None = None

    @property
    def committed(self) -> bool:
        return self.path is not None


# -- pure decisions -------------------------------------------------------------------------
def order_from_flags(step: int, flags: list[int]) -> SaveOrder | None:
    """The save the agreed flags ask for at ``step`` (None: none)."""
    save = agreed_save(flags)
    if save is None:
        return None
    kind, drain, request_id = save
    return SaveOrder(step, kind, drain, request_id)


def version_problem(
    dist_name: str, installed: str | None, requires: list[str], extra: str
) -> str | None:
    """Why ``dist_name`` at version ``installed`` is outside spottrain's extra ``extra``
    (``requires``: spottrain's requirement strings), or None (inside, not installed, or the
    extra does not name it)."""
    from packaging.requirements import InvalidRequirement, Requirement

    if installed is None:
        return None
    for text in requires:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.name != dist_name or req.marker is None:
            continue
        if not req.marker.evaluate({"extra": extra}):
            continue
        if req.specifier.contains(installed, prereleases=True):
            return None
        return (
            f"{dist_name} {installed} is outside the versions spottrain's integration was "
            f"tested with ({dist_name}{req.specifier}): install spottrain[{extra}] to get them, "
            "or expect the integration to break"
        )
    return None


def outside_root(path: Path, root: Path) -> bool:
    """Whether ``path`` is neither ``root`` nor inside it (links resolved)."""
    real, base = os.path.realpath(path), os.path.realpath(root)
    return real != base and not real.startswith(base.rstrip(os.sep) + os.sep)


# -- checks at start-up ---------------------------------------------------------------------
@functools.cache
def warn_version(dist_name: str, extra: str) -> str | None:
    """Warn once per process when the installed ``dist_name`` is outside the range of
    spottrain's extra ``extra`` (pyproject's ``[project.optional-dependencies]``); return
    the warning's text (None: in range, or nothing to compare)."""
    try:
        installed: str | None = metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        installed = None
    try:
        requires = metadata.requires("spottrain") or []
    except metadata.PackageNotFoundError:
        requires = []
    problem = version_problem(dist_name, installed, requires, extra)
    if problem is not None:
        warnings.warn(problem, stacklevel=3)
        log.warning("%s", problem)
    return problem


def accumulation_for(global_batch: int, per_device: int, world: int, setting: str) -> int:
    """Micro-batches per optimizer step (the framework's ``setting``) that keep the global
    batch at ``global_batch`` with ``per_device`` samples per rank and ``world`` ranks: how
    a job keeps its optimisation when a node leaves or joins.

    Raises:
        ValueError: a size is not positive, or ``global_batch`` is not a multiple of
            ``per_device x world`` (the message gives the figures and a fit).
    """
    if global_batch <= 0 or per_device <= 0 or world <= 0:
        raise ValueError(
            f"global batch {global_batch}, per-device batch {per_device} and world size "
            f"{world} must all be positive"
        )
    per_step = per_device * world
    if global_batch % per_step:
        raise ValueError(
            f"global batch {global_batch} is not a multiple of per-device batch {per_device} x "
            f"world size {world} = {per_step}: {setting} cannot keep it at this world size; "
            f"choose a global batch that every allowed world size x {per_device} divides "
            f"(e.g. {per_step * max(1, global_batch // per_step)}), or a per-device batch "
            "that divides it"
        )
    return global_batch // per_step


def check_inside(path: str | os.PathLike[str], root: Path, setting: str) -> Path:
    """``path`` if it is inside the checkpoint volume ``root``.

    Raises:
        CheckpointPathError: it is outside; the message names ``setting`` (what the user
            sets to move it, such as ``TrainingArguments(output_dir=...)``).
    """
    p = Path(path)
    if outside_root(p, root):
        raise CheckpointPathError(
            f"{setting} is {p}, outside the checkpoint volume {root} (${ENV_CKPT_DIR}): "
            f"checkpoints there are lost with the VM and never resumed; set {setting} to a "
            f"directory under {root}"
        )
    return p


def resolve_root(ckpt_dir: str | os.PathLike[str] | None) -> Path:
    """The checkpoint root: ``ckpt_dir``, else ``$SPOTTRAIN_CKPT_DIR``.

    Raises:
        ValueError: neither is set.
    """
    root = ckpt_dir if ckpt_dir is not None else os.environ.get(ENV_CKPT_DIR)
    if not root:
        raise ValueError(
            f"no checkpoint directory: pass ckpt_dir= or set ${ENV_CKPT_DIR} to the shared "
            "checkpoint mount (spottrain's agent sets it on every VM)"
        )
    return Path(root)


def warn_integration_mismatch(framework: str) -> str | None:
    """Warn when the job spec's ``train.integration`` (``$SPOTTRAIN_INTEGRATION``, set by the
    agent) names another integration than the one this script uses."""
    spec = os.environ.get(ENV_INTEGRATION, "")
    if not spec or spec == framework:
        return None
    text = (
        f"the job spec says train.integration: {spec}, but this script uses spottrain's "
        f"{framework} integration: set train.integration: {framework} so that validate checks "
        "what it needs and the agent treats a notice as this integration expects"
    )
    log.warning("%s", text)
    return text


# -- finding the newest complete checkpoint --------------------------------------------------
def _rank_of(group: Any) -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def find_complete(
    directory: str | os.PathLike[str], prefix: str = "checkpoint-", *, group: Any = None
) -> Complete | None:
    """The newest complete ``<prefix>N`` checkpoint in ``directory`` (see
    :func:`scan_complete`), decided by rank 0 and the same on every rank.

    With torch.distributed initialized, rank 0 scans, sets the torn ones aside and
    broadcasts its choice (on ``group``, default: the default group). Without it (called
    before the framework set up its process group) every process scans and only ``$RANK``
    0 renames: the complete ones are the same for all, so the answers agree.
    """
    path = Path(directory)
    on = dist.is_available() and dist.is_initialized()
    if not on:
        return scan_complete(path, prefix, set_aside=_rank_of(group) == 0)
    found = scan_complete(path, prefix, set_aside=True) if dist.get_rank() == 0 else None
    found = dcp_io.broadcast_from_first(found, group)
    return found if isinstance(found, Complete) else None


# -- the per-rank session --------------------------------------------------------------------
class FrameworkSession:
    """spottrain's checkpointing for one rank of a framework's training (every rank makes
    one, once torch.distributed is initialized, or in a single process).

    Args:
        framework: The integration's name (``hf``, ``lightning``, ``accelerate``,
            ``plain``): compared with the job spec's ``train.integration`` and used in logs.
        ckpt_dir: The checkpoint root (default ``$SPOTTRAIN_CKPT_DIR``): where staged
            checkpoints are committed and fencing epochs claimed, and what every
            checkpoint path must be inside.
        keep: Staged checkpoints to keep (the in-place layout's framework prunes its own).
        hold_timeout: After a drain save, how long a rank that was not SIGTERM'd holds,
            waiting for its torchrun to restart it, before training on.
        agree_interval: Seconds between two agreements (see :mod:`..agreement`).
        stuck_grace: After SIGTERM, a loop with no progress for this long (or three median
            steps, if longer) outside a save is stuck in a collective with a dead peer: the
            worker exits 143 at once. Longer than the SDK's: a framework's evaluation or
            logging runs between steps.
        redis_url: The job's Redis (default ``$SPOTTRAIN_REDIS``).
        run_id: Default ``$TORCHELASTIC_RUN_ID``, else ``$SPOTTRAIN_RUN_ID``.
        install_signal_handlers: Catch SIGTERM (only possible on the main thread).
        report_interval: Seconds between two reports of the node's step time to Redis.

    Raises:
        ValueError: no checkpoint root, or ``keep`` < 1.
        CheckpointDirError: the root is missing or not writable.
    """

    def __init__(
        self,
        framework: str,
        ckpt_dir: str | os.PathLike[str] | None = None,
        *,
        keep: int = 3,
        hold_timeout: float = 180.0,
        agree_interval: float = 0.2,
        stuck_grace: float = 30.0,
        redis_url: str | None = None,
        run_id: str | None = None,
        poll_interval: float = 0.2,
        install_signal_handlers: bool = True,
        report_interval: float = 5.0,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep}: keep at least 1 checkpoint")
        self.framework = framework
        self.root = resolve_root(ckpt_dir)
        self.ckdir = CheckpointDir(self.root)
        self.keep = keep
        self.hold_timeout = hold_timeout
        self.stuck_grace = stuck_grace
        self.round = int(os.environ.get(ENV_ROUND, "-1"))
        self.node = os.environ.get(ENV_NODE, socket.gethostname())
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.run_id = run_id or os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get(ENV_RUN_ID)
        warn_integration_mismatch(framework)
        self._start_group()
        self.sigterm = False  # a plain bool: set in a signal handler, which may take no lock
        self.holding = threading.Event()
        self.phase = "training"
        self.last_progress = time.monotonic()
        self.timer = StepTimer()
        self.tracker = Tracker()  # the framework keeps its own wandb run; none of ours
        self.last_commit: CommitResult | None = None
        self._served_request = 0
        self._served_at = 0.0
        self._progress_file = ProgressFile.from_env()
        self.agreement = Agreement(
            self.group, agree_interval, self._local_flags, lambda: self.timer.last_step_time
        )
        self.channel = RequestChannel(
            redis_url if redis_url is not None else os.environ.get(ENV_REDIS),
            self.run_id,
            poll_interval,
            active=self.rank == 0,
        )
        self._start_step_reporter(report_interval)
        self._watch = self._install_signal_watch() if install_signal_handlers else None

    def _start_group(self) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        # Our collectives never interleave with the framework's: a gloo group of our own.
        self.group: Any = None
        if self.distributed:
            self.group = dist.new_group(backend="gloo", timeout=timedelta(minutes=10))
        self.epoch = -1
        if self.rank == 0:
            self.ckdir.check_writable()  # fail before any training, not at the first save
            self.epoch = self.ckdir.claim_epoch(saving.generation(self.round, self.node))
        self.epoch = dcp_io.broadcast_from_first(self.epoch, self.group)

    def _start_step_reporter(self, report_interval: float) -> None:
        if self.channel.client is None:
            return
        threading.Thread(
            target=self.timer.report_loop,
            args=(
                self.channel.client,
                self.channel.keys,
                self.node,
                self.local_rank,
                report_interval,
                self.channel.stop_event,
            ),
            name="spottrain-step-time",
            daemon=True,
        ).start()

    def _install_signal_watch(self) -> SignalWatch | None:
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "spottrain's %s integration made off the main thread: SIGTERM is not caught, "
                "so a shutdown will not trigger an emergency checkpoint",
                self.framework,
            )
            return None
        return SignalWatch(
            self._on_sigterm,
            self.holding,
            self.stuck,
            lambda: time.monotonic() - self.last_progress,
            self.tracker,
        )

    def _on_sigterm(self) -> None:
        self.sigterm = True

    def _local_flags(self) -> list[int] | None:
        request = self.channel.pending(self._served_request, self._served_at)
        return local_flags(self.sigterm, request, False)

    # -- paths --------------------------------------------------------------------------------
    def check_inside(self, path: str | os.PathLike[str], setting: str) -> Path:
        """``path`` if inside the checkpoint root (see :func:`check_inside`).

        Raises:
            CheckpointPathError: it is not; the message names ``setting`` as the fix.
        """
        return check_inside(path, self.root, setting)

    # -- every step ---------------------------------------------------------------------------
    def step(
        self, step: int, *, compute_s: float | None = None, **metrics: float
    ) -> SaveOrder | None:
        """``step`` optimizer steps are done: note the pace and progress, and, at agreement
        steps, agree with every rank on whether to save here. Every rank calls it after
        every optimizer step, with the same ``step``; the answer is the same on every rank.

        ``metrics`` (``loss=...``) go to the run's progress in Redis (rank 0; the step and
        world size go every step, with or without them). ``compute_s`` is this rank's own
        compute time for the step, if the integration measures it.
        """
        self.timer.close_compute(compute_s)
        now = time.monotonic()
        self.timer.step_times.append(now - self.last_progress)
        self.last_progress = now
        self._progress_file.report(step)
        if self.rank == 0:
            self.channel.report_progress(step, self.world, self.round, metrics)
        if not self.agreement.due(step):
            return None
        self.phase = "agreeing"
        flags = self.agreement.agree(step)
        self.phase = "training"
        self.last_progress = time.monotonic()
        return order_from_flags(step, flags)

    def report_metrics(self, step: int, **metrics: float) -> None:
        """Metrics the framework computes later than its step (a logging hook's loss), for
        the run's progress in Redis (rank 0; other ranks: nothing)."""
        if self.rank == 0 and metrics:
            self.channel.report_progress(step, self.world, self.round, metrics)

    def touch(self) -> None:
        """The loop is making progress outside a step (evaluation, logging): after SIGTERM it
        is not stuck."""
        self.last_progress = time.monotonic()

    def compute(self) -> contextlib.AbstractContextManager[None]:
        """Time the block as this step's compute (see ``TrainSession.compute``)."""
        return self.timer.compute()

    def stuck(self) -> bool:
        """Whether the loop looks stuck in a collective (asked after SIGTERM)."""
        if self.phase in ("saving", "restoring", "closed"):
            return False
        limit = max(self.stuck_grace, 3 * self.timer.last_step_time)
        return time.monotonic() - self.last_progress > limit

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Wrap the framework's own write of a checkpoint: a long save after SIGTERM is not a
        stuck loop. :meth:`staging_path` and the commits mark it themselves."""
        phase, self.phase = self.phase, "saving"
        try:
            yield
        finally:
            self.phase = phase
            self.last_progress = time.monotonic()

    def begin_save(self) -> None:
        """The framework is about to write a checkpoint that a commit will follow (the
        in-place layout; :meth:`staging_path` does this itself): until the commit, a long
        save after SIGTERM is not a stuck loop."""
        self.phase = "saving"

    # -- commits ------------------------------------------------------------------------------
    def staging_path(self, order: SaveOrder) -> Path:
        """An empty temporary directory in the checkpoint root for the framework to save
        ``order``'s checkpoint into, the same on every rank (collective: every rank calls
        it). :meth:`commit_staged` commits it as ``step-N``.

        Raises:
            CheckpointDirError: it could not be made (on every rank).
        """
        self.phase = "saving"
        tmp = self.ckdir.tmp_path(order.step, self.round, self.epoch)
        error = None
        if self.rank == 0:
            try:
                if tmp.exists():
                    shutil.rmtree(tmp)  # a crashed attempt of this generation at this step
                tmp.mkdir()
            except OSError as exc:
                error = CheckpointDirError(exc.errno or 0, f"creating {tmp}: {exc}")
        error = dcp_io.broadcast_from_first(error, self.group)
        if error is not None:
            self.phase = "training"
            raise error
        return tmp

    def commit_staged(
        self, order: SaveOrder, *, extra: dict[str, Any] | None = None
    ) -> CommitResult:
        """Commit what the framework saved into :meth:`staging_path` as ``step-N``: the
        files' checksums (read back, spread over the ranks), the manifest, the rename;
        fenced; reported to Redis. Collective; the same result on every rank. Periodic and
        final commits prune to ``keep``. ``extra`` (JSON values) is kept in the manifest's
        ``extra``, beside ``node``, ``drain`` and ``framework``."""
        tmp = self.ckdir.tmp_path(order.step, self.round, self.epoch)
        return self._commit(order, tmp, staged=True, extra=extra)

    def commit_in_place(
        self,
        path: str | os.PathLike[str],
        order: SaveOrder,
        *,
        extra: dict[str, Any] | None = None,
    ) -> CommitResult:
        """Commit a checkpoint directory the framework wrote under its own name (inside the
        checkpoint root): its manifest, written durably last, is the commit point. Fenced and
        reported as :meth:`commit_staged`; a refused or failed one is left without a
        manifest, so it never resumes. Collective."""
        return self._commit(order, Path(path), staged=False, extra=extra)

    def _commit(
        self, order: SaveOrder, path: Path, *, staged: bool, extra: dict[str, Any] | None
    ) -> CommitResult:
        self.phase = "saving"
        t0 = time.monotonic()
        # The reduce in flight was started before this save: it completes first on every
        # rank, so that the commit's collectives on the group come after it.
        pending = self.agreement.drain()
        try:
            sums = self._gather_sums(path)
            outcome: Any = None
            if self.rank == 0:
                outcome = self._commit_on_first(order, path, sums, staged, extra or {}, t0)
            result = dcp_io.broadcast_from_first(outcome, self.group)
            assert isinstance(result, CommitResult)
        finally:
            self.phase = "training"
            self.last_progress = time.monotonic()
        # Served before the next reduce starts, or its flags would carry this request again
        # and the next step would save it a second time. A failed write leaves it pending:
        # the next agreement tries again while there is time (a refusal is an answer).
        if result.error is None:
            self._served_request = max(self._served_request, order.request_id)
        if order.drain and result.manifest is not None:
            self._served_at = result.manifest.created_at
        self.agreement.restart(pending)
        self.last_commit = result if result.committed else self.last_commit
        return result

    def _gather_sums(self, path: Path) -> dict[str, Any] | str:
        """Every file's size and CRC32 on rank 0 (each rank reads its share), or why not."""
        if self.distributed:
            dist.barrier(group=self.group)  # every rank's files are written
        names: Any = None
        if self.rank == 0:
            try:
                names = list_files(path)
            except OSError as exc:
                names = f"cannot list {path}: {exc}"
        names = dcp_io.broadcast_from_first(names, self.group)
        if isinstance(names, str):
            return names
        mine: dict[str, Any] | str
        try:
            mine = sum_files(path, names[self.rank :: self.world])
        except OSError as exc:
            mine = f"rank {self.rank} cannot read {path}: {exc}"
        if not self.distributed:
            return mine
        parts: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(mine, parts, dst=dist.get_global_rank(self.group, 0), group=self.group)
        if parts is None:
            return {}
        sums: dict[str, Any] = {}
        for part in parts:
            if isinstance(part, str):
                return part
            sums.update(part)
        return sums

    def _commit_on_first(
        self,
        order: SaveOrder,
        path: Path,
        sums: dict[str, Any] | str,
        staged: bool,
        extra: dict[str, Any],
        t0: float,
    ) -> CommitResult:
        """Rank 0's commit of ``path``, reported to Redis."""
        if isinstance(sums, str):
            if staged:
                shutil.rmtree(path, ignore_errors=True)
            log.error("%s checkpoint at step %d failed: %s", order.kind, order.step, sums)
            return CommitResult(order, None, error=sums)
        manifest = Manifest(
            step=order.step,
            world_size=self.world,
            round=self.round,
            kind=order.kind,
            created_at=time.time(),
            files=sums,
            request_id=order.request_id,
            extra={
                **extra,
                "node": self.node,
                "drain": order.drain,
                "framework": self.framework,
            },
            epoch=self.epoch,
        )
        fence = self.channel.fence
        try:
            if staged:
                target = self.ckdir.commit(path, manifest, fence)
                if order.kind in ("periodic", "final"):  # seconds count in an emergency
                    with contextlib.suppress(OSError):
                        self.ckdir.prune(self.keep, self.round, self.epoch)
            else:
                target = self.ckdir.commit_in_place(path, manifest, fence)
        except StaleCommitError as exc:
            log.error("%s", exc)
            result = CommitResult(order, None, refused=str(exc))
            self.channel.report_refused(
                self._save_result(result, t0),
                order.kind,
                order.drain,
                order.request_id,
                self.round,
                self.epoch,
            )
            return result
        except CheckpointDirError as exc:
            log.error("%s checkpoint at step %d failed: %s", order.kind, order.step, exc)
            return CommitResult(order, None, error=exc.strerror or str(exc))
        result = CommitResult(order, target, manifest)
        log.warning(
            "%s checkpoint step %d committed in %.2f s (%s)",
            order.kind,
            order.step,
            time.monotonic() - t0,
            target,
        )
        self.channel.report_commit(
            self._save_result(result, t0), order.kind, order.drain, order.request_id
        )
        return result

    @staticmethod
    def _save_result(result: CommitResult, t0: float) -> dcp_io.SaveResult:
        """The SDK's record of a save, which the request channel reports."""
        took = time.monotonic() - t0
        return dcp_io.SaveResult(
            result.order.step, result.path, result.manifest, result.refused, took, 0.0
        )

    def after_commit(self, result: CommitResult) -> None:
        """After a drain save (``result.order.drain``), as the SDK does: a rank that got
        SIGTERM exits (0 if it committed, else 1); the others hold until torchrun restarts
        them, and train on if ``hold_timeout`` passes first. A failed drain save on ranks
        that got no SIGTERM returns at once (the request stays pending: the next agreement
        tries again). Anything else: returns at once. Every rank calls it."""
        if not result.order.drain or not (result.committed or self.sigterm):
            return
        self.phase = "holding"
        saving.hold_or_exit(
            result.order.step,
            result.committed,
            sigterm=lambda: self.sigterm,
            holding=self.holding,
            tracker=self.tracker,
            hold_timeout=self.hold_timeout,
        )
        self.phase = "training"
        self._served_request = max(self._served_request, self.channel.newest_id())
        self.last_progress = time.monotonic()

    # -- resume -------------------------------------------------------------------------------
    def newest_staged(self) -> Complete | None:
        """The newest committed ``step-N`` in the checkpoint root whose manifest and files
        verify, decided by rank 0 and the same on every rank (collective). The framework
        loads it; then call :meth:`report_restore` with the step it restored."""
        self.phase = "restoring"
        found: Complete | None = None
        try:
            if self.rank == 0:
                r = self.ckdir.find_restorable()
                if r is not None:
                    found = Complete(r.path, r.manifest.step, r.manifest, r.skipped)
            found = dcp_io.broadcast_from_first(found, self.group)
        finally:
            self.phase = "training"
        return found

    def resume_staged(self) -> Complete | None:
        """The checkpoint to load (:meth:`newest_staged`), with each torn newer one it passed
        over logged; None, and the fresh start reported, when there is none. Collective."""
        found = self.newest_staged()
        if found is None:
            self.report_restore(0)
            return None
        for name, why in found.skipped:
            log.warning("resume skipped %s: %s", name, why)
        return found

    def newest_in_place(
        self, directory: str | os.PathLike[str], prefix: str = "checkpoint-"
    ) -> Complete | None:
        """The newest complete ``<prefix>N`` in ``directory`` (inside the checkpoint root),
        torn newer ones set aside (see :func:`find_complete`); collective."""
        self.phase = "restoring"
        try:
            found = None
            if self.rank == 0:
                found = scan_complete(Path(directory), prefix, set_aside=True)
            found = dcp_io.broadcast_from_first(found, self.group)
        finally:
            self.phase = "training"
        return found if isinstance(found, Complete) else None

    def report_restore(self, step: int, restored: Complete | Manifest | None = None) -> None:
        """The framework restored ``step`` (0: it started fresh): rank 0 records it in Redis
        (the controller counts ``steps lost`` from it, so give the step the FRAMEWORK
        restored, not what the checkpoint's name says). ``restored``, the checkpoint (or its
        manifest) it loaded, marks the requests that checkpoint answered as served."""
        manifest = restored.manifest if isinstance(restored, Complete) else restored
        if manifest is not None:
            self._served_request = max(self._served_request, manifest.request_id)
            if manifest.extra.get("drain"):
                self._served_at = max(self._served_at, manifest.created_at)
        if self.rank == 0:
            self.channel.report_restore(step, self.world, self.round)
        self.last_progress = time.monotonic()

    # -- the end ------------------------------------------------------------------------------
    def finish(self, step: int) -> None:
        """Training is over at ``step`` (its final checkpoint, if any, committed): rank 0
        tells the controller; the session's threads and group stop. Every rank calls it."""
        self.agreement.drain()
        if self.rank == 0:
            self.channel.report_finished(step)
        self.close()
        if self.distributed and dist.is_initialized() and self.group is not None:
            dist.barrier(group=self.group)  # no rank tears down a group another still reads
            dist.destroy_process_group(self.group)
            self.group = self.agreement.group = None

    def close(self) -> None:
        """Stop the session's threads and signal handling (idempotent)."""
        self.channel.stop()
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        self.phase = "closed"

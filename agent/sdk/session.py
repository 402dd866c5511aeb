"""A worker's checkpointing session: restore, the per-step agreement on saving, the saves
themselves, and the hold or exit after an emergency save (see the package docstring).
``TrainSession(fault_tolerance="replica")`` is :mod:`.replica_mode`'s session instead."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from spottrain.protocol.env import ENV_CKPT_DIR, ENV_NODE, ENV_REDIS, ENV_ROUND, ENV_RUN_ID
from spottrain.tracking import Tracker, WandbSettings

from ..checkpoint import dcp_io
from ..checkpoint.directory import CheckpointDir
from ..checkpoint.manifest import Manifest
from ..local_progress import ProgressFile
from . import saving
from .agreement import _DRAIN, _EARLY, _PERIODIC, _REQUEST, _SIGTERM, _ZEROS, Agreement, local_flags
from .channel import RequestChannel
from .modes import REPLICA, StepWork, resolve_mode
from .signals import SignalWatch
from .state import stage
from .timing import StepTimer
from .tracking import start_tracker

if TYPE_CHECKING:
    from .batch import GlobalBatch

log = logging.getLogger("spottrain.sdk")


class TrainSession:
    """Checkpointing for one worker of an elastic job (every rank makes one).

    Args:
        ckpt_dir: The shared checkpoint directory (default ``$SPOTTRAIN_CKPT_DIR``). It must
            exist and be writable: a missing mount is an error, not an empty new directory.
        every_steps: Save every this many steps (0: never by count).
        every_seconds: Save when this many seconds passed since the last save (0: never).
        keep: Committed checkpoints to keep.
        thread_count: Writer threads per rank.
        async_periodic: Periodic saves copy the state in memory and write it in the
            background while training goes on (emergency and final saves are always
            synchronous: nothing may run past them).
        hold_timeout: After an emergency save for a drain, how long a rank that was not
            told to stop waits for its torchrun to restart it before training on.
        agree_interval: Seconds between two agreements on whether to save. Every rank
            proposes how many steps that is from its own step time; all take the largest
            proposal (at most 64 steps), so a request is acted on within about two intervals.
        stuck_grace: After SIGTERM, a worker whose training loop makes no progress for this
            long (or three median steps, if longer) is stuck in a collective with a dead peer
            and exits at once rather than making torchrun wait.
        redis_url: The job's Redis (default ``$SPOTTRAIN_REDIS``); without it there are no
            injected requests, no progress reports and no round check in Redis.
        run_id: Default ``$TORCHELASTIC_RUN_ID`` (torchrun's ``--rdzv-id``).
        install_signal_handlers: Catch SIGTERM (set False if the script handles it).
        tracking: Rank 0's wandb run: True (default) takes the settings from
            ``WANDB_PROJECT``, ``WANDB_ENTITY``, ``WANDB_MODE`` and ``WANDB_RUN_GROUP`` (no
            project: a run the script started with ``wandb.init`` is used, else nothing is
            tracked); explicit :class:`~spottrain.tracking.WandbSettings`; False: off.
        report_interval: Seconds between two reports of this rank's compute time (and, from
            local rank 0, the node's step time) to its node record in Redis.
        fault_tolerance: ``"elastic"`` (this class) or ``"replica"`` (this class with
            the methods of :class:`~.replica_mode.ReplicaMode` first); default
            ``$SPOTTRAIN_FAULT_TOLERANCE``, else elastic.
    """

    def __new__(cls, *args: Any, fault_tolerance: str | None = None, **kwargs: Any) -> TrainSession:
        # The job's spec picks the mode through the workers' environment: the same script
        # gets the replica session without a change.
        if cls is TrainSession and resolve_mode(fault_tolerance) == REPLICA:
            return super().__new__(_replica_session())
        return super().__new__(cls)

    def __init__(
        self,
        ckpt_dir: str | os.PathLike[str] | None = None,
        *,
        every_steps: int = 0,
        every_seconds: float = 0.0,
        keep: int = 3,
        thread_count: int = 4,
        async_periodic: bool = True,
        hold_timeout: float = 180.0,
        agree_interval: float = 0.2,
        stuck_grace: float = 5.0,
        redis_url: str | None = None,
        run_id: str | None = None,
        poll_interval: float = 0.2,
        install_signal_handlers: bool = True,
        tracking: WandbSettings | bool = True,
        report_interval: float = 5.0,
        fault_tolerance: str | None = None,
    ) -> None:
        self.fault_tolerance = resolve_mode(fault_tolerance)
        root = ckpt_dir if ckpt_dir is not None else os.environ.get(ENV_CKPT_DIR)
        if not root:
            raise ValueError(
                f"no checkpoint directory: pass ckpt_dir= or set ${ENV_CKPT_DIR} to the shared "
                "checkpoint mount"
            )
        if keep < 1:
            raise ValueError(f"keep={keep}: keep at least 1 checkpoint")
        self.ckdir = CheckpointDir(root)
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.keep = keep
        self.thread_count = thread_count
        self.async_periodic = async_periodic
        self.hold_timeout = hold_timeout
        self.agree_interval = agree_interval
        self.stuck_grace = stuck_grace
        self.round = int(os.environ.get(ENV_ROUND, "-1"))
        self.node = os.environ.get(ENV_NODE, socket.gethostname())
        self._start_groups()
        self._start_loop_state()
        self.run_id = run_id or os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get(ENV_RUN_ID)
        self._requests = RequestChannel(
            redis_url if redis_url is not None else os.environ.get(ENV_REDIS),
            self.run_id,
            poll_interval,
            active=self.rank == 0,
        )
        self._tracker = (
            start_tracker(tracking, self.run_id, self.round, self.world)
            if self.rank == 0
            else Tracker()
        )
        self._start_step_reporter(report_interval)
        self._watchdog = self._install_signal_watch() if install_signal_handlers else None

    def _start_groups(self) -> None:
        """The process groups of the SDK's own, the save thread, and this session's fencing
        epoch (claimed by rank 0 and the same on every rank)."""
        self._dist = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._dist else 0
        self.world = dist.get_world_size() if self._dist else 1
        # Collectives of our own never interleave with the script's: a separate gloo group.
        self._group: Any = None
        if self._dist:
            self._group = dist.new_group(backend="gloo", timeout=timedelta(minutes=10))
        # Asynchronous saves run their collectives on a thread of their own: another group.
        self._async_group: Any = None
        if self._dist:
            self._async_group = dist.new_group(backend="gloo", timeout=timedelta(minutes=10))
        # A new thread starts on CUDA device 0: the save thread takes the script's device, so
        # staging copies and DCP's streams stay on this rank's GPU.
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
        self._executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="spottrain-save",
            initializer=saving.use_cuda_device,
            initargs=(device,),
        )
        self._inflight: Future[bool] | None = None
        self.epoch = -1
        if self.rank == 0:
            self.ckdir.check_writable()  # fail before any training, not at the first save
            self.epoch = self.ckdir.claim_epoch(saving.generation(self.round, self.node))
        self.epoch = dcp_io.broadcast_from_first(self.epoch, self._group)

    def _start_loop_state(self) -> None:
        # A plain bool: the signal handler must not take a lock (an Event's would deadlock
        # if the signal lands while the main thread holds it).
        self._sigterm = False
        self._holding = threading.Event()
        self._phase = "starting"
        self._last_progress = time.monotonic()
        self._timer = StepTimer()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self._local_progress = ProgressFile.from_env()  # the agent's dead man's switch reads it
        self._agreement = Agreement(
            self._group, self.agree_interval, self._local_flags, lambda: self.last_step_time
        )
        self._last_save_step = -1
        self._last_save_time = time.monotonic()
        self._served_request = 0
        self._served_at = 0.0  # requests made before a drain checkpoint are answered by it
        self.saves: list[dcp_io.SaveResult] = []
        self.last_restored: Manifest | None = None
        self._next_step = 0

    def _start_step_reporter(self, report_interval: float) -> None:
        self._step_reporter: threading.Thread | None = None
        if self._requests.client is not None:
            # Every rank tells the controller how long its own compute takes, which is how
            # it finds stragglers (a node's figure is its slowest rank's).
            self._step_reporter = threading.Thread(
                target=self._timer.report_loop,
                args=(
                    self._requests.client,
                    self._requests.keys,
                    self.node,
                    self.local_rank,
                    report_interval,
                    self._requests.stop_event,
                ),
                name="spottrain-step-time",
                daemon=True,
            )
            self._step_reporter.start()

    def _install_signal_watch(self) -> SignalWatch | None:
        if threading.current_thread() is threading.main_thread():
            return SignalWatch(
                self._on_sigterm,
                self._holding,
                self._stuck,
                lambda: time.monotonic() - self._last_progress,
                self._tracker,
            )
        log.warning(
            "TrainSession made off the main thread: SIGTERM is not caught, so a "
            "shutdown will not trigger an emergency checkpoint"
        )
        return None

    # -- restore ----------------------------------------------------------------------------
    def restore(self, state: dict[str, Any]) -> int:
        """Load the newest checkpoint whose manifest verifies into ``state``; return its step
        (0 when there is none). Each newer checkpoint that fails is logged and skipped."""
        self._phase = "restoring"
        choice: tuple[str, Manifest] | None = None
        if self.rank == 0:
            found = self.ckdir.find_restorable()
            for name, why in found.skipped if found else []:
                log.warning("restore skipped %s: %s", name, why)
            if found is not None:
                choice = (str(found.path), found.manifest)
        choice = dcp_io.broadcast_from_first(choice, self._group)
        step = 0
        if choice is not None:
            path, manifest = choice
            dcp_io.load(state, Path(path), group=self._group)  # CheckpointLoadError: see there
            step = manifest.step
            self._served_request = manifest.request_id
            if manifest.extra.get("drain"):
                self._served_at = manifest.created_at
            self._last_save_step = step
            self.last_restored = manifest
            log.info(
                "restored step %d from %s (saved by world size %d, round %d)",
                step,
                path,
                manifest.world_size,
                manifest.round,
            )
        if self.rank == 0:
            self._requests.report_restore(step, self.world, self.round)
        self._next_step = step
        self._phase = "training"
        self._mark()
        return step

    # -- every step -------------------------------------------------------------------------
    def step(
        self,
        step: int,
        state: dict[str, Any],
        *,
        tokens: float | None = None,
        compute_s: float | None = None,
        **metrics: float,
    ) -> None:
        """Tell the SDK that ``step`` optimizer steps are done; it may save here.

        Every rank must call it after every step. It returns at once unless a save is due;
        after an emergency save for a drain it does not return (the worker exits or holds
        until torchrun restarts it).

        ``metrics`` (``loss=...``) are reported to the controller and tracked. ``tokens``
        is how many tokens this step trained on across all ranks (global batch x sequence
        length): rank 0 tracks ``tokens_per_s`` from it and the step's time. ``compute_s``
        is this rank's own compute time for the step (forward and backward, without waiting
        on the all-reduce), for scripts that time it themselves rather than with
        :meth:`compute`.
        """
        self._timer.close_compute(compute_s)  # first: a bad compute_s changes nothing
        self._next_step = step
        now = time.monotonic()
        step_s = now - self._last_progress
        self._timer.step_times.append(step_s)
        self._mark()
        self._local_progress.report(step)
        if tokens is not None:
            metrics["tokens"] = tokens
        if self.rank == 0 and metrics:
            self._requests.report_progress(step, self.world, self.round, metrics)
        if self._tracker.active:
            row: dict[str, float] = {"step": step, **metrics}
            row["step_time_s"] = step_s
            row["world_size"] = self.world
            if tokens is not None and step_s > 0:
                row["tokens_per_s"] = tokens / step_s
            self._tracker.log(row)
        flags = _ZEROS
        if self._agreement.due(step):
            self._phase = "agreeing"
            flags = self._agreement.agree(step)
            self._phase = "training"
        kind = None
        if flags[_DRAIN] or flags[_SIGTERM]:
            kind = "emergency"
        elif flags[_EARLY]:
            kind = "requested"
        elif (self.every_steps and step % self.every_steps == 0) or flags[_PERIODIC]:
            kind = "periodic"
        committed = True
        if kind is not None and step != self._last_save_step:
            drain = bool(flags[_DRAIN] or flags[_SIGTERM])
            committed = self._save(step, state, kind, request_id=flags[_REQUEST], drain=drain)
        if kind == "emergency" and (committed or self._sigterm):
            self._after_drain_save(step, committed)
        # A drain save that failed is not held on: the request stays pending, so the next
        # agreement tries again while there is time.
        self._mark()

    def finish(self, step: int, state: dict[str, Any]) -> None:
        """Save the final state (unless step ``step`` is saved already) and stop the SDK's
        threads. Every rank calls it once, after the last step."""
        self._agreement.drain()
        # The periodic save of this very step may still be running, and may yet fail: its
        # outcome decides (the same on every rank) whether a final save is needed.
        self._wait_async()
        if step != self._last_save_step:
            self._save(step, state, "final", request_id=0, drain=False)
        if self.rank == 0:
            self._requests.report_finished(step)
        self.close()
        self._release_groups()

    def _release_groups(self) -> None:
        """Destroy the SDK's groups while the interpreter is whole: left to its exit, gloo's
        teardown could abort a finished rank, and torchrun would count the run as failed."""
        if self._dist and dist.is_initialized():
            dist.barrier(group=self._group)  # no rank tears down a group another still reads
            for group in (self._async_group, self._group):
                dist.destroy_process_group(group)
            self._group = self._async_group = self._agreement.group = None

    def close(self) -> None:
        self._wait_async()
        self._executor.shutdown(wait=True)
        self._requests.stop()
        self._tracker.finish()
        if self._watchdog is not None:
            self._watchdog.stop()
        self._phase = "closed"

    def compute(self) -> contextlib.AbstractContextManager[None]:
        """Time what the block runs as this step's compute: wrap the forward and backward,
        not the gradient all-reduce (whose wait is the same on every rank). Several blocks
        in one step (micro-batches) add up."""
        return self._timer.compute()

    def time_ddp(self, model: Any, hook: Any = None, state: Any = None) -> None:
        """Let :meth:`compute` leave out a ``DistributedDataParallel`` model's wait for its
        gradient all-reduce, which DDP runs inside the backward: a span around the forward
        and backward then ends when the backward's last gradient bucket is ready, before
        the wait for the slowest rank's gradients (without this, every rank's figure
        evens out at the slowest's and the controller cannot tell a straggler).

        It registers a DDP communication hook that marks the time and calls ``hook`` (the
        hook the script would register itself, ``hook(state, bucket)``; default: DDP's own
        all-reduce, ``state`` the process group, None for the default one). Call it once,
        instead of ``model.register_comm_hook``. A forward's ``broadcast_buffers`` (on by
        default, when the model has buffers) still waits for every rank inside the span;
        FSDP has no such hook: its all-gathers stay in the span.
        """
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        inner = allreduce_hook if hook is None else hook
        timer = self._timer
        # A lambda: DDP refuses a hook whose ``bucket`` annotation is not the GradBucket
        # class itself, and this module's annotations are strings.
        model.register_comm_hook(state, lambda st, bucket: _marked(timer, inner, st, bucket))

    @property
    def compute_time(self) -> float | None:
        """Median compute seconds per step over the recent steps (None: not timed)."""
        return self._timer.compute_time

    @property
    def discarded(self) -> int:
        """Steps discarded and redone (replica mode); an elastic step never is."""
        return 0

    @property
    def last_step_time(self) -> float:
        """Median seconds per step over the recent steps."""
        return self._timer.last_step_time

    # -- the mode-neutral step: the same loop runs in replica mode --------------------------
    def begin_step(self, batch: GlobalBatch) -> StepWork:
        """The next step's number and this rank's micro-batches of it (elastic: ``batch``'s
        own, weighted for gradients averaged over the ranks)."""
        step = self._next_step
        return StepWork(step, tuple(batch.micro_ranges(step)), batch.world / batch.global_size)

    def wrap_ddp(self, module: torch.nn.Module) -> torch.nn.Module:
        """``module`` in DDP over the world (replica mode: across the replicas)."""
        if not self._dist:
            return module
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module)

    def use_fsdp(self, model: torch.nn.Module) -> torch.nn.Module:
        """After ``fully_shard``: nothing here (replica mode makes its reduce a sum)."""
        return model

    def commit(
        self, params: Iterable[torch.nn.Parameter] = (), *, extra: Sequence[torch.Tensor] = ()
    ) -> bool:
        """Average ``params``' gradients (none: DDP did; FSDP2's shards are skipped, their
        reduce-scatter did) and ``extra`` tensors (such as the step's weighted loss) over the
        ranks, in place; whether to step the optimizer (always, elastic; replica mode: False
        when the step is discarded and must be redone)."""
        return saving.average(list(params), list(extra), self.world if self._dist else 1)

    def end_step(self, state: dict[str, Any], **metrics: float) -> int:
        """:meth:`step` for the step :meth:`begin_step` gave; returns the next step's
        number."""
        self.step(self._next_step + 1, state, **metrics)
        return self._next_step

    # -- internals --------------------------------------------------------------------------
    _write = saving.write
    _after_drain_save = saving.after_drain_save

    def _mark(self) -> None:
        self._last_progress = time.monotonic()

    def _on_sigterm(self) -> None:
        self._sigterm = True

    def _local_flags(self) -> list[int] | None:
        """This rank's flags, or None when all are zero (the common case, made cheap)."""
        periodic = (
            self.every_seconds > 0
            and self.rank == 0
            and time.monotonic() - self._last_save_time >= self.every_seconds
        )
        request = self._requests.pending(self._served_request, self._served_at)
        return local_flags(self._sigterm, request, periodic)

    def _save(
        self, step: int, state: dict[str, Any], kind: str, *, request_id: int, drain: bool
    ) -> bool:
        """Save (or start saving, for a periodic save); return whether it committed (True
        for a save still running in the background)."""
        # The reduce in flight was started before this save: finish it first so that the
        # save's own collectives on the group come after it on every rank.
        pending = self._agreement.drain()
        self._wait_async()  # one save at a time, in step order
        t0 = time.monotonic()
        self._last_save_step = step
        self._last_save_time = t0
        if kind == "periodic" and self.async_periodic:
            # Copy the state (memory speed), then write it while training goes on.
            self._phase = "staging"
            snapshot = stage(state)
            self._phase = "training"
            self._inflight = self._executor.submit(
                self._write, snapshot, step, kind, request_id, drain, self._async_group, t0
            )
            committed = True
        else:
            self._phase = "saving"
            try:
                committed = self._write(state, step, kind, request_id, drain, self._group, t0)
            finally:
                self._phase = "training"
                self._mark()  # a long save is progress, not a stuck loop
        self._agreement.restart(pending)
        return committed

    def _wait_async(self) -> None:
        if self._inflight is not None:
            phase, self._phase = self._phase, "saving"
            try:
                self._inflight.result()
            finally:
                self._phase = phase
                self._inflight = None
                self._mark()

    def _stuck(self) -> bool:
        """Whether the training loop looks stuck (SIGTERM is pending, no save running)."""
        if self._phase in ("saving", "staging", "restoring", "closed"):
            return False
        limit = max(self.stuck_grace, 3 * self.last_step_time)
        return time.monotonic() - self._last_progress > limit


@functools.cache
def _replica_session() -> type[TrainSession]:
    """TrainSession with replica mode's methods first (made on first use: replica mode
    imports torchft, which elastic jobs never load)."""
    from .replica_mode import ReplicaMode

    class ReplicaTrainSession(ReplicaMode, TrainSession):
        __doc__ = ReplicaMode.__doc__

    return ReplicaTrainSession


def _marked(timer: StepTimer, hook: Any, state: Any, bucket: Any) -> Any:
    """Mark the compute span's end (this bucket's gradients are ready), then run ``hook``."""
    timer.mark_compute_end()
    return hook(state, bucket)

"""The trainer SDK: what a training script calls so that a preemption loses no progress.

A script restores the newest complete checkpoint (or starts fresh), then tells the SDK after
every optimizer step::

    session = TrainSession(every_steps=100)
    state = {"model": ModelState(model, optimizer, scheduler), "rng": RngState()}
    step = session.restore(state)
    batch = GlobalBatch(global_size=256, micro_size=8, world=session.world, rank=session.rank)
    while step < total:
        with session.compute():                   # this rank's own compute time
            for samples in batch.micro_ranges(step):
                ...                               # forward/backward on those samples
        ...                                       # all-reduce, optimizer step
        step += 1
        session.step(step, state, loss=loss.item(), tokens=256 * seq_len)
    session.finish(step, state)

**Compute time.** Synchronous data-parallel training makes every rank's wall time per step
the same (the gradient all-reduce waits for the slowest), so a slow node cannot be told
from that. A script wraps its forward and backward, before the all-reduce, in
``with session.compute():`` (or passes ``compute_s=`` to :meth:`TrainSession.step`); each
rank reports the median of its own compute seconds per step to its node's record in Redis
(``compute:<local rank>``), and the controller takes a node's slowest local rank as the
node's figure when it looks for stragglers. On a GPU the span is timed with CUDA events on
the current stream, read once they completed (no synchronisation is added).

**Agreeing on the step.** At agreement steps, :meth:`TrainSession.step` starts one tiny
all-reduce (MAX of six integers) on a gloo group of its own, and at the next agreement step
it waits for it and starts the next. The reduce runs while the steps in between compute, and
every rank decides from the same reduced numbers, so all ranks save at the same step. The
numbers include each rank's proposal for the distance to the next agreement (about
``agree_interval`` seconds of steps, at most 64): all ranks take the largest, so they stay
in lockstep while fast CPU steps agree every few steps and slow GPU steps every step. A
request is acted on within about two intervals. The cheaper-looking alternatives are wrong:
each rank polling Redis on its own sees a request at different steps, and a step chosen
ahead ("save at step s+2") can already be behind a rank that is fast. A blocking all-reduce
every step is correct but costs a round trip per step. ``bench/checkpoint.py`` measures
these.

**Where requests come from.** A rank that gets SIGTERM (a VM shutting down, torchrun
stopping its workers) raises the drain flag itself; rank 0 polls the run's checkpoint
requests in Redis, which the agent writes when its watchers see a notice. After an
emergency save for a drain, ranks that got SIGTERM exit 0; the others hold, without
training, until their torchrun stops them for the new round (or ``hold_timeout`` passes).

**Tracking.** With wandb configured (``WANDB_PROJECT`` in the environment, which the job
spec's ``wandb:`` section sets on every VM), rank 0 logs each step (the metrics given to
:meth:`TrainSession.step`, ``step_time_s``, ``world_size`` and, from ``tokens=``,
``tokens_per_s``) and records each committed checkpoint as a wandb reference artifact; see
:mod:`spottrain.tracking`. Each rendezvous round is a wandb run of its own
(``<run id>-r<round>``) in the group ``<run id>``, plotted against ``step``.

**Commit and fencing.** See :mod:`spottrain.agent.checkpoint.directory`. Each session is a
generation of writers: rank 0 claims a fencing epoch from the checkpoint directory when the
session starts and shares it with every rank. A save is committed by rank 0 only if no newer
epoch has been claimed there since, and, while Redis holds the rendezvous, no newer round
(``SPOTTRAIN_RDZV_ROUND``, set by the Redis rendezvous) trains: a node frozen mid-save and
woken after its peers moved on cannot overwrite their progress. Rounds that restart at 0 (a
Redis that lost its data, expired keys, a relaunch under a new ``--rdzv-id``) start a new
generation with a higher epoch and commit as usual. A refused commit is an error in the log,
a ``checkpoint-refused`` event in the run's stream and a count in ``ckpt:refused``, which
``spottrain status`` and a draining agent report.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import pickle
import random
import signal
import socket
import statistics
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from spottrain.keys import EVENTS_MAXLEN, RunKeys
from spottrain.tracking import Tracker, WandbSettings, active_run, run_id_for, start_run

from .checkpoint import dcp_io
from .checkpoint.directory import CheckpointDir
from .checkpoint.manifest import Manifest
from .local_progress import ProgressFile

log = logging.getLogger("spottrain.sdk")

ENV_CKPT_DIR = "SPOTTRAIN_CKPT_DIR"
ENV_REDIS = "SPOTTRAIN_REDIS"
ENV_ROUND = "SPOTTRAIN_RDZV_ROUND"
ENV_NODE = "SPOTTRAIN_NODE_ID"
ENV_COPY_TO = "SPOTTRAIN_CKPT_COPY_TO"
# Seconds between the progress events rank 0 adds to the run's event stream.
PROGRESS_EVENT_S = 60.0
# How long an exiting worker gives wandb to write its last records (the checkpoint that
# matters is committed by then; the VM may have seconds left).
_EXIT_TRACKING_S = 3.0

# Positions in the agreement vector (all-reduced with MAX).
_DRAIN, _EARLY, _PERIODIC, _REQUEST, _SIGTERM, _EVERY = range(6)
_NFLAGS = 6
_MAX_AGREE_EVERY = 64
_ZEROS = [0] * _NFLAGS


# -- the global batch ----------------------------------------------------------------------------
@dataclass(frozen=True)
class GlobalBatch:
    """A global batch that stays the same whatever the world size.

    Each optimizer step consumes samples ``[step * global_size, (step + 1) * global_size)``
    of the (deterministic) sample order, cut into micro-batches of ``micro_size`` (the last
    one shorter when ``micro_size`` does not divide ``global_size``); micro-batch ``j`` goes
    to rank ``j % world``. Gradient accumulation takes up the slack when the world shrinks,
    and any world size up to the number of micro-batches works: ranks run counts that differ
    by at most one, and :meth:`weight` scales each micro-batch's mean loss so that gradients
    averaged over the ranks are the mean over the global batch's samples, whatever the split.
    The data position is therefore global (it is the step), and no sample is skipped or
    repeated across a resize.

    Raises:
        ValueError: a size is not positive, or the world has more ranks than a step has
            micro-batches (a rank would have nothing to do).
    """

    global_size: int
    micro_size: int
    world: int
    rank: int

    def __post_init__(self) -> None:
        if self.global_size <= 0 or self.micro_size <= 0 or self.world <= 0:
            raise ValueError(
                f"global batch {self.global_size}, micro batch {self.micro_size} and world "
                f"size {self.world} must all be positive"
            )
        if self.world > self.micro_batches:
            raise ValueError(
                f"global batch {self.global_size} in micro batches of {self.micro_size} is "
                f"{self.micro_batches} micro-batch(es), fewer than world size {self.world}: "
                "every rank needs at least one. The largest usable world size is "
                f"{self.micro_batches}; lower the micro batch or raise the global batch (or "
                "cap nodes.max x GPUs per node at it)"
            )
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside world size {self.world}")

    @property
    def micro_batches(self) -> int:
        """Micro-batches in one step, over all ranks."""
        return -(-self.global_size // self.micro_size)

    @property
    def accum_steps(self) -> int:
        """Micro-batches this rank runs per optimizer step."""
        return len(range(self.rank, self.micro_batches, self.world))

    def micro_ranges(self, step: int) -> list[range]:
        """This rank's micro-batches of ``step``, as ranges of global sample indices."""
        base = step * self.global_size
        end = base + self.global_size
        out = []
        for j in range(self.rank, self.micro_batches, self.world):
            start = base + j * self.micro_size
            out.append(range(start, min(start + self.micro_size, end)))
        return out

    def weight(self, micro: range) -> float:
        """The factor for ``micro``'s mean loss (``loss * weight``, then backward) when the
        ranks' gradients are then averaged (summed and divided by the world size, as DDP
        does): ``len(micro) * world / global_size``. It is ``1 / accum_steps`` when the
        sizes divide evenly; with uneven splits it weights every sample the same."""
        return len(micro) * self.world / self.global_size


# -- state ------------------------------------------------------------------------------------
class ModelState(Stateful):
    """Model, optimizer and LR schedule as one DCP item; sharded (FSDP) and replicated
    (DDP or plain) models both work, through torch's distributed state-dict helpers."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": get_model_state_dict(self.model)}
        if self.optimizer is not None:
            out["optim"] = get_optimizer_state_dict(self.model, self.optimizer)
        if self.scheduler is not None:
            out["sched"] = self.scheduler.state_dict()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict["model"])
        if self.optimizer is not None:
            set_optimizer_state_dict(self.model, self.optimizer, state_dict["optim"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state_dict["sched"])


class RngState(Stateful):
    """The default random generators (torch CPU and CUDA, Python, NumPy if present).

    Saved once for the job (rank 0's copy wins the dedup of a replicated item). Randomness
    that must not depend on the world size belongs to the samples: seed it from the global
    sample index (see ``examples/gpt_train.py``).
    """

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "python": pickle.dumps(random.getstate()),
        }
        if torch.cuda.is_available():
            out["cuda"] = torch.cuda.get_rng_state()
        np = sys.modules.get("numpy")
        if np is not None:
            out["numpy"] = pickle.dumps(np.random.get_state())
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["torch"])
        random.setstate(pickle.loads(state_dict["python"]))
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["cuda"])
        np = sys.modules.get("numpy")
        if "numpy" in state_dict and np is not None:
            np.random.set_state(pickle.loads(state_dict["numpy"]))


# -- the session ------------------------------------------------------------------------------
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
    """

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
    ) -> None:
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
            initializer=_use_cuda_device,
            initargs=(device,),
        )
        self._inflight: Future[bool] | None = None

        # This session's fencing epoch, claimed by rank 0 and the same on every rank.
        self.epoch = -1
        if self.rank == 0:
            self.ckdir.check_writable()  # fail before any training, not at the first save
            self.epoch = self.ckdir.claim_epoch(_generation(self.round, self.node))
        self.epoch = dcp_io.broadcast_from_first(self.epoch, self._group)

        # A plain bool: the signal handler must not take a lock (an Event's would deadlock
        # if the signal lands while the main thread holds it).
        self._sigterm = False
        self._holding = threading.Event()
        self._phase = "starting"
        self._last_progress = time.monotonic()
        self._step_times: deque[float] = deque(maxlen=20)
        self._compute_times: deque[float] = deque(maxlen=20)
        self._compute_acc = 0.0  # this step's compute seconds so far (host clock)
        self._computed = False  # whether compute() ran in this step
        self._gpu_marks: list[tuple[Any, Any]] = []  # this step's CUDA event pairs
        self._gpu_pending: deque[list[tuple[Any, Any]]] = deque()  # steps not yet read
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self._local_progress = ProgressFile.from_env()  # the agent's dead man's switch reads it
        self._pending: tuple[Any, torch.Tensor] | None = None
        self._agree_every = 1
        self._next_agree = 0
        self._bufs = (
            torch.zeros(_NFLAGS, dtype=torch.int64),
            torch.zeros(_NFLAGS, dtype=torch.int64),
        )
        self._buf_index = 0
        self._last_save_step = -1
        self._last_save_time = time.monotonic()
        self._served_request = 0
        self._served_at = 0.0  # requests made before a drain checkpoint are answered by it
        self.saves: list[dcp_io.SaveResult] = []
        self.last_restored: Manifest | None = None

        self.run_id = (
            run_id or os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SPOTTRAIN_RUN_ID")
        )
        self._requests = _RequestPoller(
            redis_url if redis_url is not None else os.environ.get(ENV_REDIS),
            self.run_id,
            poll_interval,
            active=self.rank == 0,
        )
        self._tracker = self._start_tracking(tracking) if self.rank == 0 else Tracker()
        self._step_reporter: threading.Thread | None = None
        if self._requests.client is not None:
            # Every rank tells the controller how long its own compute takes, which is how
            # it finds stragglers (a node's figure is its slowest rank's).
            self._step_reporter = threading.Thread(
                target=self._report_step_time,
                args=(report_interval,),
                name="spottrain-step-time",
                daemon=True,
            )
            self._step_reporter.start()
        self._watchdog: _SignalWatch | None = None
        if install_signal_handlers:
            if threading.current_thread() is threading.main_thread():
                self._watchdog = _SignalWatch(self)
            else:
                log.warning(
                    "TrainSession made off the main thread: SIGTERM is not caught, so a "
                    "shutdown will not trigger an emergency checkpoint"
                )

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
        self._close_compute(compute_s)  # first: a bad compute_s changes nothing
        now = time.monotonic()
        step_s = now - self._last_progress
        self._step_times.append(step_s)
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
        if step >= self._next_agree:
            flags = self._exchange()
            # Every rank got the same proposals, so every rank picks the same next step.
            self._agree_every = max(1, flags[_EVERY])
            self._next_agree = step + self._agree_every
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
        self._drain_pending()
        # The periodic save of this very step may still be running, and may yet fail: its
        # outcome decides (the same on every rank) whether a final save is needed.
        self._wait_async()
        if step != self._last_save_step:
            self._save(step, state, "final", request_id=0, drain=False)
        if self.rank == 0:
            self._requests.report_finished(step)
        self.close()

    def close(self) -> None:
        self._wait_async()
        self._executor.shutdown(wait=True)
        self._requests.stop()
        self._tracker.finish()
        if self._watchdog is not None:
            self._watchdog.stop()
        self._phase = "closed"

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """Time what the block runs as this step's compute: wrap the forward and backward,
        not the gradient all-reduce (whose wait is the same on every rank). Several blocks
        in one step (micro-batches) add up."""
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        start = end = None
        if cuda:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
        t0 = time.monotonic()
        try:
            yield
        finally:
            if cuda:
                end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                end.record()
                self._gpu_marks.append((start, end))
            else:
                self._compute_acc += time.monotonic() - t0
            self._computed = True

    def _close_compute(self, compute_s: float | None) -> None:
        """File the step's compute time; CUDA-timed steps are read once their events have
        completed, so reading never waits on the GPU (unless 8 steps are still pending)."""
        if compute_s is not None:
            if not (compute_s >= 0 and math.isfinite(compute_s)):
                raise ValueError(
                    f"compute_s={compute_s!r}: give this step's compute seconds, a finite "
                    "number >= 0"
                )
            self._compute_times.append(compute_s)
            self._gpu_marks = []
        elif self._gpu_marks:
            self._gpu_pending.append(self._gpu_marks)
            self._gpu_marks = []
        elif self._computed:
            self._compute_times.append(self._compute_acc)
        self._compute_acc = 0.0
        self._computed = False
        while self._gpu_pending and (
            len(self._gpu_pending) > 8 or all(e.query() for _, e in self._gpu_pending[0])
        ):
            pairs = self._gpu_pending.popleft()
            for _, e in pairs:
                e.synchronize()
            self._compute_times.append(sum(s.elapsed_time(e) for s, e in pairs) / 1000.0)

    @property
    def compute_time(self) -> float | None:
        """Median compute seconds per step over the recent steps (None: not timed)."""
        return statistics.median(self._compute_times) if self._compute_times else None

    def _report_step_time(self, every: float) -> None:
        client, keys = self._requests.client, self._requests.keys
        while not self._requests._stop.wait(every):
            if keys is None:
                continue
            fields = {}
            if self.local_rank == 0 and self._step_times:
                fields["step_time"] = f"{self.last_step_time:.4f}"
            compute = self.compute_time
            if compute is not None:
                # With the time it was measured: the controller ignores a rank that stopped
                # reporting (a round with fewer local ranks, a worker that holds).
                fields[f"compute:{self.local_rank}"] = f"{compute:.4f} {time.time():.0f}"
            if not fields:
                continue
            try:
                client.hset(keys.node(self.node), mapping=fields)
            except Exception:  # Redis away: the next report will do
                continue

    @property
    def last_step_time(self) -> float:
        """Median seconds per step over the recent steps."""
        return statistics.median(self._step_times) if self._step_times else 0.0

    # -- internals --------------------------------------------------------------------------
    def _mark(self) -> None:
        self._last_progress = time.monotonic()

    def _local_flags(self) -> list[int] | None:
        """This rank's flags, or None when all are zero (the common case, made cheap)."""
        flags: list[int] | None = None
        if self._sigterm:
            flags = [0] * _NFLAGS
            flags[_SIGTERM] = 1
        req = self._requests.pending(self._served_request, self._served_at)
        if req is not None:
            flags = flags or [0] * _NFLAGS
            req_id, drain = req
            flags[_REQUEST] = req_id
            flags[_DRAIN if drain else _EARLY] = 1
        if (
            self.every_seconds > 0
            and self.rank == 0
            and time.monotonic() - self._last_save_time >= self.every_seconds
        ):
            flags = flags or [0] * _NFLAGS
            flags[_PERIODIC] = 1
        return flags

    def _exchange(self) -> list[int]:
        """Wait for the reduce started at the previous step; start the next one."""
        self._phase = "agreeing"
        if not self._dist:
            self._phase = "training"
            return self._local_flags() or _ZEROS
        flags = _ZEROS
        if self._pending is not None:
            work, buf = self._pending
            work.wait()
            flags = buf.tolist()
        self._pending = None
        self._start_reduce()
        self._phase = "training"
        return flags

    def _proposed_interval(self) -> int:
        """Steps until the next agreement, so that agreements come about every
        ``agree_interval`` seconds: every step when steps are slow, every few when fast."""
        step_s = self.last_step_time
        if step_s <= 0:
            return 1
        return max(1, min(_MAX_AGREE_EVERY, int(self.agree_interval / step_s)))

    def _start_reduce(self) -> None:
        # Two buffers in turn: one may still be read by the reduce in flight.
        self._buf_index ^= 1
        buf = self._bufs[self._buf_index]
        local = self._local_flags() or list(_ZEROS)
        local[_EVERY] = self._proposed_interval()
        buf.copy_(torch.tensor(local, dtype=torch.int64))
        work = dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._pending = (work, buf)

    def _drain_pending(self) -> None:
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None

    def _save(
        self, step: int, state: dict[str, Any], kind: str, *, request_id: int, drain: bool
    ) -> bool:
        """Save (or start saving, for a periodic save); return whether it committed (True
        for a save still running in the background)."""
        # The reduce in flight was started before this save: finish it first so that the
        # save's own collectives on the group come after it on every rank.
        pending = self._pending
        self._drain_pending()
        self._wait_async()  # one save at a time, in step order
        t0 = time.monotonic()
        self._last_save_step = step
        self._last_save_time = t0
        if kind == "periodic" and self.async_periodic:
            # Copy the state (memory speed), then write it while training goes on.
            self._phase = "staging"
            snapshot = _stage(state)
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
        self._restart_exchange(pending)
        return committed

    def _write(
        self,
        state: dict[str, Any],
        step: int,
        kind: str,
        request_id: int,
        drain: bool,
        group: Any,
        t0: float,
    ) -> bool:
        try:
            result = dcp_io.save(
                state,
                self.ckdir,
                step=step,
                round_=self.round,
                kind=kind,
                request_id=request_id,
                extra={"node": self.node, "drain": drain},
                group=group,
                fence=self._requests.fence,
                thread_count=self.thread_count,
                keep=self.keep,
                epoch=self.epoch,
            )
        except dcp_io.CheckpointWriteError as exc:
            log.error("%s checkpoint at step %d failed: %s", kind, step, exc)
            if self._last_save_step == step:
                self._last_save_step = -1  # so that finish() tries this step again
            return False
        self.saves.append(result)
        self._served_request = max(self._served_request, request_id)
        if drain and result.manifest is not None:
            self._served_at = result.manifest.created_at
        if result.refused is not None and self.rank == 0:
            self._requests.report_refused(result, kind, drain, request_id, self.round, self.epoch)
        if result.committed and self.rank == 0:
            log.warning(
                "%s checkpoint step %d committed in %.2f s (%s)",
                kind,
                step,
                time.monotonic() - t0,
                result.path,
            )
            self._requests.report_commit(result, kind, drain, request_id)
            self._track_commit(result, kind, drain)
        return result.committed

    def _start_tracking(self, option: WandbSettings | bool) -> Tracker:
        """Rank 0's wandb run (see the module docstring): one per rendezvous round, so a
        re-formed group starts a new run of the job's group, and a rank 0 restarted in the
        same round resumes its run."""
        if option is False:
            return Tracker()
        settings = option if isinstance(option, WandbSettings) else WandbSettings.from_env()
        if settings is None:
            script_run = active_run()
            return Tracker(lambda: script_run, owned=False) if script_run is not None else Tracker()
        wandb_id = None
        if self.run_id:
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            suffix = f"r{self.round}" if self.round >= 0 else f"t{restart}"
            wandb_id = run_id_for(self.run_id, suffix)
        return start_run(
            settings,
            run_id=wandb_id,
            job_type="train",
            group=self.run_id,
            config={"spottrain_run": self.run_id, "round": self.round, "world_size": self.world},
            step_metric="step",
        )

    def _track_commit(self, result: dcp_io.SaveResult, kind: str, drain: bool) -> None:
        """Record a committed checkpoint as a reference artifact: the volume's directory and,
        when the agent copies checkpoints out, the copy it makes of this one."""
        if not self._tracker.active or result.path is None or result.manifest is None:
            return
        path = Path(result.path).absolute()
        run = self.run_id or "spottrain"
        refs = {"volume": path.as_uri(), "copy": _copy_uri(run, path.name)}
        self._tracker.log_checkpoint(
            run_id_for(run, "ckpt"),
            refs,
            metadata={
                "step": result.step,
                "kind": kind,
                "drain": drain,
                "world_size": result.manifest.world_size,
                "round": result.manifest.round,
                "bytes": result.manifest.total_bytes,
                "node": self.node,
            },
            aliases=["latest", f"step-{result.step}", kind],
        )

    def _wait_async(self) -> None:
        if self._inflight is not None:
            phase, self._phase = self._phase, "saving"
            try:
                self._inflight.result()
            finally:
                self._phase = phase
                self._inflight = None
                self._mark()

    def _restart_exchange(self, pending: Any) -> None:
        # The reduce drained before the save carried flags raised before this step; they
        # are served by this save, so the next reduce starts from the current flags.
        if pending is not None and self._dist:
            self._start_reduce()

    def _after_drain_save(self, step: int, committed: bool) -> None:
        if self._sigterm:
            if committed:
                _exit_clean(
                    f"stopping after the emergency checkpoint at step {step}", self._tracker
                )
            log.error(
                "the emergency checkpoint at step %d did not commit: stopping anyway; the "
                "steps since the newest committed checkpoint are lost",
                step,
            )
            _exit_clean("stopping without an emergency checkpoint", self._tracker, code=1)
        self._holding.set()
        self._tracker.flush(_EXIT_TRACKING_S)  # its artifact, before a SIGTERM ends us
        log.warning(
            "holding after the emergency checkpoint at step %d until torchrun restarts this "
            "worker (at most %.0f s)",
            step,
            self.hold_timeout,
        )
        deadline = time.monotonic() + self.hold_timeout
        while time.monotonic() < deadline:
            if self._sigterm:
                _exit_clean(f"stopped while holding at step {step}", self._tracker)
            time.sleep(0.05)
        self._holding.clear()
        log.warning("no restart came within %.0f s: training on", self.hold_timeout)
        self._served_request = max(self._served_request, self._requests.newest_id())

    def _stuck(self) -> bool:
        """Whether the training loop looks stuck (SIGTERM is pending, no save running)."""
        if self._phase in ("saving", "staging", "restoring", "closed"):
            return False
        limit = max(self.stuck_grace, 3 * self.last_step_time)
        return time.monotonic() - self._last_progress > limit


def _use_cuda_device(device: int | None) -> None:
    if device is not None:
        torch.cuda.set_device(device)


def _stage(obj: Any) -> Any:
    """A copy of the state to write while training changes the original: Stateful objects
    are turned into their state dicts and every tensor is copied (to the CPU)."""
    if isinstance(obj, Stateful):
        return _stage(obj.state_dict())
    if isinstance(obj, torch.Tensor):
        if isinstance(obj, DTensor):
            return obj.detach().clone()  # stays sharded on its device
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _stage(v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(_stage(v) for v in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(_stage(v) for v in obj)
    return copy.deepcopy(obj)


def _generation(round_: int, node: str) -> str:
    """A name for this session's generation of writers, unique to it: a rendezvous round
    may repeat (a new rendezvous state starts again at 0), so the round only describes it."""
    run = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SPOTTRAIN_RUN_ID") or "-"
    return f"run {run} round {round_} node {node} pid {os.getpid()} {uuid.uuid4().hex[:12]}"


def _copy_uri(run: str, name: str) -> str:
    """Where the agent copies checkpoint ``name`` (``<copy_to>/<run>/<name>``, as
    :mod:`spottrain.agent.ckpt_copy` lays it out), or "" when it copies none."""
    copy_to = os.environ.get(ENV_COPY_TO, "")
    if not copy_to:
        return ""
    from spottrain.cloud.storage import parse_store_url

    try:
        url = parse_store_url(copy_to)
    except ValueError:
        return ""
    if url.scheme == "file":
        return (Path(url.path) / run / name).as_uri()
    prefix = f"{url.path}/" if url.path else ""
    return f"{url.scheme}://{url.bucket}/{prefix}{run}/{name}"


def _exit_clean(why: str, tracker: Tracker | None = None, code: int = 0) -> None:
    log.warning("%s", why)
    if tracker is not None:
        tracker.finish(exit_code=code, timeout=_EXIT_TRACKING_S)
    logging.shutdown()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    # The checkpoint is committed; skipping interpreter teardown avoids hanging in a
    # process-group shutdown whose peers are already gone.
    os._exit(code)


class _SignalWatch:
    """SIGTERM handling that works even when the main thread is stuck in a collective.

    The Python handler only sets a flag (the main thread acts on it at the next step). The
    signal also wakes a thread through ``signal.set_wakeup_fd``, which runs even while the
    main thread is blocked in C++: if the loop is holding it exits at once, and if the loop
    is stuck (a peer died mid-collective) it exits after the grace, so torchrun's restart is
    not held up.
    """

    def __init__(self, session: TrainSession) -> None:
        self.session = session
        self._r, self._w = socket.socketpair()
        self._r.setblocking(True)
        self._w.setblocking(False)
        self._stopped = False
        self._prev_handler = signal.signal(signal.SIGTERM, self._on_signal)
        self._prev_fd = signal.set_wakeup_fd(self._w.fileno(), warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._run, name="spottrain-sigterm", daemon=True)
        self._thread.start()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.session._sigterm = True

    def _run(self) -> None:
        while not self._stopped:
            try:
                data = self._r.recv(64)
            except OSError:
                return
            if not data or self._stopped:
                return
            if signal.SIGTERM not in data:
                continue
            self.session._sigterm = True
            while not self._stopped:
                if self.session._holding.is_set():
                    _exit_clean(
                        "SIGTERM while holding after the emergency checkpoint",
                        self.session._tracker,
                    )
                if self.session._stuck():
                    log.error(
                        "SIGTERM and the training loop has not moved for %.1f s (a peer is "
                        "gone mid-collective): exiting without a checkpoint",
                        time.monotonic() - self.session._last_progress,
                    )
                    logging.shutdown()
                    os._exit(143)
                time.sleep(0.1)

    def stop(self) -> None:
        self._stopped = True
        with contextlib.suppress(ValueError, TypeError):  # off the main thread: leave them
            signal.set_wakeup_fd(self._prev_fd)
            signal.signal(signal.SIGTERM, self._prev_handler)
        with contextlib.suppress(OSError):
            self._w.send(b"\0")
        self._r.close()
        self._w.close()


class _RequestPoller:
    """Rank 0's link to Redis: polls checkpoint requests, reports progress and commits,
    and answers the fencing question. Redis being away never stops training."""

    def __init__(self, url: str | None, run_id: str | None, interval: float, active: bool) -> None:
        self.client: Any = None
        self.keys: RunKeys | None = None
        self._lock = threading.Lock()
        self._requests: dict[str, dict[str, Any]] = {}
        self._progress: dict[str, Any] | None = None
        self._event_world: Any = None
        self._event_at = float("-inf")
        self._stop = threading.Event()
        self._warned = False
        if url and run_id:
            from spottrain.redis_conn import connect, settings_from_url

            self.client = connect(settings_from_url(url, socket_timeout=2.0), retries=1)
            self.keys = RunKeys(run_id)
        self._thread: threading.Thread | None = None
        if active and self.client is not None:
            self._thread = threading.Thread(
                target=self._run, args=(interval,), name="spottrain-requests", daemon=True
            )
            self._thread.start()

    def _run(self, interval: float) -> None:
        assert self.keys is not None
        while not self._stop.wait(interval):
            try:
                raw = self.client.hgetall(self.keys.ckpt_requests)
                reqs = {}
                for node, body in raw.items():
                    with contextlib.suppress(ValueError, TypeError):
                        reqs[node.decode()] = json.loads(body)
                with self._lock:
                    self._requests = reqs
                    progress, self._progress = self._progress, None
                if progress is not None:
                    pipe = self.client.pipeline(transaction=False)
                    pipe.hset(self.keys.progress, mapping=progress)
                    if self._progress_event_due(progress):
                        # The hash keeps only the newest step; this keeps a thinned history
                        # in the stream for `spottrain report`'s step-rate timeline.
                        row = {k: str(progress[k]) for k in ("step", "world_size", "round")}
                        if "loss" in progress:
                            row["loss"] = str(progress["loss"])
                        pipe.xadd(
                            self.keys.events,
                            {
                                "type": "progress",
                                "node": os.environ.get(ENV_NODE, ""),
                                "at": f"{progress['at']:.3f}",
                                **row,
                            },
                            maxlen=EVENTS_MAXLEN,
                            approximate=True,
                        )
                    pipe.execute()
                self._warned = False
            except Exception as exc:
                if not self._warned:
                    log.warning("cannot reach Redis for checkpoint requests: %s", exc)
                    self._warned = True

    def pending(self, served: int, served_at: float) -> tuple[int, bool] | None:
        """(newest unserved request id, whether any of them drains), or None. A request is
        served when a checkpoint named it (``served``) or when a drain checkpoint was
        committed after it was made (``served_at``)."""
        if not self._requests:  # read without the lock: a stale answer only delays a step
            return None
        now = time.time()
        with self._lock:
            live = [
                r
                for r in self._requests.values()
                if int(r.get("id", 0)) > served
                and float(r.get("at", 0)) > served_at
                and (r.get("deadline") is None or float(r["deadline"]) > now - 5)
            ]
        if not live:
            return None
        return max(int(r["id"]) for r in live), any(bool(r.get("drain")) for r in live)

    def newest_id(self) -> int:
        with self._lock:
            return max((int(r.get("id", 0)) for r in self._requests.values()), default=0)

    def _progress_event_due(self, progress: dict[str, Any]) -> bool:
        """At most one progress event a minute, and one whenever the world size changes
        (about 1,440 a day, far under the stream's cap)."""
        world, at = progress.get("world_size"), float(progress.get("at", 0.0))
        if world != self._event_world or at - self._event_at >= PROGRESS_EVENT_S:
            self._event_world, self._event_at = world, at
            return True
        return False

    def report_progress(
        self, step: int, world: int, round_: int, metrics: dict[str, float]
    ) -> None:
        with self._lock:
            self._progress = {
                "step": step,
                "world_size": world,
                "round": round_,
                "at": time.time(),
                **{k: float(v) for k, v in metrics.items()},
            }

    def report_finished(self, step: int) -> None:
        """Tell the controller that training is over (its final state is committed)."""
        if self.client is None or self.keys is None:
            return
        try:
            self.client.hset(self.keys.progress, mapping={"finished": "1", "final_step": str(step)})
        except Exception as exc:
            log.warning("end of training not reported to Redis: %s", exc)

    def report_restore(self, step: int, world: int, round_: int) -> None:
        """Record a restart of the job's workers: the step restored and the highest step the
        job had reported before (the controller counts lost steps and crash loops by it)."""
        if self.client is None or self.keys is None:
            return
        try:
            reached = max(int(float(self.client.hget(self.keys.progress, "step") or 0)), step)
            pipe = self.client.pipeline(transaction=False)
            pipe.xadd(
                self.keys.events,
                {
                    "type": "restored",
                    "node": os.environ.get(ENV_NODE, ""),
                    "at": f"{time.time():.3f}",
                    "step": str(step),
                    "reached": str(reached),
                    "world_size": str(world),
                    "round": str(round_),
                },
                maxlen=EVENTS_MAXLEN,
                approximate=True,
            )
            pipe.rpush(self.keys.restores, json.dumps({"step": step, "reached": reached}))
            pipe.execute()
        except Exception as exc:
            log.warning("restore not reported to Redis: %s", exc)

    def report_commit(
        self, result: dcp_io.SaveResult, kind: str, drain: bool, request_id: int
    ) -> None:
        if self.client is None or self.keys is None or result.manifest is None:
            return
        record = {
            "node": os.environ.get(ENV_NODE, ""),
            "step": result.step,
            "round": result.manifest.round,
            "kind": kind,
            "drain": int(drain),
            "request_id": request_id,
            "path": str(result.path),
            "bytes": result.manifest.total_bytes,
            "write_s": round(result.write_s, 4),
            "at": time.time(),
        }
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.hset(self.keys.ckpt_last, mapping=record)
            pipe.xadd(
                self.keys.events,
                {"type": "checkpoint-committed", **{k: str(v) for k, v in record.items()}},
                maxlen=EVENTS_MAXLEN,
                approximate=True,
            )
            pipe.execute()
        except Exception as exc:
            log.warning("checkpoint committed but not reported to Redis: %s", exc)

    def report_refused(
        self,
        result: dcp_io.SaveResult,
        kind: str,
        drain: bool,
        request_id: int,
        round_: int,
        epoch: int,
    ) -> None:
        """Make a refused commit loud: an event in the run's stream and a count with the
        newest refusal in ``ckpt:refused`` (read by ``spottrain status`` and the agents)."""
        if self.client is None or self.keys is None:
            return
        record = {
            "node": os.environ.get(ENV_NODE, ""),
            "step": str(result.step),
            "kind": kind,
            "drain": str(int(drain)),
            "request_id": str(request_id),
            "round": str(round_),
            "epoch": str(epoch),
            "reason": result.refused or "",
            "at": f"{time.time():.3f}",
        }
        try:
            pipe = self.client.pipeline(transaction=True)
            pipe.hincrby(self.keys.ckpt_refused, "count", 1)
            pipe.hset(self.keys.ckpt_refused, mapping=record)
            pipe.xadd(
                self.keys.events,
                {"type": "checkpoint-refused", **record},
                maxlen=EVENTS_MAXLEN,
                approximate=True,
            )
            pipe.execute()
        except Exception as exc:
            log.warning("refused checkpoint not reported to Redis: %s", exc)

    def fence(self, round_: int) -> str | None:
        """Why a commit from ``round_`` must be refused, or None. Redis unreachable, or
        without the view (lost data, expired keys, another run id): allow; the checkpoint
        directory's fencing epoch still applies. A view's round only ever grows within one
        Redis state, so a higher one there means a newer round of this very state trains."""
        if self.client is None or self.keys is None:
            return None
        try:
            raw = self.client.hget(self.keys.rdzv_view, "round")
            newest = int(raw) if raw is not None else None
        except Exception as exc:
            log.warning("cannot check the rendezvous round in Redis (%s): committing", exc)
            return None
        if newest is not None and newest > round_:
            return f"rendezvous round {newest} is training now"
        return None

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

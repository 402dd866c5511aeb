"""A worker's replica-mode session: the engine, the holder row, disk checkpoints and the
leave on notice, in the order a training loop needs them::

    session = ReplicaSession(state_dict, load_state_dict, ckpt_dir=..., every_steps=50)
    session.restore()                 # from disk only when no live peer holds the state
    while session.step < total:
        plan = session.begin_step(global_batch, micro_batch)
        for micro in plan.micro_batches:
            ...                       # forward/backward, loss * plan.weight(micro)
        session.reduce_grads(params)  # or a DDP model wrapped by session.engine.wrap_ddp
        if session.commit():
            optimizer.step()
        session.end_step(loss=...)    # holder row, periodic save, leave on notice

**Leave.** On a drain request for this node (``RunKeys.ckpt_requests``, written by the agent
on a notice) or SIGTERM, the replica leaves at the next step boundary: rank 0 marks its row
``leaving`` and learns atomically whether any other live holder remains; if none, the
replica writes an emergency checkpoint first. Then it shuts its manager down (no more
heartbeats) and exits 0. torchft 0.2.0's manager cannot stop heartbeating and keep
training, so the survivors' next quorum waits until the lighthouse's heartbeat timeout drops
the leaver; leaving between steps keeps that wait out of any collective (no step is
discarded).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

import torch
import torch.distributed as dist

from spottrain.protocol.env import ENV_CKPT_DIR, ENV_NODE, ENV_REDIS, ENV_RUN_ID
from spottrain.protocol.keys import RunKeys

from ..checkpoint import dcp_io
from ..local_progress import ProgressFile
from .disk import ReplicaCheckpoints
from .engine import EngineConfig, ReplicaEngine
from .holders import LIVE, HolderBoard, must_save_on_leave
from .plan import StepPlan

log = logging.getLogger("spottrain.replica")


class Reporter(Protocol):
    """Where rank 0 tells the controller how training goes (the SDK's Redis channel; this
    package does not import the SDK, which builds on it)."""

    def report_progress(
        self, step: int, world: int, round_: int, metrics: dict[str, float]
    ) -> None: ...
    def report_restore(self, step: int, world: int, round_: int) -> None: ...
    def report_finished(self, step: int) -> None: ...
    def stop(self) -> None: ...


class _Silent:
    def report_progress(
        self, step: int, world: int, round_: int, metrics: dict[str, float]
    ) -> None:
        pass

    def report_restore(self, step: int, world: int, round_: int) -> None:
        pass

    def report_finished(self, step: int) -> None:
        pass

    def stop(self) -> None:
        pass


class ReplicaSession:
    """Replica-mode training for one worker (every rank of the replica makes one).

    Args:
        state_dict / load_state_dict: The state a joiner fetches from a live peer and a
            checkpoint holds (model, optimizer, scheduler, RNG, data position).
        ckpt_dir: The shared checkpoint directory (default ``$SPOTTRAIN_CKPT_DIR``; None and
            unset: no disk checkpoints).
        every_steps: Periodic checkpoint every this many committed steps (0: never).
        redis_url / run_id: The job's Redis (default ``$SPOTTRAIN_REDIS``,
            ``$SPOTTRAIN_RUN_ID``); without it no holder row and no drain request.
        config: The engine's (default from the environment).
        reporter: Rank 0's progress, restores and end of training go there (the SDK passes
            its Redis channel; default: reported nowhere).
    """

    def __init__(
        self,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
        *,
        ckpt_dir: str | None = None,
        every_steps: int = 0,
        keep: int = 3,
        redis_url: str | None = None,
        run_id: str | None = None,
        config: EngineConfig | None = None,
        install_signal_handlers: bool = True,
        reporter: Reporter | None = None,
    ) -> None:
        self._state_dict, self._load_state_dict = state_dict, load_state_dict
        self.engine = ReplicaEngine(state_dict, load_state_dict, config)
        self.every_steps = every_steps
        self.rank, self.world = self.engine.rank, self.engine.world
        self._group = dist.new_group(backend="gloo") if self.world > 1 else None
        root = ckpt_dir if ckpt_dir is not None else os.environ.get(ENV_CKPT_DIR)
        self.disk = (
            ReplicaCheckpoints(root, self.engine.config.replica_id, keep=keep, group=self._group)
            if root
            else None
        )
        self.board = HolderBoard(
            *_redis(redis_url, run_id, active=self.rank == 0),
            self.engine.config.replica_id,
            os.environ.get(ENV_NODE, socket.gethostname()),
        )
        self._progress = ProgressFile.from_env()
        # The controller's view (step, loss, finished, restores), as the elastic SDK reports
        # it; every replica's rank 0 writes it, the newest step wins.
        self._channel: Reporter = reporter if reporter is not None else _Silent()
        self._sigterm = False
        # (step, unix time) of this replica's newest commit, and its longest gap between
        # two consecutive commits (s - 1 then s): the survivors' pause, for the summary.
        self._last_commit: tuple[int, float] | None = None
        self._longest_gap: tuple[float, int] = (0.0, 0)
        if install_signal_handlers and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)
        self.last_plan: StepPlan | None = None

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self._sigterm = True  # acted on at the next step boundary (no lock in a handler)

    @property
    def step(self) -> int:
        return self.engine.step

    # -- start --------------------------------------------------------------------------------
    def restore(self) -> int:
        """Before the first quorum: load the newest disk checkpoint unless a live peer holds
        the state (the quorum then heals this replica from it). Returns the step."""
        peers = self.board.live_peers() if self.rank == 0 else None
        peers = dcp_io.broadcast_from_first(peers, self._group)
        if self.disk is not None and not peers:
            restored = self.disk.restore(
                self._state_dict, self._load_state_dict, self.engine.manager_state()
            )
            if restored is not None:
                self.engine.load_manager_state(restored)
                self.board.update(state=LIVE, step=restored["step"])
                if self.rank == 0:
                    self._channel.report_restore(restored["step"], self.world, -1)
        return self.step

    # -- every step ---------------------------------------------------------------------------
    def begin_step(self, global_batch: int, micro_batch: int) -> StepPlan:
        self.last_plan = self.engine.begin_step(global_batch, micro_batch)
        return self.last_plan

    def reduce(self, tensors: list[torch.Tensor]) -> bool:
        return self.engine.reduce(tensors)

    def reduce_grads(self, params: list[torch.nn.Parameter]) -> bool:
        return self.engine.reduce_grads(params)

    def commit(self) -> bool:
        return self.engine.commit()

    def end_step(self, **metrics: float) -> None:
        """After the optimizer step (or its skip): report (``metrics`` such as ``loss=``
        go to the run's progress), save if due, leave if asked."""
        plan = self.last_plan
        step = self.step
        self._progress.report(step)
        if self.rank == 0 and plan is not None and step > plan.step:
            row = {**metrics, "discarded": float(self.engine.discarded)}
            self._channel.report_progress(step, plan.participants, plan.quorum_id, row)
        if plan is not None and plan.step < step:
            now = time.time()
            last = self._last_commit
            if last is not None and last[0] == step - 1 and now - last[1] > self._longest_gap[0]:
                self._longest_gap = (now - last[1], step)
            self._last_commit = (step, now)
        if plan is not None and (self.board.row is not None or plan.step < step):
            self.board.update(
                longest_gap_s=round(self._longest_gap[0], 4),
                longest_gap_step=self._longest_gap[1],
                state=LIVE,
                step=step,
                quorum_id=plan.quorum_id,
                participants=plan.participants,
                discarded=self.engine.discarded,
            )
        due = self.every_steps > 0 and step % self.every_steps == 0 and plan is not None
        if due and plan is not None and plan.participant_rank == 0 and step > plan.step:
            self._save(step, "periodic")
        if self._leave_asked():
            self.leave()

    def _leave_asked(self) -> bool:
        flags = [int(self._sigterm), int(self.board.drain.is_set())]
        if self._group is not None:
            t = torch.tensor(flags)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
            flags = t.tolist()
        return any(flags)

    def _save(self, step: int, kind: str) -> None:
        if self.disk is None:
            return
        quorum = self.last_plan.quorum_id if self.last_plan else -1
        self.disk.save(
            step, self._state_dict(), self.engine.manager_state(), kind=kind, quorum_id=quorum
        )

    # -- leave and finish -----------------------------------------------------------------------
    def leave(self, code: int = 0) -> None:
        """Leave the run now (does not return): an emergency checkpoint only if no other live
        replica holds the state, then stop heartbeating and exit."""
        others = self.board.leave() if self.rank == 0 else None
        save = must_save_on_leave(others or 0) if self.rank == 0 else False
        save = bool(dcp_io.broadcast_from_first(save, self._group))
        log.warning(
            "replica %s leaving at step %d (%s other live holder(s))%s",
            self.engine.config.replica_id,
            self.step,
            "unknown" if others is None else others,
            ": writing an emergency checkpoint first" if save else "",
        )
        if save:
            self._save(self.step, "emergency")
        self.engine.close()
        _exit(code)

    def finish(self, *, exit_process: bool = True) -> None:
        """After the last step: a final checkpoint from the lowest participant, then stop
        (and exit 0 without the interpreter's teardown, which could wait on a group set
        aside while a frozen peer held it, unless ``exit_process`` is False)."""
        plan = self.last_plan
        if plan is not None and plan.participant_rank == 0 and self.every_steps > 0:
            newest = self.disk.saves[-1].step if self.disk and self.disk.saves else -1
            if newest != self.step:
                self._save(self.step, "final")
        if self.rank == 0:
            self._channel.report_finished(self.step)
        self._channel.stop()
        self.board.stop()
        self.engine.close()
        if exit_process:
            _exit(0)


def _redis(url: str | None, run_id: str | None, *, active: bool) -> tuple[Any, RunKeys | None]:
    url = url if url is not None else os.environ.get(ENV_REDIS)
    run_id = run_id_from_env(run_id)
    if not (active and url and run_id):
        return None, None
    from spottrain.redis_conn import connect, settings_from_url

    try:
        return connect(settings_from_url(url, socket_timeout=2.0), retries=1), RunKeys(run_id)
    except Exception as exc:
        log.warning("replica mode without Redis (%s): no holder row, no drain requests", exc)
        return None, None


def run_id_from_env(given: str | None) -> str | None:
    """The run's id: torchrun's ``--rdzv-id`` in replica mode is the run id plus the slot
    (``<run>.replica-<j>``), so the agent's ``$SPOTTRAIN_RUN_ID`` comes first."""
    if given:
        return given
    if os.environ.get(ENV_RUN_ID):
        return os.environ[ENV_RUN_ID]
    rdzv = os.environ.get("TORCHELASTIC_RUN_ID")
    return rdzv.rsplit(".replica-", 1)[0] if rdzv else None


def _exit(code: int) -> None:
    logging.shutdown()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    # Skip interpreter teardown: the manager's threads and the group's peers are gone.
    os._exit(code)

"""``TrainSession(fault_tolerance="replica")``: the trainer SDK over the replica engine
(:class:`spottrain.agent.replica.session.ReplicaSession`, torchft's manager behind it).

The same loop runs in both modes::

    session = TrainSession(every_steps=100)     # the mode: $SPOTTRAIN_FAULT_TOLERANCE
    state = {"model": ModelState(model, opt, sched), "rng": RngState()}
    step = session.restore(state)
    batch = GlobalBatch(global_size=256, micro_size=8, world=session.world, rank=session.rank)
    while step < total:
        work = session.begin_step(batch)        # replica: the step's quorum (and a heal)
        opt.zero_grad()
        with session.compute():
            for samples in work:                # this rank's micro-batches of work.step
                (loss_of(samples) * work.weight(samples)).backward()
        if session.commit(model.parameters()):  # False: discarded, redone on the same samples
            opt.step()
            sched.step()
        step = session.end_step(state, loss=...)
    session.finish(step, state)

In replica mode the step is the manager's: it does not advance when a step is discarded (a
peer was lost mid-step; :attr:`discarded` counts them) and it jumps forward when this replica
heals from a live peer. The state (``ModelState``, ``RngState``, any ``Stateful``; the data
position is the step) is what a joiner fetches from a live peer and what a checkpoint holds.
``session.world`` and ``session.rank`` are the replica's own ranks: the step's global batch
is split over the replicas taking part, and each replica's share over its ranks.

Gradients cross replicas through :meth:`ReplicaMode.commit` (a model without DDP)
or a model wrapped by :meth:`ReplicaMode.wrap_ddp` (after :meth:`restore`; then
``commit()`` without parameters). An FSDP2 model sharded over the replica's ranks (HSDP:
replicas are the outer dimension) passes its parameters: their gradient shards cross the
replicas rank by rank, never the replica's own group; call :meth:`ReplicaMode.use_fsdp`
once after ``fully_shard`` (its reduce-scatter must sum).

The elastic-only knobs (``every_seconds``, ``async_periodic``, ``hold_timeout``,
``agree_interval``, ``stuck_grace``, ``thread_count``, ``poll_interval``, ``tracking``,
``report_interval``) are accepted, so one script serves both modes, and do nothing here:
saves are synchronous from one replica, a notice or SIGTERM makes the replica leave at the
next step boundary (an emergency checkpoint only if it is the last live holder), and wandb
tracking and the compute-time reports are elastic features so far.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from spottrain.protocol.env import ENV_REDIS

from ..replica.reduction import is_sharded, sum_fsdp_gradients
from ..replica.session import ReplicaSession, run_id_from_env
from .channel import RequestChannel
from .modes import REPLICA, StepWork
from .timing import StepTimer

if TYPE_CHECKING:
    from .batch import GlobalBatch

log = logging.getLogger("spottrain.sdk")


class ReplicaMode:
    """What ``TrainSession(...)`` is in replica mode (see the module docstring): the
    session's methods for it, placed before :class:`~.session.TrainSession`'s by the class
    ``TrainSession`` makes for the mode (this module does not import that one)."""

    rank: int
    world: int
    _timer: StepTimer

    def __init__(
        self,
        ckpt_dir: str | os.PathLike[str] | None = None,
        *,
        every_steps: int = 0,
        keep: int = 3,
        redis_url: str | None = None,
        run_id: str | None = None,
        install_signal_handlers: bool = True,
        fault_tolerance: str | None = None,
        **elastic_only: Any,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep}: keep at least 1 checkpoint")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "replica mode: initialise torch.distributed for the replica's own group first "
                "(dist.init_process_group under torchrun), then make the TrainSession"
            )
        self.fault_tolerance = REPLICA
        self._ckpt_dir = None if ckpt_dir is None else os.fspath(ckpt_dir)
        self.every_steps, self.keep = every_steps, keep
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._dist = True
        self._redis_url = redis_url if redis_url is not None else os.environ.get(ENV_REDIS)
        self.run_id = run_id_from_env(run_id)
        self._install_signals = install_signal_handlers
        self._timer = StepTimer()
        self._last_progress = time.monotonic()
        self._replica: ReplicaSession | None = None
        self._next_step = 0
        self.saves: list[Any] = []  # this mode's saves are the engine's (replica.disk)
        if elastic_only:
            log.info("replica mode ignores the elastic options %s", sorted(elastic_only))

    @property
    def replica(self) -> ReplicaSession:
        """The engine's session (after :meth:`restore`): its ``engine``, ``board``, plans."""
        if self._replica is None:
            raise RuntimeError("replica mode: call session.restore(state) first")
        return self._replica

    @property
    def discarded(self) -> int:
        """Steps discarded so far (a peer lost mid-step); each was redone."""
        return self._replica.engine.discarded if self._replica is not None else 0

    # -- start --------------------------------------------------------------------------------
    def restore(self, state: dict[str, Any]) -> int:
        """Join the replicas: the newest checkpoint is loaded into ``state`` only when no live
        peer holds the state (otherwise the first step heals from a peer). Returns the step."""
        reporter = RequestChannel(self._redis_url, self.run_id, 1.0, active=self.rank == 0)
        self._replica = ReplicaSession(
            lambda: state_dict_of(state),
            lambda sd: load_state_dict_into(state, sd),
            ckpt_dir=self._ckpt_dir,
            every_steps=self.every_steps,
            keep=self.keep,
            redis_url=self._redis_url,
            run_id=self.run_id,
            install_signal_handlers=self._install_signals,
            reporter=reporter,
        )
        self._next_step = self._replica.restore()
        self._last_progress = time.monotonic()
        return self._next_step

    def wrap_ddp(self, module: torch.nn.Module) -> torch.nn.Module:
        """``module`` in DDP whose gradients cross the replicas (a lost peer discards the
        step instead of raising)."""
        return self.replica.engine.wrap_ddp(module)

    # -- every step ---------------------------------------------------------------------------
    def begin_step(self, batch: GlobalBatch) -> StepWork:
        """The step's quorum (a replica that must heal loads a live peer's state here), and
        this rank's micro-batches of the replica's share of the step."""
        plan = self.replica.begin_step(batch.global_size, batch.micro_size)
        self._next_step = plan.step
        return StepWork(
            step=plan.step,
            micro_ranges=tuple(plan.local(self.rank, self.world)),
            sample_scale=1.0 / batch.global_size,
            participants=plan.participants,
            participating=plan.participating,
            healed=plan.healed,
            quorum_id=plan.quorum_id,
            participant_rank=plan.participant_rank,
            wait_s=self.replica.engine.quorum_wait_s[-1],
        )

    def commit(
        self, params: Iterable[torch.nn.Parameter] = (), *, extra: Sequence[torch.Tensor] = ()
    ) -> bool:
        """Sum ``params``' gradients (none: a DDP model's hook did; an FSDP2 model's shards
        with the same rank of each other replica) and ``extra`` tensors over the step's
        replicas, in place; whether to step the optimizer.
        False: the step is discarded (the tensors are garbage); skip the optimizer step, and
        the next :meth:`begin_step` gives the same step and samples again."""
        tensors, shards = list(extra), list[torch.Tensor]()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            (shards if is_sharded(p.grad) else tensors).append(p.grad)
        if tensors:
            self.replica.engine.reduce(tensors)
        if shards:  # FSDP2's: summed inside the replica already, each rank its own (HSDP)
            self.replica.engine.reduce(shards, replicated=False)
        return self.replica.commit()

    def use_fsdp(self, model: torch.nn.Module) -> torch.nn.Module:
        """After ``fully_shard`` over the replica's ranks: FSDP2's reduce-scatter becomes a
        sum, as the replicas' is (the step's weights are for summed gradients)."""
        sum_fsdp_gradients(model)
        return model

    def end_step(self, state: dict[str, Any], **metrics: float) -> int:
        """After the optimizer step (or its skip): progress reported (``metrics`` and the
        discarded count), a periodic save if due, the leave if a notice came (it does not
        return then). Returns the next step's number."""
        self._timer.close_compute(metrics.pop("compute_s", None))
        now = time.monotonic()
        self._timer.step_times.append(now - self._last_progress)
        self._last_progress = now
        self.replica.end_step(**metrics)
        self._next_step = self.replica.step
        return self._next_step

    def step(
        self,
        step: int,
        state: dict[str, Any],
        *,
        tokens: float | None = None,
        compute_s: float | None = None,
        **metrics: float,
    ) -> None:
        raise RuntimeError(
            "replica mode: session.step() cannot tell a discarded step; use "
            "begin_step/commit/end_step (see spottrain.agent.sdk.replica_mode)"
        )

    # -- end ------------------------------------------------------------------------------------
    def finish(
        self, step: int | None = None, state: Any = None, *, exit_process: bool = True
    ) -> None:
        """A final checkpoint (from one replica) unless the step is saved, the end reported,
        the manager stopped. It then ends the process with code 0 (``exit_process=False``:
        returns), skipping the interpreter's teardown, which could wait on a cross-replica
        group a frozen peer held: do what must follow training before it."""
        self.replica.finish(exit_process=exit_process)

    def close(self) -> None:
        if self._replica is not None:
            self._replica.engine.close()


def state_dict_of(state: dict[str, Any]) -> dict[str, Any]:
    """The script's state (``Stateful`` items, tensors, plain values) as nested dicts."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}


def load_state_dict_into(state: dict[str, Any], loaded: dict[str, Any]) -> None:
    """Load what :func:`state_dict_of` made (a live peer's, or a checkpoint's) in place."""
    for key, item in state.items():
        if key not in loaded:
            raise KeyError(f"the state to load has no {key!r}: peers run different scripts?")
        if isinstance(item, Stateful):
            item.load_state_dict(loaded[key])
        elif isinstance(item, torch.Tensor):
            item.copy_(loaded[key])
        else:
            state[key] = loaded[key]

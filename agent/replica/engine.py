"""The replica engine: torchft's Manager behind one class of ours (the only place torchft is
driven), with our own step protocol.

**Step protocol.** :meth:`ReplicaEngine.begin_step` runs a SYNCHRONOUS quorum (torchft's
``use_async_quorum=False``): it returns only when the step's members are known and a
replica that must heal has loaded a live peer's state, so the step's global batch can be
split over its participants before the forward pass (:mod:`.plan`). The cost is the
quorum's round trip at the start of every step instead of overlapping it with the forward
pass; :attr:`ReplicaEngine.quorum_wait_s` records it per step. A healed replica takes part in
the step it healed in: it holds the live state before its forward pass (torchft's async mode
excludes healers because their forward runs on stale weights, which cannot happen here;
excluding them would also need every member to know who heals, which an init-sync heal at
step 0 does not tell the primary).

Gradients cross replicas through one function, :meth:`ReplicaEngine.reduce`, on one of two
paths (:mod:`.reduction`): replicated tensors (a model without DDP, and
:meth:`ReplicaEngine.ddp_hook`, a DDP comm hook) are summed over the replica's own ranks and
then across replicas; the gradient shards of an FSDP2 model (``replicated=False``,
:meth:`ReplicaEngine.reduce_shard_grads`: HSDP, shard inside the replica, replicate across)
only across replicas, rank ``i`` with rank ``i``. The reduction is a SUM (each sample's loss weighs
``1 / global batch``). A collective that fails (a peer died or froze and the watchdog aborted
the group) marks the step DISCARDED: :meth:`ReplicaEngine.commit` returns False, the
optimizer step must be skipped, and the next :meth:`begin_step` returns the same step, so
it is redone on the same samples. torchft's own DDP hook asserts on the failed future's value
and crashes the survivor; ours never raises.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torchft.manager import Manager

from spottrain.protocol.env import (
    ENV_LIGHTHOUSE,
    ENV_MANAGER_PORT,
    ENV_MIN_REPLICAS,
    ENV_QUORUM,
    ENV_QUORUM_HEARTBEAT_TIMEOUT,
    ENV_REPLICA_ID,
)

from .groups import make_group
from .plan import StepPlan, make_plan
from .quorum import RecordingClient
from .reduction import local_part, reduce_in_stages, refuse_shards_as_replicated
from .refusal import RefusalGuard, shim_refused
from .watchdog import Watchdog

log = logging.getLogger("spottrain.replica")


class PeerLostError(RuntimeError):
    """A member of the step's quorum stopped heartbeating during a collective."""


@dataclass
class EngineConfig:
    """Where the replica is and how long things may take (defaults from the environment)."""

    replica_id: str
    lighthouse: str  # "host:port" or "http://host:port"
    manager_port: int = 0
    min_replicas: int = 1
    # Long: a multi-GB all-reduce must not time out; a lost peer is noticed by the watchdog.
    collective_timeout_s: float = 120.0
    quorum_timeout_s: float = 120.0
    connect_timeout_s: float = 10.0
    heartbeat_interval_ms: int = 100
    # A peer whose last heartbeat is older than this during a collective is lost (the
    # lighthouse's own --heartbeat_timeout_ms; about 1 s in spottrain's).
    peer_timeout_s: float = 1.0
    quorum_retries: int = 100
    # "cuda": the cross-replica group is NCCL in a subprocess (untested without a GPU).
    device: str = field(default_factory=lambda: "cuda" if torch.cuda.is_available() else "cpu")
    hostname: str = field(default_factory=socket.gethostname)

    @classmethod
    def from_env(cls, **overrides: Any) -> EngineConfig:
        env = os.environ
        missing = [n for n in (ENV_REPLICA_ID, ENV_LIGHTHOUSE) if not env.get(n)]
        if missing and not all(k in overrides for k in ("replica_id", "lighthouse")):
            raise ValueError(
                f"${missing[0]} is not set: replica mode needs the agent's "
                f"${ENV_REPLICA_ID} and ${ENV_LIGHTHOUSE} (run under spottrain-agent with "
                "train.fault_tolerance: replica, or set them)"
            )
        values: dict[str, Any] = {
            "replica_id": env.get(ENV_REPLICA_ID, ""),
            "lighthouse": env.get(ENV_LIGHTHOUSE, ""),
            "manager_port": _int_env(ENV_MANAGER_PORT, 0),
            "min_replicas": _int_env(ENV_MIN_REPLICAS, 1),
        }
        timeout = env.get(ENV_QUORUM_HEARTBEAT_TIMEOUT)
        if timeout:
            # The Redis quorum's heartbeat timeout: a peer silent for longer is lost.
            values["peer_timeout_s"] = float(timeout)
        values.update(overrides)
        return cls(**values)

    @property
    def lighthouse_url(self) -> str:
        addr = self.lighthouse
        return addr if "://" in addr else f"http://{addr}"


def _heartbeat_source(cfg: EngineConfig) -> Any:
    """Where the watchdog reads peers' heartbeat ages: with the Redis quorum the agent's
    shim (``cfg.lighthouse``), which reads them from Redis for all the node's ranks; else
    the lighthouse's status page."""
    if os.environ.get(ENV_QUORUM) != "redis":
        return cfg.lighthouse_url
    from .watchdog import shim_ages

    return shim_ages(cfg.lighthouse)


def _refusal_guard(cfg: EngineConfig) -> RefusalGuard | None:
    """With the Redis quorum, the guard that restarts this replica once the quorum refused
    its id (:mod:`.refusal`); torchft's lighthouse refuses no id."""
    if os.environ.get(ENV_QUORUM) != "redis":
        return None
    return RefusalGuard(shim_refused(cfg.lighthouse))


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"${name}={raw!r} is not an integer: set it to a number") from None


class ReplicaEngine:
    """One replica's link to its peers. Every rank of the replica makes one, after
    ``torch.distributed`` is initialised for the replica's own group (its rank 0 hosts the
    store the manager uses).

    Args:
        state_dict: Returns the state a joiner needs (model, optimizer, scheduler, RNG, data
            position), nested dicts of tensors and plain values.
        load_state_dict: Loads what ``state_dict`` returned (from a live peer).
        config: Default :meth:`EngineConfig.from_env`.
    """

    def __init__(
        self,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
        config: EngineConfig | None = None,
    ) -> None:
        self.config = config or EngineConfig.from_env()
        cfg = self.config
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "initialise torch.distributed for the replica's own group first "
                "(dist.init_process_group under torchrun): the manager uses its store"
            )
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.group = make_group(cfg.device, timedelta(seconds=cfg.collective_timeout_s))
        self.manager = Manager(
            pg=self.group,
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            min_replica_size=cfg.min_replicas,
            use_async_quorum=False,
            timeout=timedelta(seconds=cfg.collective_timeout_s),
            quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
            connect_timeout=timedelta(seconds=cfg.connect_timeout_s),
            rank=self.rank,
            world_size=self.world,
            lighthouse_addr=cfg.lighthouse_url,
            replica_id=cfg.replica_id,
            port=cfg.manager_port,
            hostname=cfg.hostname,
            heartbeat_interval=timedelta(milliseconds=cfg.heartbeat_interval_ms),
            quorum_retries=cfg.quorum_retries,
        )
        self.recorder = RecordingClient(self.manager._client, self.manager)
        self.manager._client = self.recorder
        self.group.recorder = self.recorder
        self.watchdog = Watchdog(
            _heartbeat_source(cfg), self.group, self.recorder, peer_timeout_s=cfg.peer_timeout_s
        )
        self.refusal = _refusal_guard(cfg)
        self._manager_id: str | None = None
        self.discarded = 0
        self.quorum_wait_s: list[float] = []
        self.plan: StepPlan | None = None
        self._closed = False

    # -- the step ---------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Committed steps (the step being attempted next)."""
        return int(self.manager.current_step())

    def begin_step(self, global_batch: int, micro_batch: int) -> StepPlan:
        """The synchronous quorum of the next step, and this replica's part of it."""
        t0 = time.monotonic()
        if self.refusal is not None:
            self.refusal.arm(self.manager_id)
        try:
            self.manager.start_quorum()
        finally:
            if self.refusal is not None:
                self.refusal.disarm()
        self.quorum_wait_s.append(time.monotonic() - t0)
        view = self.recorder.last
        participants = int(self.manager.num_participants())
        rank = self.manager.participating_rank() if self.manager.is_participating() else None
        errored = self.manager.errored() is not None
        self.plan = make_plan(
            step=self.step,
            quorum_id=view.quorum_id if view else -1,
            participants=max(participants, 1),
            participant_rank=None if errored else rank,
            healed=bool(view and view.heal),
            global_batch=global_batch,
            micro_batch=micro_batch,
        )
        self.watchdog.watch(view)
        return self.plan

    @property
    def manager_id(self) -> str:
        """This incarnation's id in the quorum (``<replica id>:<uuid>``: a restarted worker's
        manager has a new one), as the replica's rank 0 published it in the store."""
        if self._manager_id is None:
            self._manager_id = self.manager._store.get("replica_id").decode()
        return self._manager_id

    def reduce(self, tensors: list[torch.Tensor], *, replicated: bool = True) -> bool:
        """SUM ``tensors`` across the step's replicas, in place; False when this rank's
        reduce failed (the tensors are then garbage). Whether to step is :meth:`commit`'s
        decision, which every rank of the replica shares. A non-participant contributes
        zeros.

        ``replicated=True``: every rank of the replica holds a partial sum of the same full
        tensors (a model without DDP): summed over the replica's ranks, then across
        replicas. ``replicated=False``: each rank holds its own shard, already summed inside
        the replica (an FSDP2 model's gradients after its reduce-scatter; DTensors are
        reduced through their local shards): summed only with the same rank of every other
        replica (HSDP). See :mod:`.reduction`."""
        if replicated:
            refuse_shards_as_replicated(tensors)
        else:
            tensors = [local_part(t) for t in tensors]
        if not tensors:
            return self.manager.errored() is None
        flat = tensors[0] if len(tensors) == 1 else _flatten_dense_tensors(tensors)  # type: ignore[no-untyped-call]
        ok = self._allreduce(flat, replicated=replicated)
        if ok and len(tensors) > 1:
            parts = _unflatten_dense_tensors(flat, tensors)  # type: ignore[no-untyped-call]
            for t, reduced in zip(tensors, parts, strict=True):
                t.copy_(reduced)
        return ok

    def reduce_shards(self, tensors: list[torch.Tensor]) -> bool:
        """:meth:`reduce` of per-rank shards (HSDP): never over the replica's own group."""
        return self.reduce(tensors, replicated=False)

    def reduce_grads(self, params: list[torch.nn.Parameter], *, replicated: bool = True) -> bool:
        """:meth:`reduce` over the parameters' gradients (missing ones become zeros)."""
        grads = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        return self.reduce(grads, replicated=replicated)

    def reduce_shard_grads(self, params: list[torch.nn.Parameter]) -> bool:
        """:meth:`reduce_grads` of an FSDP2 model (after its backward's reduce-scatter):
        each rank's gradient shards cross replicas with the same rank of each other one."""
        return self.reduce_grads(params, replicated=False)

    def _allreduce(self, buf: torch.Tensor, *, replicated: bool = True) -> bool:
        return reduce_in_stages(
            buf,
            replicated=replicated,
            replica_world=self.world,
            intra_group=self.intra_group,
            cross=self._cross_replica,
        )

    def _cross_replica(self, buf: torch.Tensor) -> bool:
        """The fault-tolerant sum with the same group rank of every replica of the quorum."""
        if self.manager.errored() is not None:
            return False
        from torch.distributed import ReduceOp

        wake = threading.Event()
        self.watchdog.enter(wake)
        try:
            work = self.manager.allreduce(buf, reduce_op=ReduceOp.SUM)
            raw = getattr(work, "_work", None)  # the group's own work (absent: a no-op)
            if raw is not None:
                # Wait on the future, not in gloo's blocking wait: the watchdog can wake us
                # when a peer is lost, and gloo's abort does not interrupt its wait.
                raw.get_future().add_done_callback(lambda _f: wake.set())
                wake.wait()
                if self.watchdog.lost_during(wake):
                    self.manager.report_error(PeerLostError("a peer stopped heartbeating"))
                    return False
            work.wait()
        except Exception as exc:  # never crash the survivor: the step is discarded
            log.warning("cross-replica all-reduce failed: %s", exc)
            self.manager.report_error(exc)
        finally:
            self.watchdog.leave()
        return self.manager.errored() is None

    @property
    def intra_group(self) -> Any:
        """The replica's own group, for replicas of several ranks (None for one): only
        replicated tensors are summed over it, never shards."""
        return None if self.world == 1 else dist.group.WORLD

    def ddp_hook(self, _state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        """A DDP comm hook over :meth:`reduce`: a failed reduce discards the step instead of
        raising (``model.register_comm_hook(None, engine.ddp_hook)``)."""
        buf = bucket.buffer()
        # A copy: an all-reduce abandoned when a peer froze may still write into its buffer
        # later, and DDP reuses its bucket buffers every step.
        work = buf.clone()
        if self._allreduce(work):
            buf.copy_(work)
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(buf)
        return fut

    def wrap_ddp(self, module: torch.nn.Module) -> torch.nn.Module:
        """``module`` in DDP whose gradients cross replicas through :meth:`ddp_hook` (a
        dummy group soaks up DDP's own init broadcast; the manager syncs weights)."""
        from torch.nn.parallel import DistributedDataParallel
        from torchft.process_group import ProcessGroupDummy

        ddp = DistributedDataParallel(
            module, process_group=ProcessGroupDummy(0, 1), find_unused_parameters=True
        )

        # DDP checks the hook's annotations against the real classes; ours are strings.
        def hook(state, bucket):  # type: ignore[no-untyped-def]
            return self.ddp_hook(state, bucket)

        ddp.register_comm_hook(None, hook)
        return ddp

    def commit(self) -> bool:
        """Whether to step the optimizer. False: the step is discarded and will be redone on
        the same samples. Every rank of the replica gets the same answer (torchft's
        ``should_commit`` is a vote of all the replica's ranks), so a replica whose shard
        reduce failed on one rank and succeeded on another steps none of its shards."""
        ok = bool(self.manager.should_commit())
        if not ok:
            self.discarded += 1
            err = self.manager.errored()
            log.warning(
                "step %d discarded (%d so far)%s",
                self.step,
                self.discarded,
                f": {str(err).splitlines()[0]}" if err else "",
            )
        return ok

    def load_manager_state(self, state: dict[str, int]) -> None:
        """Restore the committed step (from a disk checkpoint) before the first quorum."""
        self.manager.load_state_dict(state)

    def manager_state(self) -> dict[str, int]:
        return dict(self.manager.state_dict())

    def close(self) -> None:
        """Stop heartbeating and serving (the lighthouse drops this replica after its
        heartbeat timeout)."""
        if self._closed:
            return
        self._closed = True
        self.watchdog.stop()
        if self.refusal is not None:
            self.refusal.stop()
        self.manager.shutdown(wait=False)
        self.group.abort_now()

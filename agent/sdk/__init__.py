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
``with session.compute():`` (or passes ``compute_s=`` to :meth:`TrainSession.step`); a
``DistributedDataParallel`` model, whose all-reduce runs inside the backward, is handed to
:meth:`TrainSession.time_ddp` once, so that the span ends when its last gradient bucket is
ready rather than after the wait for the slowest rank. Each rank reports the median of its
own compute seconds per step, and how many steps that covers, to its node's record in Redis
(``compute:<local rank>``, ``compute_n:<local rank>``), and the controller takes a node's
slowest local rank as the node's figure when it looks for stragglers (it replaces one only
on a sustained, corroborated signal: see the controller's ``StragglerPolicy``). On a GPU
the span is timed with CUDA events on the current stream, read once they completed (no
synchronisation is added).

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

**Two modes, one loop.** ``TrainSession(fault_tolerance="replica")`` (or
``$SPOTTRAIN_FAULT_TOLERANCE=replica``, which the agent sets from the job's
``train.fault_tolerance``) trains each replica on its own through torchft instead (see
:mod:`.replica_mode`). A script that steps with ``work = session.begin_step(batch)``, ``if
session.commit(params): opt.step()`` and ``step = session.end_step(state, loss=...)`` runs
unchanged in both modes; ``session.step`` stays the elastic loop's call.

**Modules.** :mod:`.session` (:class:`TrainSession`: restore, step, save, hold), :mod:`.saving`
(a checkpoint write, the hold after a drain), :mod:`.modes` (the mode, a step's work),
:mod:`.replica_mode` (replica mode's methods), :mod:`.agreement`
(the all-reduced flags), :mod:`.channel` (rank 0's Redis link: requests in, reports out, the
fence), :mod:`.signals` (SIGTERM), :mod:`.state` (:class:`ModelState`, :class:`RngState`, the
staging copy of an asynchronous save), :mod:`.batch` (:class:`GlobalBatch`), :mod:`.timing`
(step and compute times), :mod:`.tracking` (wandb) and :mod:`.token_cache` (tokenized data
cached on the shared volume); :mod:`.integrations` gives scripts on the Hugging Face
``Trainer``, Accelerate, Lightning or plain torchrun the same checkpointing through one
object (see ``docs/integrations.md``). The names above are importable from this package;
it loads each module on first use, so the token cache's tokenizing processes do not import
torch. The
environment variables it reads are the floor's (:mod:`spottrain.protocol.env`), re-exported
here under their documented names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# The environment the SDK reads: names of the floor's (no torch behind them).
from spottrain.protocol.env import ENV_CKPT_DIR, ENV_COPY_TO, ENV_NODE, ENV_REDIS, ENV_ROUND

# The public names, imported from their modules on first use: the token cache's tokenizing
# processes import ``spottrain.agent.sdk.token_cache`` without paying for torch.
_EXPORTS = {
    "GlobalBatch": "batch",
    "ModelState": "state",
    "RngState": "state",
    "TrainSession": "session",
}

__all__ = [
    "ENV_CKPT_DIR",
    "ENV_COPY_TO",
    "ENV_NODE",
    "ENV_REDIS",
    "ENV_ROUND",
    "GlobalBatch",
    "ModelState",
    "RngState",
    "TrainSession",
]

if TYPE_CHECKING:
    from .batch import GlobalBatch
    from .session import TrainSession
    from .state import ModelState, RngState


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])

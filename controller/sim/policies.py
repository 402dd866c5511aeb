"""What the training does with a fleet that changes: the policies ``spottrain simulate``
compares, each a small state machine driven by the simulated fleet.

The fleet (:mod:`spottrain.controller.sim.engine`) has one *slot* per node of the full-size
job; slot ``s`` belongs to data-parallel replica ``s // replica_nodes``. It tells every policy
the same three things, at the same simulated instants:

- ``on_notice(s, now)``: the VM in slot ``s`` got its preemption notice (it dies
  ``notice_s`` later);
- ``on_lost(s, now, had_notice)``: the VM in slot ``s`` is gone;
- ``on_filled(s, now)``: a booted, healthy VM took slot ``s``.

Each policy keeps ``progress``: the seconds of full-fleet training that count, so far (at
three-quarters of the replicas for an hour, progress grows by 2,700 s with linear scaling).
Work done since the last committed checkpoint is uncommitted; a rollback throws it away and
adds it to ``lost``. Training stops (``until``) for checkpoint writes, restarts and
re-forms; a change while stopped pushes the restart back (one restart absorbs every change
that happened before it completed).

- :class:`Sync`: fully synchronous restart-everything. Notices are ignored; any VM lost
  stops the job and throws away everything since the last periodic checkpoint. The job
  restarts (rendezvous + loading the checkpoint) once every slot has a VM again; a VM lost
  during the restart starts the wait over.
- :class:`Elastic`: spottrain today (elastic torchrun). A notice stops everyone for an
  emergency checkpoint (if it fits the window less the drain overhead, else the last
  periodic checkpoint is restored) and the survivors re-form at the smaller size; a VM lost
  without notice costs the detection timeout, a re-form and the work since the last
  checkpoint; a joiner makes everyone save (within torch's 30 s) and re-form again. Every
  re-form restarts every worker and loads the checkpoint.
- :class:`Replica` (``replica-ideal``): replicas as the unit of fault tolerance as first
  modelled, before torchft was measured: the survivors keep stepping, a replica that loses
  a VM stops counting, an unannounced loss costs everyone the detection timeout of the step
  in flight, and a complete replica rejoins after copying the state from a live peer (a
  rendezvous plus the shard over the network); the quorum and the process group cost
  nothing. Only if every replica is down does the job fall back to the checkpoint. Kept as
  the bound a quorum that scales would approach.
- ``replica`` (:mod:`spottrain.controller.sim.replica_policy`): the same, with torchft
  0.2.0's measured costs (:mod:`spottrain.controller.sim.replica_params`).

All write the same periodic checkpoints (stopping training for the write).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spottrain.controller.sim.replica_params import ReplicaParams
from spottrain.spec import DRAIN_OVERHEAD_S

INF = math.inf
# torch 2.13's restart path kills the workers this long after asking them to stop, so a
# scale-up's checkpoint must fit in it (see the README's "Limits that remain").
JOIN_SAVE_LIMIT_S = 30.0

Schedule = Callable[[float, Callable[[float, Any], None], Any], None]


@dataclass(frozen=True)
class Costs:
    """The seconds each event costs, derived from the simulation's settings.

    Attributes:
        slots: nodes of the full-size job.
        replica_nodes: nodes per data-parallel replica.
        notice_s: the notice window.
        save_s: writing one checkpoint (size / write bandwidth).
        load_s: loading it at a restart (size / load bandwidth).
        rendezvous_s: a re-form: the group agrees on a new membership and the workers
            restart.
        detect_s: what noticing a VM that vanished without notice adds.
        catch_up_s: a replica copying its state from a live peer.
        ckpt_every_s: periodic checkpoint interval (``inf``: none).
        scaling: throughput at a share ``x`` of the replicas is ``x ** scaling``.
        replica: the ``replica`` policy's measured costs.
    """

    slots: int
    replica_nodes: int
    notice_s: float
    save_s: float
    load_s: float
    rendezvous_s: float
    detect_s: float
    catch_up_s: float
    ckpt_every_s: float
    scaling: float
    replica: ReplicaParams = field(default_factory=ReplicaParams)

    @property
    def replicas(self) -> int:
        return self.slots // self.replica_nodes

    def throughput(self, replicas_up: int) -> float:
        share = replicas_up / self.replicas
        return share if self.scaling == 1.0 else share**self.scaling


class Trainer:
    """What the policies share: progress, commits, rollbacks, stops, periodic checkpoints."""

    name = ""

    def __init__(self, costs: Costs, schedule: Schedule) -> None:
        self.c = costs
        self._at = schedule
        self.progress = 0.0  # full-fleet seconds of training that count
        self.committed = 0.0  # progress at the newest committed checkpoint
        self.lost = 0.0  # progress thrown away by rollbacks
        self.rate = 0.0
        self.t = 0.0
        self.until = -INF  # training stopped until then; -inf: training; inf: waiting
        self.rollbacks = 0
        self.checkpoints = 0
        self._token = 0  # bumped by every rollback: older pending commits are void
        self._gen = 0  # bumped whenever ``until`` changes: older resume events are void
        self._ckpt_gen = 0

    # --- bookkeeping ----------------------------------------------------------------------
    @property
    def training(self) -> bool:
        return self.until == -INF

    def advance(self, now: float) -> None:
        if self.rate:
            self.progress += self.rate * (now - self.t)
        self.t = now

    def rollback(self, now: float) -> None:
        """Throw away what was not committed."""
        self.advance(now)
        if self.progress > self.committed:
            self.lost += self.progress - self.committed
            self.rollbacks += 1
        self.progress = self.committed
        self._token += 1

    def hold(self, now: float, until: float) -> None:
        """Stop training until at least ``until``."""
        self.advance(now)
        self.rate = 0.0
        if until > self.until:
            self._set_until(until)

    def wait(self, now: float) -> None:
        """Stop training until something calls :meth:`resume_at`."""
        self.advance(now)
        self.rate = 0.0
        self._set_until(INF)

    def resume_at(self, now: float, when: float) -> None:
        self.advance(now)
        self.rate = 0.0
        self._set_until(when)

    def _set_until(self, until: float) -> None:
        self.until = until
        self._gen += 1
        if until < INF:
            self._at(until, self._resume, self._gen)

    def _resume(self, now: float, gen: int) -> None:
        if gen != self._gen:
            return
        self.advance(now)
        self.until = -INF
        self.on_resume(now)

    def on_resume(self, now: float) -> None:
        raise NotImplementedError

    def save(self, now: float) -> None:
        """Write a checkpoint of the current progress: training stops for the write, and
        the checkpoint counts once the write ends (unless a rollback came first)."""
        self.advance(now)
        self._at(now + self.c.save_s, self._commit, (self._token, self.progress))
        self.hold(now, now + self.c.save_s)

    def _commit(self, now: float, arg: tuple[int, float]) -> None:
        token, value = arg
        if token == self._token and value > self.committed:
            self.committed = value
            self.checkpoints += 1

    def restart_periodic(self, now: float) -> None:
        """The next periodic checkpoint is ``ckpt_every_s`` from now."""
        self._ckpt_gen += 1
        if self.c.ckpt_every_s < INF:
            self._at(now + self.c.ckpt_every_s, self._due, self._ckpt_gen)

    def _due(self, now: float, gen: int) -> None:
        if gen != self._ckpt_gen or not self.training:
            return
        self.save(now)

    # --- the fleet's events -------------------------------------------------------------
    def start(self, now: float) -> None:
        """The fleet is complete and training at ``now``."""
        self.t = now
        self.until = -INF
        self.on_resume(now)

    def on_notice(self, slot: int, now: float) -> None:
        raise NotImplementedError

    def on_lost(self, slot: int, now: float, had_notice: bool) -> None:
        raise NotImplementedError

    def on_filled(self, slot: int, now: float) -> None:
        raise NotImplementedError


class Sync(Trainer):
    """Restart everything from the last periodic checkpoint on any loss."""

    name = "sync"

    def __init__(self, costs: Costs, schedule: Schedule) -> None:
        super().__init__(costs, schedule)
        self.missing = 0

    def on_resume(self, now: float) -> None:
        self.rate = 1.0
        self.restart_periodic(now)

    def on_notice(self, slot: int, now: float) -> None:
        pass  # the job trains on until the VM dies

    def on_lost(self, slot: int, now: float, had_notice: bool) -> None:
        self.missing += 1
        self.rollback(now)
        self.wait(now)  # also abandons a restart in progress

    def on_filled(self, slot: int, now: float) -> None:
        self.missing -= 1
        if self.missing == 0 and self.until == INF:
            self.resume_at(now, now + self.c.rendezvous_s + self.c.load_s)


class _Slots(Trainer):
    """Which slots hold a VM that can train, and how many replicas are complete."""

    def __init__(self, costs: Costs, schedule: Schedule) -> None:
        super().__init__(costs, schedule)
        self.avail = bytearray(b"\x01") * costs.slots
        self.missing = [0] * costs.replicas
        self.complete = costs.replicas

    def _out(self, slot: int) -> bool:
        """Slot ``slot`` can no longer train; whether that broke a complete replica."""
        if not self.avail[slot]:
            return False
        self.avail[slot] = 0
        j = slot // self.c.replica_nodes
        if j >= len(self.missing):
            return False  # a slot past the last whole replica never trains
        self.missing[j] += 1
        if self.missing[j] == 1:
            self.complete -= 1
            return True
        return False

    def _in(self, slot: int) -> bool:
        """Slot ``slot`` can train again; whether that completed its replica."""
        if self.avail[slot]:
            return False
        self.avail[slot] = 1
        j = slot // self.c.replica_nodes
        if j >= len(self.missing):
            return False
        self.missing[j] -= 1
        if self.missing[j] == 0:
            self.complete += 1
            return True
        return False


class Elastic(_Slots):
    """Every membership change stops everyone: save, re-form, restart, load."""

    name = "elastic"

    def __init__(self, costs: Costs, schedule: Schedule) -> None:
        super().__init__(costs, schedule)
        self.world = costs.replicas
        self.reforms = 0

    @property
    def _restart_s(self) -> float:
        return self.c.rendezvous_s + self.c.load_s

    def on_resume(self, now: float) -> None:
        self.world = self.complete
        if self.world == 0:
            self.wait(now)
            return
        self.rate = self.c.throughput(self.world)
        self.restart_periodic(now)

    def _change(self, now: float, save_limit_s: float, fallback_s: float) -> None:
        """A membership change: if training, everyone saves (when the save fits
        ``save_limit_s``; else they give up after ``fallback_s`` and restore the last
        checkpoint), then the group re-forms and restarts."""
        self.reforms += 1
        if self.until == INF:
            return  # nothing runs; the next join restarts it
        if not self.training:
            self.hold(now, now + self._restart_s)
            return
        if self.c.save_s <= save_limit_s:
            self.save(now)
            self.hold(now, now + self.c.save_s + self._restart_s)
        else:
            self.rollback(now)
            self.hold(now, now + fallback_s + self._restart_s)

    def on_notice(self, slot: int, now: float) -> None:
        if self._out(slot):
            window = max(self.c.notice_s - DRAIN_OVERHEAD_S, 0.0)
            self._change(now, window, window)

    def on_lost(self, slot: int, now: float, had_notice: bool) -> None:
        if had_notice or not self._out(slot):
            return  # it left at its notice, or its replica was not training
        self.reforms += 1
        self.rollback(now)
        if self.until != INF:
            self.hold(now, now + self.c.detect_s + self._restart_s)

    def on_filled(self, slot: int, now: float) -> None:
        if not self._in(slot):
            return  # its replica is still incomplete: nothing joins yet
        if self.until == INF:
            self.resume_at(now, now + self._restart_s)
            return
        self._change(now, JOIN_SAVE_LIMIT_S, JOIN_SAVE_LIMIT_S)


class Replica(_Slots):
    """Survivors keep stepping; a replica that lost a VM rejoins from a live peer; the
    quorum and the process group cost nothing (the bound, not torchft as measured)."""

    name = "replica-ideal"

    def __init__(self, costs: Costs, schedule: Schedule) -> None:
        super().__init__(costs, schedule)
        self.up = bytearray(b"\x01") * costs.replicas
        self.up_count = costs.replicas
        self._rgen = [0] * costs.replicas
        self.catch_ups = 0

    def _rate(self) -> float:
        return self.c.throughput(self.up_count)

    def on_resume(self, now: float) -> None:
        if self.up_count == 0:
            self.wait(now)
            return
        self.rate = self._rate()

    def start(self, now: float) -> None:
        super().start(now)
        self.restart_periodic(now)

    def _due(self, now: float, gen: int) -> None:
        # Survivors never restart, so the checkpoint clock runs on through short stops.
        if gen != self._ckpt_gen:
            return
        if self.training:
            self.save(now)
            self._ckpt_gen += 1
            self._at(now + self.c.save_s + self.c.ckpt_every_s, self._due, self._ckpt_gen)
        elif self.until < INF:
            self._at(self.until, self._due, gen)

    def _rerate(self, now: float) -> None:
        if self.training:
            self.advance(now)
            self.rate = self._rate()

    def on_notice(self, slot: int, now: float) -> None:
        pass  # the replica steps on until its VM dies, then leaves between steps

    def on_lost(self, slot: int, now: float, had_notice: bool) -> None:
        self._out(slot)
        j = slot // self.c.replica_nodes
        if j >= len(self.up):
            return
        self._rgen[j] += 1  # a catch-up in progress is void
        if not self.up[j]:
            return
        self.up[j] = 0
        self.up_count -= 1
        if self.up_count == 0:
            self.rollback(now)
            self.wait(now)
            return
        self._survivors_stall(now, had_notice)
        self._rerate(now)

    def _survivors_stall(self, now: float, had_notice: bool) -> None:
        """What a replica's loss costs the replicas that go on."""
        if not had_notice:
            self.hold(now, now + self.c.detect_s)  # the step in flight times out

    def on_filled(self, slot: int, now: float) -> None:
        if not self._in(slot):
            return
        j = slot // self.c.replica_nodes
        self._rgen[j] += 1
        if self.up_count > 0:
            ready = now + self.c.rendezvous_s + self.c.catch_up_s
        else:
            ready = now + self.c.rendezvous_s + self.c.load_s
        self._at(ready, self._caught_up, (j, self._rgen[j]))

    def _caught_up(self, now: float, arg: tuple[int, int]) -> None:
        j, gen = arg
        if gen != self._rgen[j] or self.up[j]:
            return
        self.up[j] = 1
        self.up_count += 1
        self.catch_ups += 1
        if self.until == INF:
            self.resume_at(now, now)
            self.restart_periodic(now)
        else:
            self._rerate(now)

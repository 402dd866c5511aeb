"""The discrete-event core of ``spottrain simulate``: a spot fleet, its preemptions, and the
controller's real planner keeping it at size.

One event queue (``heapq``) in simulated seconds; nothing sleeps. The fleet is simulated once
and every policy of :mod:`spottrain.controller.sim.policies` watches the same fleet, so the
policies see the same preemptions at the same instants (the cloud does not care how the job
trains).

The fleet:

- **Preemptions** hit running VMs (booted; not already noticed) at ``rate_per_node_hour``
  each, a Poisson process per VM (drawn by thinning one process at the full fleet's rate);
  a share ``notice_fraction`` come with the notice (the VM dies ``notice_s`` later), the
  rest kill the VM at once. **Zone reclaims** (``zone_reclaims_per_day``, Poisson) take a
  share of the running VMs at once and leave the zone without spot capacity for
  ``reclaim_outage_s``: launches there fail as a cloud's capacity errors do. A **trace**
  (``{at_s, node, notice}`` rows, the local cloud's format) preempts the named node if it
  runs, else a random running one.
- **The controller** runs a pass (``pass_s`` apart, as ``spottrain up`` does) whenever
  something changed since the last one (a notice, a VM lost, a VM booted), and at the times
  a pass could decide differently on its own (a blocked offer opening, the on-demand
  fallback coming due). Each pass builds an :class:`~spottrain.controller.reconcile.types.Observed`
  and calls :func:`~spottrain.controller.reconcile.planner.plan`, the real planner, and does what it
  says as the loop does: a launch on a spot offer during a capacity outage fails and blocks
  that offer for ``block_s``; any other launch boots after ``launch_latency_s``; terminates
  end VMs. The nodes live in a :class:`~spottrain.controller.reconcile.fleet.FleetIndex` that each
  change updates in place, so a pass costs what its changed nodes cost, not what 12,500
  nodes cost.
- **Slots.** The full-size job has one slot per node; a launch takes the slot that has
  waited longest for a VM (a lost one, or one whose VM is draining). A VM that boots while
  its slot's previous VM still drains takes the slot when that VM dies.
- **Cost.** Every VM is paid from its launch to its end at its offer's price.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from spottrain.cloud.base import Instance, InstanceState, Market, Offer
from spottrain.controller.reconcile.fleet import FleetIndex
from spottrain.controller.reconcile.planner import plan
from spottrain.controller.reconcile.rules import request_id
from spottrain.controller.reconcile.types import (
    Launch,
    NodeObs,
    Observed,
    Penalise,
    Policy,
    Stop,
    Terminate,
    ZoneHistory,
)
from spottrain.controller.sim.model import PolicyResult, SimConfig, SimResult
from spottrain.controller.sim.policies import Trainer
from spottrain.controller.sim.replica_policy import POLICIES
from spottrain.protocol.states import NodeState
from spottrain.spec import SpotPolicy
from spottrain.trace import TracedPreemption

# Event priorities at one instant: the fleet first, then the training's own timers, then the
# controller's pass (which sees everything that happened at that instant), then samples.
_FLEET, _TRAIN, _PASS, _SAMPLE = 0, 1, 2, 3
PENDING, READY, DRAINING_VM, GONE = 0, 1, 2, 3


class _VM:
    __slots__ = ("launched_at", "name", "noticed", "offer", "pos", "request_id", "slot", "state")

    def __init__(self, name: str, offer: Offer, launched_at: float, rid: str, slot: int) -> None:
        self.name = name
        self.offer = offer
        self.launched_at = launched_at
        self.request_id = rid
        self.slot = slot
        self.state = PENDING
        self.pos = -1  # index in the running list
        self.noticed = False


class Simulation:
    """Build it with a :class:`SimConfig`, then :meth:`run` it (once)."""

    def __init__(self, cfg: SimConfig) -> None:
        if cfg.nodes < 1:
            raise ValueError("the job needs at least one node")
        self.cfg = cfg
        self.horizon = cfg.hours * 3600.0
        self.rng = random.Random(cfg.seed)
        self.job_tag = f"sim-{cfg.seed}"
        self.policy = Policy(
            min_nodes=1,
            max_nodes=cfg.nodes,
            spot_policy=cfg.spot_policy,
            fallback_after_s=cfg.fallback_after_s,
        )
        self.offers = [cfg.spot, cfg.on_demand]
        self.home = (cfg.spot.cloud, cfg.spot.zone, cfg.spot.instance_type)
        self.result = SimResult(cfg)
        self._q: list[tuple[float, int, int, Callable[[float, Any], None], Any]] = []
        self._seq = itertools.count()
        # The fleet.
        self.vms: dict[str, _VM] = {}
        self.running: list[_VM] = []  # booted and not noticed: what preemptions can hit
        self.index = FleetIndex()
        self.occupant: list[_VM | None] = [None] * cfg.nodes
        self.incoming: list[_VM | None] = [None] * cfg.nodes
        self._needy: deque[int] = deque()
        self._needy_flag = bytearray(cfg.nodes)
        self.spares: list[_VM] = []
        # The controller's state between passes (what the loop keeps in Redis).
        self.next_index = cfg.nodes
        self.blocked: dict[tuple[str, str, str, str], float] = {}
        self.spot_short_since: float | None = None
        self.outage_until = -math.inf
        self.zone_preemptions = 0
        self.bad_nodes = 0
        self._pass_at = math.inf
        self._wakes: set[float] = set()
        # Money.
        self._vm_count = 0
        self._vm_rate = 0.0
        self._t_acct = 0.0
        # The training.
        costs = cfg.costs()
        self.trainers: list[Trainer] = [POLICIES[name](costs, self.at) for name in cfg.policies]
        self._samples: list[list[float]] = [[] for _ in self.trainers]

    # --- the queue --------------------------------------------------------------------
    def at(self, t: float, fn: Callable[[float, Any], None], arg: Any = None) -> None:
        heapq.heappush(self._q, (t, _TRAIN, next(self._seq), fn, arg))

    def _at(self, t: float, prio: int, fn: Callable[[float, Any], None], arg: Any = None) -> None:
        heapq.heappush(self._q, (t, prio, next(self._seq), fn, arg))

    def run(self) -> SimResult:
        t0 = time.perf_counter()
        cfg = self.cfg
        first = cfg.on_demand if cfg.spot_policy is SpotPolicy.ON_DEMAND else cfg.spot
        for i in range(cfg.nodes):
            vm = _VM(f"n{i}", first, -cfg.launch_latency_s, request_id(self.job_tag, f"n{i}"), i)
            self._add_vm(vm, 0.0)
            self._boot(vm)
            self.occupant[i] = vm
        for tr in self.trainers:
            tr.start(0.0)
        if cfg.rate_per_node_hour > 0:
            self._next_candidate(0.0)
        if cfg.zone_reclaims_per_day > 0:
            self._next_reclaim(0.0)
        for row in cfg.trace:
            if row.at_s <= self.horizon:
                self._at(row.at_s, _FLEET, self._traced, row)
        step = self.horizon / max(cfg.samples, 1)
        for k in range(1, max(cfg.samples, 1) + 1):
            self._at(min(k * step, self.horizon), _SAMPLE, self._sample, None)
        q = self._q
        horizon = self.horizon
        while q:
            t, _, _, fn, arg = heapq.heappop(q)
            if t > horizon:
                break
            fn(t, arg)
        self._account(horizon)
        res = self.result
        n_samples = len(self._samples[0]) if self._samples else 0
        res.sample_hours = [min(k * step, horizon) / 3600.0 for k in range(1, n_samples + 1)]
        for tr, samples in zip(self.trainers, self._samples, strict=True):
            tr.advance(horizon)
            prev = 0.0
            timeline = []
            for p in samples:
                timeline.append((p - prev) / step)
                prev = p
            res.policies.append(
                PolicyResult(tr.name, tr.progress, tr.lost, tr.rollbacks, tr.checkpoints, timeline)
            )
        res.final_nodes = list(self.index)
        res.wall_s = time.perf_counter() - t0
        return res

    def _sample(self, now: float, _: Any) -> None:
        for tr, samples in zip(self.trainers, self._samples, strict=True):
            tr.advance(now)
            samples.append(tr.progress)

    # --- money ------------------------------------------------------------------------
    def _account(self, now: float) -> None:
        dt = (now - self._t_acct) / 3600.0
        if dt > 0:
            self.result.cost_usd += self._vm_rate * dt
            self.result.vm_hours += self._vm_count * dt
        self._t_acct = now

    def _add_vm(self, vm: _VM, now: float) -> None:
        self._account(now)
        self._vm_count += 1
        self._vm_rate += vm.offer.price_per_hour
        self.vms[vm.name] = vm
        self.index.put(self._obs(vm, InstanceState.PENDING, None))

    def _drop_vm(self, vm: _VM, now: float) -> None:
        self._account(now)
        self._vm_count -= 1
        self._vm_rate -= vm.offer.price_per_hour
        del self.vms[vm.name]
        self.index.remove(vm.name)

    # --- what the planner sees --------------------------------------------------------
    def _obs(self, vm: _VM, state: InstanceState, agent: str | None) -> NodeObs:
        o = vm.offer
        inst = Instance(
            id=f"i-{vm.name}",
            cloud=o.cloud,
            region=o.region,
            zone=o.zone,
            instance_type=o.instance_type,
            market=o.market,
            state=state,
            job=self.job_tag,
            node=vm.name,
            request_id=vm.request_id,
            launched_at=vm.launched_at,
        )
        return NodeObs(
            name=vm.name,
            instance=inst,
            offer=o,
            launched_at=vm.launched_at,
            agent_state=agent,
            alive_beat=agent is not None,
        )

    # --- running VMs (what preemptions can hit) ---------------------------------------
    def _run_add(self, vm: _VM) -> None:
        if vm.offer.market is not Market.SPOT:
            return  # on-demand VMs are not taken back
        vm.pos = len(self.running)
        self.running.append(vm)

    def _run_remove(self, vm: _VM) -> None:
        if vm.pos < 0:
            return
        last = self.running.pop()
        if last is not vm:
            self.running[vm.pos] = last
            last.pos = vm.pos
        vm.pos = -1

    # --- slots --------------------------------------------------------------------------
    def _check_needy(self, s: int, now: float) -> None:
        occ = self.occupant[s]
        if self.incoming[s] is None and (occ is None or occ.noticed):
            if self.spares:
                self._assign(self.spares.pop(), s, now)
            elif not self._needy_flag[s]:
                self._needy_flag[s] = 1
                self._needy.append(s)

    def _take_needy(self) -> int:
        while self._needy:
            s = self._needy.popleft()
            self._needy_flag[s] = 0
            occ = self.occupant[s]
            if self.incoming[s] is None and (occ is None or occ.noticed):
                return s
        return -1

    def _assign(self, vm: _VM, s: int, now: float) -> None:
        vm.slot = s
        self.incoming[s] = vm
        if vm.state == READY and self.occupant[s] is None:
            self._fill(s, vm, now)

    def _fill(self, s: int, vm: _VM, now: float) -> None:
        self.occupant[s] = vm
        self.incoming[s] = None
        for tr in self.trainers:
            tr.on_filled(s, now)

    # --- fleet events -------------------------------------------------------------------
    def _boot(self, vm: _VM) -> None:
        vm.state = READY
        self._run_add(vm)
        self.index.put(self._obs(vm, InstanceState.RUNNING, NodeState.JOINED))

    def _ready(self, now: float, vm: _VM) -> None:
        if vm.state != PENDING:
            return  # ended before it booted
        self._account(now)
        self._boot(vm)
        s = vm.slot
        if s >= 0 and self.occupant[s] is None:
            self._fill(s, vm, now)
        self._changed(now)

    def _preempt(self, vm: _VM, now: float, notice: bool) -> None:
        if vm.state != READY or vm.offer.market is not Market.SPOT:
            return
        self.result.preemptions += 1
        self.zone_preemptions += 1
        if not notice:
            self._die(vm, now, had_notice=False)
            return
        self.result.with_notice += 1
        self._run_remove(vm)
        vm.state = DRAINING_VM
        vm.noticed = True
        self.index.put(self._obs(vm, InstanceState.RUNNING, NodeState.DRAINING))
        self._at(now + self.cfg.notice_s, _FLEET, self._death, vm)
        s = vm.slot
        if s >= 0:
            if self.occupant[s] is vm:
                for tr in self.trainers:
                    tr.on_notice(s, now)
            elif self.incoming[s] is vm:
                self.incoming[s] = None  # it never trained: the slot waits for another
                vm.slot = -1
            self._check_needy(s, now)
        elif vm in self.spares:
            self.spares.remove(vm)
        self._changed(now)

    def _death(self, now: float, vm: _VM) -> None:
        self._die(vm, now, had_notice=True)

    def _die(self, vm: _VM, now: float, had_notice: bool) -> None:
        if vm.state == GONE:
            return
        self._run_remove(vm)
        vm.state = GONE
        self._drop_vm(vm, now)
        s = vm.slot
        if s >= 0:
            if self.occupant[s] is vm:
                self.occupant[s] = None
                for tr in self.trainers:
                    tr.on_lost(s, now, had_notice)
                nxt = self.incoming[s]
                if nxt is not None and nxt.state == READY:
                    self._fill(s, nxt, now)
            elif self.incoming[s] is vm:
                self.incoming[s] = None
            self._check_needy(s, now)
        elif vm in self.spares:
            self.spares.remove(vm)
        self._changed(now)

    # --- preemption sources -----------------------------------------------------------
    def _next_candidate(self, now: float) -> None:
        bound = self.cfg.rate_per_node_hour / 3600.0 * self.cfg.nodes
        self._at(now + self.rng.expovariate(bound), _FLEET, self._candidate, None)

    def _candidate(self, now: float, _: Any) -> None:
        self._next_candidate(now)
        n = len(self.running)
        # Thinning: each running VM is hit at the per-VM rate (at most ``nodes`` run).
        if n and self.rng.random() * max(self.cfg.nodes, n) < n:
            vm = self.running[int(self.rng.random() * n)]
            self._preempt(vm, now, self.rng.random() < self.cfg.notice_fraction)

    def _next_reclaim(self, now: float) -> None:
        rate = self.cfg.zone_reclaims_per_day / 86400.0
        self._at(now + self.rng.expovariate(rate), _FLEET, self._reclaim, None)

    def _reclaim(self, now: float, _: Any) -> None:
        self._next_reclaim(now)
        n = len(self.running)
        if n == 0:
            return
        self.result.reclaims += 1
        take = min(n, max(1, math.ceil(self.cfg.reclaim_share * n)))
        for vm in self.rng.sample(self.running, take):
            self._preempt(vm, now, self.rng.random() < self.cfg.notice_fraction)
        self.outage_until = max(self.outage_until, now + self.cfg.reclaim_outage_s)

    def _traced(self, now: float, row: TracedPreemption) -> None:
        vm = self.vms.get(row.node) if row.node else None
        if vm is None or vm.pos < 0:
            if not self.running:
                return
            vm = self.running[int(self.rng.random() * len(self.running))]
        self._preempt(vm, now, row.notice)

    # --- the controller ---------------------------------------------------------------
    def _changed(self, now: float) -> None:
        p = self.cfg.pass_s
        t = now if p <= 0 else max(now, math.ceil(now / p - 1e-9) * p)
        if t < self._pass_at:
            self._pass_at = t
            self._at(t, _PASS, self._pass, t)

    def _wake(self, now: float, _: Any) -> None:
        self._wakes.discard(now)
        self._changed(now)

    def _pass(self, now: float, when: float) -> None:
        if when != self._pass_at:
            return
        self._pass_at = math.inf
        self._account(now)
        res = self.result
        key = self.home
        history = {
            key: ZoneHistory(
                preemptions=self.zone_preemptions,
                node_hours=res.vm_hours,
                bad_nodes=self.bad_nodes,
            )
        }
        obs = Observed(
            now=now,
            nodes=self.index,
            offers=self.offers,
            blocked=self.blocked,
            history=history,
            spent_usd=res.cost_usd,
            home=self.home,
            spot_short_since=self.spot_short_since,
            next_index=self.next_index,
            job_tag=self.job_tag,
        )
        t0 = time.perf_counter()
        out = plan(self.policy, obs)
        res.plan_s += time.perf_counter() - t0
        res.passes += 1
        if out.home is not None:
            self.home = out.home
        self.next_index = out.next_index
        for a in out.actions:
            if isinstance(a, Launch):
                self._launch(a, now)
            elif isinstance(a, Terminate):
                vm = self.vms.get(a.node)
                if vm is not None:
                    res.terminated += 1
                    self._die(vm, now, had_notice=False)
            elif isinstance(a, Penalise):
                self.bad_nodes += 1
            elif isinstance(a, Stop) and not res.stop_reason:
                res.stop_reason = a.why
        self._schedule_wake(now)

    def _launch(self, a: Launch, now: float) -> None:
        offer = a.offer
        res = self.result
        if offer.market is Market.SPOT and now < self.outage_until:
            # What the loop does with a CapacityError: block the offer, note the shortage.
            res.capacity_errors += 1
            self.blocked = {k: u for k, u in self.blocked.items() if u > now}
            self.blocked[offer.key] = now + self.policy.block_s
            if self.spot_short_since is None:
                self.spot_short_since = now
            return
        if offer.market is Market.SPOT:
            self.spot_short_since = None
        else:
            res.on_demand_launches += 1
        res.launches += 1
        vm = _VM(a.node, offer, now, a.request_id, -1)
        self._add_vm(vm, now)
        s = self._take_needy()
        if s >= 0:
            vm.slot = s
            self.incoming[s] = vm
        else:
            self.spares.append(vm)
        self._at(now + self.cfg.launch_latency_s, _FLEET, self._ready, vm)
        if self.cfg.launch_latency_s > self.policy.boot_timeout_s:
            self._wake_for(now + self.policy.boot_timeout_s + max(self.cfg.pass_s, 1e-3))

    def _schedule_wake(self, now: float) -> None:
        """Passes also run when the clock alone could change the plan: a blocked offer
        opening again, the on-demand fallback coming due."""
        times = [u for u in self.blocked.values() if u > now]
        if (
            self.spot_short_since is not None
            and self.policy.spot_policy is SpotPolicy.SPOT_THEN_ON_DEMAND
        ):
            due = self.spot_short_since + self.policy.fallback_after_s
            if due > now:
                times.append(due)
        if times:
            self._wake_for(min(times))

    def _wake_for(self, t: float) -> None:
        if t not in self._wakes:
            self._wakes.add(t)
            self._at(t, _PASS, self._wake, None)


def simulate(cfg: SimConfig) -> SimResult:
    """Run one simulation."""
    return Simulation(cfg).run()

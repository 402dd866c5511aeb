"""The controller's decisions: a pure function from what is observed to what to do, and why.

``plan(policy, observed)`` imports no cloud SDK, no Redis and no clock: the time is a field of
:class:`Observed`, and tests call it with literals. It returns frozen actions and one line of
reason; one executor (:mod:`spottrain.controller.executor`) applies them.

The rules, in the order they are checked:

1. **The end.** A finished job (its final checkpoint committed), a stopped one, or a crash
   loop (the job restored from the same checkpoint after failing at the same step K times)
   terminates every VM, and nothing launches again.
2. **Budget.** Spent so far plus the running fleet's cost over the next hour must stay under
   the cap: no launch that would break that; at the cap, checkpoint and stop.
3. **Bad nodes.** A node whose VM failed its boot health check, or never became healthy
   within the boot timeout, is terminated and its offer penalised (counted against the zone
   and type like a preemption, which weighs the ranking); a straggler
   (its compute time per step, forward and backward without the all-reduce's wait, well
   above the fleet's median: wall time per step is the same on every node of a synchronous
   job) is reported and replaced; a node that left
   (drained, or finished) has its idle VM terminated. A node at risk (its cloud sent a
   rebalance recommendation) gets one replacement launched early (rule 5); once that
   replacement has joined, the at-risk node is drained (emergency checkpoint, leave) rather
   than kept until its preemption: the handover then loses no step, and the surplus VM costs
   no longer than a boot.
4. **Move.** When the job has been below its minimum in its zone for ``move_after_s`` and that
   zone's offer is blocked (capacity), the whole job moves to the best offer elsewhere,
   after a checkpoint copied to object storage. A job whose checkpoints are not copied
   (``Policy.copies_checkpoints`` false) does not move: the new zone's volumes would not
   hold its checkpoint; it waits for its zone, and the reason says so.
5. **Backfill.** Lost and draining nodes are replaced without touching the rest, up to
   ``max`` nodes training, on the cheapest offer weighted by interruption risk, in the job's
   zone and GPU type unless the spec chooses spreading; spot first, on-demand when the
   policy allows it and spot capacity has been missing for ``fallback_after_s``. Each
   at-risk node without a replacement adds one launch: the fleet may run up to ``max`` plus
   the at-risk count, a temporary surplus that ends when those nodes drain, and never a
   launch the budget cannot cover.

**Big fleets.** A pass looks closely only at the nodes that can need something (booting,
draining, failed, left, not listed, stopping); every other node (listed, alive, its agent
up) is only counted: one more staying node, its price, its zone. ``plan`` sorts the nodes into
those two kinds in one scan; a :class:`FleetIndex` passed as ``Observed.nodes`` keeps the
sort up to date as nodes are put and removed one at a time, so that a pass over 12,500 nodes
of which a few changed costs as much as a pass over those few (``spottrain simulate`` plans
that way). Both give the same plan.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TypeVar, overload

from spottrain.cloud.base import Instance, InstanceState, Market, Offer
from spottrain.spec import SpotPolicy

# Agent states (spottrain.agent.lifecycle.NodeState values), spelt here so the planner
# depends on nothing but data.
BOOTING, HEALTHY, JOINED = "booting", "healthy", "joined"
CHECKPOINTING, DRAINING, LEFT, FAILED = "checkpointing", "draining", "left", "failed"
HOURS_PER_MONTH = 730.0
_K = TypeVar("_K", float, str)


@dataclass(frozen=True)
class Policy:
    """What the spec asks, as the planner needs it.

    Attributes:
        min_nodes, max_nodes: the elastic range; the controller aims for ``max_nodes``.
        same_zone: keep every node in one zone and on one GPU type.
        spot_policy: see :class:`SpotPolicy`.
        fallback_after_s: seconds without spot capacity before on-demand is allowed.
        budget_usd: the cap.
        move_after_s: seconds below ``min_nodes`` in a blocked zone before the job moves.
        copies_checkpoints: checkpoints are copied to object storage that nodes elsewhere
            bring in at boot; without it the job never moves (another zone's volumes hold
            nothing of it, or an older checkpoint than the one it must resume from).
        block_s: how long an offer stays blocked after a capacity error or a bad node.
        boot_timeout_s: a VM not healthy this long after its launch is replaced.
        lost_grace_s: a launched VM the cloud does not list for this long is taken as lost
            (clouds are eventually consistent).
        straggler_factor: a node whose compute time per step exceeds this multiple of the
            median of the others is replaced (needs at least 3 nodes reporting).
        crash_loop_k: restores from the same checkpoint after failing at the same step
            that stop the job; ``crash_loop_k`` x ``max_nodes`` VMs in a row that fail at
            boot, with none joining in between, stop it too (a broken image or setting).
        stall_s: the seconds of training a preemption costs the whole fleet (recovery),
            which turns an interruption rate into dollars for the ranking.
        prior_hours: how many node-hours of observation the bundled band is worth when
            blended with the job's own preemptions.
        stop_margin_s: at the cap, the time reserved to checkpoint before stopping.
        finish_grace_s: after training finished, how long a node's agent may take to leave
            before its VM is ended anyway.
    """

    min_nodes: int
    max_nodes: int
    same_zone: bool = True
    spot_policy: SpotPolicy = SpotPolicy.SPOT
    fallback_after_s: float = 1800.0
    budget_usd: float = math.inf
    move_after_s: float = 600.0
    copies_checkpoints: bool = True
    block_s: float = 900.0
    boot_timeout_s: float = 900.0
    lost_grace_s: float = 120.0
    straggler_factor: float = 2.0
    crash_loop_k: int = 3
    stall_s: float = 120.0
    prior_hours: float = 24.0
    stop_margin_s: float = 300.0
    finish_grace_s: float = 60.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError(
                f"need 1 <= min_nodes <= max_nodes, got {self.min_nodes}, {self.max_nodes}"
            )
        if self.crash_loop_k < 2:
            raise ValueError(f"crash_loop_k must be >= 2, got {self.crash_loop_k}")


@dataclass(frozen=True)
class NodeObs:
    """One node as observed: its VM (from the cloud) and its agent (from Redis).

    Attributes:
        name: the node name (the VM's ``spottrain-node`` tag).
        instance: the VM as the cloud lists it; None when the cloud does not (yet) list it.
        offer: the offer it was launched on (from the launch record).
        launched_at: when the controller launched it.
        agent_state: the agent's lifecycle state, None before it registered.
        alive_beat: whether its heartbeat is fresh.
        compute_s: its recent compute seconds per step (forward and backward, without
            waiting on the all-reduce; its slowest local rank's), if it reports one.
        health_failed: the agent reported a failed boot health check.
        at_risk: why the node is at risk of preemption ("rebalance recommendation"), from
            its agent; empty when it is not.
        replaces: the at-risk node this one was launched to replace, while that node lives.
    """

    name: str
    instance: Instance | None
    offer: Offer | None
    launched_at: float
    agent_state: str | None = None
    alive_beat: bool = False
    compute_s: float | None = None
    health_failed: bool = False
    at_risk: str = ""
    replaces: str = ""


@dataclass(frozen=True)
class Restore:
    """One restart of the job's workers: the checkpoint step they restored, and the highest
    step the job had reached before (where it failed)."""

    restored_step: int
    reached_step: int


@dataclass(frozen=True)
class ZoneHistory:
    """The job's own experience of one (cloud, zone, instance type): preemptions seen, bad
    VMs (failed health checks, never booted) and node-hours run there."""

    preemptions: int = 0
    node_hours: float = 0.0
    bad_nodes: int = 0


@dataclass(frozen=True)
class Observed:
    """Everything the planner looks at, gathered by the loop's observe step."""

    now: float
    nodes: Sequence[NodeObs]
    offers: Sequence[Offer]
    blocked: Mapping[tuple[str, str, str, str], float] = field(default_factory=dict)
    history: Mapping[tuple[str, str, str], ZoneHistory] = field(default_factory=dict)
    spent_usd: float = 0.0
    finished: bool = False
    finished_at: float | None = None
    stopped: str = ""
    restores: Sequence[Restore] = ()
    home: tuple[str, str, str] | None = None  # (cloud, zone, instance type)
    below_min_since: float | None = None
    spot_short_since: float | None = None
    next_index: int = 0
    job_tag: str = "job"
    moving: bool = False
    bad_streak: int = 0
    last_failure: str = ""
    last_refusal: str = ""


class ActionKind(StrEnum):
    LAUNCH = "launch"
    TERMINATE = "terminate"
    PENALISE = "penalise"
    MOVE = "move"
    DRAIN = "drain"
    STOP = "stop"
    REPORT = "report"


@dataclass(frozen=True)
class Launch:
    """Launch ``node`` on ``offer``; ``replaces`` names the at-risk node it takes over from."""

    node: str
    request_id: str
    offer: Offer
    replaces: str = ""
    kind: ActionKind = ActionKind.LAUNCH


@dataclass(frozen=True)
class Terminate:
    node: str
    instance_id: str
    why: str
    kind: ActionKind = ActionKind.TERMINATE


@dataclass(frozen=True)
class Drain:
    """Ask a node's agent to drain (emergency checkpoint, leave the rendezvous); its VM is
    ended once the agent has left (rule 3)."""

    node: str
    why: str
    kind: ActionKind = ActionKind.DRAIN


@dataclass(frozen=True)
class Penalise:
    """Count a bad VM against its (cloud, zone, type) in the job's history, like a
    preemption: the ranking then weighs that offer down (a bad host is not a bad zone, so
    the offer is not blocked)."""

    key: tuple[str, str, str]
    why: str
    kind: ActionKind = ActionKind.PENALISE


@dataclass(frozen=True)
class Move:
    """Checkpoint, copy it to object storage, end every VM, and restart on ``to``."""

    to: Offer
    why: str
    kind: ActionKind = ActionKind.MOVE


@dataclass(frozen=True)
class Stop:
    """Checkpoint (when ``checkpoint``), end every VM, and end the job."""

    why: str
    error: bool = False
    checkpoint: bool = True
    kind: ActionKind = ActionKind.STOP


@dataclass(frozen=True)
class Report:
    message: str
    kind: ActionKind = ActionKind.REPORT


Action = Launch | Terminate | Drain | Penalise | Move | Stop | Report


@dataclass(frozen=True)
class Plan:
    actions: tuple[Action, ...]
    reason: str
    home: tuple[str, str, str] | None = None
    next_index: int = 0

    def of(self, kind: type) -> list[Action]:
        return [a for a in self.actions if isinstance(a, kind)]


def request_id(job_tag: str, node: str) -> str:
    """A launch's request id: unique across runs (a hash of the run id) and stable for a
    node, so a restarted controller repeats a launch instead of doubling it."""
    digest = hashlib.sha256(job_tag.encode()).hexdigest()[:10]
    return f"st{digest}-{node}"


def hourly_risk(
    offer: Offer, history: Mapping[tuple[str, str, str], ZoneHistory], prior_h: float
) -> float:
    """Expected interruptions per VM-hour: the bundled band (a monthly share) blended with
    the preemptions this job saw on this zone and type, weighted by node-hours."""
    if offer.market is Market.ON_DEMAND:
        return 0.0
    prior_rate = offer.interruption_risk / HOURS_PER_MONTH
    seen = history.get((offer.cloud, offer.zone, offer.instance_type))
    if seen is None:
        return prior_rate
    events = seen.preemptions + seen.bad_nodes
    return (prior_rate * prior_h + events) / (prior_h + seen.node_hours)


def effective_price(
    offer: Offer, policy: Policy, history: Mapping[tuple[str, str, str], ZoneHistory]
) -> float:
    """USD per VM-hour including what interruptions are expected to cost: each one stalls
    the whole fleet (``max_nodes`` VMs) for ``stall_s``."""
    rate = hourly_risk(offer, history, policy.prior_hours)
    stall_h = policy.stall_s / 3600.0
    return offer.price_per_hour * (1.0 + rate * policy.max_nodes * stall_h)


def _alive(n: NodeObs) -> bool:
    return n.instance is None or n.instance.state.alive


def _lost(n: NodeObs, now: float, policy: Policy) -> bool:
    if n.instance is None:
        return now - n.launched_at > policy.lost_grace_s
    return not n.instance.state.alive


# Agent states after which a node needs a look each pass (a timeout, an end, a replacement).
_WATCHED_AGENT_STATES = (BOOTING, FAILED, LEFT, DRAINING)


def _settled(n: NodeObs) -> bool:
    """A node no rule can act on whatever the clock says: listed and alive (not stopping),
    its agent registered and neither booting, failed, left nor draining, its health not
    failed, not at risk nor a replacement for one. Such a node only counts (staying, its
    price, its zone); a straggler check, which looks at compute times, is the one rule that
    reads it, and it reads the whole fleet."""
    inst = n.instance
    return (
        inst is not None
        and (inst.state is InstanceState.RUNNING or inst.state is InstanceState.PENDING)
        and not n.health_failed
        and not n.at_risk
        and not n.replaces
        and n.agent_state is not None
        and n.agent_state not in _WATCHED_AGENT_STATES
    )


@dataclass
class _Tally:
    """The nodes sorted for a pass: the ones to look at (in fleet order) and counts of the
    settled rest."""

    unsettled: list[NodeObs]
    settled: int
    prices: Counter[float]  # price per hour -> settled nodes with an offer at that price
    zones: Counter[str]  # zone -> settled nodes with an offer there
    timed: int  # nodes (of either kind) that report a compute time

    @classmethod
    def of(cls, nodes: Iterable[NodeObs]) -> _Tally:
        unsettled: list[NodeObs] = []
        prices: Counter[float] = Counter()
        zones: Counter[str] = Counter()
        settled = timed = 0
        for n in nodes:
            if n.compute_s is not None:
                timed += 1
            if _settled(n):
                settled += 1
                if n.offer is not None:
                    prices[n.offer.price_per_hour] += 1
                    zones[n.offer.zone] += 1
            else:
                unsettled.append(n)
        return cls(unsettled, settled, prices, zones, timed)


def _hourly_cost(prices: Counter[float]) -> float:
    """USD per hour of nodes counted by price (summed by price, so the figure does not
    depend on the order the nodes came in)."""
    return sum((price * count for price, count in sorted(prices.items())), 0.0)


class FleetIndex(Sequence[NodeObs]):
    """The observed nodes by name, kept sorted for :func:`plan` as they change.

    Pass it as ``Observed.nodes``: it is a sequence of the nodes (in the order they were
    first put), and ``plan`` reads its running counts instead of scanning every node, so a
    pass costs in proportion to the nodes that are booting, draining, failed or otherwise
    unsettled, not to the fleet. ``put`` adds or replaces a node (a replaced node keeps its
    place), ``remove`` drops one; neither copies the fleet.
    """

    def __init__(self, nodes: Iterable[NodeObs] = ()) -> None:
        self._nodes: dict[str, NodeObs] = {}
        self._order: dict[str, int] = {}
        self._next = 0
        self._unsettled: dict[str, NodeObs] = {}
        self._settled = 0
        self._prices: Counter[float] = Counter()
        self._zones: Counter[str] = Counter()
        self._timed = 0
        self._list: list[NodeObs] | None = None
        for n in nodes:
            self.put(n)

    def put(self, node: NodeObs) -> None:
        """Add ``node``, or replace the node of the same name."""
        old = self._nodes.get(node.name)
        if old is not None:
            self._uncount(old)
        else:
            self._order[node.name] = self._next
            self._next += 1
        self._nodes[node.name] = node
        self._count(node)
        self._list = None

    def remove(self, name: str) -> NodeObs | None:
        """Drop the node called ``name``; returns it (None when there was none)."""
        old = self._nodes.pop(name, None)
        if old is not None:
            self._uncount(old)
            del self._order[name]
            self._list = None
        return old

    def get(self, name: str) -> NodeObs | None:
        return self._nodes.get(name)

    def _count(self, n: NodeObs) -> None:
        if n.compute_s is not None:
            self._timed += 1
        if _settled(n):
            self._settled += 1
            if n.offer is not None:
                self._prices[n.offer.price_per_hour] += 1
                self._zones[n.offer.zone] += 1
        else:
            self._unsettled[n.name] = n

    def _uncount(self, n: NodeObs) -> None:
        if n.compute_s is not None:
            self._timed -= 1
        if self._unsettled.pop(n.name, None) is None:
            self._settled -= 1
            if n.offer is not None:
                _decrement(self._prices, n.offer.price_per_hour)
                _decrement(self._zones, n.offer.zone)

    def tally(self) -> _Tally:
        order = self._order
        unsettled = sorted(self._unsettled.values(), key=lambda n: order[n.name])
        return _Tally(
            unsettled, self._settled, Counter(self._prices), Counter(self._zones), self._timed
        )

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[NodeObs]:
        return iter(self._nodes.values())

    def __contains__(self, value: object) -> bool:
        return isinstance(value, NodeObs) and self._nodes.get(value.name) == value

    @overload
    def __getitem__(self, i: int) -> NodeObs: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[NodeObs]: ...

    def __getitem__(self, i: int | slice) -> NodeObs | Sequence[NodeObs]:
        if self._list is None:
            self._list = list(self._nodes.values())
        return self._list[i]


def _decrement(counter: Counter[_K], key: _K) -> None:
    left = counter[key] - 1
    if left:
        counter[key] = left
    else:
        del counter[key]


def plan(policy: Policy, obs: Observed) -> Plan:
    """Decide what to do now. See the module docstring for the rules.

    Returns:
        A :class:`Plan`: its actions, one line of reason, the job's home (cloud, zone,
        instance type) after this pass, and the next free node index.
    """
    now = obs.now
    actions: list[Action] = []
    reasons: list[str] = []

    def live_all() -> list[NodeObs]:
        return [n for n in obs.nodes if not _lost(n, now, policy)]

    def end_all(why: str) -> list[Action]:
        return [
            Terminate(n.name, n.instance.id, why)
            for n in live_all()
            if n.instance is not None and n.instance.state.alive
        ]

    # 1. The end. Agents leave on their own once training is over; a VM is ended once its
    # agent left, stopped beating, or after ``finish_grace_s`` whatever it does.
    if obs.finished:
        late = obs.finished_at is not None and now - obs.finished_at > policy.finish_grace_s
        finished_ends: list[Action] = [
            Terminate(n.name, n.instance.id, "training finished")
            for n in live_all()
            if n.instance is not None
            and n.instance.state.alive
            and (late or n.agent_state in (LEFT, FAILED, None) or not n.alive_beat)
        ]
        return Plan(
            tuple(finished_ends),
            f"training finished: scaling down ({len(finished_ends)} VMs)",
            obs.home,
            obs.next_index,
        )
    if obs.stopped:
        ends = end_all(obs.stopped)
        return Plan(
            tuple(ends),
            f"stopped ({obs.stopped}): {len(ends)} VMs to end",
            obs.home,
            obs.next_index,
        )
    loop = _crash_loop(obs.restores, policy.crash_loop_k)
    if loop is not None:
        why = (
            f"crash loop: the job failed at step {loop.reached_step} and restored step "
            f"{loop.restored_step} {policy.crash_loop_k} times; fix the training script "
            "and relaunch"
        )
        return Plan((Stop(why, error=True, checkpoint=False),), why, obs.home, obs.next_index)

    if obs.bad_streak >= policy.crash_loop_k * policy.max_nodes:
        why = (
            f"{obs.bad_streak} VMs in a row failed at boot and none joined; the last said: "
            f"{obs.last_failure or 'nothing'}. Fix that and relaunch"
        )
        return Plan((Stop(why, error=True, checkpoint=False),), why, obs.home, obs.next_index)

    # Settled nodes (see ``_settled``) are live, run or will, and stay; only the others
    # are looked at one by one.
    tally = obs.nodes.tally() if isinstance(obs.nodes, FleetIndex) else _Tally.of(obs.nodes)
    live = [n for n in tally.unsettled if not _lost(n, now, policy)]
    vms = [n for n in live if n.instance is None or n.instance.state is not InstanceState.STOPPING]

    # 2. Budget.
    prices = tally.prices
    prices.update(n.offer.price_per_hour for n in vms if n.offer is not None)
    running_rate = _hourly_cost(prices)
    margin_cost = running_rate * policy.stop_margin_s / 3600.0
    if obs.spent_usd + margin_cost >= policy.budget_usd:
        why = (
            f"budget: ${obs.spent_usd:,.2f} spent of ${policy.budget_usd:,.2f}; checkpointing "
            "and stopping"
        )
        return Plan((Stop(why),), why, obs.home, obs.next_index)

    # 3. Bad nodes.
    gone: set[str] = set()
    for n in live:
        if n.instance is None or not n.instance.state.alive:
            continue
        if n.health_failed or n.agent_state == FAILED:
            actions.append(Terminate(n.name, n.instance.id, "its agent failed"))
            if n.offer is not None:
                actions.append(Penalise(_zone_key(n.offer), f"node {n.name} was bad"))
            gone.add(n.name)
        elif n.agent_state in (None, BOOTING) and now - n.launched_at > policy.boot_timeout_s:
            actions.append(
                Terminate(
                    n.name, n.instance.id, f"not healthy {policy.boot_timeout_s:.0f} s after launch"
                )
            )
            if n.offer is not None:
                actions.append(Penalise(_zone_key(n.offer), f"node {n.name} never booted"))
            gone.add(n.name)
        elif n.agent_state == LEFT:
            actions.append(Terminate(n.name, n.instance.id, "its agent left (drained or done)"))
            gone.add(n.name)
    n_staying = tally.settled
    staying_zones = tally.zones
    # Fewer than three nodes timing their steps cannot make a straggler.
    straggler = _straggler(live_all(), policy.straggler_factor, gone) if tally.timed >= 3 else None
    if straggler is not None:
        n, median = straggler
        assert n.instance is not None and n.compute_s is not None
        msg = (
            f"node {n.name} is a straggler: {n.compute_s:.2f} s of compute per step against the "
            f"fleet's median {median:.2f} s; replacing it"
        )
        actions += [Report(msg), Terminate(n.name, n.instance.id, "straggler")]
        gone.add(n.name)
        reasons.append(msg)
        if _settled(n):
            n_staying -= 1
            if n.offer is not None:
                _decrement(staying_zones, n.offer.zone)
    if gone:
        reasons.append(f"replacing {len(gone)} bad node(s)")

    # Who is left to count: VMs that run (or will) and whose agents are not leaving.
    def is_staying(n: NodeObs) -> bool:
        return n.name not in gone and n.agent_state not in (DRAINING, LEFT, FAILED)

    def staying_all() -> list[NodeObs]:
        return [
            n
            for n in obs.nodes
            if not _lost(n, now, policy)
            and (n.instance is None or n.instance.state is not InstanceState.STOPPING)
            and is_staying(n)
        ]

    for n in vms:
        if is_staying(n):
            n_staying += 1
            if n.offer is not None:
                staying_zones[n.offer.zone] += 1
    at_risk, uncovered = _handover(vms, is_staying, actions, reasons)
    blocked = {k for k, until in obs.blocked.items() if until > now}
    home = obs.home
    if home is None and n_staying:
        home = _majority_home(staying_all())

    # 4. Move.
    if (
        policy.same_zone
        and home is not None
        and n_staying < policy.min_nodes
        and obs.below_min_since is not None
        and now - obs.below_min_since >= policy.move_after_s
        and not obs.moving
    ):
        here = _candidates(policy, obs, blocked, home, now, only_home=True)
        if not here:
            away = [
                o
                for o in _candidates(policy, obs, blocked, None, now, only_home=False)
                if o.zone != home[1]
            ]
            if away and not policy.copies_checkpoints:
                best = away[0]
                reasons.append(
                    f"zone {home[1]} is short but the job stays: a move to {best.cloud} "
                    f"{best.zone} would start from whatever its volumes hold, not the job's "
                    "checkpoint (set checkpoint.copy_to to let the job move)"
                )
            elif away:
                best = away[0]
                why = (
                    f"zone {home[1]} could not hold {policy.min_nodes} node(s) for "
                    f"{now - obs.below_min_since:.0f} s: moving the job to {best.cloud} "
                    f"{best.zone} ({best.instance_type}, {best.market})"
                )
                return Plan(
                    (*actions, Move(best, why)),
                    why,
                    (best.cloud, best.zone, best.instance_type),
                    obs.next_index,
                )
            reasons.append(f"zone {home[1]} is short and no other offer is open")

    # Never more than max nodes (plus one replacement per at-risk node): a late-confirmed
    # launch can overshoot; end the newest.
    cap = policy.max_nodes + len(at_risk)
    if n_staying > cap:
        staying = staying_all()
        extra = sorted(staying, key=lambda n: (n.launched_at, n.name))[cap:]
        for n in extra:
            if n.instance is not None and n.instance.state.alive:
                actions.append(
                    Terminate(n.name, n.instance.id, f"over max_nodes ({policy.max_nodes})")
                )
        staying = [n for n in staying if n not in extra]
        n_staying = len(staying)
        staying_zones = Counter(n.offer.zone for n in staying if n.offer is not None)
        reasons.append(f"ending {len(extra)} node(s) over max_nodes")

    # A move in progress: the old fleet drains and copies its checkpoint; the new zone
    # starts once the copy is complete (the loop clears ``moving`` then).
    if obs.moving:
        reasons.append("moving: waiting for the drained fleet's checkpoint copy")
        return Plan(tuple(actions), "; ".join(reasons), home, obs.next_index)

    # 5. Backfill. At-risk nodes do not count towards max: each gets its replacement.
    need = policy.max_nodes - n_staying + len(at_risk)
    next_index = obs.next_index
    if need > 0:
        offers = _candidates(
            policy,
            obs,
            blocked,
            home if policy.same_zone else None,
            now,
            only_home=policy.same_zone and home is not None,
        )
        launched = 0
        projected = running_rate
        for _ in range(need):
            if not offers:
                break
            offer = offers[0] if policy.same_zone else _spread_pick(offers, staying_zones, actions)
            projection = obs.spent_usd + projected + offer.price_per_hour
            if projection > policy.budget_usd:
                reasons.append(
                    f"budget: one more node would project ${projection:,.2f} within the "
                    f"hour, over the ${policy.budget_usd:,.2f} cap"
                )
                break
            node = f"n{next_index}"
            next_index += 1
            replaces = uncovered.pop(0).name if uncovered else ""
            actions.append(Launch(node, request_id(obs.job_tag, node), offer, replaces))
            if replaces:
                reasons.append(f"{replaces} at risk: launching replacement {node}")
            projected += offer.price_per_hour
            launched += 1
            if home is None and policy.same_zone:
                home = (offer.cloud, offer.zone, offer.instance_type)
                offers = [o for o in offers if (o.cloud, o.zone, o.instance_type) == home]
        hard = [k for k, until in obs.blocked.items() if until - now > 3600]
        if (
            not launched
            and not n_staying
            and not offers
            and obs.offers
            and len(hard) >= len({o.key for o in obs.offers})
        ):
            why = (
                "every allowed offer was refused by its cloud (quota, or a setting it rejects); "
                f"the last said: {obs.last_refusal or 'nothing'}"
            )
            return Plan((*actions, Stop(why, error=True, checkpoint=False)), why, home, next_index)
        if (
            not launched
            and not n_staying
            and offers
            and "budget" in (reasons[-1] if reasons else "")
        ):
            cheapest = offers[0].price_per_hour
            why = (
                f"budget: ${policy.budget_usd - obs.spent_usd:,.2f} left cannot cover an hour of "
                f"the cheapest node (${cheapest:,.2f}/h); raise budget.max_usd"
            )
            return Plan((*actions, Stop(why, error=True, checkpoint=False)), why, home, next_index)
        if launched:
            where = ", ".join(
                sorted(
                    {
                        f"{a.offer.zone} {a.offer.instance_type} {a.offer.market}"
                        for a in actions
                        if isinstance(a, Launch)
                    }
                )
            )
            reasons.append(
                f"{n_staying} of {policy.max_nodes} node(s): launching {launched} on {where}"
            )
        elif not offers:
            reasons.append(f"{n_staying} of {policy.max_nodes} node(s): no open offer to launch on")
    if not reasons:
        reasons.append(f"{n_staying} of {policy.max_nodes} node(s): nothing to do")
    return Plan(tuple(actions), "; ".join(reasons), home, next_index)


def _handover(
    vms: Sequence[NodeObs],
    is_staying: Callable[[NodeObs], bool],
    actions: list[Action],
    reasons: list[str],
) -> tuple[list[NodeObs], list[NodeObs]]:
    """Rule 3's at-risk nodes: drain each one whose replacement has joined. Returns the
    staying at-risk nodes and those of them that have no replacement yet (rule 5 launches
    one for each)."""
    at_risk = sorted(
        (
            n
            for n in vms
            if n.at_risk and is_staying(n) and n.instance is not None and n.instance.state.alive
        ),
        key=lambda n: n.name,
    )
    replacements = {n.replaces: n for n in vms if n.replaces and is_staying(n)}
    uncovered = []
    for n in at_risk:
        r = replacements.get(n.name)
        if r is None:
            uncovered.append(n)
        elif r.agent_state == JOINED and n.agent_state in (JOINED, CHECKPOINTING):
            why = f"{n.name} at risk ({n.at_risk}): replacement {r.name} joined; draining {n.name}"
            actions.append(Drain(n.name, why))
            reasons.append(why)
        else:
            reasons.append(
                f"{n.name} at risk ({n.at_risk}): replacement {r.name} "
                f"{r.agent_state or 'launching'}"
            )
    return at_risk, uncovered


def _zone_key(o: Offer) -> tuple[str, str, str]:
    return (o.cloud, o.zone, o.instance_type)


def _majority_home(nodes: Sequence[NodeObs]) -> tuple[str, str, str] | None:
    counts = Counter(
        (n.offer.cloud, n.offer.zone, n.offer.instance_type) for n in nodes if n.offer is not None
    )
    return counts.most_common(1)[0][0] if counts else None


def _markets(policy: Policy, obs: Observed, now: float) -> tuple[Market, ...]:
    if policy.spot_policy is SpotPolicy.SPOT:
        return (Market.SPOT,)
    if policy.spot_policy is SpotPolicy.ON_DEMAND:
        return (Market.ON_DEMAND,)
    short = (
        obs.spot_short_since is not None and now - obs.spot_short_since >= policy.fallback_after_s
    )
    return (Market.SPOT, Market.ON_DEMAND) if short else (Market.SPOT,)


def _candidates(
    policy: Policy,
    obs: Observed,
    blocked: set[tuple[str, str, str, str]],
    home: tuple[str, str, str] | None,
    now: float,
    *,
    only_home: bool,
) -> list[Offer]:
    """Open offers, best first: allowed market, not blocked, in the home zone and type when
    asked; spot before on-demand, then by risk-weighted price."""
    markets = _markets(policy, obs, now)
    out = [
        o
        for o in obs.offers
        if o.market in markets
        and o.key not in blocked
        and (not only_home or home is None or (o.cloud, o.zone, o.instance_type) == home)
    ]
    if home is not None and not only_home and policy.same_zone:
        # A move keeps the GPU type when it can: prefer offers of the same type.
        same_type = [o for o in out if o.instance_type == home[2]]
        out = same_type or out
    return sorted(
        out,
        key=lambda o: (
            o.market is not Market.SPOT,
            effective_price(o, policy, obs.history),
            o.cloud,
            o.zone,
            o.instance_type,
        ),
    )


def _spread_pick(
    offers: Sequence[Offer], staying_zones: Counter[str], actions: Sequence[Action]
) -> Offer:
    """With spreading, the cheapest offer in the zone that has the fewest nodes (staying
    nodes counted by zone, plus this pass's launches)."""
    per_zone = Counter(staying_zones)
    per_zone.update(a.offer.zone for a in actions if isinstance(a, Launch))
    return min(offers, key=lambda o: (per_zone[o.zone], offers.index(o)))


def _straggler(
    nodes: Sequence[NodeObs], factor: float, skip: set[str]
) -> tuple[NodeObs, float] | None:
    timed = [
        n
        for n in nodes
        if n.compute_s is not None
        and n.name not in skip
        and n.instance is not None
        and n.instance.state.alive
        and n.agent_state == JOINED
    ]
    if len(timed) < 3:
        return None
    worst = max(timed, key=lambda n: n.compute_s or 0.0)
    others = [n.compute_s for n in timed if n is not worst and n.compute_s is not None]
    median = statistics.median(others)
    if worst.compute_s is not None and median > 0 and worst.compute_s > factor * median:
        return worst, median
    return None


def _crash_loop(restores: Sequence[Restore], k: int) -> Restore | None:
    """The last ``k`` restores all restored the same step after failing at the same step."""
    if len(restores) < k:
        return None
    last = restores[-k:]
    return last[0] if all(r == last[0] for r in last) else None

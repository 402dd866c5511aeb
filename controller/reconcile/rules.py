"""The planner's rules, one function each (see :mod:`.planner` for the rules in words).

Each rule reads the pass (:class:`Pass`: the policy, what was observed, and what earlier
rules decided), adds actions and reasons to it, and returns a :class:`Plan` when it ends the
pass early (a stop, a move), else None.
"""

from __future__ import annotations

import bisect
import hashlib
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from spottrain.cloud.base import InstanceState, Offer
from spottrain.protocol.boot import IMAGE_STAGES, BootState
from spottrain.protocol.states import LEAVING, TERMINAL, TRAINING, NodeState
from spottrain.safetext import one_line

from .fleet import FleetIndex, Tally, decrement, is_lost, is_settled, majority_home
from .pricing import candidates, hourly_cost, spread_pick, zone_key
from .types import (
    CLOSED_RENDEZVOUS,
    FLEET_EVERY_S,
    FLEET_WINDOW_S,
    Action,
    Block,
    Drain,
    FailedLaunch,
    FailedLaunches,
    Launch,
    LaunchFailed,
    Move,
    NodeObs,
    Observed,
    Penalise,
    Plan,
    Policy,
    Report,
    Restore,
    SlowStreak,
    SlowWatch,
    Stop,
    StragglerPolicy,
    Terminate,
    Watch,
)


def request_id(job_tag: str, node: str) -> str:
    """A launch's request id: unique across runs (a hash of the run id) and stable for a
    node, so a restarted controller repeats a launch instead of doubling it."""
    digest = hashlib.sha256(job_tag.encode()).hexdigest()[:10]
    return f"st{digest}-{node}"


# --- 1. The end ------------------------------------------------------------------------------
def the_end(policy: Policy, obs: Observed) -> Plan | None:
    """Rule 1: a finished or stopped job ends its VMs; a crash loop, or a streak of VMs that
    failed before training (:class:`~.types.FailedLaunches`), stops it."""
    if obs.finished:
        return _finished(policy, obs)
    if obs.stopped:
        ends = _end_all(policy, obs, obs.stopped)
        return Plan(
            tuple(ends),
            f"stopped ({obs.stopped}): {len(ends)} VMs to end",
            obs.home,
            obs.next_index,
        )
    loop = crash_loop(obs.restores, policy.crash_loop_k)
    if loop is not None:
        said = obs.failed.last or next(
            (f"{n.name}: {n.crash.why()}" for n in obs.nodes if n.crash is not None), ""
        )
        why = (
            f"crash loop: the job failed at step {loop.reached_step} and restored step "
            f"{loop.restored_step} {policy.crash_loop_k} times"
            + (f" (the last failure: {one_line(said)})" if said else "")
            + "; fix the training script and relaunch"
        )
        return Plan((Stop(why, error=True, checkpoint=False),), why, obs.home, obs.next_index)
    if obs.failed.gives_up(policy.max_failed_launches) and not obs.failed.effects_only:
        # Rule 3 stops the run as the streak reaches the limit; this repeats the stop for a
        # controller restarted before it was recorded. A streak of closed rendezvous may
        # wait there for its cause.
        why = obs.failed.why()
        return Plan((Stop(why, error=True, checkpoint=False),), why, obs.home, obs.next_index)
    return None


def _live_all(policy: Policy, obs: Observed) -> list[NodeObs]:
    return [n for n in obs.nodes if not is_lost(n, obs.now, policy)]


def _end_all(policy: Policy, obs: Observed, why: str) -> list[Action]:
    return [
        Terminate(n.name, n.instance.id, why)
        for n in _live_all(policy, obs)
        if n.instance is not None and n.instance.state.alive
    ]


def _finished(policy: Policy, obs: Observed) -> Plan:
    """Agents leave on their own once training is over; a VM is ended once its agent left,
    stopped beating, or after ``finish_grace_s`` whatever it does."""
    late = obs.finished_at is not None and obs.now - obs.finished_at > policy.finish_grace_s
    ends: list[Action] = [
        Terminate(n.name, n.instance.id, "training finished")
        for n in _live_all(policy, obs)
        if n.instance is not None
        and n.instance.state.alive
        and (late or n.agent_state is None or n.agent_state in TERMINAL or not n.alive_beat)
    ]
    return Plan(
        tuple(ends),
        f"training finished: scaling down ({len(ends)} VMs)",
        obs.home,
        obs.next_index,
    )


def crash_loop(restores: Sequence[Restore], k: int) -> Restore | None:
    """The last ``k`` restores all restored the same step after failing at the same step."""
    if len(restores) < k:
        return None
    last = restores[-k:]
    return last[0] if all(r == last[0] for r in last) else None


# --- the pass ----------------------------------------------------------------------------------
@dataclass
class Pass:
    """One pass of rules 2 to 5: the fleet sorted (settled nodes only counted, see
    :func:`.fleet.is_settled`), and what the rules decided so far."""

    policy: Policy
    obs: Observed
    tally: Tally
    live: list[NodeObs]  # unsettled nodes not lost
    vms: list[NodeObs]  # of those, the ones not stopping
    actions: list[Action] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    gone: set[str] = field(default_factory=set)
    running_rate: float = 0.0
    n_staying: int = 0
    staying_zones: Counter[str] = field(default_factory=Counter)
    at_risk: list[NodeObs] = field(default_factory=list)
    uncovered: list[NodeObs] = field(default_factory=list)
    blocked: set[tuple[str, str, str, str]] = field(default_factory=set)
    fresh_blocks: set[tuple[str, str, str, str]] = field(default_factory=set)  # this pass's
    home: tuple[str, str, str] | None = None

    @classmethod
    def sort(cls, policy: Policy, obs: Observed) -> Pass:
        nodes = obs.nodes
        tally = nodes.tally() if isinstance(nodes, FleetIndex) else Tally.of(nodes)
        live = [n for n in tally.unsettled if not is_lost(n, obs.now, policy)]
        vms = [
            n for n in live if n.instance is None or n.instance.state is not InstanceState.STOPPING
        ]
        return cls(policy, obs, tally, live, vms, home=obs.home)

    def is_staying(self, n: NodeObs) -> bool:
        """A VM that runs (or will) and whose agent is not leaving."""
        return n.name not in self.gone and n.agent_state not in LEAVING

    def staying_all(self) -> list[NodeObs]:
        now, policy = self.obs.now, self.policy
        return [
            n
            for n in self.obs.nodes
            if not is_lost(n, now, policy)
            and (n.instance is None or n.instance.state is not InstanceState.STOPPING)
            and self.is_staying(n)
        ]

    def result(self, next_index: int | None = None) -> Plan:
        index = self.obs.next_index if next_index is None else next_index
        return Plan(tuple(self.actions), "; ".join(self.reasons), self.home, index)

    def ending(self, last: Action, why: str, next_index: int | None = None) -> Plan:
        index = self.obs.next_index if next_index is None else next_index
        return Plan((*self.actions, last), why, self.home, index)


# --- 2. Budget ---------------------------------------------------------------------------------
def budget(p: Pass) -> Plan | None:
    """Rule 2: at the cap (with the time to checkpoint reserved), checkpoint and stop."""
    policy, obs = p.policy, p.obs
    prices = p.tally.prices
    prices.update(n.offer.price_per_hour for n in p.vms if n.offer is not None)
    p.running_rate = hourly_cost(prices)
    margin_cost = p.running_rate * policy.stop_margin_s / 3600.0
    if obs.spent_usd + margin_cost >= policy.budget_usd:
        why = (
            f"budget: ${obs.spent_usd:,.2f} spent of ${policy.budget_usd:,.2f}; checkpointing "
            "and stopping"
        )
        return Plan((Stop(why),), why, obs.home, obs.next_index)
    return None


# --- 3. Bad nodes --------------------------------------------------------------------------------
def bad_nodes(p: Pass) -> Plan | None:
    """Rule 3: failed, never-booted and left nodes end (the bad ones penalised), and a
    straggler is reported and replaced. A VM that failed before training (:func:`failure`)
    ends at once and counts in the give-up streak; the streak's limit stops the run here.
    Returns that stop, else None."""
    policy = p.policy
    streak = p.obs.failed
    # Nodes that train (for a while, not only joined) show the launch works: a failure at
    # no known training step is then that VM's own, and not counted.
    training = p.tally.training
    for n in p.live:
        if n.instance is None or not n.instance.state.alive:
            continue
        failed = failure(n, p.obs.now, policy)
        if failed is not None:
            p.actions.append(Terminate(n.name, n.instance.id, failed.why))
            p.gone.add(n.name)
            if streak.counted(n.name):
                continue  # ended and counted on an earlier pass; the cloud still lists it
            if n.offer is not None:
                p.actions.append(Penalise(zone_key(n.offer), f"node {n.name} was bad", node=n.name))
                if failed.stage in IMAGE_STAGES:
                    _block_image(p, n.offer, failed)
            streak = streak.add(
                failed,
                count=streak.counts(failed, training),
                committed_step=p.obs.committed_step,
                now=p.obs.now,
            )
            p.actions.append(LaunchFailed(failed, streak))
            if _gives_up(p, streak):
                why = streak.why()
                return p.ending(Stop(why, error=True, checkpoint=False), why)
        elif n.agent_state == NodeState.LEFT:
            why = "its agent left (drained or done)"
            p.actions.append(Terminate(n.name, n.instance.id, why, preempted=n.preempted))
            p.gone.add(n.name)
    if streak is p.obs.failed and _gives_up(p, streak):
        # A streak of closed rendezvous that waited for the failure that closed it, which
        # never came (its node ended otherwise, or took too long).
        why = streak.why()
        return p.ending(Stop(why, error=True, checkpoint=False), why)
    p.n_staying = p.tally.settled
    p.staying_zones = p.tally.zones
    _replace_straggler(p)
    if p.gone:
        p.reasons.append(f"replacing {len(p.gone)} bad node(s)")
    return None


# How long a streak of VMs that found the job's rendezvous closed waits at its limit for the
# failure that closed it, from a node whose workers were failing: its agent ends them within
# seconds (a crash loop is three quick failures).
CAUSE_WAIT_S = 120.0


def _gives_up(p: Pass, streak: FailedLaunches) -> bool:
    """Whether the streak ends the run now: at its limit, unless it is only VMs that found
    the rendezvous closed while a node whose workers fail (the likely closer) is still up and
    has not said why, for at most :data:`CAUSE_WAIT_S`; its failure then names the cause."""
    if not streak.gives_up(p.policy.max_failed_launches):
        return False
    if not streak.effects_only or p.obs.now - streak.at >= CAUSE_WAIT_S:
        return True
    failing = [
        n.name
        for n in _live_all(p.policy, p.obs)
        if n.name not in p.gone
        and n.instance is not None
        and n.instance.state.alive
        and not n.trains
        and n.crash is not None
        and CLOSED_RENDEZVOUS not in n.crash.line
    ]
    if failing:
        p.reasons.append(
            f"{streak.count} VMs found the rendezvous closed; waiting for why "
            f"{', '.join(failing)}'s workers failed"
        )
    return not failing


def failure(n: NodeObs, now: float, policy: Policy) -> FailedLaunch | None:
    """How ``n`` failed before training, if it did: its agent failed (its health check, or
    later: its workers crash-looped, whose reason is the crash's key and step, see
    :func:`spottrain.protocol.crashes.same_crash`), its boot reported a failure, or it was
    not healthy ``boot_timeout_s`` after its launch. Text from the VM is made one safe
    line."""
    if n.health_failed or n.agent_state == NodeState.FAILED:
        said = one_line(n.agent_reason) if n.agent_reason else ""
        why = f"its agent failed: {said}" if said else "its agent failed"
        crash = n.crash
        if crash is not None and crash.loop and not n.health_failed:
            tail = tuple(one_line(x, 200) for x in crash.tail)
            return FailedLaunch(
                n.name,
                why,
                reason=crash.key,
                at_boot=False,
                crashed=True,
                launched_at=n.launched_at,
                step=crash.step,
                tail=tail,
            )
        return FailedLaunch(n.name, why, reason=why, at_boot=n.health_failed)
    if n.agent_state not in (None, NodeState.BOOTING):
        return None
    boot = n.boot
    if boot is not None and boot.failed:
        said = one_line(boot.reason)
        stage = one_line(boot.stage, 80)
        why = f"boot failed in '{stage}'" + (f": {said}" if said else "")
        return FailedLaunch(n.name, why, stage=boot.stage, reason=said)
    if now - n.launched_at <= policy.boot_timeout_s:
        return None
    reason = f"not healthy {policy.boot_timeout_s:.0f} s after launch"
    why = reason
    stage = ""
    if boot is not None:
        stage = boot.stage
        where = "booted" if boot.state is BootState.BOOTED else f"was at '{one_line(stage, 80)}'"
        why += f" (its boot {where})"
    if n.console:
        why += f"; its console's last line: {one_line(n.console, 200)}"
    return FailedLaunch(n.name, why, stage=stage, reason=reason)


def _block_image(p: Pass, offer: Offer, failed: FailedLaunch) -> None:
    """The machine image cannot boot spottrain: block every offer of its cloud's region (an
    image is per region) for ``refusal_block_s``, so that a launch tries another region."""
    keys = {offer.key} | {
        o.key for o in p.obs.offers if o.cloud == offer.cloud and o.region == offer.region
    }
    fresh = tuple(sorted(keys - p.fresh_blocks))
    if not fresh:
        return
    p.fresh_blocks.update(fresh)
    why = f"{failed.line} (the machine image of {offer.cloud} {offer.region})"
    p.actions.append(Block(fresh, p.obs.now + p.policy.refusal_block_s, why))
    p.reasons.append(f"blocking {offer.cloud} {offer.region}: {failed.line}")


def _replace_straggler(p: Pass) -> None:
    # Fewer than three nodes timing their steps cannot make a straggler.
    if p.tally.timed < 3 and not p.obs.slow.streaks:
        return
    watch, found = watch_slow(
        p.policy.straggler, p.obs.slow, _live_all(p.policy, p.obs), p.gone, p.obs.now
    )
    if found is not None:
        watch = SlowWatch(
            {k: s for k, s in watch.streaks.items() if k != found[0].name}, watch.fleet
        )
    if watch != p.obs.slow:
        p.actions.append(Watch(watch))
    if found is None:
        return
    n, median = found
    assert n.instance is not None and n.compute_s is not None
    msg = (
        f"node {n.name} is a straggler: {n.compute_s:.2f} s of compute per step against the "
        f"fleet's median {median:.2f} s; replacing it"
    )
    p.actions += [Report(msg), Terminate(n.name, n.instance.id, "straggler")]
    p.gone.add(n.name)
    p.reasons.append(msg)
    if is_settled(n):
        p.n_staying -= 1
        if n.offer is not None:
            decrement(p.staying_zones, n.offer.zone)


def watch_slow(
    policy: StragglerPolicy,
    watch: SlowWatch,
    nodes: Sequence[NodeObs],
    skip: set[str],
    now: float,
) -> tuple[SlowWatch, tuple[NodeObs, float] | None]:
    """Fold this pass's compute reports into the straggler check's memory (see
    :class:`~.types.StragglerPolicy`) and find the node to replace, if one is due.

    Each node's report is looked at once (by its time, :attr:`NodeObs.compute_at`; a node
    without one is looked at every pass). Only nodes on a streak are remembered, and a node
    that stops timing, or that too few peers time, loses its streak.

    Returns:
        The memory after this pass, and the node to replace with its peers' median compute
        seconds per step (the slowest against its peers when several are due), or None.
    """
    timed = [
        n
        for n in nodes
        if n.compute_s is not None
        and n.name not in skip
        and n.instance is not None
        and n.instance.state.alive
        and n.agent_state == NodeState.JOINED
    ]
    if len(timed) < 3:
        return SlowWatch({}, watch.fleet), None
    figures = sorted(n.compute_s for n in timed if n.compute_s is not None)
    fleet, current = _fleet_figures(watch.fleet, timed, policy.min_samples, now)
    slowed = current is not None and current > policy.fleet_factor * min(s for _, s in fleet)
    waits = sorted(w for n in timed if (w := _wait(n)) is not None)
    streaks: dict[str, SlowStreak] = {}
    due: list[tuple[float, NodeObs, float]] = []
    for n in timed:
        assert n.compute_s is not None
        old = watch.streaks.get(n.name)
        at = now if n.compute_at is None else n.compute_at
        if old is not None and at <= old.last_at:
            streaks[n.name] = old  # its report was looked at already
            continue
        median = median_without(figures, n.compute_s)
        ratio = n.compute_s / median if median > 0 else 0.0
        if ratio < policy.recover_factor or slowed:
            continue  # recovered clearly, or the whole fleet slowed: the streak ends
        counts = (
            ratio > policy.factor
            and n.compute_samples >= policy.min_samples
            and _peers_wait(n, waits, n.compute_s - median, policy.corroboration)
        )
        if counts:
            since = at if old is None else old.since
            streak = SlowStreak(since, 1 if old is None else old.count + 1, at)
            if streak.count >= policy.observations and at - since >= policy.sustain_s:
                due.append((ratio, n, median))
        elif old is not None:
            streak = SlowStreak(old.since, old.count, at)  # between the marks: held
        else:
            continue
        streaks[n.name] = streak
    found = max(due, key=lambda d: (d[0], d[1].name)) if due else None
    return SlowWatch(streaks, fleet), (None if found is None else (found[1], found[2]))


def _fleet_figures(
    kept: tuple[tuple[float, float], ...], timed: Sequence[NodeObs], min_samples: int, now: float
) -> tuple[tuple[tuple[float, float], ...], float | None]:
    """The fleet's lowest median compute time in each ``FLEET_EVERY_S`` of the last
    ``FLEET_WINDOW_S``, this pass's included, and this pass's median (None: fewer than 3
    nodes timed enough steps; a node's first steps are its slowest)."""
    sampled = [
        n.compute_s for n in timed if n.compute_s is not None and n.compute_samples >= min_samples
    ]
    fresh = tuple((at, s) for at, s in kept if 0 <= now - at <= FLEET_WINDOW_S)
    if len(sampled) < 3:
        return fresh, None
    median = statistics.median(sampled)
    if fresh and now - fresh[-1][0] < FLEET_EVERY_S:
        last_at, last = fresh[-1]
        return (fresh if median >= last else (*fresh[:-1], (last_at, median))), median
    return (*fresh, (now, median)), median


def _wait(n: NodeObs) -> float | None:
    """The seconds per step ``n`` spends out of its compute (waiting for its peers)."""
    if n.step_s is None or n.compute_s is None:
        return None
    return max(0.0, n.step_s - n.compute_s)


def _peers_wait(n: NodeObs, waits: Sequence[float], excess: float, share: float) -> bool:
    """The second signal: the peers wait longer per step than ``n`` does by at least
    ``share`` of ``n``'s excess compute (they wait for it). A node's compute figure can lag
    its real pace (a median over its recent steps, a node starved for a moment); the wait
    of its peers says whether the fleet is held up by it now."""
    own = _wait(n)
    if own is None or excess <= 0 or len(waits) < 2:
        return False
    return median_without(waits, own) - own >= share * excess


def median_without(ordered: Sequence[float], x: float) -> float:
    """The median of ``ordered`` (sorted, holding ``x``) once one ``x`` is taken out, in
    O(log n): the straggler check takes it for every node of a big fleet."""
    i = bisect.bisect_left(ordered, x)
    m = len(ordered) - 1

    def at(k: int) -> float:
        return ordered[k] if k < i else ordered[k + 1]

    if m % 2:
        return at(m // 2)
    return (at(m // 2 - 1) + at(m // 2)) / 2


def count_staying(p: Pass) -> None:
    """Count who stays (settled nodes are counted already), then the at-risk handover, the
    open offers and the job's home."""
    for n in p.vms:
        if p.is_staying(n):
            p.n_staying += 1
            if n.offer is not None:
                p.staying_zones[n.offer.zone] += 1
    handover(p)
    now = p.obs.now
    p.blocked = {k for k, until in p.obs.blocked.items() if until > now} | p.fresh_blocks
    if p.home is None and p.n_staying:
        p.home = majority_home(p.staying_all())
    elif p.home is not None and not p.n_staying and _home_closed(p):
        # Nothing runs in the home zone and every offer there is blocked (its image does not
        # boot, its capacity is gone): the job starts where it can, from its checkpoint copy,
        # instead of waiting out the move rule with nothing to move.
        p.reasons.append(f"leaving {p.home[1]}: every offer there is blocked")
        p.home = None


def _home_closed(p: Pass) -> bool:
    """The home's offers are all blocked, and a checkpoint elsewhere would come from the
    object-storage copy (a job that does not copy its checkpoints stays home)."""
    if not p.policy.copies_checkpoints or p.home is None:
        return False
    home = [o for o in p.obs.offers if (o.cloud, o.zone, o.instance_type) == p.home]
    return bool(home) and all(o.key in p.blocked for o in home)


def handover(p: Pass) -> None:
    """Rule 3's at-risk nodes: drain each one whose replacement has joined. Sets the staying
    at-risk nodes and those of them that have no replacement yet (rule 5 launches one for
    each)."""
    p.at_risk = sorted(
        (
            n
            for n in p.vms
            if n.at_risk and p.is_staying(n) and n.instance is not None and n.instance.state.alive
        ),
        key=lambda n: n.name,
    )
    replacements = {n.replaces: n for n in p.vms if n.replaces and p.is_staying(n)}
    p.uncovered = []
    for n in p.at_risk:
        r = replacements.get(n.name)
        if r is None:
            p.uncovered.append(n)
        elif r.agent_state == NodeState.JOINED and n.agent_state in TRAINING:
            why = f"{n.name} at risk ({n.at_risk}): replacement {r.name} joined; draining {n.name}"
            p.actions.append(Drain(n.name, why))
            p.reasons.append(why)
        else:
            p.reasons.append(
                f"{n.name} at risk ({n.at_risk}): replacement {r.name} "
                f"{r.agent_state or 'launching'}"
            )


# --- 4. Move -------------------------------------------------------------------------------------
def move(p: Pass) -> Plan | None:
    """Rule 4: below the minimum in a blocked home zone for ``move_after_s``: move the job to
    the best offer elsewhere (when its checkpoints are copied)."""
    policy, obs, home, now = p.policy, p.obs, p.home, p.obs.now
    if not (
        policy.same_zone
        and home is not None
        and p.n_staying < policy.min_nodes
        and obs.below_min_since is not None
        and now - obs.below_min_since >= policy.move_after_s
        and not obs.moving
    ):
        return None
    if candidates(policy, obs, p.blocked, home, now, only_home=True):
        return None
    away = [
        o
        for o in candidates(policy, obs, p.blocked, None, now, only_home=False)
        if o.zone != home[1]
    ]
    if not away:
        p.reasons.append(f"zone {home[1]} is short and no other offer is open")
        return None
    best = away[0]
    if not policy.copies_checkpoints:
        p.reasons.append(
            f"zone {home[1]} is short but the job stays: a move to {best.cloud} "
            f"{best.zone} would start from whatever its volumes hold, not the job's "
            "checkpoint (set checkpoint.copy_to to let the job move)"
        )
        p.reasons.append(f"zone {home[1]} is short and no other offer is open")
        return None
    why = (
        f"zone {home[1]} could not hold {policy.min_nodes} node(s) for "
        f"{now - obs.below_min_since:.0f} s: moving the job to {best.cloud} "
        f"{best.zone} ({best.instance_type}, {best.market})"
    )
    p.home = (best.cloud, best.zone, best.instance_type)
    return p.ending(Move(best, why), why)


def over_max(p: Pass) -> None:
    """Never more than max nodes (plus one replacement per at-risk node): a late-confirmed
    launch can overshoot; end the newest."""
    policy = p.policy
    cap = policy.max_nodes + len(p.at_risk)
    if p.n_staying <= cap:
        return
    staying = p.staying_all()
    extra = sorted(staying, key=lambda n: (n.launched_at, n.name))[cap:]
    for n in extra:
        if n.instance is not None and n.instance.state.alive:
            p.actions.append(
                Terminate(n.name, n.instance.id, f"over max_nodes ({policy.max_nodes})")
            )
    staying = [n for n in staying if n not in extra]
    p.n_staying = len(staying)
    p.staying_zones = Counter(n.offer.zone for n in staying if n.offer is not None)
    p.reasons.append(f"ending {len(extra)} node(s) over max_nodes")


# --- 5. Backfill ---------------------------------------------------------------------------------
def backfill(p: Pass) -> Plan:
    """Rule 5: replace lost and draining nodes up to ``max`` (at-risk nodes do not count
    towards it: each gets its replacement), within the budget."""
    policy, obs = p.policy, p.obs
    need = policy.max_nodes - p.n_staying + len(p.at_risk)
    next_index = obs.next_index
    if need > 0:
        only_home = policy.same_zone and p.home is not None
        home = p.home if policy.same_zone else None
        offers = candidates(policy, obs, p.blocked, home, obs.now, only_home=only_home)
        launched, offers, next_index = _launch(p, need, offers)
        stuck = _stuck(p, launched, offers, next_index)
        if stuck is not None:
            return stuck
        if launched:
            where = ", ".join(
                sorted(
                    {
                        f"{a.offer.zone} {a.offer.instance_type} {a.offer.market}"
                        for a in p.actions
                        if isinstance(a, Launch)
                    }
                )
            )
            p.reasons.append(
                f"{p.n_staying} of {policy.max_nodes} node(s): launching {launched} on {where}"
            )
        elif not offers:
            p.reasons.append(
                f"{p.n_staying} of {policy.max_nodes} node(s): no open offer to launch on"
            )
    if not p.reasons:
        p.reasons.append(f"{p.n_staying} of {policy.max_nodes} node(s): nothing to do")
    return p.result(next_index)


def _launch(p: Pass, need: int, offers: list[Offer]) -> tuple[int, list[Offer], int]:
    """Up to ``need`` launches on the best offers the budget covers. Returns how many, the
    offers left to choose from, and the next free node index."""
    policy, obs = p.policy, p.obs
    next_index = obs.next_index
    launched = 0
    projected = p.running_rate
    for _ in range(need):
        if not offers:
            break
        offer = offers[0] if policy.same_zone else spread_pick(offers, p.staying_zones, p.actions)
        projection = obs.spent_usd + projected + offer.price_per_hour
        if projection > policy.budget_usd:
            p.reasons.append(
                f"budget: one more node would project ${projection:,.2f} within the "
                f"hour, over the ${policy.budget_usd:,.2f} cap"
            )
            break
        node = f"n{next_index}"
        next_index += 1
        replaces = p.uncovered.pop(0).name if p.uncovered else ""
        p.actions.append(
            Launch(
                node,
                request_id(obs.job_tag, node),
                offer,
                replaces,
                block_s=policy.block_s,
                refusal_block_s=policy.refusal_block_s,
            )
        )
        if replaces:
            p.reasons.append(f"{replaces} at risk: launching replacement {node}")
        projected += offer.price_per_hour
        launched += 1
        if p.home is None and policy.same_zone:
            p.home = (offer.cloud, offer.zone, offer.instance_type)
            offers = [o for o in offers if (o.cloud, o.zone, o.instance_type) == p.home]
    return launched, offers, next_index


def _stuck(p: Pass, launched: int, offers: list[Offer], next_index: int) -> Plan | None:
    """A job with no node and nothing it can launch stops: every offer refused for good, or
    a budget that cannot cover an hour of the cheapest node."""
    policy, obs, now = p.policy, p.obs, p.obs.now
    if launched or p.n_staying:
        return None
    hard = [k for k, until in obs.blocked.items() if until - now > 3600]
    if not offers and obs.offers and len(hard) >= len({o.key for o in obs.offers}):
        why = (
            "every allowed offer was refused by its cloud (quota, or a setting it rejects); "
            f"the last said: {obs.last_refusal or 'nothing'}"
        )
        return p.ending(Stop(why, error=True, checkpoint=False), why, next_index)
    if offers and "budget" in (p.reasons[-1] if p.reasons else ""):
        cheapest = offers[0].price_per_hour
        why = (
            f"budget: ${policy.budget_usd - obs.spent_usd:,.2f} left cannot cover an hour of "
            f"the cheapest node (${cheapest:,.2f}/h); raise budget.max_usd"
        )
        return p.ending(Stop(why, error=True, checkpoint=False), why, next_index)
    return None

"""The planner's vocabulary: the policy, what it observes, and the actions it decides.

Plain frozen data: no cloud SDK, no Redis, no clock. Every action names the node it is
about as a field.

:class:`FailedLaunches` is the run's one give-up policy: VMs in a row that failed before
they trained (their boot failed, their agent failed, or they never became healthy within
the boot timeout, or their workers crash-looped), counted per reason; at
``Policy.max_failed_launches`` of the same reason the run stops (rule 1 and rule 3 of
:mod:`.planner`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from spottrain.cloud.base import Instance, Offer
from spottrain.protocol.boot import BootReport, reason_key
from spottrain.protocol.crashes import TAIL_LINES, Crash, same_crash
from spottrain.protocol.states import TRAINING
from spottrain.spec import SpotPolicy


@dataclass(frozen=True)
class StragglerPolicy:
    """When a node slow against its peers is replaced (rule 3, :func:`.rules.watch_slow`).

    A node's figure is its compute seconds per step (:attr:`NodeObs.compute_s`). One of its
    reports (an *observation*) counts as slow when all of these hold: the node has timed at
    least ``min_samples`` steps; its figure is over ``factor`` times its peers' median; the
    peers' wait in the collectives outgrows its own by at least ``corroboration`` of its
    excess compute (they wait for it: the second signal, from the wall time per step every
    node reports); and the fleet's median is not over ``fleet_factor`` times its lowest of
    the last :data:`FLEET_WINDOW_S` seconds (a loaded host slows every node, unevenly). The
    node is replaced once ``observations`` such reports, the first and the last at least
    ``sustain_s`` apart, came with none below ``recover_factor`` times its peers' median
    between them (recovering clearly ends the count, a report in between holds it) and
    none while the fleet had slowed.

    Raises:
        ValueError: a value out of range (named in the message).
    """

    factor: float = 2.0
    recover_factor: float = 1.5
    observations: int = 3
    sustain_s: float = 60.0
    min_samples: int = 10
    corroboration: float = 0.5
    fleet_factor: float = 1.5

    def __post_init__(self) -> None:
        if not 1.0 < self.recover_factor <= self.factor:
            raise ValueError(
                f"need 1 < straggler recover_factor <= factor, got {self.recover_factor}, "
                f"{self.factor}: a node must recover clearly below the slow mark"
            )
        if self.observations < 1 or self.min_samples < 1:
            raise ValueError(
                f"straggler observations and min_samples must be >= 1, got "
                f"{self.observations}, {self.min_samples}"
            )
        if self.sustain_s < 0 or not 0 <= self.corroboration <= 1 or self.fleet_factor <= 1:
            raise ValueError(
                f"need straggler sustain_s >= 0, 0 <= corroboration <= 1 and fleet_factor > "
                f"1, got {self.sustain_s}, {self.corroboration}, {self.fleet_factor}"
            )


# How far back the fleet's lowest median compute time is the calm it is compared with, and
# how often a figure is kept for it (a change that lasts becomes the new calm: a smaller
# world gives each rank more micro-batches).
FLEET_WINDOW_S = 600.0
FLEET_EVERY_S = 10.0


@dataclass(frozen=True)
class SlowStreak:
    """One node's run of slow reports (see :class:`StragglerPolicy`).

    Attributes:
        since: the time of the first slow report counted.
        count: the slow reports counted.
        last_at: the time of the newest report looked at (a report is looked at once).
    """

    since: float
    count: int
    last_at: float


SLOW_WATCH = "slow_watch"  # the controller's hash field that holds the SlowWatch


@dataclass(frozen=True)
class SlowWatch:
    """The straggler check's memory across passes: the nodes on a slow streak, and the
    fleet's median compute time now and then (``(time, seconds)``, oldest first). Kept in
    the controller's hash (``slow_watch``, JSON), so a restarted controller carries it on."""

    streaks: Mapping[str, SlowStreak] = field(default_factory=dict)
    fleet: tuple[tuple[float, float], ...] = ()

    def to_json(self) -> str:
        return json.dumps(
            {
                "streaks": {
                    k: [s.since, s.count, s.last_at] for k, s in sorted(self.streaks.items())
                },
                "fleet": [list(f) for f in self.fleet],
            }
        )

    @classmethod
    def from_json(cls, text: str | None) -> SlowWatch:
        """The watch a controller's hash holds; an empty one for nothing or what does not
        parse (the check then starts over, which only delays a replacement)."""
        try:
            d = json.loads(text or "{}")
            streaks = {
                str(k): SlowStreak(float(v[0]), int(v[1]), float(v[2]))
                for k, v in d.get("streaks", {}).items()
            }
            fleet = tuple((float(at), float(secs)) for at, secs in d.get("fleet", ()))
            return cls(streaks, fleet)
        except (ValueError, TypeError, AttributeError, IndexError):
            return cls()


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
        refusal_block_s: how long an offer stays blocked after its cloud refused a launch
            (quota, or a setting it rejects): a human has to raise the quota or fix it.
        boot_timeout_s: a VM not healthy this long after its launch is replaced.
        lost_grace_s: a launched VM the cloud does not list for this long is taken as lost
            (clouds are eventually consistent).
        straggler: when a node slow against its peers is replaced (see
            :class:`StragglerPolicy`).
        crash_loop_k: restores from the same checkpoint after failing at the same step
            that stop the job.
        max_failed_launches: VMs in a row that fail before training for the same reason
            (:class:`FailedLaunches`), with no node training meanwhile, that stop the job
            (a broken image, setting or environment: every relaunch would fail the same).
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
    refusal_block_s: float = 86_400.0
    boot_timeout_s: float = 900.0
    lost_grace_s: float = 120.0
    straggler: StragglerPolicy = field(default_factory=lambda: StragglerPolicy())
    crash_loop_k: int = 3
    max_failed_launches: int = 3
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
        if self.max_failed_launches < 1:
            raise ValueError(f"max_failed_launches must be >= 1, got {self.max_failed_launches}")


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
        compute_at: when that figure was measured (unix seconds; None: no figure).
        compute_samples: the fewest steps a local rank's figure is the median of.
        step_s: its wall seconds per step (local rank 0's recent median), None: not
            reported. Every node of a synchronous job has the same; the part of it that
            is not compute is the node's wait for its peers.
        health_failed: the agent reported a failed boot health check.
        agent_reason: why the agent is in its state, as it wrote it (a failed agent's cause).
        boot: its VM's boot as last reported (the VM's boot hash, or its console read by
            the controller), read only while its agent has not registered or is booting.
        console: the last line of its VM's console output as the controller last read it
            ("" when it read none): what a VM that never became healthy last said.
        at_risk: why the node is at risk of preemption ("rebalance recommendation"), from
            its agent; empty when it is not.
        replaces: the at-risk node this one was launched to replace, while that node lives.
        crash: its workers' newest failure, from its agent (None: none).
        trained: its agent says its workers trained for a while since their last failure
            (:data:`spottrain.protocol.crashes.TRAINED_S`): joined at the rendezvous is not
            enough, workers that fail at every start join it too.
    """

    name: str
    instance: Instance | None
    offer: Offer | None
    launched_at: float
    agent_state: str | None = None
    alive_beat: bool = False
    compute_s: float | None = None
    compute_at: float | None = None
    compute_samples: int = 0
    step_s: float | None = None
    health_failed: bool = False
    agent_reason: str = ""
    boot: BootReport | None = None
    console: str = ""
    at_risk: str = ""
    preempted: str = ""
    replaces: str = ""
    crash: Crash | None = None
    trained: bool = False

    @property
    def trains(self) -> bool:
        """Its workers are in a rendezvous round and have trained for a while."""
        return self.agent_state in TRAINING and self.trained


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
class FailedLaunch:
    """One VM that failed before it trained, and why.

    Attributes:
        node: its node.
        why: one line of what happened ("boot failed in 'install the environment': pip:
            ...", "not healthy 900 s after launch; its console's last line: ...").
        stage: the boot stage it failed or stopped in ("" when unknown).
        reason: what makes two failures the same, with ``stage`` (see :attr:`key`): ``why``
            without what only this VM said (its console's last line).
        at_boot: it failed at boot (its boot, its health check, the boot timeout), not
            later (its agent failed after the health check).
        crashed: its workers crash-looped (its agent ended torchrun, or torchrun gave up).
        launched_at: when its VM was launched (for a crash loop: see
            :meth:`FailedLaunches.same`).
        step: the training step its workers failed at, when they crash-looped at a known
            one (a NaN, an out-of-memory): the same step is the same reason.
        tail: its workers' last lines of output before they failed, oldest first.
    """

    node: str
    why: str
    stage: str = ""
    reason: str = ""
    at_boot: bool = True
    crashed: bool = False
    launched_at: float = 0.0
    step: int | None = None
    tail: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """The reason as the streak compares it (:func:`spottrain.protocol.boot.reason_key`)."""
        return reason_key(self.stage, self.reason)

    @property
    def line(self) -> str:
        return f"{self.node}: {self.why}"

    @property
    def found_closed(self) -> bool:
        """Its torchrun found the job's rendezvous closed: an effect of a peer's failure,
        never a cause of its own (:data:`CLOSED_RENDEZVOUS`)."""
        return CLOSED_RENDEZVOUS in self.why


# torch's error when a node's torchrun finds its job's rendezvous closed: its peers' torchrun
# ended (their workers failed past their restarts), so it names their failure's effect, never
# a cause of its own.
CLOSED_RENDEZVOUS = "RendezvousClosedError"

# How many counted nodes a streak remembers, so that a VM the cloud still lists for a pass
# or two after it was ended is not counted again.
RECENT_FAILED = 64


@dataclass(frozen=True)
class FailedLaunches:
    """The give-up policy's streak: VMs in a row that failed before training, all for the
    same reason (:meth:`same`); a failure for another reason starts a new streak, and the
    job training ends it (:meth:`ended_by`, then :meth:`reset`). Kept in the controller's
    hash (``failed_launches``, JSON), so a restarted controller carries it on.

    Attributes:
        count: the failures in the streak.
        key: their reason's key.
        last: the last one's line ("n4: boot failed in '...': ...").
        at_boot: the last one failed at boot (else later, before training).
        recent: the nodes counted lately, in streaks before this one too, newest last.
        crashed: the last one's workers crash-looped.
        at: when the last one was counted.
        step: the training step the last one's workers failed at (None: none known).
        best_step: the newest checkpoint committed when the last one was counted (-1: none).
        tail: the last one's workers' last lines of output.
    """

    count: int = 0
    key: str = ""
    last: str = ""
    at_boot: bool = True
    recent: tuple[str, ...] = ()
    crashed: bool = False
    at: float = 0.0
    step: int | None = None
    best_step: int = -1
    tail: tuple[str, ...] = ()

    def counted(self, node: str) -> bool:
        """Whether ``node``'s failure was counted already (its VM still listed)."""
        return node in self.recent

    def same(self, failure: FailedLaunch) -> bool:
        """Whether ``failure`` has the streak's reason: the same key, or the same known
        training step (:func:`spottrain.protocol.crashes.same_crash`); or both are crash
        loops of VMs that ran side by side (``failure``'s VM was launched before the last
        one was counted): the workers of one job fail together, the one that hit the bug
        and its peers whose connection to it broke, each with a line of its own."""
        if not self.count:
            return False
        if same_crash(self.key, self.step, failure.key, failure.step):
            return True
        if failure.found_closed or self.effects_only:
            return True  # the streak's failure closed it, or this one is what closed it
        return self.crashed and failure.crashed and failure.launched_at < self.at

    @property
    def effects_only(self) -> bool:
        """Every failure in the streak found the job's rendezvous closed: the peer whose
        failure closed it has not been counted yet (its agent is still ending its workers),
        and the run's error waits for it (:meth:`add`)."""
        return self.count > 0 and CLOSED_RENDEZVOUS in self.last

    def counts(self, failure: FailedLaunch, trained: int) -> bool:
        """Whether ``failure`` enters the streak while ``trained`` nodes train
        (:attr:`NodeObs.trains`): a failure at a known training step always does (its
        peers training up to that step say nothing of it); another only while none trains
        (the launch works, the failure is that VM's)."""
        return failure.step is not None or trained == 0

    def ended_by(self, committed_step: int | None, trained: int) -> bool:
        """Whether the job trains again, which ends the streak: a checkpoint committed
        beyond the newest one when the last failure was counted; or, for a streak of
        failures at no known step, a node training for a while (``trained`` of them). A
        streak at a known step (a NaN, an out-of-memory after every resume) ends only by a
        commit past it: a node that trains up to that step trains for a while too."""
        if not self.count:
            return False
        if committed_step is not None and committed_step > self.best_step:
            return True
        return self.step is None and trained > 0

    def add(
        self,
        failure: FailedLaunch,
        *,
        count: bool = True,
        committed_step: int | None = None,
        now: float = 0.0,
    ) -> FailedLaunches:
        """The streak after ``failure``, counted at ``now``: one more when it has the
        streak's reason (:meth:`same`), a new streak of one otherwise; only remembered when
        not ``count``. ``committed_step``: the newest checkpoint committed now (None:
        none)."""
        recent = (*self.recent, failure.node)[-RECENT_FAILED:]
        if not count:
            return FailedLaunches(recent=recent)
        best = -1 if committed_step is None else committed_step
        same = self.same(failure)
        keeps = same and not same_crash(self.key, self.step, failure.key, failure.step)
        if keeps and not (self.effects_only and not failure.found_closed):
            # It ran beside the streak's VM and failed with a line of its own: its peer's
            # bug broke its connection, left its rendezvous round short, or closed the
            # rendezvous it came to join. The streak keeps the reason of the one that failed
            # first, which names the bug (and keeps its time, so only VMs that ran beside
            # that one join this way); a streak of closed rendezvous only takes the reason of
            # the first failure that says something else, the one that closed it.
            return replace(self, count=self.count + 1, recent=recent, best_step=best)
        n = self.count + 1 if same else 1
        return FailedLaunches(
            n,
            failure.key,
            failure.line,
            failure.at_boot,
            recent,
            crashed=failure.crashed,
            at=now,
            step=failure.step,
            best_step=best,
            tail=failure.tail[-TAIL_LINES:],
        )

    def reset(self) -> FailedLaunches:
        """No streak (a node trains), the counted nodes still remembered."""
        return FailedLaunches(recent=self.recent)

    def gives_up(self, limit: int) -> bool:
        return self.count >= limit

    def why(self) -> str:
        """The run's error when the streak gives up, in one line."""
        when = "at boot" if self.at_boot else "before training"
        vms = "1 VM" if self.count == 1 else f"{self.count} VMs in a row"
        return f"{vms} failed {when}: {self.last}; fix that and run spottrain up again"

    def to_json(self) -> str:
        return json.dumps(
            {
                "count": self.count,
                "key": self.key,
                "last": self.last,
                "at_boot": self.at_boot,
                "recent": list(self.recent),
                "crashed": self.crashed,
                "at": self.at,
                "step": self.step,
                "best_step": self.best_step,
                "tail": list(self.tail),
            }
        )

    @classmethod
    def from_json(cls, text: str | None) -> FailedLaunches:
        """The streak a controller's hash holds; none for nothing or what does not parse."""
        try:
            d = json.loads(text or "{}")
            step = d.get("step")
            return cls(
                count=int(d.get("count", 0)),
                key=str(d.get("key", "")),
                last=str(d.get("last", "")),
                at_boot=bool(d.get("at_boot", True)),
                recent=tuple(str(n) for n in d.get("recent", ())),
                crashed=bool(d.get("crashed", False)),
                at=float(d.get("at", 0.0)),
                step=None if step is None else int(step),
                best_step=int(d.get("best_step", -1)),
                tail=tuple(str(x) for x in d.get("tail", ())[-TAIL_LINES:]),
            )
        except (ValueError, TypeError, AttributeError):
            return cls()


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
    failed: FailedLaunches = field(default_factory=FailedLaunches)
    last_refusal: str = ""
    committed_step: int | None = None  # the newest checkpoint committed (None: none yet)
    slow: SlowWatch = field(default_factory=SlowWatch)


class ActionKind(StrEnum):
    LAUNCH = "launch"
    TERMINATE = "terminate"
    PENALISE = "penalise"
    MOVE = "move"
    DRAIN = "drain"
    STOP = "stop"
    REPORT = "report"
    LAUNCH_FAILED = "launch-failed"
    BLOCK = "block"
    WATCH = "watch"


@dataclass(frozen=True)
class Launch:
    """Launch ``node`` on ``offer``; ``replaces`` names the at-risk node it takes over from.

    ``block_s`` and ``refusal_block_s``: how long the offer is blocked if its cloud answers
    with a capacity error, or refuses the launch (quota, a rejected setting)."""

    node: str
    request_id: str
    offer: Offer
    replaces: str = ""
    block_s: float = 900.0
    refusal_block_s: float = 86_400.0
    kind: ActionKind = ActionKind.LAUNCH


@dataclass(frozen=True)
class Terminate:
    """End ``node``'s VM; ``preempted``: the node drained on its cloud's preemption notice,
    so its end counts as the preemption it is (the cloud, ending it later, would say so)."""

    node: str
    instance_id: str
    why: str
    preempted: str = ""
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
    the offer is not blocked). ``node`` is the bad VM's node."""

    key: tuple[str, str, str]
    why: str
    node: str
    kind: ActionKind = ActionKind.PENALISE


@dataclass(frozen=True)
class LaunchFailed:
    """Record ``failure`` (an event) and the give-up streak after it, ``streak`` (the
    controller's hash)."""

    failure: FailedLaunch
    streak: FailedLaunches
    kind: ActionKind = ActionKind.LAUNCH_FAILED


@dataclass(frozen=True)
class Block:
    """Block these offers (keys of :attr:`Offer.key`) until ``until``: no launch there
    meanwhile (a machine image that cannot boot spottrain blocks its region)."""

    keys: tuple[tuple[str, str, str, str], ...]
    until: float
    why: str
    kind: ActionKind = ActionKind.BLOCK


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


@dataclass(frozen=True)
class Watch:
    """Record the straggler check's memory after this pass (the controller's hash)."""

    slow: SlowWatch
    kind: ActionKind = ActionKind.WATCH


Action = Launch | Terminate | Drain | Penalise | LaunchFailed | Block | Move | Stop | Report | Watch


@dataclass(frozen=True)
class Plan:
    actions: tuple[Action, ...]
    reason: str
    home: tuple[str, str, str] | None = None
    next_index: int = 0

    def of(self, kind: type) -> list[Action]:
        return [a for a in self.actions if isinstance(a, kind)]

"""The reconcile loop of a launched fleet: observe (read-only), plan (pure), execute.

Each pass is level-triggered: it reads what the clouds list for the run's tag and what the
agents report (:mod:`.observe`), reads the consoles of a few VMs that have said nothing of
their boot (:mod:`.consoles`; a failure found there is written as the node's boot report),
asks :func:`.planner.plan` what to do, and does it (:mod:`.execute`). A controller killed
at any point and started again reads the same state and carries on: the launch ledger is
written before every launch and launches are idempotent by request id, so nothing is leaked
and nothing launched twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from spottrain.catalog import Catalog, bundled
from spottrain.cloud.base import Instance, Offer, Provider
from spottrain.protocol.states import LIVE_LAUNCHES
from spottrain.spec import JobSpec, Placement

from .consoles import ConsoleWatch
from .drive import drive_passes
from .execute import Executor, crash_point
from .ledger import redrive
from .observe import Observer, od_price
from .planner import plan
from .progress import MoveCopy, after_pass, stop_progress
from .records import Ledger
from .state import RunState
from .summary import Summary, finished, summarize
from .types import Observed, Plan, Policy

log = logging.getLogger("spottrain.controller")


def policy_from_spec(spec: JobSpec, **overrides: float) -> Policy:
    """The planner's policy for ``spec``; ``overrides`` set the tunables (tests, CLI).

    The local cloud's stockouts are set by a lever and lift at once, so its offers are
    blocked for a minute after a capacity error, not the quarter of an hour real clouds get.
    """
    local_only = set(spec.resources.clouds) == {"local"}
    base = Policy(
        block_s=60.0 if local_only else 900.0,
        min_nodes=spec.nodes.min,
        max_nodes=spec.nodes.max,
        same_zone=spec.resources.placement is Placement.SAME_ZONE,
        spot_policy=spec.spot.policy,
        fallback_after_s=spec.spot.fallback_after_minutes * 60,
        move_after_s=spec.resources.move_after_minutes * 60,
        # The local cloud always copies (under $SPOTTRAIN_HOME when copy_to is not set).
        copies_checkpoints=local_only or spec.checkpoint.copy_to is not None,
        budget_usd=spec.budget.max_usd,
        max_failed_launches=spec.controller.max_failed_launches,
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


@dataclass
class Controller:
    """Drives one run. Build it, then call :meth:`run` (or :meth:`step` from tests).

    Args:
        spec: the job.
        run_id: the run (its tag on every VM, its keys in Redis).
        providers: one per cloud the spec allows.
        state: the run's state in Redis.
        boot: renders the boot script of a node on an offer.
        policy: the planner's policy.
        interval_s: seconds between passes.
        offers_ttl_s: how long offers are reused between passes.
        tick: called once per pass with the time (the local cloud's preemption injector).
        clock: unix seconds.
        consoles: which VM consoles to read, and what was read (in memory only).
    """

    spec: JobSpec
    run_id: str
    providers: Mapping[str, Provider]
    state: RunState
    boot: Callable[[str, Offer], str]
    policy: Policy
    interval_s: float = 2.0
    offers_ttl_s: float = 60.0
    stop_timeout_s: float = 180.0
    move_timeout_s: float = 240.0
    tick: Callable[[float], object] | None = None
    clock: Callable[[], float] = time.time
    catalog: Catalog = field(default_factory=bundled)
    owner: str = "controller"
    consoles: ConsoleWatch = field(default_factory=ConsoleWatch)
    _observer: Observer | None = None
    _last_reason: str = ""

    def _observing(self) -> Observer:
        if self._observer is None:
            self._observer = Observer(
                self.spec, self.run_id, self.providers, self.state, self.catalog
            )
        return self._observer

    def _executor(self) -> Executor:
        return Executor(
            self.spec,
            self.run_id,
            self.providers,
            self.state,
            self.boot,
            lambda o: od_price(self.catalog, o),
            self.clock,
        )

    def observe(self, now: float) -> tuple[Observed, Ledger, dict[str, Instance]]:
        """The planner's input, read-only: the observation (with this pass's ledger fold
        and bookkeeping applied in memory, not written), the folded ledger and each node's
        listed VM."""
        seen = self._observing().observe(
            now, lost_grace_s=self.policy.lost_grace_s, offers_ttl_s=self.offers_ttl_s
        )
        return seen.obs, seen.ledger, seen.listed

    # --- a pass --------------------------------------------------------------------------
    def step(self) -> Plan:
        """One pass: observe, plan, act. Returns the plan."""
        now = self.clock()
        if self.tick is not None:
            self.tick(now)
        seen = self._observing().observe(
            now, lost_grace_s=self.policy.lost_grace_s, offers_ttl_s=self.offers_ttl_s
        )
        execute = self._executor()
        execute.offer_errors(seen.offer_errors)
        execute.steps(seen.steps)
        obs = self._progress_stop(seen.obs, execute)
        obs = self._read_consoles(obs, execute)
        # `spottrain scale` lowers (or restores) the most nodes the planner keeps.
        wanted = self.state.ctl().get("target_nodes")
        policy = self.policy
        if wanted:
            policy = replace(
                policy, max_nodes=max(policy.min_nodes, min(int(wanted), policy.max_nodes))
            )
        p = plan(policy, obs)
        execute.redrive(redrive(seen.ledger, seen.listed, obs.now, self.policy))
        execute.act(p.actions, obs.nodes, obs.now, p.next_index, seen.listed)
        self._after(p, obs, execute)
        crash_point("after-pass")
        return p

    def _read_consoles(self, obs: Observed, execute: Executor) -> Observed:
        """Read the consoles that are due (a few a pass) and show the planner what every
        console read so far said."""
        due = self.consoles.due(obs.nodes, obs.now, self.policy.boot_timeout_s)
        if due:
            self.consoles.record(execute.read_consoles(due, obs.now))
        if not self.consoles.reads:
            return obs
        return replace(obs, nodes=self.consoles.annotate(obs.nodes))

    def _progress_stop(self, obs: Observed, execute: Executor) -> Observed:
        """A stop in progress ends when every node has left or the stop timeout passed."""
        obs, steps = stop_progress(self.state.ctl(), obs, self.stop_timeout_s)
        execute.steps(steps)
        return obs

    def _after(self, p: Plan, obs: Observed, execute: Executor) -> None:
        ctl = self.state.ctl()
        copy = MoveCopy(None, -1)
        if ctl.get("moving"):
            copied = self.state.client.hget(self.state.keys.ckpt_copied, "step")
            copy = MoveCopy(
                int(copied) if copied is not None else None,
                int(self.state.ckpt_last().get("step", "-1")),
            )
        execute.steps(
            after_pass(
                p,
                obs,
                ctl,
                min_nodes=self.policy.min_nodes,
                move_timeout_s=self.move_timeout_s,
                move_copy=copy,
                last_reason=self._last_reason,
            )
        )
        if p.reason != self._last_reason:
            log.info("plan: %s", p.reason)
            self._last_reason = p.reason

    def live_vms(self) -> list[str]:
        """Nodes whose VM may still run, by the ledger."""
        return [r.node for r in self.state.ledger().records.values() if r.status in LIVE_LAUNCHES]

    def done(self) -> bool:
        """The run is over: stopped or finished, and no VM of it runs."""
        ctl = self.state.ctl()
        ledger = self.state.ledger()
        live = [r for r in ledger.records.values() if r.status in LIVE_LAUNCHES]
        return (finished(self.state) or bool(ctl.get("stopped"))) and not live

    def summary(self) -> Summary:
        return summarize(self.state, self.clock())

    def run(self, *, on_pass: Callable[[Summary], object] | None = None) -> Summary:
        """Pass after pass until the run is over. Holds the run's lease throughout.

        Raises:
            ControllerError: another controller holds the run, or a cloud refused the
                credentials.
        """
        return drive_passes(self, on_pass)

"""The reconcile loop of a launched fleet: observe (read-only), plan (pure), execute.

Each pass is level-triggered: it reads what the clouds list for the run's tag and what the
agents report (:mod:`.observe`), asks :func:`.planner.plan` what to do, and does it
(:mod:`.execute`). A controller killed at any point and started again reads the same state
and carries on: the launch ledger is written before every launch and launches are
idempotent by request id, so nothing is leaked and nothing launched twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from spottrain.cloud.base import Instance, Offer, Provider
from spottrain.cloud.catalog import Catalog, bundled
from spottrain.spec import JobSpec, Placement

from .drive import drive_passes
from .execute import Executor, crash_point
from .ledger import redrive
from .observe import Observer, od_price
from .planner import plan
from .records import INTENT, LAUNCHED, Ledger
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
        obs = self._progress_stop(seen.obs, now)
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
        self._after(p, obs)
        crash_point("after-pass")
        return p

    def _progress_stop(self, obs: Observed, now: float) -> Observed:
        """A stop in progress ends when every node has left or the stop timeout passed."""
        ctl = self.state.ctl()
        if ctl.get("stopping") and not ctl.get("stopped"):
            since = float(ctl.get("stopping_since", now))
            agents_left = all(
                n.agent_state in ("left", "failed", None)
                or n.instance is None
                or not n.instance.state.alive
                for n in obs.nodes
            )
            if agents_left or now - since > self.stop_timeout_s:
                self.state.set_ctl(stopped=ctl["stopping"])
                return replace(obs, stopped=ctl["stopping"])
        return obs

    def _after(self, p: Plan, obs: Observed) -> None:
        staying = [
            n
            for n in obs.nodes
            if (n.instance is None or n.instance.state.alive)
            and n.agent_state not in ("draining", "left", "failed")
        ]
        ctl = self.state.ctl()
        updates: dict[str, str] = {"reason": p.reason}
        if p.home is not None:
            updates["home"] = "|".join(p.home)
        if len(staying) < self.policy.min_nodes:
            if not ctl.get("below_min_since"):
                updates["below_min_since"] = str(obs.now)
        elif ctl.get("below_min_since"):
            self.state.client.hdel(self.state.keys.ctl, "below_min_since")
        if ctl.get("moving") and self._move_copied(ctl, obs):
            self.state.client.hdel(
                self.state.keys.ctl, "moving", "below_min_since", "moving_quiet_since"
            )
            # The new zone's nodes bring in the newest copy at boot: they resume from it.
            copied = self.state.client.hget(self.state.keys.ckpt_copied, "step")
            self.state.event(
                "move-ready",
                to=ctl["moving"],
                resumes_from_step=int(copied) if copied is not None else -1,
            )
        self.state.set_ctl(**updates)
        if p.reason != self._last_reason:
            # The reason is logged when it changes, not every pass.
            self.state.event("plan", reason=p.reason)
            log.info("plan: %s", p.reason)
            self._last_reason = p.reason

    def _move_copied(self, ctl: dict[str, str], obs: Observed) -> bool:
        """The moved job may start in its new zone: every old agent has stopped (each copies
        its drain checkpoint out before it exits) and the newest commit is copied, or a
        short grace has passed since they stopped (a commit whose node died uncopied never
        will be), or the move timed out."""
        since = float(ctl.get("moving_since", "0"))
        if obs.now - since > self.move_timeout_s:
            return True
        if any(n.alive_beat for n in obs.nodes if n.instance is None or n.instance.state.alive):
            return False
        copied = self.state.client.hgetall(self.state.keys.ckpt_copied)
        copied_step = int(copied.get(b"step", b"-1"))
        last_step = int(self.state.ckpt_last().get("step", "-1"))
        if copied_step >= last_step:
            return True
        quiet = ctl.get("moving_quiet_since")
        if not quiet:
            self.state.set_ctl(moving_quiet_since=str(obs.now))
            return False
        return obs.now - float(quiet) > 15.0

    def live_vms(self) -> list[str]:
        """Nodes whose VM may still run, by the ledger."""
        return [
            r.node for r in self.state.ledger().records.values() if r.status in (INTENT, LAUNCHED)
        ]

    def done(self) -> bool:
        """The run is over: stopped or finished, and no VM of it runs."""
        ctl = self.state.ctl()
        ledger = self.state.ledger()
        live = [r for r in ledger.records.values() if r.status in (INTENT, LAUNCHED)]
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

"""The reconcile loop: observe (clouds and Redis), plan (pure), act (the one executor).

Each pass is level-triggered: it reads what the clouds list for the run's tag and what the
agents report, asks :func:`spottrain.controller.reconcile.planner.plan` what to do, and does it. A
controller killed at any point and started again reads the same state and carries on: the
launch ledger is written before every launch and launches are idempotent by request id, so
nothing is leaked and nothing launched twice. Crash points (``SPOTTRAIN_CRASH_AT``) let the
tests kill it between every pair of side effects.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

import redis

from spottrain.cloud.base import (
    AuthError,
    BadRequestError,
    CapacityError,
    Instance,
    InstanceState,
    LaunchRequest,
    Market,
    Offer,
    Provider,
    ProviderError,
    QuotaError,
    TransientError,
)
from spottrain.cloud.catalog import Catalog, bundled
from spottrain.controller.reconcile.planner import (
    Drain,
    Launch,
    Move,
    NodeObs,
    Observed,
    Penalise,
    Plan,
    Policy,
    Report,
    Stop,
    Terminate,
    plan,
)
from spottrain.controller.providers import offer_query
from spottrain.controller.reconcile.state import (
    ENDED,
    FAILED,
    INTENT,
    LAUNCHED,
    LaunchRecord,
    LeaseLost,
    Ledger,
    RunState,
)
from spottrain.spec import JobSpec, Placement

log = logging.getLogger("spottrain.controller")

CRASH_ENV = "SPOTTRAIN_CRASH_AT"
# Every point between two side effects of a pass, in the order a pass meets them.
CRASH_POINTS = (
    "after-intent",
    "after-launch",
    "after-launch-record",
    "after-terminate",
    "after-block",
    "after-notice",
    "after-pass",
)


class ControllerError(Exception):
    """The controller cannot go on (credentials refused, another controller holds the run)."""


def crash_point(name: str) -> None:
    """Die here, as a killed controller would, when ``SPOTTRAIN_CRASH_AT`` names this point.

    ``name`` or ``name:N`` (die on the N-th time the point is reached in this process).
    """
    target = os.environ.get(CRASH_ENV, "")
    if not target:
        return
    point, _, nth = target.partition(":")
    if point != name:
        return
    seen = _CRASH_COUNTS.get(name, 0) + 1
    _CRASH_COUNTS[name] = seen
    if seen >= int(nth or 1):
        os._exit(137)


_CRASH_COUNTS: dict[str, int] = {}


def catalog_offer(
    catalog: Catalog, cloud: str, region: str, zone: str, instance_type: str, market: Market
) -> Offer:
    """The offer a VM was bought on, from the catalog (a VM adopted without its offer).

    Raises:
        ValueError: the catalog does not know the type or its region.
    """
    t = catalog.get(cloud, instance_type)
    return Offer(
        cloud=cloud,
        region=region,
        zone=zone,
        instance_type=instance_type,
        gpus=t.gpus,
        gpu_type=t.gpu_type,
        market=market,
        price_per_hour=catalog.price(cloud, instance_type, region, market),
        interruption_risk=t.interruption_risk if market is Market.SPOT else 0.0,
    )


def od_price(catalog: Catalog, offer: Offer) -> float:
    """The on-demand price of an offer's type and region ("$ saved" is against it); the
    offer's own price when the catalog has none."""
    try:
        return catalog.price(offer.cloud, offer.instance_type, offer.region, Market.ON_DEMAND)
    except ValueError:
        return offer.price_per_hour


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
class Summary:
    """What a run did, for the live view and the end of ``spottrain up``."""

    phase: str
    step: int
    loss: float | None
    world_size: int
    nodes: dict[str, str]
    preemptions: int
    steps_lost: int
    spent_usd: float
    saved_usd: float
    reason: str
    checkpoints: int = 0
    final_step: int | None = None
    at_risk: list[str] = field(default_factory=list)


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
    _offers: list[Offer] = field(default_factory=list)
    _offers_at: float = -math.inf
    _last_reason: str = ""

    # --- observe -------------------------------------------------------------------------
    def _list_instances(self) -> list[Instance]:
        found: list[Instance] = []
        for prov in self.providers.values():
            found.extend(prov.list(self.run_id))
        return found

    def _fetch_offers(self, now: float) -> list[Offer]:
        if now - self._offers_at < self.offers_ttl_s and self._offers:
            return self._offers
        offers: list[Offer] = []
        for cloud, prov in self.providers.items():
            try:
                offers.extend(prov.offers(offer_query(self.spec, cloud, self.catalog)))
            except AuthError:
                raise
            except ProviderError as e:
                self.state.event("offers-failed", cloud=cloud, error=str(e))
        self._offers, self._offers_at = offers, now
        return offers

    def _reconcile_ledger(self, ledger: Ledger, instances: list[Instance], now: float) -> None:
        """Fold what the clouds list into the ledger: adopt VMs it lacks, record launches
        and ends, count interruptions once."""
        by_node: dict[str, list[Instance]] = {}
        for inst in instances:
            by_node.setdefault(inst.node, []).append(inst)
        for node, insts in by_node.items():
            rec = ledger.records.get(node)
            if rec is None:
                # A VM of this run the ledger does not know (its record was lost): adopt it.
                inst = insts[0]
                offer = self._offer_for(inst)
                rec = LaunchRecord(
                    node=node,
                    request_id=inst.request_id,
                    offer=offer,
                    launched_at=inst.launched_at or now,
                    status=LAUNCHED,
                    instance_id=inst.id,
                    od_price=self._od_price(offer),
                    reason="adopted",
                )
                self.state.put_launch(rec)
                self.state.event("adopted", vm=inst.id, node_name=node)
                ledger.records[node] = rec
            mine = [i for i in insts if i.request_id == rec.request_id] or insts
            inst = mine[0]
            if rec.status in (FAILED, ENDED) and inst.state.alive:
                # A VM the ledger gave up on runs after all (a late answer): count it again.
                rec = replace(rec, status=LAUNCHED, instance_id=inst.id, ended_at=None)
                self.state.put_launch(rec)
                ledger.records[node] = rec
                self.state.event("adopted", vm=inst.id, node_name=node, why="late launch")
            for extra in insts:
                if extra is not inst and extra.state.alive:
                    # Two VMs claim one node: keep the ledger's, end the other.
                    self._terminate(extra, node, "a second VM for the same node")
            if rec.status in (INTENT, LAUNCHED) and inst.state.alive:
                if rec.status == INTENT or rec.instance_id != inst.id:
                    rec = replace(rec, status=LAUNCHED, instance_id=inst.id)
                    self.state.put_launch(rec)
                    ledger.records[node] = rec
            elif rec.status in (INTENT, LAUNCHED) and inst.state is InstanceState.TERMINATED:
                rec = replace(
                    rec,
                    status=ENDED,
                    instance_id=inst.id,
                    ended_at=now,
                    interrupted=inst.interrupted,
                    reason=rec.reason or inst.state_reason,
                )
                self.state.put_launch(rec)
                ledger.records[node] = rec
                if inst.interrupted:
                    key = (rec.offer.cloud, rec.offer.zone, rec.offer.instance_type)
                    self.state.count(key, "preemptions")
                    self.state.event(
                        "preempted",
                        vm=inst.id,
                        node_name=node,
                        zone=rec.offer.zone,
                        reason=inst.state_reason,
                    )
                else:
                    self.state.event("vm-ended", vm=inst.id, node_name=node, reason=rec.reason)
        for node, rec in list(ledger.records.items()):
            # Listed before, gone now: the cloud forgot it (a DELETE-on-preempt VM).
            if (
                rec.status == LAUNCHED
                and node not in by_node
                and now - rec.launched_at > self.policy.lost_grace_s
            ):
                rec = replace(rec, status=ENDED, ended_at=now, reason="vanished")
                self.state.put_launch(rec)
                ledger.records[node] = rec
                self.state.event("vm-ended", vm=rec.instance_id, node_name=node, reason="vanished")

    def _offer_for(self, inst: Instance) -> Offer:
        for o in self._offers:
            if o.key == (inst.cloud, inst.zone, inst.instance_type, inst.market.value):
                return o
        return catalog_offer(
            self.catalog, inst.cloud, inst.region, inst.zone, inst.instance_type, inst.market
        )

    def _od_price(self, offer: Offer) -> float:
        return od_price(self.catalog, offer)

    def observe(self, now: float) -> tuple[Observed, Ledger, dict[str, Instance]]:
        """Gather the planner's input. Raises ProviderError when a cloud cannot be listed
        (a pass on a partial view could relaunch what exists)."""
        instances = self._list_instances()
        offers = self._fetch_offers(now)
        ledger = self.state.ledger()
        self._reconcile_ledger(ledger, instances, now)
        live_records = [r for r in ledger.records.values() if r.status in (INTENT, LAUNCHED)]
        names = [r.node for r in live_records]
        agents = self.state.node_records(names)
        beats = self.state.heartbeats(names)
        by_node = {}
        for inst in instances:
            rec = ledger.records.get(inst.node)
            if rec is not None and inst.request_id == rec.request_id:
                by_node[inst.node] = inst
        live_names = set(names)
        nodes = [
            NodeObs(
                name=r.node,
                instance=by_node.get(r.node),
                offer=r.offer,
                launched_at=r.launched_at,
                agent_state=agents.get(r.node, {}).get("state"),
                alive_beat=beats.get(r.node, False),
                compute_s=node_compute_s(agents.get(r.node, {}), now),
                at_risk=agents.get(r.node, {}).get("at_risk", ""),
                # Only while the node it replaces lives: after that it is an ordinary node.
                replaces=r.replaces if r.replaces in live_names else "",
            )
            for r in live_records
        ]
        ctl = self.state.ctl()
        home = tuple(ctl["home"].split("|")) if ctl.get("home") else None
        obs = Observed(
            now=now,
            nodes=nodes,
            offers=offers,
            blocked=self.state.blocked(),
            history=self.state.zone_history(ledger, now),
            spent_usd=ledger.spent(now),
            finished=finished(self.state),
            finished_at=_float(ctl.get("finished_at")),
            stopped=ctl.get("stopped", ""),
            restores=self.state.restores(),
            home=home if home and len(home) == 3 else None,
            below_min_since=_float(ctl.get("below_min_since")),
            spot_short_since=_float(ctl.get("spot_short_since")),
            next_index=int(ctl.get("next_index", "0")),
            job_tag=self.run_id,
            moving=bool(ctl.get("moving")),
            bad_streak=int(ctl.get("bad_streak", "0")),
            last_failure=ctl.get("last_failure", ""),
            last_refusal=ctl.get("last_refusal", ""),
        )
        if obs.finished and obs.finished_at is None:
            self.state.set_ctl(finished_at=str(now))
            obs = replace(obs, finished_at=now)
        if any(n.agent_state == "joined" for n in nodes) and obs.bad_streak:
            self.state.set_ctl(bad_streak="0")
            obs = replace(obs, bad_streak=0)
        return obs, ledger, by_node

    # --- act -----------------------------------------------------------------------------
    def _terminate(self, inst: Instance, node: str, why: str) -> None:
        self.state.fence()
        self.providers[inst.cloud].terminate([inst.id])
        self.state.event("terminate", vm=inst.id, node_name=node, why=why)
        crash_point("after-terminate")

    def _launch(self, action: Launch, now: float, next_index: int) -> None:
        offer = action.offer
        rec = LaunchRecord(
            node=action.node,
            request_id=action.request_id,
            offer=offer,
            launched_at=now,
            od_price=self._od_price(offer),
            replaces=action.replaces,
        )
        self.state.fence()
        self.state.record_intent(rec, next_index)
        crash_point("after-intent")
        self._send_launch(rec)

    def _send_launch(self, rec: LaunchRecord) -> None:
        offer = rec.offer
        req = LaunchRequest(
            request_id=rec.request_id,
            job=self.run_id,
            node=rec.node,
            offer=offer,
            user_data=self.boot(rec.node, offer),
        )
        self.state.fence()
        try:
            inst = self.providers[offer.cloud].launch(req)
        except CapacityError as e:
            now = self.clock()
            self.state.block(offer.key, now + self.policy.block_s)
            self.state.update_launch(rec.node, status=FAILED, reason=f"capacity: {e.message}")
            if offer.market is Market.SPOT and not self.state.ctl().get("spot_short_since"):
                self.state.set_ctl(spot_short_since=str(now))
            crash_point("after-block")
            self.state.event(
                "capacity",
                node_name=rec.node,
                zone=offer.zone,
                itype=offer.instance_type,
                market=offer.market.value,
                blocked_s=self.policy.block_s,
            )
            return
        except (QuotaError, BadRequestError) as e:
            # A day's block: a human has to raise the quota or fix the setting.
            self.state.block(offer.key, self.clock() + 86_400)
            crash_point("after-block")
            self.state.update_launch(rec.node, status=FAILED, reason=str(e))
            self.state.set_ctl(last_refusal=str(e))
            self.state.event("launch-refused", node_name=rec.node, error=str(e))
            return
        except TransientError as e:
            # The intent stays: the next pass sends the same request id again.
            self.state.event("launch-retry", node_name=rec.node, error=str(e))
            return
        crash_point("after-launch")
        self.state.update_launch(rec.node, status=LAUNCHED, instance_id=inst.id)
        if offer.market is Market.SPOT:
            self.state.client.hdel(self.state.keys.ctl, "spot_short_since")
        crash_point("after-launch-record")
        self.state.event(
            "launched",
            node_name=rec.node,
            vm=inst.id,
            zone=offer.zone,
            itype=offer.instance_type,
            market=offer.market.value,
            price=round(offer.price_per_hour, 4),
        )

    def _redrive_intents(self, ledger: Ledger, listed: Mapping[str, Instance], now: float) -> None:
        """Send again every launch whose answer a killed controller never recorded; give up
        on one the cloud never confirmed within the grace (the planner replaces it, and a VM
        that shows up later is adopted)."""
        for rec in ledger.records.values():
            if rec.status != INTENT or rec.node in listed:
                continue
            if now - rec.launched_at > self.policy.lost_grace_s:
                self.state.update_launch(rec.node, status=FAILED, reason="launch never confirmed")
            else:
                self._send_launch(rec)

    def _drain_all(self, obs: Observed) -> None:
        """Ask every running node to drain (emergency checkpoint, leave). Repeating it is
        harmless: an agent dedups notices, so a restarted controller simply asks again."""
        from spottrain.agent.agent import inject_notice

        window = min(60.0, *self.spec.notice_windows.values())
        for n in obs.nodes:
            if n.instance is not None and n.instance.state.alive:
                self.state.fence()
                inject_notice(self.state.client, self.state.keys, n.name, "terminate", window)
        crash_point("after-notice")

    def _drain_one(self, a: Drain) -> None:
        """Ask one node to drain; once its agent has left, rule 3 ends its VM."""
        from spottrain.agent.agent import inject_notice

        window = min(60.0, *self.spec.notice_windows.values())
        self.state.fence()
        inject_notice(self.state.client, self.state.keys, a.node, "terminate", window)
        self.state.event("drain", node_name=a.node, why=a.why)

    def _stop(self, action: Stop, obs: Observed) -> None:
        ctl = self.state.ctl()
        if ctl.get("stopping"):
            return
        # Notices first, then the record: a controller killed between the two asks again.
        if action.checkpoint:
            self._drain_all(obs)
        self.state.set_ctl(stopping=action.why, stopping_since=str(obs.now))
        self.state.event("stopping", why=action.why, error=int(action.error))
        if not action.checkpoint:
            self.state.set_ctl(stopped=action.why)
        if action.error:
            self.state.set_ctl(error=action.why)

    def act(self, p: Plan, obs: Observed, ledger: Ledger, listed: Mapping[str, Instance]) -> None:
        self._redrive_intents(ledger, listed, obs.now)
        for a in p.actions:
            if isinstance(a, Launch):
                self._launch(a, obs.now, p.next_index)
            elif isinstance(a, Terminate):
                inst = listed.get(a.node)
                if inst is not None:
                    self._terminate(inst, a.node, a.why)
                    self.state.update_launch(a.node, reason=a.why)
            elif isinstance(a, Drain):
                self._drain_one(a)
            elif isinstance(a, Penalise):
                self.state.count(a.key, "bad_nodes")
                node = a.why.split()[1] if a.why.startswith("node ") else ""
                reason = self.state.node_records([node]).get(node, {}).get("reason", a.why)
                streak = int(self.state.ctl().get("bad_streak", "0")) + 1
                self.state.set_ctl(bad_streak=str(streak), last_failure=reason)
                self.state.event("penalised", key="|".join(a.key), why=a.why)
            elif isinstance(a, Report):
                self.state.event("report", message=a.message)
            elif isinstance(a, Stop):
                self._stop(a, obs)
            elif isinstance(a, Move):
                self._move(a, obs)

    def _move(self, a: Move, obs: Observed) -> None:
        # Draining every node makes each write an emergency checkpoint, which its agent
        # copies to object storage; the new zone's nodes bring that copy in at boot.
        self._drain_all(obs)
        self.state.set_ctl(
            moving=a.to.zone,
            moving_since=str(obs.now),
            home=f"{a.to.cloud}|{a.to.zone}|{a.to.instance_type}",
        )
        self.state.event("move", to=a.to.zone, why=a.why)

    # --- a pass --------------------------------------------------------------------------
    def step(self) -> Plan:
        """One pass: observe, plan, act. Returns the plan."""
        now = self.clock()
        if self.tick is not None:
            self.tick(now)
        obs, ledger, listed = self.observe(now)
        obs = self._progress_stop(obs, now)
        # `spottrain scale` lowers (or restores) the most nodes the planner keeps.
        wanted = self.state.ctl().get("target_nodes")
        policy = self.policy
        if wanted:
            policy = replace(
                policy, max_nodes=max(policy.min_nodes, min(int(wanted), policy.max_nodes))
            )
        p = plan(policy, obs)
        self.act(p, obs, ledger, listed)
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


class Driven(Protocol):
    """What :func:`drive_passes` runs: a controller of either kind of fleet."""

    run_id: str
    state: RunState
    owner: str
    interval_s: float

    def step(self) -> object: ...
    def summary(self) -> Summary: ...
    def done(self) -> bool: ...


# A controller that cannot reach Redis retries, waiting between tries from the first value
# up to the second (each with jitter, so a fleet of controllers does not retry in step).
REDIS_BACKOFF_S = (1.0, 30.0)
DEFAULT_REDIS_OUTAGE_S = 3600.0


@dataclass
class RedisOutage:
    """How long the controller's Redis has not answered, and the next wait before a try."""

    limit_s: float
    since: float | None = None
    tries: int = 0
    last_error: str = ""

    def failed(self, now: float, error: Exception) -> float:
        """Record a failed pass; returns the seconds to wait before the next try.

        Raises:
            ControllerError: Redis has not answered for ``limit_s``.
        """
        if self.since is None:
            self.since = now
        self.tries += 1
        self.last_error = str(error) or type(error).__name__
        down = now - self.since
        if down >= self.limit_s:
            raise ControllerError(
                f"Redis has not answered for {down:.0f} s ({self.last_error}); the controller "
                "stops, the VMs train on: bring Redis back, then `spottrain resume` drives the "
                "run again"
            )
        lo, hi = REDIS_BACKOFF_S
        wait = min(hi, lo * 2 ** (self.tries - 1))
        return min(random.uniform(wait / 2, wait), max(0.0, self.limit_s - down))

    def answered(self, now: float) -> float | None:
        """Redis answered: returns how long it was away (None: it was not)."""
        if self.since is None:
            return None
        down = now - self.since
        self.since, self.tries = None, 0
        return down


def drive_passes(
    ctl: Driven,
    on_pass: Callable[[Summary], object] | None = None,
    *,
    redis_outage_s: float = DEFAULT_REDIS_OUTAGE_S,
    on_report: Callable[[str], object] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    monotonic: Callable[[], float] = time.monotonic,
) -> Summary:
    """Pass after pass of ``ctl`` until the run is over, holding the run's lease and
    stamping the controller's heartbeat.

    Every side effect of a pass renews the lease first (:meth:`RunState.fence`), so a
    controller that lost it stops acting at once. A pass that Redis failed is tried again
    with a growing wait (``on_report`` says when Redis went and came back), up to
    ``redis_outage_s``.

    Raises:
        ControllerError: another controller holds the run, a cloud refused the
            credentials, or Redis did not answer for ``redis_outage_s``.
    """
    state, owner = ctl.state, ctl.owner
    ttl = max(10.0, ctl.interval_s * 5)
    outage = RedisOutage(redis_outage_s)
    report = on_report or (lambda line: None)
    first = True
    try:
        while True:
            try:
                if not state.acquire(owner, ttl):
                    holder = state.lease_holder()
                    if first:
                        raise ControllerError(
                            f"run {ctl.run_id} is driven by another controller "
                            f"({holder}); stop it first or wait {ttl:.0f} s"
                        )
                    raise ControllerError(
                        f"lost the lease of run {ctl.run_id} to another controller ({holder})"
                    )
                first = False
                state.hold(owner, ttl)
                state.beat(owner, ttl)
                down = outage.answered(monotonic())
                if down is not None:
                    report(f"Redis answers again after {down:.0f} s: the controller goes on")
                    log.warning("Redis is back after %.0f s", down)
                    state.event("redis-back", down_s=round(down, 1))
                try:
                    ctl.step()
                except AuthError as e:
                    state.event("error", error=str(e))
                    raise ControllerError(str(e)) from None
                except ProviderError as e:
                    # A cloud could not be asked: skip this pass rather than act on half a view.
                    state.event("observe-failed", error=str(e))
                    log.warning("pass skipped: %s", e)
                summary = ctl.summary()
                if on_pass is not None:
                    on_pass(summary)
                if ctl.done():
                    phase = "failed" if state.ctl().get("error") else "done"
                    state.set_ctl(phase=phase)
                    return ctl.summary()
            except LeaseLost as e:
                # The pass stopped at its next side effect; the next one takes the lease
                # again only if nobody else holds it.
                log.warning("%s: this pass stops here", e)
                report(f"spottrain: {e}; this pass stops here")
            except redis.RedisError as e:
                was_down = outage.since is not None
                wait = outage.failed(monotonic(), e)
                if not was_down:
                    report(
                        f"Redis does not answer ({e}): the controller retries for up to "
                        f"{redis_outage_s:.0f} s; the VMs train on"
                    )
                    log.warning("Redis does not answer (%s): retrying", e)
                sleep(wait)
                continue
            sleep(ctl.interval_s)
    finally:
        state.hold(None)
        with contextlib.suppress(redis.RedisError):
            state.release(owner)


def finished(state: RunState) -> bool:
    """Training is over: the SDK's ``finish`` reported it, or a final checkpoint landed."""
    return state.progress().get("finished") == "1" or state.ckpt_last().get("kind") == "final"


def _final_step(progress: dict[str, str], last: dict[str, str]) -> int | None:
    if progress.get("finished") == "1":
        return int(progress.get("final_step", progress.get("step", "0")))
    if last.get("kind") == "final":
        return int(last["step"])
    return None


COMPUTE_FRESH_S = 60.0  # a rank's compute report older than this is no longer its own


def node_compute_s(record: Mapping[str, str], now: float) -> float | None:
    """A node's compute seconds per step: its slowest local rank's recent median, from the
    ``compute:<local rank>`` fields its trainers write ("<seconds> <unix time>"). Reports
    older than ``COMPUTE_FRESH_S`` are left out (a rank that holds, or is gone)."""
    figures = []
    for k, v in record.items():
        if not k.startswith("compute:"):
            continue
        try:
            secs, at = (float(x) for x in v.split())
        except ValueError:
            continue
        if now - at <= COMPUTE_FRESH_S and math.isfinite(secs) and secs >= 0:
            figures.append(secs)
    return max(figures) if figures else None


def _float(v: str | None) -> float | None:
    return float(v) if v else None


def summarize(state: RunState, now: float) -> Summary:
    """The run's figures from Redis alone (``spottrain status`` uses it too)."""
    ctl = state.ctl()
    ledger = state.ledger()
    progress = state.progress()
    names = [r.node for r in ledger.records.values() if r.status in (INTENT, LAUNCHED)]
    agents = state.node_records(names)
    nodes = {}
    for r in sorted(ledger.records.values(), key=lambda r: r.launched_at):
        if r.status in (INTENT, LAUNCHED):
            nodes[r.node] = agents.get(r.node, {}).get("state", "launching")
    restores = state.restores()
    lost = sum(max(0, r.reached_step - r.restored_step) for r in restores)
    preempted = sum(1 for r in ledger.records.values() if r.interrupted)
    last = state.ckpt_last()
    loss = progress.get("loss")
    phase = ctl.get("phase") or ("stopping" if ctl.get("stopping") else "running")
    final = _final_step(progress, last)
    return Summary(
        phase=phase,
        step=final if final is not None else int(float(progress.get("step", 0))),
        loss=float(loss) if loss else None,
        world_size=int(float(progress.get("world_size", 0))),
        nodes=nodes,
        preemptions=preempted,
        steps_lost=lost,
        spent_usd=ledger.spent(now),
        saved_usd=ledger.saved(now),
        reason=ctl.get("error") or ctl.get("reason", ""),
        final_step=final,
        at_risk=_at_risk_lines(ledger, agents),
    )


def _at_risk_lines(ledger: Ledger, agents: Mapping[str, Mapping[str, str]]) -> list[str]:
    """One line per live node at risk of preemption, and how its replacement is doing."""
    live = {r.node: r for r in ledger.records.values() if r.status in (INTENT, LAUNCHED)}
    by_target = {r.replaces: r.node for r in live.values() if r.replaces}
    lines = []
    for node in sorted(live):
        why = agents.get(node, {}).get("at_risk")
        state = agents.get(node, {}).get("state")
        if not why or state in ("draining", "left", "failed"):
            continue
        r = by_target.get(node)
        if r is None:
            lines.append(f"{node} at risk ({why}): no replacement launched yet")
        else:
            lines.append(
                f"{node} at risk ({why}): replacement {r} "
                f"{agents.get(r, {}).get('state') or 'launching'}"
            )
    return lines

"""The controller of a fleet that a cloud group owns (provisioned by ``terraform/aws`` or
``terraform/gcp``): it adopts the group's VMs by the job tag the modules set, keeps the
run's state in Redis like the launching controller does, and applies
:func:`~spottrain.controller.groups.plan.plan_group`'s decisions. It is the only code that
calls the group.

Each VM of the group is a node of the run, named by its id (the modules' boot scripts make
the instance id, or the GCP instance name, the agent's node id). The launch ledger records
each one when first seen, so cost, savings, ``spottrain status`` and the final report work
as for launched fleets. Its observe is read-only: the ledger's fold is decided by
:func:`~spottrain.controller.groups.fold.fold_group` and written by the pass.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from spottrain.catalog import Catalog, bundled
from spottrain.cloud.base import Offer, region_of_zone
from spottrain.cloud.base.groups import Group, Member
from spottrain.protocol.states import LedgerStatus
from spottrain.spec import JobSpec

from ..reconcile.drive import drive_passes
from ..reconcile.ledger import CountPreemption, Note, PutRecord
from ..reconcile.observe import catalog_offer, od_price
from ..reconcile.state import RunState
from ..reconcile.summary import Summary, finished, summarize
from .fold import ForgetAgent, GroupStep, Pricing, Unmark, fold_group
from .plan import (
    DrainMember,
    GroupObserved,
    GroupPlan,
    GroupPolicy,
    MemberObs,
    ReleaseMember,
    RemoveMembers,
    SetTarget,
    StopRun,
    plan_group,
)

log = logging.getLogger(__name__)


GROUP_TUNABLES = frozenset(GroupPolicy.__dataclass_fields__) - {"min_nodes", "max_nodes"}


def group_policy_from_spec(spec: JobSpec, **overrides: float) -> GroupPolicy:
    base = GroupPolicy(
        min_nodes=spec.nodes.min, max_nodes=spec.nodes.max, budget_usd=spec.budget.max_usd
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


def wanted_nodes(spec: JobSpec, ctl: Mapping[str, str]) -> int:
    """The node count the job wants now: ``spottrain scale``'s, else ``nodes.max``."""
    raw = ctl.get("target_nodes")
    return int(raw) if raw else spec.nodes.max


@dataclass
class GroupController:
    """Drives one run on a group-owned fleet. Same surface as
    :class:`~spottrain.controller.reconcile.controller.Controller` (``step``, ``run``,
    ``summary``, ``done``).

    Args:
        spec: the job (its ``fleet:`` section names the group).
        run_id: the run; the group's VMs carry it as their job tag.
        group: the group.
        state: the run's state in Redis.
        policy: the planner's tunables.
        notice_window_s: the deadline a drain request gives an agent.
    """

    spec: JobSpec
    run_id: str
    group: Group
    state: RunState
    policy: GroupPolicy
    interval_s: float = 5.0
    notice_window_s: float = 120.0
    clock: Callable[[], float] = time.time
    catalog: Catalog = field(default_factory=bundled)
    owner: str = "controller"
    region: str = ""
    _last_reason: str = ""

    # --- observe -------------------------------------------------------------------------
    def _marks(self) -> dict[str, dict[str, Any]]:
        raw = self.state.client.hgetall(self.state.keys.ctl_group)
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    def _mark(self, member_id: str, **fields: Any) -> None:
        raw = self.state.client.hget(self.state.keys.ctl_group, member_id)
        marks = {**(json.loads(raw) if raw else {}), **fields}
        self.state.client.hset(self.state.keys.ctl_group, member_id, json.dumps(marks))

    def _offer_of(self, m: Member) -> Offer:
        cloud = self.group.cloud
        region = self.region or region_of_zone(cloud, m.zone)
        try:
            return catalog_offer(self.catalog, cloud, region, m.zone, m.instance_type, m.market)
        except ValueError:
            # A type the catalog lacks (the module's variable allows any): cost unknown.
            return Offer(
                cloud=cloud,
                region=region,
                zone=m.zone,
                instance_type=m.instance_type,
                gpus=self.spec.nodes.gpus,
                gpu_type="",
                market=m.market,
                price_per_hour=0.0,
                interruption_risk=0.0,
            )

    def _forget_agent(self, node: str) -> None:
        # The VM is gone: its agent's last state ("left", "failed") must not be read as the
        # state of the VM the group may bring back under the same name.
        self.state.client.delete(self.state.keys.node(node), self.state.keys.heartbeat(node))

    def _look(self, now: float) -> tuple[GroupObserved, list[GroupStep]]:
        """The planner's input, read-only, with the ledger's fold applied in memory; and
        the fold's steps that write it."""
        view = self.group.describe()
        ids = [m.id for m in view.members]
        pricing = Pricing(self._offer_of, lambda o: od_price(self.catalog, o), self.group.name)
        folded = fold_group(
            view,
            now,
            self.state.ledger(),
            self._marks(),
            self.state.node_records(ids),
            pricing,
        )
        records, marks, agents = folded.ledger.records, folded.marks, folded.agents
        forgotten = {s.node for s in folded.steps if isinstance(s, ForgetAgent)}
        beats = {n: beat and n not in forgotten for n, beat in self.state.heartbeats(ids).items()}
        members = tuple(
            MemberObs(
                member=m,
                agent_state=agents.get(m.id, {}).get("state"),
                alive_beat=beats.get(m.id, False),
                first_seen=records[m.id].launched_at if m.id in records else now,
                drain_asked_at=marks.get(m.id, {}).get("drain_asked_at"),
                removed_at=marks.get(m.id, {}).get("removed_at"),
            )
            for m in view.members
        )
        ctl = self.state.ctl()
        obs = GroupObserved(
            now=now,
            wanted=wanted_nodes(self.spec, ctl),
            group_target=view.target,
            members=members,
            max_size=view.max_size,
            finished=finished(self.state),
            stopping=ctl.get("stopping", ""),
            spent_usd=folded.ledger.spent(now),
        )
        return obs, folded.steps

    def observe(self, now: float) -> GroupObserved:
        """The planner's input, read-only (this pass's ledger fold applied in memory)."""
        return self._look(now)[0]

    def _take(self, steps: list[GroupStep]) -> None:
        """Write the fold's decisions."""
        for s in steps:
            if isinstance(s, PutRecord):
                self.state.put_launch(s.record)
            elif isinstance(s, Note):
                self.state.event(s.type, **s.fields)
            elif isinstance(s, CountPreemption):
                self.state.count(s.key, "preemptions")
            elif isinstance(s, Unmark):
                self.state.client.hdel(self.state.keys.ctl_group, s.member_id)
            elif isinstance(s, ForgetAgent):
                self._forget_agent(s.node)

    # --- act -----------------------------------------------------------------------------
    def act(self, p: GroupPlan, obs: GroupObserved) -> None:
        from spottrain.protocol.notices import CONTROLLER_DRAIN_KIND, inject_notice

        for a in p.actions:
            self.state.fence()  # a controller that lost the run's lease acts no more
            if isinstance(a, StopRun):
                self.state.set_ctl(stopping=a.why, stopping_since=str(obs.now))
                if a.error:
                    self.state.set_ctl(error=a.why)
                self.state.event("stopping", why=a.why, error=int(a.error))
            elif isinstance(a, ReleaseMember):
                self.group.release(a.id)
                self.state.event("released", vm=a.id, node_name=a.id, why=a.why)
            elif isinstance(a, DrainMember):
                # Mark first: a controller killed between the two asks the same VM again
                # (the agent dedups) instead of choosing another victim.
                self._mark(a.id, drain_asked_at=obs.now)
                inject_notice(
                    self.state.client,
                    self.state.keys,
                    a.id,
                    CONTROLLER_DRAIN_KIND,
                    self.notice_window_s,
                )
                self.state.event("drain", vm=a.id, node_name=a.id, why=a.why)
            elif isinstance(a, RemoveMembers):
                for member_id in a.ids:
                    self._mark(member_id, removed_at=obs.now, replace=a.replace)
                self.group.remove(a.ids, replace=a.replace)
                if a.replace:
                    for member_id in a.ids:
                        self._forget_agent(member_id)
                for member_id in a.ids:
                    self.state.event(
                        "terminate", vm=member_id, node_name=member_id, why=a.why, replace=a.replace
                    )
            elif isinstance(a, SetTarget):
                self.group.set_target(a.size)
                self.state.event("group-size", size=a.size, why=a.why)

    def step(self) -> GroupPlan:
        now = self.clock()
        obs, steps = self._look(now)
        self._take(steps)
        p = plan_group(self.policy, obs)
        self.act(p, obs)
        self._after(p, obs)
        return p

    def _after(self, p: GroupPlan, obs: GroupObserved) -> None:
        ctl = self.state.ctl()
        updates = {"reason": p.reason}
        if ctl.get("stopping") and not ctl.get("stopped") and p.active == 0:
            updates["stopped"] = ctl["stopping"]
        self.state.set_ctl(**updates)
        if p.reason != self._last_reason:
            self.state.event("plan", reason=p.reason)
            log.info("plan: %s", p.reason)
            self._last_reason = p.reason

    # --- the run -------------------------------------------------------------------------
    def live_vms(self) -> list[str]:
        return [
            r.node
            for r in self.state.ledger().records.values()
            if r.status == LedgerStatus.LAUNCHED
        ]

    def done(self) -> bool:
        """Over: stopped or finished, and the group holds no VM."""
        ctl = self.state.ctl()
        if not (finished(self.state) or ctl.get("stopped")):
            return False
        view = self.group.describe()
        return view.target == 0 and not view.alive

    def summary(self) -> Summary:
        return summarize(self.state, self.clock())

    def run(self, *, on_pass: Callable[[Summary], object] | None = None) -> Summary:
        return drive_passes(self, on_pass)

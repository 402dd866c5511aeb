"""Execute: the only code that acts on clouds and nodes for a launched fleet (launch,
terminate, drain notices) and writes what the planner decided into Redis.

Every side effect renews the run's lease first (:meth:`RunState.fence`). Crash points
(``SPOTTRAIN_CRASH_AT``) let the tests kill the controller between every pair of side
effects.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from spottrain.agent.replica_slots import find_claim, release_slot
from spottrain.cloud.base import (
    BadRequestError,
    CapacityError,
    Instance,
    InstanceState,
    LaunchRequest,
    Market,
    Offer,
    Provider,
    QuotaError,
    TransientError,
)
from spottrain.protocol.boot import last_console_line, parse_console
from spottrain.protocol.env import ENV_CRASH_AT
from spottrain.protocol.states import LedgerStatus
from spottrain.spec import FaultTolerance, JobSpec

from .consoles import ConsoleRead
from .ledger import (
    FAILED_LAUNCHES,
    CountPreemption,
    EndDuplicate,
    GiveUp,
    Note,
    PutRecord,
    Resend,
    SetCtl,
    Step,
)
from .progress import DelCtl, ProgressStep
from .records import LaunchRecord
from .state import RunState
from .types import (
    SLOW_WATCH,
    Action,
    Block,
    Drain,
    Launch,
    LaunchFailed,
    Move,
    NodeObs,
    Penalise,
    Report,
    Stop,
    Terminate,
    Watch,
)

log = logging.getLogger("spottrain.controller")

CRASH_ENV = ENV_CRASH_AT
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


@dataclass
class Executor:
    """Takes one run's steps and actions.

    Args:
        spec: the job (its notice windows bound a drain's deadline).
        run_id: the run.
        providers: one per cloud.
        state: the run's state in Redis.
        boot: renders the boot script of a node on an offer.
        od_price: the on-demand price of an offer (for "$ saved").
        clock: unix seconds.
    """

    spec: JobSpec
    run_id: str
    providers: Mapping[str, Provider]
    state: RunState
    boot: Callable[[str, Offer], str]
    od_price: Callable[[Offer], float]
    clock: Callable[[], float] = time.time

    # --- the ledger's steps ------------------------------------------------------------------
    def offer_errors(self, errors: Iterable[tuple[str, str]]) -> None:
        for cloud, error in errors:
            self.state.event("offers-failed", cloud=cloud, error=error)

    def steps(self, steps: Iterable[Step | ProgressStep]) -> None:
        for s in steps:
            if isinstance(s, PutRecord):
                self.state.put_launch(s.record)
                if s.record.status == LedgerStatus.ENDED:
                    self._free_replica_slot(s.record.node)
            elif isinstance(s, Note):
                self.state.event(s.type, **s.fields)
            elif isinstance(s, CountPreemption):
                self.state.count(s.key, "preemptions")
            elif isinstance(s, EndDuplicate):
                self.terminate(s.instance, s.node, s.why)
            elif isinstance(s, SetCtl):
                self.state.set_ctl(**s.fields)
            elif isinstance(s, DelCtl):
                self.state.client.hdel(self.state.keys.ctl, *s.fields)

    def _free_replica_slot(self, node: str) -> None:
        """A replica node whose VM is gone leaves its slot now, so the backfill launched for
        it takes that slot (a new member of it) instead of waiting out the dead agent's
        heartbeat or opening a slot of its own."""
        if self.spec.train.fault_tolerance is not FaultTolerance.REPLICA:
            return
        claim = find_claim(self.state.client, self.state.keys, node)
        if claim is not None:
            release_slot(self.state.client, self.state.keys, claim, node)
            self.state.event("replica-slot-freed", node_name=node, slot=claim.slot)

    def redrive(self, actions: Iterable[Resend | GiveUp]) -> None:
        for a in actions:
            if isinstance(a, GiveUp):
                self.state.update_launch(a.node, status=LedgerStatus.FAILED, reason=a.reason)
            else:
                self.send_launch(a.record, a.block_s, a.refusal_block_s)

    # --- consoles ----------------------------------------------------------------------------
    def read_consoles(self, nodes: Iterable[NodeObs], now: float) -> dict[str, ConsoleRead]:
        """Read these nodes' VM consoles (:class:`~.consoles.ConsoleWatch` chose them). A
        failure line of the node's boot found there, that its boot hash does not hold yet,
        is written as its boot hash with ``source=console``, with a ``boot`` event. A read
        that fails is logged and tried again on a later pass, never raised: the console
        only explains."""
        out: dict[str, ConsoleRead] = {}
        for n in nodes:
            inst = n.instance
            if inst is None or inst.cloud not in self.providers:
                continue
            try:
                text = self.providers[inst.cloud].console_output(inst.id)
            except Exception as e:  # diagnosis only: nothing here may stop the loop
                log.warning("could not read the console of %s (node %s): %s", inst.id, n.name, e)
                out[n.name] = ConsoleRead(now, error=str(e) or type(e).__name__)
                continue
            report = parse_console(text, n.name, at=now)
            out[n.name] = ConsoleRead(now, last_console_line(text), report)
            if report is not None and report.failed and not (n.boot and n.boot.failed):
                self.state.fence()
                self.state.put_boot(report)
        return out

    # --- the plan's actions ------------------------------------------------------------------
    def act(
        self,
        actions: Iterable[Action],
        nodes: Iterable[NodeObs],
        now: float,
        next_index: int,
        listed: Mapping[str, Instance],
    ) -> None:
        nodes = list(nodes)
        for a in actions:
            if isinstance(a, Launch):
                self.launch(a, now, next_index)
            elif isinstance(a, Terminate):
                inst = listed.get(a.node)
                if inst is not None:
                    self.terminate(inst, a.node, a.why)
                    if a.preempted:
                        reason = f"preempted: {a.preempted}"
                        self.state.update_launch(a.node, reason=reason, interrupted=True)
                    else:
                        self.state.update_launch(a.node, reason=a.why)
            elif isinstance(a, Drain):
                self.drain_one(a)
            elif isinstance(a, Penalise):
                self.penalise(a)
            elif isinstance(a, LaunchFailed):
                self.launch_failed(a)
            elif isinstance(a, Block):
                self.block(a)
            elif isinstance(a, Report):
                self.state.event("report", message=a.message)
            elif isinstance(a, Watch):
                self.state.set_ctl(**{SLOW_WATCH: a.slow.to_json()})
            elif isinstance(a, Stop):
                self.stop(a, nodes, now)
            elif isinstance(a, Move):
                self.move(a, nodes, now)

    def terminate(self, inst: Instance, node: str, why: str) -> None:
        self.state.fence()
        self.providers[inst.cloud].terminate([inst.id])
        self.state.event("terminate", vm=inst.id, node_name=node, why=why)
        crash_point("after-terminate")

    def launch(self, action: Launch, now: float, next_index: int) -> None:
        offer = action.offer
        rec = LaunchRecord(
            node=action.node,
            request_id=action.request_id,
            offer=offer,
            launched_at=now,
            od_price=self.od_price(offer),
            replaces=action.replaces,
        )
        self.state.fence()
        self.state.record_intent(rec, next_index)
        crash_point("after-intent")
        self.send_launch(rec, action.block_s, action.refusal_block_s)

    def send_launch(self, rec: LaunchRecord, block_s: float, refusal_block_s: float) -> None:
        """Ask the cloud for ``rec``'s VM; on a capacity error block its offer ``block_s``,
        on a refusal (quota, a rejected setting) ``refusal_block_s``."""
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
            self._capacity(rec, block_s, e.message)
            return
        except (QuotaError, BadRequestError) as e:
            # A human has to raise the quota or fix the setting.
            self.state.block(offer.key, self.clock() + refusal_block_s)
            crash_point("after-block")
            self.state.update_launch(rec.node, status=LedgerStatus.FAILED, reason=str(e))
            self.state.set_ctl(last_refusal=str(e))
            self.state.event("launch-refused", node_name=rec.node, error=str(e))
            return
        except TransientError as e:
            # The intent stays: the next pass sends the same request id again.
            self.state.event("launch-retry", node_name=rec.node, error=str(e))
            return
        crash_point("after-launch")
        self.state.update_launch(rec.node, status=LedgerStatus.LAUNCHED, instance_id=inst.id)
        if offer.market is Market.SPOT:
            self.state.client.hdel(self.state.keys.ctl, "spot_short_since")
        crash_point("after-launch-record")
        # Who a replacement stands in for, so the event log alone tells a handover's story.
        handover = {"replaces": rec.replaces} if rec.replaces else {}
        self.state.event(
            "launched",
            node_name=rec.node,
            vm=inst.id,
            zone=offer.zone,
            itype=offer.instance_type,
            market=offer.market.value,
            price=round(offer.price_per_hour, 4),
            **handover,
        )

    def _capacity(self, rec: LaunchRecord, block_s: float, message: str) -> None:
        offer = rec.offer
        now = self.clock()
        self.state.block(offer.key, now + block_s)
        self.state.update_launch(
            rec.node, status=LedgerStatus.FAILED, reason=f"capacity: {message}"
        )
        if offer.market is Market.SPOT and not self.state.ctl().get("spot_short_since"):
            self.state.set_ctl(spot_short_since=str(now))
        crash_point("after-block")
        self.state.event(
            "capacity",
            node_name=rec.node,
            zone=offer.zone,
            itype=offer.instance_type,
            market=offer.market.value,
            blocked_s=block_s,
        )

    def penalise(self, a: Penalise) -> None:
        self.state.count(a.key, "bad_nodes")
        self.state.event("penalised", key="|".join(a.key), why=a.why)

    def launch_failed(self, a: LaunchFailed) -> None:
        """Record the give-up streak after a VM that failed before training, and say so."""
        self.state.set_ctl(**{FAILED_LAUNCHES: a.streak.to_json()})
        f = a.failure
        self.state.event(
            "launch-failed",
            node_name=f.node,
            stage=f.stage,
            why=f.why,
            streak=a.streak.count,
        )

    def block(self, a: Block) -> None:
        """Block offers a VM's failure showed cannot work (its machine image)."""
        self.state.fence()
        for key in a.keys:
            self.state.block(key, a.until)
        crash_point("after-block")
        self.state.set_ctl(last_refusal=a.why)
        self.state.event(
            "blocked",
            offers=", ".join("|".join(k) for k in a.keys),
            until=round(a.until, 3),
            why=a.why,
        )

    def _window(self) -> float:
        return min(60.0, *self.spec.notice_windows.values())

    def drain_all(self, nodes: Iterable[NodeObs]) -> None:
        """Ask every running node to drain (emergency checkpoint, leave). Repeating it is
        harmless: an agent dedups notices, so a restarted controller simply asks again."""
        from spottrain.protocol.notices import CONTROLLER_DRAIN_KIND, inject_notice

        window = self._window()
        for n in nodes:
            if n.instance is not None and n.instance.state.alive:
                self.state.fence()
                inject_notice(
                    self.state.client, self.state.keys, n.name, CONTROLLER_DRAIN_KIND, window
                )
        crash_point("after-notice")

    def drain_one(self, a: Drain) -> None:
        """Ask one node to drain; once its agent has left, rule 3 ends its VM."""
        from spottrain.protocol.notices import CONTROLLER_DRAIN_KIND, inject_notice

        self.state.fence()
        inject_notice(
            self.state.client, self.state.keys, a.node, CONTROLLER_DRAIN_KIND, self._window()
        )
        self.state.event("drain", node_name=a.node, why=a.why)

    def stop(self, action: Stop, nodes: Iterable[NodeObs], now: float) -> None:
        ctl = self.state.ctl()
        if ctl.get("stopping"):
            return
        # Notices first, then the record: a controller killed between the two asks again.
        if action.checkpoint:
            self.drain_all(nodes)
        self.state.set_ctl(stopping=action.why, stopping_since=str(now))
        self.state.event("stopping", why=action.why, error=int(action.error))
        if not action.checkpoint:
            self.state.set_ctl(stopped=action.why)
        if action.error:
            self.state.set_ctl(error=action.why)

    def move(self, a: Move, nodes: Iterable[NodeObs], now: float) -> None:
        # Draining every node makes each write an emergency checkpoint, which its agent
        # copies to object storage; the new zone's nodes bring that copy in at boot.
        self.drain_all(nodes)
        self.state.set_ctl(
            moving=a.to.zone,
            moving_since=str(now),
            home=f"{a.to.cloud}|{a.to.zone}|{a.to.instance_type}",
        )
        self.state.event("move", to=a.to.zone, why=a.why)


def end_run_vms(
    run_id: str,
    providers: Mapping[str, Provider],
    state: RunState | None,
    timeout: float,
    *,
    sleep: Callable[[float], None] = time.sleep,
    monotonic: Callable[[], float] = time.monotonic,
) -> list[str]:
    """End every VM of run ``run_id`` (``spottrain down``) and wait, up to ``timeout``,
    until the clouds list each as terminated. Each VM's end is recorded once as a
    ``terminate`` event when ``state`` is given. Returns what is still there, one
    ``cloud:id (state)`` each.
    """
    deadline = monotonic() + timeout
    asked: set[str] = set()
    first = True
    while True:
        left = []
        for prov in providers.values():
            listed = prov.list(run_id)
            alive = [i for i in listed if i.state is not InstanceState.TERMINATED]
            # The first round ends what is listed as ended too: a GCP VM that shut itself
            # down (its dead man's switch, a STOP preemption) is stopped, its disks billed,
            # until it is deleted. Ending an ended VM again is harmless on every cloud.
            ending = listed if first else alive
            if ending:
                prov.terminate([i.id for i in ending])
                left += [f"{i.cloud}:{i.id} ({i.state})" for i in alive]
            for i in alive:
                if i.id not in asked and state is not None:
                    with contextlib.suppress(Exception):
                        state.event("terminate", vm=i.id, node_name=i.node, why="down")
                asked.add(i.id)
        first = False
        if not left or monotonic() > deadline:
            return left
        sleep(1.0)

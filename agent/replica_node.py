"""One node of one replica, as the agent sees it: its slot, its replica's launch settings,
its rendezvous, and the slot given back when the agent ends."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import redis

from spottrain.protocol.keys import RunKeys

from .config import AgentConfig
from .node_record import NodeRecord
from .replica_launch import ReplicaLaunch, plan_launch
from .replica_slots import SlotClaim, claim_slot, release_slot

log = logging.getLogger("spottrain.agent")


class ReplicaNode:
    def __init__(
        self, client: redis.Redis, keys: RunKeys, cfg: AgentConfig, record: NodeRecord
    ) -> None:
        self.client = client
        self.keys = keys
        self.cfg = cfg
        self.record = record
        self.slot: SlotClaim | None = None
        self._launch: ReplicaLaunch | None = None

    @property
    def launch(self) -> ReplicaLaunch:
        """The settings :meth:`plan` settled (only asked for after it succeeded)."""
        assert self._launch is not None, "plan() first"
        return self._launch

    @property
    def rdzv_keys(self) -> RunKeys:
        """The keys of the replica's own rendezvous (the run's before a launch is planned:
        nothing joined yet)."""
        if self._launch is None:
            return self.keys
        return RunKeys(self._launch.rdzv_id, self.cfg.key_prefix)

    def plan(self, stopped: Callable[[], bool] = lambda: False) -> str | None:
        """Claim this node's slot and settle the launch's settings; return why that failed
        (one line), or None."""
        if self.slot is None:
            try:
                self.slot = claim_slot(
                    self.client, self.keys, self.cfg.node_id, self.cfg.nodes_per_replica
                )
            except (redis.RedisError, RuntimeError) as exc:
                return f"cannot claim a replica slot: {exc}"
            # Each heartbeat writes it again: `status` shows which replica a node is in.
            self.record.mark(replica=self.slot.slot)
            self.record.event("replica-slot", slot=self.slot.slot, members=list(self.slot.members))
        plan = plan_launch(
            self.client,
            self.keys,
            slot=self.slot.slot,
            nodes_per_replica=self.cfg.nodes_per_replica,
            min_replicas=self.cfg.min_replicas,
            lighthouse=self.cfg.lighthouse,
            lighthouse_wait=self.cfg.lighthouse_wait,
            manager_port=self.cfg.manager_port,
            local_cloud=self.cfg.cloud == "local",
            stopped=stopped,
        )
        if isinstance(plan, str):
            return plan
        self._launch = plan
        return None

    def event_fields(self) -> dict[str, Any]:
        """What the torchrun-started event adds in replica mode."""
        r = self.launch
        return {"replica": r.slot, "lighthouse": r.lighthouse, "manager_port": r.manager_port}

    def leave_rendezvous(self) -> None:
        """Leave the replica's own rendezvous once its workers have stopped, so the
        replica's other nodes re-form at once instead of at its heartbeat's expiry; other
        replicas never see it (their keys differ). The notice handler's leave names the run's
        rendezvous, which replica mode leaves unused."""
        if self._launch is None:
            return
        from .rendezvous.membership import leave_node

        with contextlib.suppress(LookupError, redis.RedisError):
            leave_node(self.client, self.rdzv_keys, self.cfg.node_id)

    def release(self) -> None:
        """Give the slot back (a clean exit); a node that dies is dropped by the next claim
        once its heartbeat key expires."""
        if self.slot is None:
            return
        try:
            release_slot(self.client, self.keys, self.slot, self.cfg.node_id)
        except redis.RedisError as exc:
            log.warning("could not release %s (its heartbeat expires): %s", self.slot.slot, exc)

"""One node of one replica, as the agent sees it: its slot, its replica's launch settings,
its rendezvous, and the slot given back once its torchrun has ended.

The slot is given back as soon as torchrun ends, not when the agent does: a torchrun that
ended without a signal closed its generation of the replica's rendezvous, so a node that
lingers (waiting for its VM to be ended) must not keep a backfilled VM in that generation;
with the slot empty the backfill starts a new one. With ``nodes_per_replica`` > 1 a notice on
one node makes the whole replica leave (its ranks agree on the leave), so every member's
torchrun exits 0 and closes the generation: the noticed node drains, each other member's
agent records "training finished" (state ``left``) and gives its slot back too, and the
controller ends those VMs as it ends any whose agent left, and backfills. The slot's next
claim then starts a new generation that waits for ``nodes_per_replica`` fresh nodes. A
member is never relaunched in place. A backfill that claims the slot in the instant between
the replica's leave and its members' torchruns ending joins the closed generation, fails,
and is replaced like any failed node; the claim after it starts a new generation.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import redis

from spottrain.protocol.keys import RunKeys
from spottrain.redis_conn import RedisSettings

from .config import AgentConfig
from .node_record import NodeRecord
from .replica_launch import ReplicaLaunch, plan_launch
from .replica_slots import SlotClaim, claim_slot, release_slot

if TYPE_CHECKING:
    from .quorum_shim.local import RelayPlan
    from .quorum_shim.server import LighthouseShim

log = logging.getLogger("spottrain.agent")


class ReplicaNode:
    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        cfg: AgentConfig,
        record: NodeRecord,
        settings: RedisSettings | None = None,
    ) -> None:
        self.client = client
        self.settings = settings
        # The Redis quorum's local lighthouse shim: started at the first launch, kept across
        # relaunches (a relaunched manager joins under a new id through the same shim).
        self.shim: LighthouseShim | None = None
        self.keys = keys
        self.cfg = cfg
        self.record = record
        self.slot: SlotClaim | None = None
        self._launch: ReplicaLaunch | None = None
        self._left = False

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
            self.record.event(
                "replica-slot",
                slot=self.slot.slot,
                members=list(self.slot.members),
                gen=self.slot.gen,
            )
        lighthouse = self.cfg.lighthouse
        if self.cfg.redis_quorum:
            problem = self._start_shim()
            if problem:
                return problem
            assert self.shim is not None
            lighthouse = self.shim.address
        plan = plan_launch(
            self.client,
            self.keys,
            slot=self.slot.slot,
            gen=self.slot.gen,
            nodes_per_replica=self.cfg.nodes_per_replica,
            min_replicas=self.cfg.min_replicas,
            lighthouse=lighthouse,
            lighthouse_wait=self.cfg.lighthouse_wait,
            manager_port=self.cfg.manager_port,
            local_cloud=self.cfg.cloud == "local",
            stopped=stopped,
            quorum=self.cfg.quorum,
        )
        if isinstance(plan, str):
            return plan
        self._launch = replace(plan, heartbeat_timeout_s=self.cfg.quorum_heartbeat_timeout_s)
        return None

    def _start_shim(self) -> str | None:
        """Start the lighthouse shim once; why it could not start (one line), or None."""
        if self.shim is not None:
            return None
        from spottrain.quorum.model import QuorumConfig
        from spottrain.redis_conn import settings_from_url

        from .quorum_shim.local import start_local_shim

        port = 0 if self.cfg.cloud == "local" else self.cfg.quorum_port
        try:
            relay = self._relay_plan()
            settings = self.settings or settings_from_url(
                self.cfg.redis_url, password_file=self.cfg.password_file
            )
            self.shim = start_local_shim(
                settings,
                self.keys,
                QuorumConfig(
                    heartbeat_timeout_ms=round(self.cfg.quorum_heartbeat_timeout_s * 1000),
                    join_timeout_ms=self.cfg.quorum_join_timeout_ms,
                    min_replicas=self.cfg.min_replicas,
                ),
                port=port,
                wait_replicas=self.cfg.quorum_wait_replicas,
                relay=relay,
                on_lease=self._relay_lease(relay),
            )
        except (OSError, ValueError, redis.RedisError, RuntimeError) as exc:
            return (
                f"cannot start the Redis quorum's lighthouse shim on 127.0.0.1:{port} (relay "
                f"port {self.cfg.quorum_relay_port}): {exc} (free the port, or give "
                "--quorum-port / --quorum-relay-port)"
            )
        relayed = {"relay_group": relay.group, "relay": relay.address} if relay else {}
        self.record.event("quorum-shim-started", address=self.shim.address, **relayed)
        return None

    def _relay_lease(self, relay: RelayPlan | None) -> Callable[[bool], None] | None:
        """Where a relay lease taken or lost is told: the run's events, so an operator sees
        where each group's relay moved (``status`` shows where they are now)."""
        if relay is None:
            return None

        def told(holding: bool) -> None:
            what = "quorum-relay-taken" if holding else "quorum-relay-lost"
            self.record.event(what, relay_group=relay.group, relay=relay.address)

        return told

    def _relay_plan(self) -> RelayPlan | None:
        """This node's relay group and relay address (--quorum-relay-group), or None."""
        size = self.cfg.quorum_relay_group
        if not size or self.slot is None:
            return None
        from spottrain.ports import free_port

        from .quorum_shim.local import RelayPlan
        from .quorum_shim.relay import relay_group

        local = self.cfg.cloud == "local"  # the local "VMs" share one host: any free port
        host = "127.0.0.1" if local else self.cfg.address or socket.gethostname()
        port = 0 if local else self.cfg.quorum_relay_port
        port = port or free_port("127.0.0.1" if local else "0.0.0.0")
        return RelayPlan(
            group=relay_group(self.slot.slot, size),
            bind=f"{'127.0.0.1' if local else '0.0.0.0'}:{port}",
            address=f"{host}:{port}",
        )

    def quorum_leave(self, now: bool) -> None:
        """A notice: this node's replica leaves the Redis quorum, stall-free (see
        :meth:`.quorum_shim.server.LighthouseShim.leave`). A no-op with the lighthouse."""
        if self.shim is None:
            return
        ids = self.shim.leave(now=now)
        if ids:
            self.record.event("quorum-leave", replica_ids=ids, at_once=now)

    def stop_shim(self) -> None:
        if self.shim is not None:
            shim, self.shim = self.shim, None
            shim.stop()

    def event_fields(self) -> dict[str, Any]:
        """What the torchrun-started event adds in replica mode."""
        r = self.launch
        return {
            "replica": r.slot,
            "gen": r.gen,
            "rdzv_id": r.rdzv_id,
            "lighthouse": r.lighthouse,
            "quorum": r.quorum,
            "manager_port": r.manager_port,
        }

    def leave_rendezvous(self) -> bool:
        """Leave the replica's own rendezvous once its workers have stopped, so the
        replica's other nodes re-form at once instead of at its heartbeat's expiry; other
        replicas never see it (their keys differ). The notice handler's own leave names the
        run's rendezvous, which replica mode leaves unused, so the handler reports this one.

        Returns whether this node is out of it (now or by an earlier call); False when it
        never joined it or Redis did not answer."""
        if self._launch is None or self._left:
            return self._left
        from .rendezvous.membership import leave_node

        try:
            leave_node(self.client, self.rdzv_keys, self.cfg.node_id)
        except LookupError:
            return False
        except redis.RedisError as exc:
            log.warning("could not leave %s (its heartbeat expires): %s", self.launch.rdzv_id, exc)
            return False
        self._left = True
        return True

    def release(self) -> None:
        """Give the slot back (torchrun ended, or the agent exits); a node that dies is
        dropped by the next claim once its heartbeat key expires. Once only."""
        if self.slot is None:
            return
        slot, self.slot = self.slot, None
        try:
            release_slot(self.client, self.keys, slot, self.cfg.node_id)
        except redis.RedisError as exc:
            log.warning("could not release %s (its heartbeat expires): %s", slot.slot, exc)

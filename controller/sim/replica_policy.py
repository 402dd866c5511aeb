"""The ``replica`` policy with torchft 0.2.0's measured costs, and the registry of every
policy ``spottrain simulate`` runs.

It keeps :class:`~spottrain.controller.sim.policies.Replica`'s bookkeeping (which replicas
are up, a joiner voided when its replica loses a VM again, the fall back to the checkpoint
when none is up) and changes what the events cost
(:mod:`spottrain.controller.sim.replica_params`):

- training runs at ``step_s / (step_s + quorum(n))`` of the live replicas' rate: each step
  waits for one quorum round of the ``n`` live replicas (the Redis quorum's, by default, or
  the stock lighthouse's);
- a loss stops the survivors for the notice stall (the Redis quorum: one round, its leave
  landing; the lighthouse: heartbeat timeout + a step) or the kill stall (about the
  heartbeat timeout, the Redis quorum's growing with the fleet, + the step redone), then
  one process-group rebuild at the smaller size;
- a joiner enters the quorum ``join_start_s`` after its VM took the slot, which stops the
  survivors for one process-group rebuild at the larger size; it trains once the rebuild
  and its state fetch from a live peer are done. With no replica up it restores the
  checkpoint instead and nobody waits for it.

Stops queue up: a cost that lands while the survivors are already stopped for another
starts when that one ends (each quorum change is a rebuild of its own).
"""

from __future__ import annotations

from spottrain.controller.sim.policies import INF, Costs, Elastic, Replica, Schedule, Sync, Trainer


class TorchftReplica(Replica):
    """Survivors keep stepping, paying torchft's measured quorum and rebuild costs."""

    name = "replica"

    def __init__(self, costs: Costs, schedule: Schedule) -> None:
        super().__init__(costs, schedule)
        self.rebuilds = 0

    def _rate(self) -> float:
        return self.c.throughput(self.up_count) * self.c.replica.step_share(self.up_count)

    def _stop_for(self, now: float, seconds: float) -> None:
        """The survivors stop for ``seconds`` more, after any stop already under way."""
        if self.until == INF or seconds <= 0:
            return  # nothing trains: the cost is absorbed by the restart
        start = now if self.training else max(now, self.until)
        self.hold(now, start + seconds)

    def _survivors_stall(self, now: float, had_notice: bool) -> None:
        p = self.c.replica
        if had_notice:
            stall = p.notice_stall_s(self.up_count)
        else:  # the heartbeat timeout is the whole fleet's, not the live replicas'
            stall = p.kill_stall_total_s(self.c.replicas)
        self.rebuilds += 1
        self._stop_for(now, stall + p.pg_rebuild_s(self.up_count))

    def on_filled(self, slot: int, now: float) -> None:
        if not self._in(slot):
            return
        j = slot // self.c.replica_nodes
        self._rgen[j] += 1
        self._at(now + self.c.replica.join_start_s, self._enters_quorum, (j, self._rgen[j]))

    def _enters_quorum(self, now: float, arg: tuple[int, int]) -> None:
        j, gen = arg
        if gen != self._rgen[j] or self.up[j]:
            return
        if self.up_count == 0:
            self._at(now + self.c.load_s, self._caught_up, arg)  # no live peer: the disk
            return
        rebuild_s = self.c.replica.pg_rebuild_s(self.up_count + 1)
        self.rebuilds += 1
        self._stop_for(now, rebuild_s)
        self._at(now + rebuild_s + self.c.catch_up_s, self._caught_up, arg)


POLICIES: dict[str, type[Trainer]] = {
    "sync": Sync,
    "elastic": Elastic,
    "replica": TorchftReplica,
    "replica-ideal": Replica,
}

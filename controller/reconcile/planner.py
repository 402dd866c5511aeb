"""The controller's decisions: a pure function from what is observed to what to do, and why.

``plan(policy, observed)`` imports no cloud SDK, no Redis and no clock: the time is a field of
:class:`Observed`, and tests call it with literals. It returns frozen actions and one line of
reason; one executor (:mod:`.execute`) applies them.

The rules, in the order they are checked:

1. **The end.** A finished job (its final checkpoint committed), a stopped one, a crash
   loop (the job restored from the same checkpoint after failing at the same step K times),
   or a job whose last ``max_failed_launches`` VMs failed before training for the same
   reason (rule 3) terminates every VM, and nothing launches again.
2. **Budget.** Spent so far plus the running fleet's cost over the next hour must stay under
   the cap: no launch that would break that; at the cap, checkpoint and stop.
3. **Bad nodes.** A VM that failed before training is terminated at once and its offer
   penalised (counted against the zone and type like a preemption, which weighs the
   ranking): its boot reported a failure (the VM's boot hash, or a failure line the
   controller found on its console), its agent failed (its boot health check), or it was
   not healthy within the boot timeout (the reason then carries its console's last line).
   Each counts as a failed launch in the run's one give-up policy
   (:class:`~.types.FailedLaunches`): ``max_failed_launches`` of them in a row for the same
   reason (a different reason starts a new streak), with no node training meanwhile, stop
   the run with an error that names the reason; no checkpoint is taken (none trained). A
   failure in a stage of the machine image (``IMAGE_STAGES``: no python3, a too old one)
   also blocks every offer of the VM's region for ``refusal_block_s`` first, so another
   region's image is tried. A straggler
   (its compute time per step, forward and backward without the all-reduce's wait, well
   above its peers' median: wall time per step is the same on every node of a synchronous
   job) is reported and replaced, on a sustained and corroborated signal only
   (:class:`~.types.StragglerPolicy`: several reports over a minimum span, its peers
   waiting for it, enough steps timed, the fleet as a whole not slowed; the count, kept in
   :class:`~.types.SlowWatch`, ends only on a clear recovery); a node that left
   (drained, or finished) has its idle VM terminated. A node at risk (its cloud sent a
   rebalance recommendation) gets one replacement launched early (rule 5); once that
   replacement has joined, the at-risk node is drained (emergency checkpoint, leave) rather
   than kept until its preemption: the handover then loses no step, and the surplus VM costs
   no longer than a boot.
4. **Move.** When the job has been below its minimum in its zone for ``move_after_s`` and that
   zone's offer is blocked (capacity), the whole job moves to the best offer elsewhere,
   after a checkpoint copied to object storage. A job whose checkpoints are not copied
   (``Policy.copies_checkpoints`` false) does not move: the new zone's volumes would not
   hold its checkpoint; it waits for its zone, and the reason says so.
5. **Backfill.** Lost and draining nodes are replaced without touching the rest, up to
   ``max`` nodes training, on the cheapest offer weighted by interruption risk, in the job's
   zone and GPU type unless the spec chooses spreading; spot first, on-demand when the
   policy allows it and spot capacity has been missing for ``fallback_after_s``. Each
   at-risk node without a replacement adds one launch: the fleet may run up to ``max`` plus
   the at-risk count, a temporary surplus that ends when those nodes drain, and never a
   launch the budget cannot cover.

**Big fleets.** A pass looks closely only at the nodes that can need something (booting,
draining, failed, left, not listed, stopping); every other node (listed, alive, its agent
up) is only counted: one more staying node, its price, its zone. ``plan`` sorts the nodes into
those two kinds in one scan; a :class:`FleetIndex` passed as ``Observed.nodes`` keeps the
sort up to date as nodes are put and removed one at a time, so that a pass over 12,500 nodes
of which a few changed costs as much as a pass over those few (``spottrain simulate`` plans
that way). Both give the same plan.
"""

from __future__ import annotations

from .rules import Pass, backfill, bad_nodes, budget, count_staying, move, over_max, the_end
from .types import Observed, Plan, Policy


def plan(policy: Policy, obs: Observed) -> Plan:
    """Decide what to do now. See the module docstring for the rules.

    Returns:
        A :class:`Plan`: its actions, one line of reason, the job's home (cloud, zone,
        instance type) after this pass, and the next free node index.
    """
    ended = the_end(policy, obs)  # 1
    if ended is not None:
        return ended
    p = Pass.sort(policy, obs)
    stop = budget(p)  # 2
    if stop is not None:
        return stop
    gave_up = bad_nodes(p)  # 3
    if gave_up is not None:
        return gave_up
    count_staying(p)
    moved = move(p)  # 4
    if moved is not None:
        return moved
    over_max(p)
    if obs.moving:
        # A move in progress: the old fleet drains and copies its checkpoint; the new zone
        # starts once the copy is complete (the loop clears ``moving`` then).
        p.reasons.append("moving: waiting for the drained fleet's checkpoint copy")
        return p.result()
    return backfill(p)  # 5

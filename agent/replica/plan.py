"""Pure decisions of the step protocol: who takes part, which samples each part takes.

The global batch stays the same whatever the number of replicas taking part in a step:
step ``s`` consumes samples ``[s * G, (s + 1) * G)`` of the deterministic sample order,
split into contiguous shares over the participants (sizes differing by at most one), and
each share cut into micro-batches (gradient accumulation takes up the slack). Every sample's
loss is weighted ``1 / G`` and the replicas' gradients are SUMMED, so the step's gradient is
the mean over the same ``G`` samples however many replicas computed it. A step that is
discarded (a peer lost mid-step) is redone at the same ``s``, so it re-consumes the same
samples. A replica that heals at the start of a step takes its share of it (the heal is
done before its forward pass); one that takes no part (its quorum failed) computes nothing
and contributes zeros.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepPlan:
    """What one replica does in one step, decided before its forward pass."""

    step: int  # the committed steps so far: the step being attempted is this one
    quorum_id: int
    participants: int  # replicas computing a share of this step
    participant_rank: int | None  # this replica's share, None: it computes nothing
    healed: bool  # this replica loaded a live peer's state at the start of this step
    micro_batches: tuple[range, ...]  # global sample indices, per micro-batch
    global_batch: int

    @property
    def participating(self) -> bool:
        return self.participant_rank is not None

    @property
    def samples(self) -> int:
        return sum(len(m) for m in self.micro_batches)

    def local(self, rank: int, world: int) -> tuple[range, ...]:
        """The micro-batches rank ``rank`` of the replica's ``world`` ranks computes (round
        robin; a rank may get none and then contributes zeros). The replica's ranks sum
        their gradients before the cross-replica sum."""
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside the replica's {world} ranks")
        return self.micro_batches[rank::world]

    def weight(self, micro: range) -> float:
        """Factor for ``micro``'s mean loss: every sample weighs ``1 / global_batch``, and
        the replicas' gradients are summed."""
        return len(micro) / self.global_batch


def share(global_batch: int, participants: int, rank: int) -> range:
    """Participant ``rank``'s offsets within a step's global batch (contiguous, the first
    ``global_batch % participants`` shares one longer)."""
    if global_batch <= 0 or participants <= 0:
        raise ValueError(
            f"global batch {global_batch} and participants {participants} must be positive"
        )
    if not 0 <= rank < participants:
        raise ValueError(f"participant rank {rank} is outside {participants} participants")
    if participants > global_batch:
        raise ValueError(
            f"{participants} replicas take part but the global batch is {global_batch}: "
            "raise --global-batch to at least the number of replicas"
        )
    base, extra = divmod(global_batch, participants)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def micro_batches(
    step: int, global_batch: int, micro_batch: int, participants: int, rank: int | None
) -> tuple[range, ...]:
    """Global sample indices of this replica's micro-batches in ``step`` (none for a replica
    that does not take part)."""
    if micro_batch <= 0:
        raise ValueError(f"micro batch {micro_batch} must be positive")
    if rank is None:
        return ()
    mine = share(global_batch, participants, rank)
    base = step * global_batch
    out = []
    for start in range(mine.start, mine.stop, micro_batch):
        out.append(range(base + start, base + min(start + micro_batch, mine.stop)))
    return tuple(out)


def make_plan(
    *,
    step: int,
    quorum_id: int,
    participants: int,
    participant_rank: int | None,
    healed: bool,
    global_batch: int,
    micro_batch: int,
) -> StepPlan:
    # A healed replica takes its share: it loaded the live state before its forward pass.
    return StepPlan(
        step=step,
        quorum_id=quorum_id,
        participants=participants,
        participant_rank=participant_rank,
        healed=healed,
        micro_batches=micro_batches(
            step, global_batch, micro_batch, participants, participant_rank
        ),
        global_batch=global_batch,
    )

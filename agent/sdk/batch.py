"""The global batch: the same samples per step whatever the world size."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GlobalBatch:
    """A global batch that stays the same whatever the world size.

    Each optimizer step consumes samples ``[step * global_size, (step + 1) * global_size)``
    of the (deterministic) sample order, cut into micro-batches of ``micro_size`` (the last
    one shorter when ``micro_size`` does not divide ``global_size``); micro-batch ``j`` goes
    to rank ``j % world``. Gradient accumulation takes up the slack when the world shrinks,
    and any world size up to the number of micro-batches works: ranks run counts that differ
    by at most one, and :meth:`weight` scales each micro-batch's mean loss so that gradients
    averaged over the ranks are the mean over the global batch's samples, whatever the split.
    The data position is therefore global (it is the step), and no sample is skipped or
    repeated across a resize.

    Raises:
        ValueError: a size is not positive, or the world has more ranks than a step has
            micro-batches (a rank would have nothing to do).
    """

    # Pickled by scripts under this path (old pickles name it): keep it.
    __module__ = "spottrain.agent.sdk"

    global_size: int
    micro_size: int
    world: int
    rank: int

    def __post_init__(self) -> None:
        if self.global_size <= 0 or self.micro_size <= 0 or self.world <= 0:
            raise ValueError(
                f"global batch {self.global_size}, micro batch {self.micro_size} and world "
                f"size {self.world} must all be positive"
            )
        if self.world > self.micro_batches:
            raise ValueError(
                f"global batch {self.global_size} in micro batches of {self.micro_size} is "
                f"{self.micro_batches} micro-batch(es), fewer than world size {self.world}: "
                "every rank needs at least one. The largest usable world size is "
                f"{self.micro_batches}; lower the micro batch or raise the global batch (or "
                "cap nodes.max x GPUs per node at it)"
            )
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside world size {self.world}")

    @property
    def micro_batches(self) -> int:
        """Micro-batches in one step, over all ranks."""
        return -(-self.global_size // self.micro_size)

    @property
    def accum_steps(self) -> int:
        """Micro-batches this rank runs per optimizer step."""
        return len(range(self.rank, self.micro_batches, self.world))

    def micro_ranges(self, step: int) -> list[range]:
        """This rank's micro-batches of ``step``, as ranges of global sample indices."""
        base = step * self.global_size
        end = base + self.global_size
        out = []
        for j in range(self.rank, self.micro_batches, self.world):
            start = base + j * self.micro_size
            out.append(range(start, min(start + self.micro_size, end)))
        return out

    def weight(self, micro: range) -> float:
        """The factor for ``micro``'s mean loss (``loss * weight``, then backward) when the
        ranks' gradients are then averaged (summed and divided by the world size, as DDP
        does): ``len(micro) * world / global_size``. It is ``1 / accum_steps`` when the
        sizes divide evenly; with uneven splits it weights every sample the same."""
        return len(micro) * self.world / self.global_size

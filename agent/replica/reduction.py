"""Which groups a gradient crosses on its way to the step's sum, decided apart from any
process group so the rule is tested without processes.

Two layouts reach the cross-replica sum:

- **replicated** (a model without DDP, DDP's buckets): every rank of the replica holds a
  partial sum of the SAME full tensor (its own samples' gradient), so the replica's ranks
  sum first over the replica's own group, then the replicas sum across.
- **sharded** (FSDP2 inside the replica, replicas as the outer dimension of HSDP): FSDP2's
  reduce-scatter has already summed the replica's samples and left each rank a DIFFERENT
  shard. Summing over the replica's group would add different parameters together; the
  shard crosses replicas only, with the same rank of every other replica (torchft's
  cross-replica group for group rank ``i`` holds rank ``i`` of each replica: the manager
  configures it under the store prefix ``.../torchft/<quorum id>/<group rank>``).

Whether a rank steps its shards is never its own reduce's result: a rank whose shard reduce
failed while its replica's other ranks succeeded would step part of the model. torchft's
``should_commit`` votes across the replica's ranks (the replica's manager server answers only
when every group rank voted, and answers False to all when any voted False), so
:meth:`~.engine.ReplicaEngine.commit` is the one decision, the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

INTRA = "intra-replica"
CROSS = "cross-replica"


def reduction_stages(*, replicated: bool, replica_world: int) -> tuple[str, ...]:
    """The groups a tensor is summed over, in order. A shard never meets the replica's own
    group; a replicated tensor does when the replica has more than one rank."""
    if replica_world < 1:
        raise ValueError(f"a replica has at least one rank, not {replica_world}")
    if replicated and replica_world > 1:
        return (INTRA, CROSS)
    return (CROSS,)


def reduce_in_stages(
    buf: torch.Tensor,
    *,
    replicated: bool,
    replica_world: int,
    intra_group: Any,
    cross: Callable[[torch.Tensor], bool],
) -> bool:
    """Sum ``buf`` in place over :func:`reduction_stages`; ``cross`` is the fault-tolerant
    cross-replica sum (False: the step is discarded)."""
    if INTRA in reduction_stages(replicated=replicated, replica_world=replica_world):
        dist.all_reduce(buf, group=intra_group)
    return cross(buf)


def is_sharded(t: torch.Tensor) -> bool:
    """A DTensor split over some mesh dimension (an FSDP2 parameter or gradient)."""
    return isinstance(t, DTensor) and any(p.is_shard() for p in t.placements)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard (sharing its storage, so a sum
    written into it is the DTensor's), any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def refuse_shards_as_replicated(tensors: list[torch.Tensor]) -> None:
    """A sharded tensor passed as replicated would be summed with OTHER parameters' shards
    over the replica's group: a one-line error naming the fix."""
    if any(is_sharded(t) for t in tensors):
        raise ValueError(
            "these gradients are FSDP2 shards (DTensor with Shard placements): reduce them "
            "with reduce_shard_grads / reduce(..., replicated=False), which sums each shard "
            "only with the same rank of the other replicas"
        )


def sum_fsdp_gradients(model: torch.nn.Module) -> int:
    """Make an FSDP2 model's reduce-scatter a SUM, as the cross-replica reduction is (each
    sample's loss weighs ``1 / global batch``): FSDP2 averages by default. The factor is per
    FSDP module (set on the root it leaves the inner modules averaging), and gloo has no
    pre-multiplied sum, hence the plain-sum switch. Returns the modules changed."""
    from torch.distributed.fsdp import FSDPModule

    changed = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
            changed += 1
    return changed

"""The two reduction paths: a replicated tensor is summed over the replica's own ranks and
then across replicas; a shard (FSDP2/HSDP) only across replicas, never over the replica's
own group, where it would be added to other parameters' shards."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from spottrain.agent.replica.engine import ReplicaEngine
from spottrain.agent.replica.reduction import (
    CROSS,
    INTRA,
    is_sharded,
    local_part,
    reduce_in_stages,
    reduction_stages,
    refuse_shards_as_replicated,
    sum_fsdp_gradients,
)

INTRA_GROUP = object()  # stands for the replica's own group; never a real collective here


@pytest.mark.parametrize("world", [1, 2, 8])
def test_a_shard_never_meets_the_replicas_own_group(world: int) -> None:
    assert reduction_stages(replicated=False, replica_world=world) == (CROSS,)


def test_a_replicated_tensor_is_summed_inside_the_replica_first() -> None:
    assert reduction_stages(replicated=True, replica_world=2) == (INTRA, CROSS)
    assert reduction_stages(replicated=True, replica_world=1) == (CROSS,)
    with pytest.raises(ValueError, match="at least one rank"):
        reduction_stages(replicated=True, replica_world=0)


class Calls:
    """What reached torch's all-reduce and the cross-replica sum, in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[tuple[str, Any]] = []
        monkeypatch.setattr(dist, "all_reduce", self._intra)

    def _intra(self, buf: torch.Tensor, group: Any = None, **_: Any) -> None:
        self.log.append((INTRA, group))
        buf.add_(100.0)  # another rank's partial sum

    def cross(self, buf: torch.Tensor) -> bool:
        self.log.append((CROSS, None))
        buf.mul_(2.0)  # another replica's equal contribution
        return True


@pytest.mark.parametrize("replicated", [True, False])
def test_the_engine_routes_each_path_through_its_stages(
    monkeypatch: pytest.MonkeyPatch, replicated: bool
) -> None:
    calls = Calls(monkeypatch)
    # The engine's reduction reads only these of its attributes (the rest is torchft's).
    engine: Any = SimpleNamespace(world=2, intra_group=INTRA_GROUP, _cross_replica=calls.cross)
    engine._allreduce = lambda buf, replicated: ReplicaEngine._allreduce(
        engine, buf, replicated=replicated
    )
    grads = [torch.ones(3), torch.full((2,), 5.0)]
    assert ReplicaEngine.reduce(engine, grads, replicated=replicated)
    if replicated:
        assert calls.log == [(INTRA, INTRA_GROUP), (CROSS, None)]
        assert grads[0].tolist() == [202.0] * 3 and grads[1].tolist() == [210.0] * 2
    else:
        assert calls.log == [(CROSS, None)]
        assert grads[0].tolist() == [2.0] * 3 and grads[1].tolist() == [10.0] * 2


def test_reduce_in_stages_reports_the_cross_replica_result(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = Calls(monkeypatch)
    buf = torch.ones(2)
    ok = reduce_in_stages(
        buf, replicated=False, replica_world=4, intra_group=INTRA_GROUP, cross=lambda b: False
    )
    assert ok is False and calls.log == []


@pytest.fixture
def one_rank_mesh() -> Iterator[Any]:
    """A real one-rank gloo group in this process (FSDP2's DTensors need a mesh)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_a_dtensor_shard_is_reduced_in_its_own_storage(
    monkeypatch: pytest.MonkeyPatch, one_rank_mesh: Any
) -> None:
    calls = Calls(monkeypatch)
    shard = distribute_tensor(torch.arange(4.0), one_rank_mesh, [Shard(0)])
    plain = torch.ones(2)
    assert is_sharded(shard) and not is_sharded(plain)
    assert local_part(plain) is plain

    engine: Any = SimpleNamespace(world=2, intra_group=INTRA_GROUP, _cross_replica=calls.cross)
    engine._allreduce = lambda buf, replicated: ReplicaEngine._allreduce(
        engine, buf, replicated=replicated
    )
    assert ReplicaEngine.reduce(engine, [shard, plain], replicated=False)
    assert calls.log == [(CROSS, None)]
    assert shard.full_tensor().tolist() == [0.0, 2.0, 4.0, 6.0]

    # Passed as replicated, the shard would be summed with other parameters' shards.
    with pytest.raises(ValueError, match="reduce_shard_grads"):
        ReplicaEngine.reduce(engine, [shard], replicated=True)
    with pytest.raises(ValueError, match="FSDP2 shards"):
        refuse_shards_as_replicated([plain, shard])
    assert calls.log == [(CROSS, None)]


def test_every_fsdp_module_of_a_model_is_made_to_sum(one_rank_mesh: Any) -> None:
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    assert sum_fsdp_gradients(model) == 0  # not sharded: nothing to change
    fully_shard(model[0], mesh=one_rank_mesh)
    fully_shard(model, mesh=one_rank_mesh)
    assert sum_fsdp_gradients(model) == 2  # the root AND the inner module
    model(torch.ones(5, 3)).sum().backward()
    assert all(is_sharded(p.grad) for p in model.parameters())

"""One rank of an HSDP replica, for the tests: a tiny model sharded with FSDP2 over the
replica's own ranks (gloo, CPU), its gradient shards summed across replicas through
:meth:`ReplicaEngine.reduce_shard_grads` (rank ``i`` with rank ``i`` of every other replica).

Samples are made from ``(seed, index)`` alone and step ``s`` consumes ``[s * G, (s + 1) * G)``
split over the replicas taking part, then over the replica's ranks. Each step every rank
gathers the full gradient and checks it against an unsharded copy of the model run on ALL
the step's samples (``grad_err``): the shards crossed replicas without being mixed. Every
rank appends one JSON line per attempted step (committed or not, its own reduce's result,
a digest of the gathered full parameters after the step) to ``--progress`` with ``{rank}``
replaced by its rank.

``--freeze-at-step N``: at the first attempt of a step >= N taken part in with a peer, rank 1
sums its shards with its peers first, then rank 0 SIGSTOPs the whole replica before its own
shard reduce (a replica that vanishes mid-reduction without closing its sockets, after half
its ranks' shards crossed): the peers' rank 1 succeeds, their rank 0 fails.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import signal
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from spottrain.agent.replica.engine import ReplicaEngine
from spottrain.agent.replica.reduction import sum_fsdp_gradients


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--progress", required=True, help="JSON-lines path with {rank}")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--dim", type=int, default=12)
    p.add_argument("--hidden", type=int, default=18)
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--freeze-at-step", type=int, default=-1)
    return p.parse_args()


def sample(seed: int, index: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    x = torch.randn(dim, generator=g)
    return x, torch.sin(x.roll(1))


def loss_of(net: nn.Module, args: argparse.Namespace, ids: range) -> torch.Tensor:
    """Every sample weighs 1 / global batch; an empty share runs one sample at weight 0
    (FSDP2's collectives must run on every rank of the replica)."""
    pairs = [sample(args.seed, i, args.dim) for i in (ids if len(ids) else range(1))]
    x, y = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    per_sample = ((net(x) - y) ** 2).mean(dim=1)
    return per_sample.sum() / args.global_batch * (1.0 if len(ids) else 0.0)


def build(args: argparse.Namespace, world: int) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(args.seed)  # the same initial weights on every rank of every replica
    model = nn.Sequential(
        nn.Linear(args.dim, args.hidden), nn.Tanh(), nn.Linear(args.hidden, args.dim)
    )
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert sum_fsdp_gradients(model) == 3  # a SUM inside the replica too
    return model, reference


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def grad_error(
    reference: nn.Module,
    full_params: list[torch.Tensor],
    grads: list[torch.Tensor],
    args: argparse.Namespace,
    step: int,
) -> float:
    """Largest difference between the summed gradient and an unsharded model's gradient on
    the whole step's samples (same summands, another order: not bitwise)."""
    with torch.no_grad():
        for r, p in zip(reference.parameters(), full_params, strict=True):
            r.copy_(p)
    reference.zero_grad(set_to_none=True)
    everything = range(step * args.global_batch, (step + 1) * args.global_batch)
    loss_of(reference, args, everything).backward()
    return max(
        float((g - r.grad).abs().max()) for g, r in zip(grads, reference.parameters(), strict=True)
    )


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        dist.init_process_group("gloo", timeout=timedelta(minutes=5))
        self.args = args
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.model, self.reference = build(args, self.world)
        self.params = list(self.model.parameters())
        self.opt = torch.optim.SGD(self.params, lr=0.1, momentum=0.9, foreach=False)
        for p in self.params:  # momentum from the start: the live state always has it
            self.opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
        self.engine = ReplicaEngine(self.state_dict, self.load_state_dict)
        self.path = args.progress.format(rank=self.rank)
        self.frozen_once = False

    # The live state a joiner's rank i fetches from a peer's rank i: this rank's shards.
    def state_dict(self) -> dict[str, Any]:
        return {
            "params": [p.to_local().detach() for p in self.params],
            "momentum": [self.opt.state[p]["momentum_buffer"].to_local() for p in self.params],
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        with torch.no_grad():
            for p, v, m in zip(self.params, sd["params"], sd["momentum"], strict=True):
                p.to_local().copy_(v)
                self.opt.state[p]["momentum_buffer"].to_local().copy_(m)

    def write(self, **row: Any) -> None:
        row = {"replica": self.engine.config.replica_id, "rank": self.rank, "t": time.time(), **row}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def shares(self, plan: Any) -> list[range]:
        """This rank's micro-batches, padded so every rank of the replica runs as many."""
        mine = list(plan.local(self.rank, self.world))
        count = max(1, -(-len(plan.micro_batches) // self.world))
        return mine + [range(0)] * (count - len(mine))

    def freeze_mid_reduction(self) -> bool:
        """Rank 1's shards cross, then rank 0 stops the replica before its own reduce."""
        ok = self.engine.reduce_shard_grads(self.params) if self.rank == 1 else False
        dist.barrier()
        if self.rank == 0:
            self.write(event="freezing", step=self.engine.step)
            os.killpg(os.getpgrp(), signal.SIGSTOP)
        return ok

    def run_step(self) -> None:
        args = self.args
        plan = self.engine.begin_step(args.global_batch, args.micro_batch)
        if plan.healed:
            self.write(event="healed", step=plan.step)
        self.opt.zero_grad(set_to_none=False)
        for ids in self.shares(plan):
            loss_of(self.model, args, ids).backward()
        freeze = (
            args.freeze_at_step >= 0
            and plan.step >= args.freeze_at_step
            and plan.participants > 1
            and not self.frozen_once
        )
        if freeze:
            self.frozen_once = True
            reduced = self.freeze_mid_reduction()
        else:
            reduced = self.engine.reduce_shard_grads(self.params)
        grads = [p.grad.full_tensor() for p in self.params]
        full = [p.full_tensor() for p in self.params]
        err = grad_error(self.reference, full, grads, args, plan.step)
        committed = self.engine.commit()
        if committed:
            self.opt.step()
        self.write(
            step=plan.step,
            committed=committed,
            reduced=reduced,
            participants=plan.participants,
            quorum_id=plan.quorum_id,
            samples=[i for r in plan.local(self.rank, self.world) for i in r],
            grad_err=err,
            discarded=self.engine.discarded,
            digest=digest([p.full_tensor() for p in self.params]),
        )
        if args.step_time:
            time.sleep(args.step_time)


def main() -> None:
    worker = Worker(parse_args())
    worker.write(event="start", step=worker.engine.step, pid=os.getpid())
    while worker.engine.step < worker.args.steps:
        worker.run_step()
    worker.engine.close()
    os._exit(0)


if __name__ == "__main__":
    main()

"""One rank of the two-rank checkpoint test (gloo; MASTER_ADDR, MASTER_PORT, RANK and
WORLD_SIZE in the environment). Writes what it saw to OUT/rank<r>.json.

1. step 1: a tensor replicated on every rank, one item per rank under its own key, and a
   plain object; every rank records the SaveResult it got.
2. step 2: rank 1 also holds an object whose pickling raises; every rank records the error.
3. step 3: the same state as step 1 again, to show the group is still in step.

    python tests/ckpt_dist_worker.py CKPT_DIR OUT
"""

from __future__ import annotations

import json
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from spottrain.agent.checkpoint import dcp_io
from spottrain.agent.checkpoint.directory import CheckpointDir

REPLICATED_ELEMS = 512 * 1024  # 2 MiB of float32
PER_RANK_ELEMS = 64 * 1024  # 256 KiB


def state_for(rank: int, step: int) -> dict[str, Any]:
    """What rank ``rank`` holds at ``step``; "replicated" is the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    mine = torch.Generator().manual_seed(10 * rank + step)
    return {
        "replicated": torch.randn(REPLICATED_ELEMS, generator=g),
        f"rank{rank}": {"w": torch.randn(PER_RANK_ELEMS, generator=mine)},
        "meta": {"step": step},
    }


class Unpicklable:
    def __reduce__(self) -> Any:
        raise RuntimeError("rank 1 holds an object that refuses to be pickled")


def describe(result: dcp_io.SaveResult) -> dict[str, Any]:
    return {
        "step": result.step,
        "path": str(result.path),
        "refused": result.refused,
        "manifest": result.manifest.to_bytes().decode() if result.manifest else None,
    }


def main() -> None:
    ckpt_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo")  # as the SDK saves: on a group of its own
    ckdir = CheckpointDir(ckpt_dir)
    report: dict[str, Any] = {"rank": rank}

    report["save1"] = describe(
        dcp_io.save(state_for(rank, 1), ckdir, step=1, round_=4, kind="periodic", group=group)
    )

    bad = state_for(rank, 2)
    if rank == 1:
        bad["trap"] = {"obj": Unpicklable()}
    try:
        dcp_io.save(bad, ckdir, step=2, round_=4, kind="periodic", group=group)
        report["error2"] = None
    except dcp_io.CheckpointWriteError as exc:
        report["error2"] = str(exc)

    report["save3"] = describe(
        dcp_io.save(state_for(rank, 3), ckdir, step=3, round_=4, kind="periodic", group=group)
    )
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

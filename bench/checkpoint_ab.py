"""A/B of the emergency save's writer against DCP's own, on 2 ranks, nothing else running.

`bench/checkpoint.py` measures more (raw disk, notice to commit, step cost) in one long run;
on a noisy virtual disk its DCP comparison has swung both ways. This script isolates that
one comparison: each rank holds 0.5 GiB of its own tensors, and the three writers take
turns (the order rotates every round) for `--rounds` rounds:

- `dcp`: `torch.distributed.checkpoint.save` with `FileSystemWriter(thread_count=4)`,
  torch's defaults (a CRC32 per record inside `torch.save`), the anchor;
- `dcp_nocrc`: the same with torch's CRC off (no checksum at all: an upper bound);
- `sdk`: `spottrain.agent.checkpoint.dcp_io.save` (CRC32 per file, computed as the bytes go
  out, manifest, rename, `latest`).

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node=2 \\
        bench/checkpoint_ab.py [--rounds 6] [--dir build/bench-ab]

Rank 0 prints the GiB/s of each writer per round, the medians beside the anchor, and ends
with one JSON line.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.utils.serialization.config as ser_config
from benchlib import parser, print_figures

from spottrain.agent.checkpoint import dcp_io
from spottrain.agent.checkpoint.directory import CheckpointDir

GIB = 1 << 30


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--dir", default="build/bench-ab")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    state = {f"r{rank}_{i}": torch.rand(16 << 20) for i in range(8)}  # 0.5 GiB per rank
    total_gib = 0.5 * world
    root = Path(args.dir)
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    dist.barrier()
    ckdir = CheckpointDir(root)
    group = dist.new_group(backend="gloo")
    rates: dict[str, list[float]] = {"dcp": [], "dcp_nocrc": [], "sdk": []}
    n = 0
    for rnd in range(args.rounds + 1):  # round 0 warms the disk up and is not counted
        modes = list(rates)
        modes = modes[rnd % 3 :] + modes[: rnd % 3]
        for mode in modes:
            n += 1
            dist.barrier()
            t0 = time.perf_counter()
            if mode == "sdk":
                dcp_io.save(state, ckdir, step=n, round_=-1, kind="bench", group=group, keep=1)
            else:
                before = ser_config.save.compute_crc32
                ser_config.save.compute_crc32 = mode == "dcp"
                try:
                    writer = dcp.FileSystemWriter(root / f"dcp-{n}", thread_count=4)
                    dcp.save(state, storage_writer=writer)
                finally:
                    ser_config.save.compute_crc32 = before
            dist.barrier()
            rate = total_gib / (time.perf_counter() - t0)
            if rank == 0:
                print(f"round {rnd} {mode:9s} {rate:.2f} GiB/s", flush=True)
                if rnd > 0:
                    rates[mode].append(rate)
                for p in root.iterdir():
                    if p.is_dir():
                        shutil.rmtree(p)
                os.sync()  # the deletes' trims reach the disk now, not during the next save
            dist.barrier()
    if rank == 0:
        med = {k: statistics.median(v) for k, v in rates.items()}
        print(f"dcp (anchor, torch's CRC)   : {med['dcp']:.2f} GiB/s")
        print(f"dcp without any checksum    : {med['dcp_nocrc']:.2f} GiB/s")
        vs_dcp, vs_none = med["sdk"] / med["dcp"], med["sdk"] / med["dcp_nocrc"]
        print(
            f"sdk emergency writer        : {med['sdk']:.2f} GiB/s = "
            f"{vs_dcp:.2f} x dcp, {vs_none:.2f} x no checksum"
        )
        print_figures(
            {
                "sdk_vs_dcp": round(med["sdk"] / med["dcp"], 3),
                "sdk_vs_nocrc": round(med["sdk"] / med["dcp_nocrc"], 3),
                **{f"{k}_gibps": round(v, 3) for k, v in med.items()},
                "rounds": args.rounds,
            }
        )
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

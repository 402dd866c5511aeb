"""Checkpoint benchmark: the emergency save against the disk and against DCP, the time from a
notice to a committed checkpoint, and the SDK's per-step overhead. All in one run, each figure
beside its anchor (these machines are noisy: read the ratios):

  (a) raw: one writer, --size-gib of float32 bytes from memory, os.write in 64 MiB chunks,
      fsync included;
  (b) dcp: torch.distributed.checkpoint.save with FileSystemWriter(thread_count=4) on 2 ranks
      (gloo), each rank holding half of the state under its own keys; fsync included
      (sync_files), torch's defaults otherwise (its per-record CRC on); also reported with
      that CRC off (``dcp_nocrc``), since spottrain turns it off;
  (c) emergency: the SDK's path, dcp_io.save on the same 2 ranks and state, thread_count=4,
      up to the commit (manifest, rename, ``latest``); like every mode's output, the
      checkpoint is deleted after its timing (on these thin-provisioned disks a write to
      blocks never written before is several times slower, so every mode must reuse the
      same freed blocks), which leaves the SDK's prune with nothing to do;
      and notice -> commit: 2 ranks train with TrainSession.step and half of --size-gib of
      state; rank 1 gets SIGTERM at t0; the figure is t0 -> the mtime of ``latest``
      (written right after the commit's rename);
  (d) step overhead: the step of examples/gpt_train.py (its model, data and sizes) on 2 ranks,
      --steps steps with session.step (no periodic saves) against the same loop without it,
      and against the alternative of a blocking all_reduce of the 5 agreement integers per
      step; blocks of 10 steps interleaved to cancel drift; medians of per-step times, and
      the time spent inside session.step as a share of a step (the direct cost, which the
      difference of two noisy step times cannot resolve at 1 %).

Write figures are medians over --reps after one warm-up round (the first write on these
virtual disks is often much slower); modes are interleaved within each round. GB/s means 10^9
bytes per second. Beside each write rate, its CPU-seconds per GB: both ranks' process CPU time
(every thread: DCP's writers, the checksum threads) over the timed span, per 10^9 bytes; on
tmpfs (``--dir /dev/shm/...``), where a write is a memory copy, that CPU is all a save costs.
Targets are printed, not asserted: emergency >= 0.85 x raw and >= DCP with no more CPU per GB
than DCP, overhead <= 1 %.

    .venv/bin/python bench/checkpoint.py [--dir build/bench-ckpt] [--size-gib 1] [--reps 3]
    .venv/bin/python bench/checkpoint.py --writes-only --reps 7 --dir /dev/shm/bench-ckpt
    .venv/bin/python bench/checkpoint.py --quick     # a smoke test: 0.25 GiB, 1 rep, 60 steps

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchlib import parser, print_figures

from spottrain.ports import free_port
from spottrain.protocol.env import ENV_FAILPOINT, ENV_REDIS, ENV_ROUND

REPO = Path(__file__).resolve().parents[1]
GPT_EXAMPLE = REPO / "examples" / "gpt_train.py"
CHUNK = 64 << 20
TENSOR_BYTES = 64 << 20
WORLD = 2
BLOCK = 10  # steps per interleaved block in (d)
START_TIMEOUT = 300


# -- the parent ------------------------------------------------------------------------------
def launch(role: str, args: argparse.Namespace, workdir: Path, tag: str) -> list[subprocess.Popen]:
    """Start the WORLD ranks of ``role`` (this script), logs under workdir/logs/``tag``-*."""
    port = str(free_port())
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(WORLD):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(WORLD),
            "OMP_NUM_THREADS": "1",
        }
        env.pop(ENV_FAILPOINT, None)
        env.pop(ENV_REDIS, None)
        env.pop(ENV_ROUND, None)
        cmd = [sys.executable, __file__, "--role", role, "--dir", str(workdir)]
        cmd += ["--size-gib", str(args.size_gib), "--reps", str(args.reps)]
        cmd += ["--steps", str(args.steps), "--tag", tag]
        log = open(logs / f"{tag}-rank{rank}.log", "w")  # noqa: SIM115 (closed with the child)
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        )
        log.close()
    return procs


def wait_all(procs: list[subprocess.Popen], workdir: Path, tag: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, p in enumerate(procs):
        if p.returncode != 0:
            tail = (workdir / "logs" / f"{tag}-rank{rank}.log").read_text()[-3000:]
            raise SystemExit(f"{tag} rank {rank} exited {p.returncode}:\n{tail}")


def run_writes(args: argparse.Namespace, workdir: Path) -> dict[str, list[float]]:
    procs = launch("write", args, workdir, "write")
    wait_all(procs, workdir, "write", START_TIMEOUT + 120 * (args.reps + 1) * args.size_gib)
    result: dict[str, list[float]] = json.loads((workdir / "write.json").read_text())
    return result


def run_notice(args: argparse.Namespace, workdir: Path, rep: int) -> dict[str, float]:
    """One emergency save through the SDK: SIGTERM to rank 1, seconds to the commit."""
    ckpt = workdir / f"notice-{rep}"
    ckpt.mkdir()
    procs = launch("notice", args, workdir, f"notice-{rep}")
    ready = [workdir / f"notice-ready-rank{r}" for r in range(WORLD)]
    deadline = time.monotonic() + START_TIMEOUT
    while not all(p.exists() for p in ready):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            wait_all(procs, workdir, f"notice-{rep}", 1)
            raise SystemExit("the notice ranks never got going")
        time.sleep(0.05)
    time.sleep(0.5 + 0.1 * rep)  # land the notice at some point within a step
    t0 = time.time()
    procs[1].send_signal(signal.SIGTERM)
    latest = ckpt / "latest"
    while not latest.exists():
        if time.time() - t0 > 300 or procs[0].poll() is not None:
            wait_all(procs, workdir, f"notice-{rep}", 1)
            raise SystemExit("no checkpoint was committed after the notice")
        time.sleep(0.005)
    committed_at = latest.stat().st_mtime_ns / 1e9
    name = latest.read_text().strip()
    manifest = json.loads((ckpt / name / "MANIFEST.json").read_text())
    try:
        rc1 = procs[1].wait(timeout=60)
    finally:
        procs[0].send_signal(signal.SIGTERM)  # it holds after the drain save until stopped
    wait_all(procs, workdir, f"notice-{rep}", 60)
    for r in range(WORLD):
        ready[r].unlink()
    step_s = json.loads((workdir / f"notice-{rep}-steps.json").read_text())["step_s"]
    shutil.rmtree(ckpt, ignore_errors=True)
    return {
        "notice_to_commit_s": committed_at - t0,
        "notice_to_manifest_s": float(manifest["created_at"]) - t0,
        "bytes": sum(int(f["size"]) for f in manifest["files"].values()),
        "step": int(manifest["step"]),
        "rank1_exit": rc1,
        "step_s": step_s,
    }


def run_steps(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    (workdir / "steps").mkdir()
    procs = launch("steps", args, workdir, "steps")
    wait_all(procs, workdir, "steps", START_TIMEOUT + 3 * args.steps)
    result: dict[str, Any] = json.loads((workdir / "steps.json").read_text())
    return result


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> None:
    p = parser(__doc__, reps=3)
    p.add_argument("--dir", default="build/bench-ckpt", help="scratch directory (repo-relative)")
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--quick", action="store_true", help="0.25 GiB, 1 rep, 60 steps")
    p.add_argument(
        "--writes-only", action="store_true", help="(a)-(c) only: no notice, no step overhead"
    )
    p.add_argument("--role", choices=["write", "notice", "steps"], help=argparse.SUPPRESS)
    p.add_argument("--tag", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.size_gib, args.reps, args.steps = 0.25, 1, 60
    workdir = Path(args.dir)
    if not workdir.is_absolute():
        workdir = REPO / workdir
    if args.role:
        rank_main(args, workdir)
        return
    if args.size_gib <= 0 or args.reps < 1 or args.steps < 3 * BLOCK:
        raise SystemExit(f"need --size-gib > 0, --reps >= 1 and --steps >= {3 * BLOCK}")

    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    size = int(args.size_gib * (1 << 30))
    try:
        print(
            f"checkpoint bench in {workdir}: {args.size_gib:g} GiB, {args.reps} rep(s)", flush=True
        )
        w = _bench_writes(args, workdir, size)
        figures: dict[str, Any] = {
            "emergency_vs_raw": round(w["emg"] / w["raw"], 4),
            "emergency_vs_dcp": round(w["emg"] / w["dcp"], 4),
            "emergency_vs_raw_paired": round(w["paired_raw"], 4),
            "emergency_vs_dcp_paired": round(w["paired_dcp"], 4),
            "raw_gbps": round(w["raw"], 4),
            "dcp_gbps": round(w["dcp"], 4),
            "dcp_nocrc_gbps": round(w["dcp_nocrc"], 4),
            "emergency_gbps": round(w["emg"], 4),
            "emergency_cpu_vs_dcp": round(w["cpu_emg"] / w["cpu_dcp"], 4),
            "raw_cpu_s_per_gb": round(w["cpu_raw"], 4),
            "dcp_cpu_s_per_gb": round(w["cpu_dcp"], 4),
            "dcp_nocrc_cpu_s_per_gb": round(w["cpu_dcp_nocrc"], 4),
            "emergency_cpu_s_per_gb": round(w["cpu_emg"], 4),
            "dir": str(workdir),
            "size_gib": args.size_gib,
            "reps": args.reps,
        }
        if not args.writes_only:
            n = _bench_notice(args, workdir, w["emg"])
            s = _bench_steps(args, workdir)
            figures |= {
                "notice_to_commit_s": round(n["n2c"], 4),
                "step_overhead": round(s["overhead"], 5),
                "step_overhead_mean": round(s["overhead_mean"], 5),
                "step_overhead_direct": round(s["overhead_direct"], 5),
                "step_s": round(s["plain"], 6),
                "sdk_step_s": round(s["sdk"], 6),
                "blocking_step_s": round(s["blocking"], 6),
                "blocking_agree_overhead": round(s["blocking_overhead"], 5),
                "sdk_call_s": round(s["sdk_call"], 7),
                "blocking_call_s": round(s["blocking_call"], 7),
                "notice_bytes": n["n_bytes"],
                "steps": args.steps,
            }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print_figures(figures)


def _bench_writes(args: argparse.Namespace, workdir: Path, size: int) -> dict[str, float]:
    """(a)-(c): raw, DCP and emergency write rates, GB/s."""
    w = run_writes(args, workdir)
    raw, dcp, dcp_nocrc, emg = (
        size / med(w[m]) / 1e9 for m in ("raw", "dcp", "dcp_nocrc", "emergency")
    )
    print(f"(a) raw sequential write, 1 writer, 64 MiB writes, fsync : {raw:6.3f} GB/s  (anchor)")
    print(f"(b) DCP save, 2 ranks x 4 threads, fsync, torch defaults : {dcp:6.3f} GB/s  (anchor)")
    print(f"    DCP save as above with torch's per-record CRC off      : {dcp_nocrc:6.3f} GB/s")
    print(
        f"(c) emergency save (dcp_io.save, 2 ranks, to the commit)   : {emg:6.3f} GB/s   "
        f"= {emg / raw:.2f} x raw (target >= 0.85), {emg / dcp:.2f} x DCP (target >= 1.00)",
        flush=True,
    )
    # The same ratios within each round (the modes of a round run back to back), as a
    # check on the ratio of medians when the disk's speed drifts between rounds.
    paired_raw = med([r / e for r, e in zip(w["raw"], w["emergency"], strict=True)])
    paired_dcp = med([d / e for d, e in zip(w["dcp"], w["emergency"], strict=True)])
    print(f"    within each round, median: {paired_raw:.2f} x raw, {paired_dcp:.2f} x DCP")
    for mode in ("raw", "dcp", "dcp_nocrc", "emergency"):
        print(f"    {mode:10s} seconds per round: {' '.join(f'{s:.3f}' for s in w[mode])}")
    # CPU-seconds per GB: both ranks' process CPU over each timed span (every thread).
    cpu = {m: med(w[f"cpu_{m}"]) / (size / 1e9) for m in ("raw", "dcp", "dcp_nocrc", "emergency")}
    print(
        f"    CPU-seconds per GB: raw {cpu['raw']:.3f}, DCP {cpu['dcp']:.3f} (CRC off "
        f"{cpu['dcp_nocrc']:.3f}), emergency {cpu['emergency']:.3f} = "
        f"{cpu['emergency'] / cpu['dcp']:.2f} x DCP's (target <= 1.00)",
        flush=True,
    )
    # CPU-seconds per GB x GB per second: the cores a mode kept busy while it wrote. Short of
    # the machine's, the disk (or memory) limited it, not the save's own CPU.
    rates = {"raw": raw, "dcp": dcp, "dcp_nocrc": dcp_nocrc, "emergency": emg}
    busy = ", ".join(f"{m} {cpu[m] * rates[m]:.2f}" for m in rates)
    print(f"    cores busy while writing (of {os.cpu_count()}): {busy}", flush=True)
    return {
        "raw": raw,
        "dcp": dcp,
        "dcp_nocrc": dcp_nocrc,
        "emg": emg,
        "paired_raw": paired_raw,
        "paired_dcp": paired_dcp,
        "cpu_raw": cpu["raw"],
        "cpu_dcp": cpu["dcp"],
        "cpu_dcp_nocrc": cpu["dcp_nocrc"],
        "cpu_emg": cpu["emergency"],
    }


def _bench_notice(args: argparse.Namespace, workdir: Path, emg: float) -> dict[str, Any]:
    """(c): notice to committed checkpoint, s."""
    notices = [run_notice(args, workdir, rep) for rep in range(args.reps)]
    n2c = med([n["notice_to_commit_s"] for n in notices])
    n_bytes = notices[0]["bytes"]
    print(
        f"(c) notice -> committed checkpoint (SIGTERM to rank 1, {n_bytes / 2**30:.2f} GiB, "
        f"SDK) : {n2c:.3f} s   (a step is {med([n['step_s'] for n in notices]) * 1e3:.1f} ms; "
        f"the write alone at the emergency rate: {n_bytes / (emg * 1e9):.3f} s)"
    )
    for n in notices:
        print(f"    {json.dumps(n)}")
    return {"n2c": n2c, "n_bytes": n_bytes}


def _bench_steps(args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    """(d): what session.step adds to a training step."""
    s = run_steps(args, workdir)
    plain, sdk, blocking = (med(s[k]) for k in ("plain", "sdk", "blocking"))
    overhead = sdk / plain - 1
    overhead_mean = statistics.fmean(s["sdk"]) / statistics.fmean(s["plain"]) - 1
    overhead_direct = med(s["sdk_call"]) / plain
    blocking_overhead = blocking / plain - 1
    print(
        f"(d) step overhead of session.step (gpt_train step, 2 ranks, {args.steps} steps): "
        f"{overhead * 100:+.2f} % (target <= 1 %); mean-based {overhead_mean * 100:+.2f} %; "
        f"median step {plain * 1e3:.2f} ms without the SDK, {sdk * 1e3:.2f} ms with it; "
        f"time inside session.step {overhead_direct * 100:.2f} % of a step"
    )
    print(
        f"    agreement per step: the SDK's async all_reduce costs "
        f"{med(s['sdk_call']) * 1e6:.0f} us in session.step; a blocking all_reduce of 5 int64 "
        f"costs {med(s['blocking_call']) * 1e6:.0f} us, a step {blocking_overhead * 100:+.2f} %"
    )
    return {
        "plain": plain,
        "sdk": sdk,
        "blocking": blocking,
        "overhead": overhead,
        "overhead_mean": overhead_mean,
        "overhead_direct": overhead_direct,
        "blocking_overhead": blocking_overhead,
        "sdk_call": med(s["sdk_call"]),
        "blocking_call": med(s["blocking_call"]),
    }


# -- the ranks -------------------------------------------------------------------------------
def init_rank() -> tuple[int, Any]:
    import warnings
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    return dist.get_rank(), dist


def half_state(size: int, rank: int) -> dict[str, Any]:
    """This rank's half of ``size`` bytes of float32, in tensors of 64 MiB under its own keys."""
    import torch

    mine = size // WORLD
    out = {}
    i = 0
    while mine > 0:
        n = min(TENSOR_BYTES, mine)
        out[f"r{rank}.t{i}"] = torch.rand(n // 4, generator=torch.Generator().manual_seed(i))
        mine -= n
        i += 1
    return out


def raw_write(buf: Any, path: Path) -> float:
    view = memoryview(buf.numpy()).cast("B")
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, len(view), CHUNK):
            chunk = view[off : off + CHUNK]
            while chunk:
                chunk = chunk[os.write(fd, chunk) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def rank_write(args: argparse.Namespace, workdir: Path) -> None:
    rank, dist = init_rank()
    import torch
    import torch.distributed.checkpoint as dcp
    import torch.utils.serialization.config as ser_config

    from spottrain.agent.checkpoint import dcp_io
    from spottrain.agent.checkpoint.directory import CheckpointDir

    size = int(args.size_gib * (1 << 30))
    state = half_state(size, rank)
    raw_buf = torch.rand(size // 4) if rank == 0 else None
    sdk_dir = workdir / "sdk"
    if rank == 0:
        sdk_dir.mkdir()
    dist.barrier()
    ckdir = CheckpointDir(sdk_dir)
    group = dist.new_group(backend="gloo")  # as the SDK: a group of its own
    times: dict[str, list[float]] = {"raw": [], "dcp": [], "dcp_nocrc": [], "emergency": []}
    modes = list(times)
    cpu: dict[str, list[float]] = {m: [] for m in modes}  # this rank's CPU-seconds per round
    n = 0

    def timed(fn: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        dist.barrier()
        t2 = time.perf_counter()
        detail = (
            f" (write {out.write_s:.3f} commit {out.commit_s:.3f})"
            if hasattr(out, "write_s")
            else ""
        )
        print(f"rank {rank}: {t1 - t0:.3f} s, {t2 - t0:.3f} s to the barrier{detail}", flush=True)
        return t2 - t0

    for rep in range(args.reps + 1):  # round 0 is the warm-up
        order = modes[rep % len(modes) :] + modes[: rep % len(modes)]
        for mode in order if rep % 2 else order[::-1]:  # vary who follows whom
            n += 1
            path = ckdir.step_path(n) if mode == "emergency" else workdir / f"{mode}-{n}"
            c0 = time.process_time()
            if mode == "raw":
                dt = 0.0
                if rank == 0:
                    dt = raw_write(raw_buf, path)
                dist.barrier()
            elif mode in ("dcp", "dcp_nocrc"):
                crc_before = ser_config.save.compute_crc32
                ser_config.save.compute_crc32 = mode == "dcp"
                try:
                    writer = dcp.FileSystemWriter(path, thread_count=4)
                    dt = timed(lambda w=writer: dcp.save(state, storage_writer=w))
                finally:
                    ser_config.save.compute_crc32 = crc_before
            else:
                dt = timed(
                    lambda s=n: dcp_io.save(
                        state,
                        ckdir,
                        step=s,
                        round_=-1,
                        kind="emergency",
                        group=group,
                        thread_count=4,
                    )
                )
            c1 = time.process_time()
            print(f"round {rep} {mode}: {dt:.3f} s, {c1 - c0:.3f} CPU-s", flush=True)
            if rep > 0:
                times[mode].append(dt)
                cpu[mode].append(c1 - c0)
            if rank == 0:
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
                # The volume is mounted with discard on these VMs: let the deletes' trims
                # reach the disk now rather than during the next mode's timing.
                os.sync()
                time.sleep(0.5)
            dist.barrier()
    ranks: list[Any] = [None] * WORLD
    dist.all_gather_object(ranks, cpu)
    if rank == 0:
        for mode in modes:
            times[f"cpu_{mode}"] = [sum(r) for r in zip(*(c[mode] for c in ranks), strict=True)]
        (workdir / "write.json").write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def rank_notice(args: argparse.Namespace, workdir: Path) -> None:
    rank, dist = init_rank()
    import torch

    from spottrain.agent.sdk import TrainSession

    size = int(args.size_gib * (1 << 30)) // 2
    state = half_state(size, rank)
    session = TrainSession(workdir / args.tag, every_steps=0, hold_timeout=120)
    step = session.restore(state)
    a = torch.rand(256, 256)
    grad = torch.zeros(4096)
    times: list[float] = []
    while True:
        t0 = time.perf_counter()
        for _ in range(8):  # a few ms of compute, then the gradient all-reduce
            a = torch.tanh(a @ a)
        dist.all_reduce(grad)
        step += 1
        times.append(time.perf_counter() - t0)
        session.step(step, state)
        if step == 10:
            (workdir / f"notice-ready-rank{rank}").write_text("")
        if rank == 0 and step % 10 == 0:
            (workdir / f"{args.tag}-steps.json").write_text(
                json.dumps({"step_s": statistics.median(times[5:] or times)})
            )


def load_gpt_example() -> Any:
    spec = importlib.util.spec_from_file_location("spottrain_gpt_example", GPT_EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rank_steps(args: argparse.Namespace, workdir: Path) -> None:
    rank, dist = init_rank()
    import math

    import torch
    import torch.nn.functional as F

    from spottrain.agent.sdk import GlobalBatch, ModelState, RngState, TrainSession

    gpt = load_gpt_example()
    # examples/gpt_train.py's defaults.
    seed, context, d_model, layers, heads, lr = 1234, 32, 64, 2, 4, 3e-3
    world = dist.get_world_size()
    torch.manual_seed(seed)
    model = gpt.TinyGPT(256, context, d_model, layers, heads)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * min(s, 10_000) / 10_000)),
    )
    corpus = gpt.make_corpus(seed)
    session = TrainSession(workdir / "steps", every_steps=0)
    state = {"model": ModelState(model, opt, sched), "rng": RngState()}
    step = session.restore(state)
    batch = GlobalBatch(16, 2, world, rank)
    agree_group = dist.new_group(backend="gloo")

    def train_step(step: int) -> float:
        opt.zero_grad(set_to_none=False)
        total = torch.zeros(())
        for micro in batch.micro_ranges(step):
            x, y = gpt.sample(corpus, micro, context)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            (loss * batch.weight(micro)).backward()
            total += loss.detach() * batch.weight(micro)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        dist.all_reduce(total)
        total /= world
        opt.step()
        sched.step()
        return float(total.item())

    out: dict[str, list[float]] = {
        "plain": [],
        "sdk": [],
        "blocking": [],
        "sdk_call": [],
        "blocking_call": [],
    }
    variants = ["plain", "sdk", "blocking"]
    for _ in range(BLOCK):  # warm-up
        step += 1
        session.step(step, state, loss=train_step(step))
    per_variant = args.steps
    blocks = max(1, per_variant // BLOCK)
    for b in range(blocks):
        for variant in variants[b % 3 :] + variants[: b % 3]:
            for _ in range(BLOCK):
                t0 = time.perf_counter()
                step += 1
                loss = train_step(step)
                t1 = time.perf_counter()
                if variant == "sdk":
                    session.step(step, state, loss=loss)
                elif variant == "blocking":
                    flags = torch.zeros(5, dtype=torch.int64)
                    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=agree_group)
                t2 = time.perf_counter()
                out[variant].append(t2 - t0)
                if variant != "plain":
                    out[f"{variant}_call"].append(t2 - t1)
    session.close()
    if rank == 0:
        (workdir / "steps.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def rank_main(args: argparse.Namespace, workdir: Path) -> None:
    {"write": rank_write, "notice": rank_notice, "steps": rank_steps}[args.role](args, workdir)


if __name__ == "__main__":
    main()

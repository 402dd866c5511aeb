"""A small GPT-like model trained on the CPU with the spottrain trainer SDK.

Run it under torchrun (any world size; gloo). It restores the newest complete checkpoint,
trains with a global batch that stays the same whatever the world size (gradient
accumulation follows the world size, and the data position is the step), saves every
``--every-steps`` steps, and takes part in emergency saves when a node gets a preemption
notice. Every worker appends one JSON line per step to ``--progress``.

The data is made here, deterministically: a synthetic text corpus with structure to learn
(no download), written as a file and tokenized (bytes) through
``spottrain.agent.sdk.token_cache`` into ``--token-cache`` (default
``$SPOTTRAIN_TOKEN_CACHE``, else ``token-cache/`` in the run's checkpoint directory, on the
shared volume). The first rank to get there builds it; the other ranks, later restarts and
backfilled nodes map the same file. Sample ``i`` is always the same window of it, so a run
that is preempted and resumed sees exactly the samples an
uninterrupted run sees.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from spottrain.agent.sdk import GlobalBatch, ModelState, RngState, TrainSession
from spottrain.agent.sdk.token_cache import ByteTokenizer, TokenCache, open_tokens

CORPUS_BYTES = 1 << 16
# A window of the corpus: the token-cache memmap, or (bench/) a tensor made in memory.
Corpus = np.ndarray | torch.Tensor


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--ckpt-dir", default=os.environ.get("SPOTTRAIN_CKPT_DIR"))
    p.add_argument(
        "--token-cache",
        default=os.environ.get("SPOTTRAIN_TOKEN_CACHE"),
        help="tokenized-data cache directory (default: token-cache/ in the checkpoint directory)",
    )
    p.add_argument("--progress", help="JSON-lines file every worker appends to")
    p.add_argument(
        "--global-batch",
        type=int,
        default=24,
        help="samples per step (any world size up to global/micro)",
    )
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--every-steps", type=int, default=20)
    p.add_argument("--every-seconds", type=float, default=0.0)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds a step sleeps")
    p.add_argument(
        "--pace-file",
        default="",
        help="a file holding the seconds a step sleeps, read at every step, in place of "
        "--step-time while it exists (the demos slow training down while a node boots)",
    )
    p.add_argument(
        "--slow-node",
        default="",
        help="the node (SPOTTRAIN_NODE_ID) whose workers compute slowly (--slow-compute)",
    )
    p.add_argument(
        "--slow-compute",
        type=float,
        default=0.0,
        help="extra seconds each step of --slow-node's workers sleeps inside its compute",
    )
    p.add_argument("--stop-at", type=int, default=0, help="save and exit after this step")
    p.add_argument("--dump-params", help="rank 0 writes the final parameters here")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args(argv)


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, context: int, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer(
            "mask", torch.triu(torch.full((context, context), float("-inf")), 1), persistent=False
        )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        for block in self.blocks:
            x = block(x, self.mask[:t, :t])
        return self.head(self.ln(x))


def corpus_text(seed: int, size: int = CORPUS_BYTES) -> bytes:
    """Text with structure: words from a small vocabulary, in a seeded order."""
    g = torch.Generator().manual_seed(seed)
    words = [b"spot", b"train", b"node", b"gpu", b"save", b"step", b"redis", b"round"]
    out = bytearray()
    while len(out) < size:
        w = words[int(torch.randint(len(words), (1,), generator=g))]
        out += w + (b". " if torch.rand(1, generator=g).item() < 0.2 else b" ")
    return bytes(out[:size])


def make_corpus(seed: int, size: int = CORPUS_BYTES) -> torch.Tensor:
    """The corpus's byte tokens in memory, without the cache (for one-process tools)."""
    return torch.tensor(list(corpus_text(seed, size)), dtype=torch.long)


def write_corpus(directory: Path, seed: int, size: int = CORPUS_BYTES) -> Path:
    """The corpus as a file, the token cache's source. Every rank may call this at once:
    an existing file with the right bytes is left alone (its key stays), otherwise each
    writes a private copy and renames it into place, so no reader sees a partial file."""
    data = corpus_text(seed, size)
    path = directory / f"synthetic-seed{seed}-{size}.txt"
    try:
        if path.read_bytes() == data:
            return path
    except FileNotFoundError:
        pass
    directory.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


def token_cache_dir(args: argparse.Namespace) -> Path | None:
    """Next to the run's checkpoints by default: on the shared volume every node mounts, and
    kept by restarts. Runs that should share one cache point --token-cache at one place."""
    if args.token_cache:
        return Path(args.token_cache)
    return Path(args.ckpt_dir) / "token-cache" if args.ckpt_dir else None


def open_corpus(cache_dir: Path, seed: int) -> TokenCache:
    source = write_corpus(cache_dir / "corpus", seed)
    return open_tokens([source], ByteTokenizer(), cache_dir)


def load_corpus(args: argparse.Namespace) -> tuple[Corpus, TokenCache | None]:
    """The corpus's tokens, mapped from the token cache; with no cache directory (the
    one-process reference in ``simulate``) they go through a throwaway one, so they are
    the same tokens by the same code."""
    cache_dir = token_cache_dir(args)
    if cache_dir is None:
        with tempfile.TemporaryDirectory(prefix="gpt-train-tokens-") as tmp:
            return np.array(open_corpus(Path(tmp), args.seed).tokens), None
    cache = open_corpus(cache_dir, args.seed)
    return cache.tokens, cache


def sample(corpus: Corpus, indices: range, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    span = len(corpus) - context - 1
    starts = [(i * 7919) % span for i in indices]
    # Only the windows are read (and widened from uint16): the corpus stays on the volume.
    rows = np.stack([np.asarray(corpus[s : s + context + 1], dtype=np.int64) for s in starts])
    windows = torch.from_numpy(rows)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def append_line(path: str, record: dict[str, object]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())  # one short write: no interleaving
    finally:
        os.close(fd)


def build(args: argparse.Namespace) -> tuple[TinyGPT, torch.optim.Optimizer, Any, Corpus]:
    """The model, optimizer, LR schedule and corpus; identical on every rank and every run."""
    torch.manual_seed(args.seed)
    model = TinyGPT(256, args.context, args.d_model, args.layers, args.heads)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    corpus, cache = load_corpus(args)
    if cache is not None and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        state = "reused" if cache.hit else "built"
        print(f"token cache {state}: {len(cache)} tokens, {cache.path}", file=sys.stderr)
    return model, opt, sched, corpus


def lr_at(step: int) -> float:
    """Warm-up, then cosine decay (a multiplier of the base learning rate)."""
    return min(1.0, (step + 1) / 10) * 0.5 * (1 + math.cos(math.pi * min(step, 10_000) / 10_000))


def local_gradients(
    model: TinyGPT, corpus: Corpus, batch: GlobalBatch, step: int, context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of one step: (its summed gradients as one flat tensor, its loss)."""
    for p in model.parameters():
        p.grad = None
    total = torch.zeros(())
    for micro in batch.micro_ranges(step):
        x, y = sample(corpus, micro, context)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        # Weighted by the samples it holds: with uneven splits, ranks and micro-batches
        # differ in size, and every sample must count the same.
        (loss * batch.weight(micro)).backward()
        total += loss.detach() * batch.weight(micro)
    flat = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return flat, total


def apply_gradients(
    model: TinyGPT, opt: torch.optim.Optimizer, sched: Any, summed: torch.Tensor, world: int
) -> None:
    """Average the gradients summed over ranks and take the optimizer step."""
    summed /= world
    offset = 0
    for p in model.parameters():
        n = p.numel()
        p.grad = summed[offset : offset + n].view_as(p).clone()
        offset += n
    opt.step()
    sched.step()


def simulate(args: argparse.Namespace, segments: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    """One process, no checkpoints, no restarts: train at world size w up to step s for each
    (w, s), summing the ranks' gradients as the all-reduce does. The determinism tests
    compare preempted runs with this."""
    # One intra-op thread, as in every torchrun worker (OMP_NUM_THREADS=1): the thread count
    # changes the order of float sums inside a matmul, and so the last bits.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _simulate(args, segments)
    finally:
        torch.set_num_threads(threads)


def _simulate(args: argparse.Namespace, segments: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    model, opt, sched, corpus = build(args)
    step = 0
    for world, stop in segments:
        batches = [GlobalBatch(args.global_batch, args.micro_batch, world, r) for r in range(world)]
        while step < stop:
            flats = [local_gradients(model, corpus, b, step, args.context)[0] for b in batches]
            summed = flats[0]
            for f in flats[1:]:
                summed = summed + f
            apply_gradients(model, opt, sched, summed, world)
            step += 1
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def step_pause(pace_file: str, default: float) -> float:
    if pace_file:
        try:
            return float(Path(pace_file).read_text())
        except (OSError, ValueError):
            pass  # absent, or caught mid-write: the next step reads it again
    return default


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    node = os.environ.get("SPOTTRAIN_NODE_ID", os.uname().nodename)
    rdzv_round = int(os.environ.get("SPOTTRAIN_RDZV_ROUND", "-1"))
    model, opt, sched, corpus = build(args)

    session = TrainSession(
        args.ckpt_dir,
        every_steps=args.every_steps,
        every_seconds=args.every_seconds,
        keep=args.keep,
    )
    state = {"model": ModelState(model, opt, sched), "rng": RngState()}
    step = session.restore(state)
    batch = GlobalBatch(args.global_batch, args.micro_batch, world, rank)

    slow = args.slow_compute if args.slow_node and args.slow_node == node else 0.0
    while step < args.steps:
        # This rank's own compute, timed before the all-reduce (which evens out wall time).
        with session.compute():
            flat, total = local_gradients(model, corpus, batch, step, args.context)
            if slow:
                time.sleep(slow)  # a slow GPU, for the straggler tests
        if world > 1:
            dist.all_reduce(flat)
            dist.all_reduce(total)
            total /= world
        apply_gradients(model, opt, sched, flat, world)
        step += 1
        if args.progress:
            append_line(
                args.progress,
                {
                    "t": time.time(),
                    "node": node,
                    "rank": rank,
                    "world": world,
                    "round": rdzv_round,
                    "step": step,
                    "loss": round(total.item(), 6),
                    "accum": batch.accum_steps,
                },
            )
        session.step(step, state, tokens=args.global_batch * args.context, loss=total.item())
        pause = step_pause(args.pace_file, args.step_time)
        if pause:
            time.sleep(pause)
        if args.stop_at and step == args.stop_at:
            break

    session.finish(step, state)
    if args.dump_params and rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.dump_params)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

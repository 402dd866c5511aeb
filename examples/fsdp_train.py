"""A transformer language model trained with FSDP2 and the spottrain trainer SDK: the
example to start from for a job on 8-GPU VMs.

Run it under torchrun, one worker per GPU::

    torchrun --nproc-per-node 8 examples/fsdp_train.py --preset 1b --steps 20000

(``examples/fsdp_job.yaml`` runs it on spot VMs: the agent starts torchrun on every node).
What it sets up:

- **Placement.** With CUDA, each worker takes GPU ``$LOCAL_RANK`` (``torch.cuda.set_device``)
  and the process group is NCCL, bound to that GPU. Without CUDA (the tests, a laptop) it is
  gloo on the CPU. The SDK's own collectives (save agreement, checkpoint planning) run on a
  gloo group of their own in either case.
- **FSDP2** (``torch.distributed.fsdp.fully_shard``): every block is sharded, then the model
  (embeddings, final norm, head), over all ranks. Parameters, gradients and optimizer state
  are sharded ``world_size`` ways; a block's parameters are gathered just before its
  forward and its backward and freed after.
- **Mixed precision** (``--precision bf16``, the default on CUDA): FSDP2 keeps fp32 master
  parameters and optimizer state, gathers the parameters as bf16 (so every matmul runs in
  bf16, as autocast would make it), and reduces gradients in fp32
  (``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``). The loss is
  computed from fp32 logits. On the CPU the default is fp32 (bf16 works there too, slowly).
- **Gradient accumulation** from the SDK's :class:`GlobalBatch`: the global batch stays the
  same whatever the world size, and gradients are reduce-scattered once per optimizer step
  (on the last micro-batch), not once per micro-batch.
- **Checkpoints** through :class:`ModelState`: FSDP2's sharded (DTensor) state dicts of the
  model and the optimizer go to ``torch.distributed.checkpoint``, each rank writing its own
  shards, and a restore at another world size reshards them. Periodic saves are copied in
  device memory and written while training goes on; emergency saves on preemption notices
  are synchronous.
- Fused AdamW on CUDA, gradient clipping, warm-up then cosine decay, optional activation
  checkpointing (``--activation-checkpointing``: recompute each block in the backward).

Data: a synthetic token stream with structure to learn (each sample is an arithmetic
progression of token ids with random tokens mixed in), made from the global sample index and
the seed, so sample ``i`` is the same on every rank, every world size and every restart, and
nothing is downloaded. For real data, map a token cache (``spottrain.agent.sdk.token_cache``, as
``examples/gpt_train.py`` does) and keep indexing it by the global sample index.

The ``--preset 1b`` configuration (d_model 2048, 18 layers, 16 heads, vocabulary 32768,
context 2048: about 1.04B parameters) should fit 8 GPUs of 40 GB with ``--micro-batch 4``
(80 GB: ``--micro-batch 8``, or more with activation checkpointing). Those are estimates
(about 20 GB per GPU at micro batch 4, mostly activations and logits): this script has not
run on a GPU yet.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from spottrain.agent.sdk import GlobalBatch, ModelState, RngState, TrainSession


@dataclass(frozen=True)
class ModelConfig:
    vocab: int
    context: int
    d_model: int
    layers: int
    heads: int

    def __post_init__(self) -> None:
        if self.d_model % self.heads:
            raise ValueError(
                f"d_model {self.d_model} is not divisible by heads {self.heads}: pick a head "
                "count that divides it"
            )


# Sizes the tests and a laptop run (tiny) and a realistic one for 8-GPU VMs (about 1.04B
# parameters; see the module docstring for the batch sizes that fit).
PRESETS = {
    "tiny": ModelConfig(vocab=256, context=32, d_model=64, layers=2, heads=4),
    "1b": ModelConfig(vocab=32768, context=2048, d_model=2048, layers=18, heads=16),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--d-model", type=int, help="override the preset's model width")
    p.add_argument("--layers", type=int, help="override the preset's depth")
    p.add_argument("--heads", type=int, help="override the preset's attention heads")
    p.add_argument("--context", type=int, help="override the preset's sequence length")
    p.add_argument("--vocab", type=int, help="override the preset's vocabulary size")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--ckpt-dir", default=os.environ.get("SPOTTRAIN_CKPT_DIR"))
    p.add_argument(
        "--global-batch",
        type=int,
        default=12,
        help="sequences per optimizer step, the same at every world size: a multiple of\n"
        "micro batch x every world size the job can have",
    )
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per forward, per GPU")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=10, help="warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0, help="0: no clipping")
    p.add_argument(
        "--precision",
        choices=["auto", "bf16", "fp32"],
        default="auto",
        help="auto: bf16 on CUDA, fp32 on the CPU",
    )
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--every-steps", type=int, default=100)
    p.add_argument("--every-seconds", type=float, default=0.0)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-every", type=int, default=10, help="rank 0 prints a line every N steps")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=0.0,
        help="one GPU's peak dense bf16 TFLOP/s (H100 SXM: 989, A100: 312), to log the\n"
        "model FLOPs utilization",
    )
    p.add_argument("--progress", help="JSON-lines file rank 0 appends one record per step to")
    p.add_argument("--dump-params", help="rank 0 writes the full final parameters here")
    p.add_argument(
        "--die-at",
        type=int,
        default=0,
        help="(tests) every worker kills itself with SIGKILL after this step, as when a VM\n"
        "vanishes: no emergency or final save",
    )
    return p.parse_args(argv)


def model_config(args: argparse.Namespace) -> ModelConfig:
    base = PRESETS[args.preset]
    return ModelConfig(
        vocab=args.vocab or base.vocab,
        context=args.context or base.context,
        d_model=args.d_model or base.d_model,
        layers=args.layers or base.layers,
        heads=args.heads or base.heads,
    )


# -- the model --------------------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, recompute: bool) -> None:
        super().__init__()
        self.recompute = recompute
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(
            nn.Linear(d, 4 * d, bias=False), nn.GELU(), nn.Linear(4 * d, d, bias=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Recomputation runs inside the block, so FSDP2's hooks on the block have gathered
        # its parameters again when the backward recomputes it.
        if self.recompute and torch.is_grad_enabled():
            out: torch.Tensor = checkpoint(self._forward, x, use_reentrant=False)
            return out
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, recompute: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(
            Block(cfg.d_model, cfg.heads, recompute) for _ in range(cfg.layers)
        )
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self._init_weights(cfg.layers)

    def _init_weights(self, layers: int) -> None:
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # norms keep their ones and zeros
            # Projections into the residual stream are scaled down with depth (GPT-2).
            residual = name.endswith(("out.weight", "mlp.2.weight"))
            nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers) if residual else 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def shard(model: Transformer, device: torch.device, precision: str) -> Transformer:
    """FSDP2 over every rank: each block is its own unit (gathered for its forward and
    backward only), then the root takes the embeddings, the final norm and the head."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if precision == "bf16" else None,
        reduce_dtype=torch.float32,
    )
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


# -- data -------------------------------------------------------------------------------------
def sample(
    indices: range, cfg: ModelConfig, seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of global samples ``indices``: each an arithmetic progression of
    token ids (its start and stride drawn from the sample's own generator) with about one
    token in ten replaced at random. The model learns to infer the stride from the context.
    """
    rows = []
    for i in indices:
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        start, stride = torch.randint(cfg.vocab, (2,), generator=g).tolist()
        t = torch.arange(cfg.context + 1)
        seq = (start + (stride | 1) * t) % cfg.vocab
        noise = torch.rand(cfg.context + 1, generator=g) < 0.1
        seq = torch.where(noise, torch.randint(cfg.vocab, (cfg.context + 1,), generator=g), seq)
        rows.append(seq)
    batch = torch.stack(rows)
    if device.type == "cuda":
        batch = batch.pin_memory()  # so that the copy below overlaps the GPU's work
    batch = batch.to(device, non_blocking=True)
    return batch[:, :-1], batch[:, 1:]


# -- training ---------------------------------------------------------------------------------
def setup_device() -> torch.device:
    """GPU ``$LOCAL_RANK`` and NCCL when CUDA is there, else the CPU and gloo."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timedelta(minutes=10), device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    return device


def resolve_precision(option: str, device: torch.device) -> str:
    if option == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return option


def build(
    args: argparse.Namespace, device: torch.device
) -> tuple[Transformer, torch.optim.Optimizer, Any, ModelConfig]:
    """The sharded model, its optimizer and LR schedule: the same initial weights on every
    rank (the seed), sharded after they are made."""
    cfg = model_config(args)
    torch.manual_seed(args.seed)
    model = Transformer(cfg, recompute=args.activation_checkpointing)
    shard(model, device, resolve_precision(args.precision, device))
    # Fused AdamW: one kernel for all of a rank's shards on CUDA; the CPU takes the default.
    fused = True if device.type == "cuda" else None
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        fused=fused,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, args.warmup, args.steps))
    return model, opt, sched, cfg


def lr_at(step: int, warmup: int, total: int) -> float:
    """Linear warm-up, then cosine decay to a tenth (a multiplier of the base rate)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def train_step(
    model: Transformer,
    opt: torch.optim.Optimizer,
    sched: Any,
    batch: GlobalBatch,
    step: int,
    args: argparse.Namespace,
    cfg: ModelConfig,
    device: torch.device,
    session: TrainSession,
) -> torch.Tensor:
    """One optimizer step over this rank's micro-batches; returns the global mean loss."""
    assert isinstance(model, FSDPModule)
    micro = batch.micro_ranges(step)
    local = torch.zeros((), device=device)
    # Timed as this rank's compute for the controller's straggler check. With FSDP2 the
    # span also holds the waits on the parameter all-gathers (every forward and backward)
    # and on the last micro-batch's reduce-scatter, which take as long as the slowest rank
    # needs. Unlike a loop that reduces after its backward (examples/gpt_train.py), the
    # figure here evens out across ranks much as the wall time does: a slow GPU is seen
    # only where its lag outgrows what FSDP overlaps, so the straggler check is weak here.
    with session.compute():
        for m, indices in enumerate(micro):
            # Gradients stay unsharded and accumulate locally until the last micro-batch, whose
            # backward reduce-scatters them (averaged over ranks): one reduction per step.
            model.set_requires_gradient_sync(m == len(micro) - 1)
            x, y = sample(indices, cfg, args.seed, device)
            logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            # Weighted by its samples: with uneven splits ranks run different counts of
            # micro-batches, and every sample must count the same in the averaged gradient.
            (loss * batch.weight(indices)).backward()
            local += loss.detach() * batch.weight(indices)
    if args.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    dist.all_reduce(local)  # sum: gloo has no average
    return local / batch.world


def dump_params(model: Transformer, path: str) -> None:
    """The full (unsharded) parameters on rank 0's CPU; every rank must call it."""
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.get_rank() == 0:
        torch.save(full, path)


def append_line(path: str, record: dict[str, object]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def main() -> None:
    args = parse_args()
    device = setup_device()
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt, sched, cfg = build(args, device)
    n_params = sum(p.numel() for p in model.parameters())  # DTensors count their full size
    session = TrainSession(
        args.ckpt_dir,
        every_steps=args.every_steps,
        every_seconds=args.every_seconds,
        keep=args.keep,
    )
    state = {"model": ModelState(model, opt, sched), "rng": RngState()}
    step = session.restore(state)
    batch = GlobalBatch(args.global_batch, args.micro_batch, world, rank)
    tokens_per_step = args.global_batch * cfg.context
    if rank == 0:
        restored = session.last_restored
        origin = f" (saved by world size {restored.world_size})" if restored else ""
        print(
            f"fsdp_train: {n_params / 1e6:.1f}M parameters, world {world} on {device.type}, "
            f"{resolve_precision(args.precision, device)}, global batch {args.global_batch} = "
            f"{args.micro_batch} x {world} ranks x {batch.accum_steps} accumulation, "
            f"starting at step {step}{origin}",
            file=sys.stderr,
            flush=True,
        )

    t_log = time.perf_counter()
    while step < args.steps:
        loss = train_step(model, opt, sched, batch, step, args, cfg, device, session).item()
        step += 1
        session.step(step, state, loss=loss, tokens=tokens_per_step)
        if rank == 0 and args.progress:
            append_line(
                args.progress,
                {"step": step, "world": world, "accum": batch.accum_steps, "loss": loss},
            )
        if rank == 0 and args.log_every and step % args.log_every == 0:
            elapsed, t_log = time.perf_counter() - t_log, time.perf_counter()
            tokens_per_s = args.log_every * tokens_per_step / elapsed
            report_speed(step, loss, tokens_per_s, world, device)
            if args.peak_tflops:
                mfu = (
                    tokens_per_s
                    * flops_per_token(cfg, n_params)
                    / (world * args.peak_tflops * 1e12)
                )
                print(f"step {step} MFU {mfu:.1%}", file=sys.stderr, flush=True)
        if args.die_at and step == args.die_at:
            os.kill(os.getpid(), signal.SIGKILL)

    session.finish(step, state)
    if args.dump_params:
        dump_params(model, args.dump_params)
    dist.barrier()
    dist.destroy_process_group()


def flops_per_token(cfg: ModelConfig, n_params: int) -> float:
    """Training FLOPs per token: 6 per parameter (forward and backward) plus the attention
    scores, which grow with the context (the PaLM paper's estimate)."""
    return 6 * n_params + 12 * cfg.layers * cfg.d_model * cfg.context


def report_speed(
    step: int, loss: float, tokens_per_s: float, world: int, device: torch.device
) -> None:
    line = f"step {step} loss {loss:.4f} {tokens_per_s / world:,.0f} tokens/s per rank"
    if device.type == "cuda":
        line += f", peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB"
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()

"""Framework integrations benchmark: for each framework integration (the Hugging Face
``Trainer`` callback, the Lightning callback, ``SpotAccelerate``, the plain script's
``SpotCheckpoints``), its cost per step against the same loop without it, and the time from
a drain request to the committed checkpoint, beside the SDK's ``TrainSession`` on the same
model as the anchor. All in one run, each figure beside its anchor (these machines are
noisy: read the ratios):

  (a) cost per step: one process (the core's single-process mode; no torchrun), then
      (unless --no-ranks) 2 ranks under ``torchrun --standalone`` (gloo, one node; rank
      0's figures; the frameworks' own DDP, DistributedDataParallel for the plain script
      and the SDK). A tiny GPT-2 built from a config (2 layers, width 64, vocabulary 256,
      32 tokens, batch 8; no hub download) trains on random tokens on the CPU with one
      thread per rank, in the framework's own loop. Within ONE training, blocks of
      --block steps with the integration's per-step hook on and off are interleaved
      (A B B A, to cancel drift); a step's time is the interval between two calls of a
      probe placed just before the hook, so it holds the hook of the step before. The
      cost, in microseconds: the median over adjacent pairs of blocks (one with, one
      without) of the difference of their median steps (robust to the machine's drift);
      also the median over the blocks with the hook of their median step minus the same
      without it. And the time spent inside the hook (the direct cost, which the
      difference of two noisy step times cannot resolve at 1 %) as a share of a step.
      The target, printed and not asserted: at most 1 % of a step of 100 ms or longer (a
      cost of at most 1,000 us). The integration's session reports progress to a real
      Redis, as in a run. The SDK's ``TrainSession.step`` is measured the same way.
  (b) notice -> committed: once the step blocks are done, the same training goes on with
      the hook on; a thread writes a drain request into Redis the way the agent does
      (``agent/notices/handler.py``: the id numbered and the request published in one Lua
      call) at some point within a step, and polls (every 2 ms) the run's ``ckpt_last``
      until a commit answering the request shows there (what the agent's drain waits
      on). The integrations save in their framework's own format (``Trainer``'s
      ``checkpoint-N``, Lightning's ``save_checkpoint``, ``accelerator.save_state``, a
      ``torch.save`` of model and optimizer for the plain script); the anchor is
      ``TrainSession.step`` (its DCP save) on the same model and loop. Default request
      poll (0.2 s) and agreement interval (0.2 s). After each drain commit the training
      holds for 0.2 s (its ``hold_timeout``; no torchrun restarts it here) and trains on.

In one process the frameworks run one after the other (each imported once); at 2 ranks each
has a torchrun of its own. Each has its own checkpoint directory and run id. A framework
whose module or package does not import (or, at 2 ranks, whose torchrun fails) is left out
and named with the reason. The figures are medians over the measured blocks and over --reps
notices.

    .venv/bin/python bench/integrations.py [--block 10] [--blocks 40] [--reps 3] [--no-ranks]
    .venv/bin/python bench/integrations.py --quick  # a smoke test: 4 blocks of 5, 1 notice, 1 rank

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchlib import median, parser, print_figures, ratio

from spottrain.agent.notices.handler import REQUEST_LUA
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.env import ENV_CKPT_DIR, ENV_REDIS, ENV_ROUND, ENV_RUN_ID
from spottrain.protocol.keys import RunKeys

FRAMEWORKS = ("hf", "lightning", "accelerate", "plain")
RANKS = 2  # the multi-rank runs' world size (one torchrun, one node)
TARGET_STEP_S = 0.100  # the target: at most 1 % of a step of 100 ms or longer
HOLD_S = 0.2
POLL_S = 0.002
NOTICE_TIMEOUT = 120.0
SEQ, BATCH, VOCAB, SAMPLES = 32, 8, 256, 256


# -- what every framework's run shares ------------------------------------------------------
class Probe:
    """One training's measurement: which steps run the integration's hook (warm-up on,
    then A B B A blocks of off/on, then on for the notices), the step intervals of each
    block, the time inside the hook, and the notice thread's signals."""

    def __init__(self, block: int, blocks: int, stop_file: Path | None = None) -> None:
        self.block = block
        self.stop_file = stop_file  # with several ranks: the step all of them stop at
        self.stop_at: int | None = None
        self.warm = 2 * block
        self.measured = block * blocks
        self.times: dict[int, list[float]] = {}  # block -> its step intervals
        self.hook_s: list[float] = []
        self.last: float | None = None
        self.ready = threading.Event()  # the notice phase began
        self.stop = threading.Event()  # the notices are done: end the training

    def in_blocks(self, step: int) -> bool:
        return self.warm < step <= self.warm + self.measured

    def block_of(self, step: int) -> int:
        return (step - self.warm - 1) // self.block

    @staticmethod
    def block_on(b: int) -> bool:
        return (b + 1) // 2 % 2 == 1  # blocks: without, with, with, without, ...

    def hook_on(self, step: int) -> bool:
        return not self.in_blocks(step) or self.block_on(self.block_of(step))

    def tick(self, step: int) -> None:
        """Called at the same point of every step, just before the hook: the interval since
        the last call holds step ``step - 1``'s hook (if on) and step ``step``'s work."""
        now = time.perf_counter()
        if self.last is not None and self.in_blocks(step - 1):
            self.times.setdefault(self.block_of(step - 1), []).append(now - self.last)
        self.last = now
        if step > self.warm + self.measured:
            self.ready.set()

    def hook(self, step: int, fn: Callable[[], Any]) -> Any:
        """Run the integration's per-step hook when it is on, timing it within the blocks."""
        if not self.hook_on(step):
            return None
        t0 = time.perf_counter()
        out = fn()
        if self.in_blocks(step):
            self.hook_s.append(time.perf_counter() - t0)
        return out

    def stopping(self, step: int) -> bool:
        """Whether the training ends after ``step``: once the notices are done; with several
        ranks at one step for all, which rank 0 writes into ``stop_file`` ahead of time
        (the ranks of a data-parallel step are at most a step apart)."""
        if step <= self.warm + self.measured:
            return False
        if self.stop_file is None:
            return self.stop.is_set()
        if self.stop_at is None and self.stop.is_set():
            self.stop_at = step + 20
            tmp = self.stop_file.with_suffix(".tmp")
            tmp.write_text(str(self.stop_at))
            tmp.rename(self.stop_file)
        elif self.stop_at is None and self.stop_file.exists():
            self.stop_at = int(self.stop_file.read_text())
        return self.stop_at is not None and step >= self.stop_at

    def costs(self) -> dict[str, float]:
        """Seconds: the median step without the hook and with it (the median of the blocks'
        medians), and the median over adjacent pairs of blocks (one of each) of the
        difference of their medians."""
        per_block = {b: statistics.median(ts) for b, ts in self.times.items()}
        on = [m for b, m in per_block.items() if self.block_on(b)]
        off = [m for b, m in per_block.items() if not self.block_on(b)]
        pairs = []
        for b in range(0, len(per_block) - 1, 2):  # blocks 2k and 2k + 1: one of each
            first, second = per_block[b], per_block[b + 1]
            pairs.append(second - first if self.block_on(b + 1) else first - second)
        return {
            "without": statistics.median(off),
            "with": statistics.median(on),
            "paired": statistics.median(pairs),
        }


def request_drain(client: Any, keys: RunKeys, node: str) -> int:
    """A drain request as the agent writes it on a notice; its id."""
    now = time.time()
    body = {"drain": True, "deadline": now + 120, "at": now, "source": "bench", "kind": "terminate"}
    return int(
        client.eval(
            REQUEST_LUA, 2, keys.ckpt_request_seq, keys.ckpt_requests, node, json.dumps(body)
        )
    )


def notices(probe: Probe, client: Any, keys: RunKeys, reps: int, out: list[dict[str, Any]]) -> None:
    """The agent's side: ``reps`` drain requests, each timed to its commit in Redis."""
    try:
        if not probe.ready.wait(NOTICE_TIMEOUT * 3):
            return
        for rep in range(reps):
            time.sleep(0.3 + 0.037 * rep)  # past the last hold; lands at some point in a step
            t0 = time.perf_counter()
            request = request_drain(client, keys, "bench-node")
            while True:
                got = client.hgetall(keys.ckpt_last)
                if int(got.get(b"request_id", 0)) >= request:
                    out.append(
                        {
                            "notice_to_commit_s": time.perf_counter() - t0,
                            "step": int(got[b"step"]),
                            "request_id": request,
                        }
                    )
                    break
                if time.perf_counter() - t0 > NOTICE_TIMEOUT:
                    return
                time.sleep(POLL_S)
    finally:
        probe.stop.set()


class Run:
    """One framework's training in this process: its checkpoint directory, run id (keys of
    its own in the bench's Redis), probe, and the notice thread."""

    def __init__(
        self, name: str, args: argparse.Namespace, redis_url: str, ckpt: Path, run_id: str
    ) -> None:
        import redis

        self.name = name
        self.ckpt = ckpt
        self.run_id = run_id
        self.keys = RunKeys(run_id)
        self.redis_url = redis_url
        self.client = redis.Redis.from_url(redis_url)
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        stop_file = ckpt.parent / f"{ckpt.name}.stop" if self.world > 1 else None
        self.probe = Probe(args.block, args.blocks, stop_file)
        self.notices: list[dict[str, Any]] = []
        self.thread = threading.Thread(
            target=notices,
            args=(self.probe, self.client, self.keys, args.reps, self.notices),
            daemon=True,
        )
        if self.rank == 0:  # the agent's side: one per node
            self.thread.start()

    @property
    def options(self) -> dict[str, Any]:
        """The integration session's options: this run's Redis keys, a short hold."""
        return {"redis_url": self.redis_url, "run_id": self.run_id, "hold_timeout": HOLD_S}

    def close(self) -> None:
        self.probe.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=NOTICE_TIMEOUT + 10)
        self.client.close()

    def figures(self, reps: int) -> dict[str, Any]:
        """This rank's figures (see the module docstring), in seconds and microseconds."""
        costs = self.probe.costs()
        return {
            "step_s": costs["without"],
            "with_s": costs["with"],
            "cost_us": costs["paired"] * 1e6,
            "cost_medians_us": (costs["with"] - costs["without"]) * 1e6,
            "hook_us": statistics.median(self.probe.hook_s) * 1e6,
            "n2c_s": median([n["notice_to_commit_s"] for n in self.notices] or [None]),
            "notices": self.notices,
            "missed": reps - len(self.notices),
            "blocks": len(self.probe.times),
        }


# -- the model --------------------------------------------------------------------------------
def tiny_gpt2() -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4)
    return GPT2LMHeadModel(config)  # type: ignore[no-untyped-call]


class Tokens:
    """Random token sequences, each its own labels (a map-style dataset)."""

    def __init__(self) -> None:
        import torch

        self.data = torch.randint(
            0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(1)
        )

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def loader() -> Any:
    from torch.utils.data import DataLoader

    return DataLoader(Tokens(), batch_size=BATCH, shuffle=True)  # type: ignore[arg-type]


def ddp(model: Any) -> Any:
    """``model`` in DistributedDataParallel when torchrun started several ranks (the
    process group made here, as a plain script does)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return model
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return DistributedDataParallel(model)


def manual_loop(
    run: Run, model: Any, opt: Any, batches: Callable[[], Any], hook: Callable[[int, float], Any]
) -> int:
    """The loop of a script that owns it: one optimizer step per batch, ``hook(step,
    loss)`` after each, until the notices are done. The last step."""
    step = 0
    while not run.probe.stopping(step):
        for batch in batches():
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            value = float(loss)
            step += 1
            run.probe.tick(step)
            run.probe.hook(step, functools.partial(hook, step, value))
            if run.probe.stopping(step):
                break
    return step


# -- the frameworks ---------------------------------------------------------------------------
def run_hf(run: Run) -> None:
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    from spottrain.agent.sdk.integrations.hf import SpotTrainCallback

    # Its save's progress bar would land in stdout, among the figures.
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]

    probe = run.probe

    class Tick(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
            probe.tick(state.global_step)
            if probe.stopping(state.global_step):
                control.should_training_stop = True
            return control

    class Spot(SpotTrainCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
            step = state.global_step
            probe.hook(step, lambda: super(Spot, self).on_step_end(args, state, control, **kw))
            return control

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            step = state.global_step
            probe.hook(step, lambda: super(Spot, self).on_log(args, state, control, logs, **kw))

    args = TrainingArguments(
        output_dir=str(run.ckpt / "hf"),
        per_device_train_batch_size=BATCH,
        max_steps=1_000_000,
        save_strategy="no",
        logging_steps=10,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        learning_rate=1e-3,
        ddp_backend="gloo" if run.world > 1 else None,
    )
    trainer = Trainer(
        model=tiny_gpt2(),
        args=args,
        train_dataset=Tokens(),
        callbacks=[Tick(), Spot(run.ckpt, **run.options)],
    )
    trainer.remove_callback(PrinterCallback)  # it prints every log to stdout
    trainer.train()


def run_lightning(run: Run) -> None:
    import lightning.pytorch as pl
    import torch

    from spottrain.agent.sdk.integrations.lightning import SpotTrainCallback

    probe = run.probe

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_gpt2()

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.model(**batch).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Tick(pl.Callback):
        def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
            probe.tick(trainer.global_step)
            if probe.stopping(trainer.global_step):
                trainer.should_stop = True

    class Spot(SpotTrainCallback):  # type: ignore[misc]
        def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
            step = trainer.global_step
            probe.hook(step, lambda: super(Spot, self).on_train_batch_end(trainer, *a))

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=run.world,
        strategy="ddp" if run.world > 1 else "auto",
        max_steps=1_000_000,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(run.ckpt / "pl"),
        callbacks=[Tick(), Spot(run.ckpt, **run.options)],
    )
    trainer.fit(Module(), train_dataloaders=loader())


def run_accelerate(run: Run) -> None:
    import torch
    from accelerate import Accelerator

    from spottrain.agent.sdk.integrations.accelerate import SpotAccelerate

    accelerator = Accelerator(cpu=True, project_dir=str(run.ckpt / "accelerate"))
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, dl = accelerator.prepare(model, opt, loader())
    spot = SpotAccelerate(accelerator, ckpt_dir=run.ckpt, **run.options)
    spot.resume()
    step = manual_loop(run, model, opt, lambda: spot.batches(dl), lambda s, v: spot.step(s, loss=v))
    spot.finish(step)


def run_plain(run: Run) -> None:
    import torch

    from spottrain.agent.sdk.integrations.plain import SpotCheckpoints

    model = ddp(tiny_gpt2())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dl = loader()

    def save(directory: Path) -> None:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, directory / "state.pt")

    def load(directory: Path) -> int | None:
        return None

    with SpotCheckpoints(save=save, load=load, ckpt_dir=run.ckpt, **run.options) as spot:
        spot.resume()
        manual_loop(run, model, opt, lambda: dl, lambda s, v: spot.step(s, loss=v))


def run_sdk(run: Run) -> None:
    import torch

    from spottrain.agent.sdk import ModelState, TrainSession

    model = ddp(tiny_gpt2())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dl = loader()
    session = TrainSession(run.ckpt, every_steps=0, tracking=False, **run.options)
    state = {"model": ModelState(model, opt)}
    session.restore(state)
    manual_loop(run, model, opt, lambda: dl, lambda s, v: session.step(s, state, loss=v))
    session.close()


RUNNERS: dict[str, Callable[[Run], None]] = {
    "hf": run_hf,
    "lightning": run_lightning,
    "accelerate": run_accelerate,
    "plain": run_plain,
    "sdk": run_sdk,
}
MODULES = {
    "hf": "spottrain.agent.sdk.integrations.hf",
    "lightning": "spottrain.agent.sdk.integrations.lightning",
    "accelerate": "spottrain.agent.sdk.integrations.accelerate",
    "plain": "spottrain.agent.sdk.integrations.plain",
    "sdk": "spottrain.agent.sdk",
}


# -- the parent -------------------------------------------------------------------------------
def importable(name: str) -> str | None:
    """None when the integration's module imports; else why not."""
    import importlib

    try:
        importlib.import_module(MODULES[name])
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def measure(name: str, args: argparse.Namespace, server: RedisServer, root: Path) -> dict[str, Any]:
    """One framework's training in this process: its step blocks, then its notices."""
    ckpt = root / name
    ckpt.mkdir(parents=True)
    run = Run(name, args, server.url, ckpt, f"bench-{name}-{uuid.uuid4().hex[:8]}")
    try:
        RUNNERS[name](run)
    finally:
        run.close()
    return run.figures(args.reps)


def measure_ranks(
    name: str, args: argparse.Namespace, server: RedisServer, root: Path
) -> dict[str, Any] | str:
    """One framework's training on RANKS ranks under torchrun (this script's rank role);
    rank 0's figures, or why there are none."""
    ckpt = root / f"{name}-{RANKS}r"
    ckpt.mkdir(parents=True)
    log = root / f"{name}-{RANKS}r.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(RANKS), __file__, "--role", "rank", "--framework", name]
    cmd += ["--block", str(args.block), "--blocks", str(args.blocks), "--reps", str(args.reps)]
    cmd += ["--redis", server.url, "--ckpt", str(ckpt)]
    cmd += ["--run-id", f"bench-{name}-{RANKS}r-{uuid.uuid4().hex[:8]}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        try:
            done = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=600)
        except subprocess.TimeoutExpired:
            return "timed out after 600 s"
    result = ckpt.parent / f"{ckpt.name}.json"
    if done.returncode != 0 or not result.exists():
        tail = log.read_text()[-1500:]
        return f"torchrun exited {done.returncode}: ...{tail}"
    figures: dict[str, Any] = json.loads(result.read_text())
    return figures


def rank_main(args: argparse.Namespace) -> None:
    """One rank of a framework's training under torchrun; rank 0 writes its figures."""
    ckpt = Path(args.ckpt)
    run = Run(args.framework, args, args.redis, ckpt, args.run_id)
    try:
        RUNNERS[args.framework](run)
    finally:
        run.close()
    if run.rank == 0:
        (ckpt.parent / f"{ckpt.name}.json").write_text(json.dumps(run.figures(args.reps)))


def report(key: str, m: dict[str, Any], anchor: dict[str, Any] | None) -> None:
    """Print one framework's figures (``key``: its name, ``_2r`` added for 2 ranks)."""
    name, _, ranks = key.partition("_")
    step_ms = m["step_s"] * 1e3
    label = {
        "hf": "HF Trainer callback",
        "lightning": "Lightning callback",
        "accelerate": "SpotAccelerate",
        "plain": "plain SpotCheckpoints",
        "sdk": "SDK TrainSession",
    }[name] + (f", {RANKS} ranks" if ranks else "")
    print(
        f"(a) {label:31s}: cost {m['cost_us']:+8.0f} us/step = "
        f"{m['cost_us'] / (TARGET_STEP_S * 1e6) * 100:+.3f} % of a 100 ms step (target <= 1 %), "
        f"{m['cost_us'] / (m['step_s'] * 1e6) * 100:+.2f} % of this {step_ms:.2f} ms step "
        f"(difference of the medians: {m['cost_medians_us']:+.0f} us); "
        f"inside the hook {m['hook_us']:.0f} us = "
        f"{m['hook_us'] / (m['step_s'] * 1e6) * 100:.2f} % of this step, "
        f"{m['hook_us'] / (TARGET_STEP_S * 1e6) * 100:.3f} % of 100 ms"
    )
    n2c = m["n2c_s"]
    vs = (
        ""
        if anchor is None or name == "sdk"
        else f" = {ratio(n2c, anchor['n2c_s'], 2)} x the SDK's"
    )
    shown = "none committed" if n2c is None else f"{n2c:.3f} s{vs}"
    print(
        f"(b) {label:31s}: drain request -> committed in Redis {shown}"
        + (" (anchor)" if name == "sdk" else "")
    )
    for n in m["notices"]:
        print(f"    {json.dumps(n)}")


def figures_of(
    results: dict[str, dict[str, Any]], args: argparse.Namespace, left_out: dict[str, str]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, m in results.items():
        sdk = results.get("sdk" + name.partition("_")[1] + name.partition("_")[2])
        out[f"{name}_cost_us"] = round(m["cost_us"], 1)
        out[f"{name}_cost_medians_us"] = round(m["cost_medians_us"], 1)
        out[f"{name}_cost_share_100ms"] = round(m["cost_us"] / (TARGET_STEP_S * 1e6), 5)
        out[f"{name}_hook_us"] = round(m["hook_us"], 1)
        out[f"{name}_hook_share_step"] = round(m["hook_us"] / (m["step_s"] * 1e6), 5)
        out[f"{name}_hook_share_100ms"] = round(m["hook_us"] / (TARGET_STEP_S * 1e6), 5)
        out[f"{name}_step_s"] = round(m["step_s"], 6)
        out[f"{name}_notice_to_commit_s"] = None if m["n2c_s"] is None else round(m["n2c_s"], 4)
        if not name.startswith("sdk") and sdk is not None:
            out[f"{name}_notice_vs_sdk"] = ratio(m["n2c_s"], sdk["n2c_s"])
    out["measured"] = [n for n in results if n != "sdk" and "_" not in n]
    out[f"measured_{RANKS}r"] = [
        n.partition("_")[0] for n in results if n.endswith(f"_{RANKS}r") and n != f"sdk_{RANKS}r"
    ]
    out["left_out"] = left_out
    out.update(block=args.block, blocks=args.blocks, reps=args.reps)
    return out


def clean_env(rank: bool) -> None:
    """The bench's sessions take their Redis, run id and volume from arguments: none from a
    job this shell may be part of (and, but in a rank, no torchrun rank either)."""
    for var in (
        ENV_REDIS,
        ENV_ROUND,
        ENV_RUN_ID,
        ENV_CKPT_DIR,
        "SPOTTRAIN_INTEGRATION",
    ):
        os.environ.pop(var, None)
    if not rank:
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(var, None)
        os.environ.pop("TORCHELASTIC_RUN_ID", None)
    os.environ["WANDB_MODE"] = "disabled"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def parse_args() -> argparse.Namespace:
    p = parser(__doc__, reps=3)
    p.add_argument("--block", type=int, default=10, help="steps per interleaved block (default 10)")
    p.add_argument(
        "--blocks", type=int, default=40, help="measured blocks, half with the hook (default 40)"
    )
    p.add_argument(
        "--frameworks", default=",".join(FRAMEWORKS), help="which to measure (default all)"
    )
    p.add_argument("--no-ranks", action="store_true", help=f"skip the {RANKS}-rank runs (torchrun)")
    p.add_argument("--quick", action="store_true", help="4 blocks of 5 steps, 1 notice, 1 rank")
    for hidden in ("--role", "--framework", "--redis", "--ckpt", "--run-id"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.block, args.blocks, args.reps, args.no_ranks = 5, 4, 1, True
    if args.block < 1 or args.blocks < 2 or args.blocks % 2 or args.reps < 1:
        raise SystemExit("need --block >= 1, an even --blocks >= 2 and --reps >= 1")
    return args


def quiet() -> None:
    warnings.filterwarnings("ignore")
    import logging

    import torch

    logging.disable(logging.WARNING)
    torch.set_num_threads(1)


def main() -> None:
    args = parse_args()
    if args.role == "rank":
        clean_env(rank=True)
        quiet()
        rank_main(args)
        return
    wanted = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    unknown = sorted(set(wanted) - set(FRAMEWORKS))
    if unknown:
        raise SystemExit(f"unknown framework(s) {unknown}: choose from {', '.join(FRAMEWORKS)}")
    clean_env(rank=False)
    quiet()
    left_out = {name: why for name in wanted if (why := importable(name)) is not None}
    # The anchor first: its notices are the base of the others' ratios.
    names = ["sdk", *(n for n in wanted if n not in left_out)]
    root = Path(tempfile.mkdtemp(prefix="spottrain-bench-integrations-"))
    results: dict[str, dict[str, Any]] = {}
    try:
        with RedisServer() as server:
            print(
                f"integrations bench: {', '.join(names)}; blocks of {args.block} steps, "
                f"{args.blocks} measured, {args.reps} notice(s); tiny GPT-2, 1 CPU thread "
                f"per rank; redis-server on {server.endpoint}",
                flush=True,
            )
            for name, why in left_out.items():
                print(f"    {name}: left out ({why})")
            for name in names:
                results[name] = measure(name, args, server, root)
                report(name, results[name], results.get("sdk"))
            for name in [] if args.no_ranks else names:
                got = measure_ranks(name, args, server, root)
                if isinstance(got, str):
                    left_out[f"{name}_{RANKS}r"] = got
                    print(f"    {name}, {RANKS} ranks: left out ({got})")
                    continue
                results[f"{name}_{RANKS}r"] = got
                report(f"{name}_{RANKS}r", got, results.get(f"sdk_{RANKS}r"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_figures(figures_of(results, args, left_out))


if __name__ == "__main__":
    main()

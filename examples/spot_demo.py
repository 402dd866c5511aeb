"""The local spot demo: a GPT-like model trains on three agent-run nodes while a spot fleet
does its worst, and no preemption with notice loses a step.

It starts an embedded Redis server, then three local nodes, each `spottrain-agent run` as its
own process group (the way systemd runs it on a VM), launching torchrun with the Redis
rendezvous and examples/gpt_train.py (trainer SDK, periodic checkpoints in the background).
Then:

1. a node gets a spot interruption notice (injected through Redis, as the local cloud does):
   every rank saves an emergency checkpoint at one step, the node leaves, the others go on;
2. a replacement node starts (a backfill) and the job grows back to three nodes;
3. a node is shut down the systemd way (SIGTERM to every process of it): its workers join
   the emergency save instead of dying;
4. a node vanishes without notice (SIGKILL): the survivors resume from the last periodic
   checkpoint, the only case that redoes work;
5. training runs to the last step, and a summary says what each event cost.

    scripts/demo              # or: .venv/bin/python examples/spot_demo.py [--steps N]
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

from demo_progress import Progress, say

from spottrain.agent.testing.local_launcher import LocalAgentJob
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.fileio import atomic_write
from spottrain.protocol.keys import RunKeys, make_run_id
from spottrain.protocol.notices import inject_notice

HERE = Path(__file__).resolve().parent


class Demo(Progress):
    def __init__(self, job: LocalAgentJob) -> None:
        super().__init__(job)
        self.events: list[tuple[str, float, int]] = []  # label, seconds to train again, lost

    def recover(self, label: str, world: int, since: float) -> None:
        def back() -> bool:
            return any(r.world == world and r.t >= since for r in self.rank0())

        self.run_until(back, 300, f"training at world size {world}")
        recs = self.rank0()
        first = min((r for r in recs if r.world == world and r.t >= since), key=lambda r: r.t)
        reached = max(r.step for r in recs if r.t < first.t)
        lost = reached - (first.step - 1)
        self.events.append((label, first.t - since, lost))
        say(
            f"  -> training again at world size {world} after {first.t - since:.1f} s, "
            f"from step {first.step} ({lost} steps redone)"
        )


def set_pace(path: Path, seconds: float) -> None:
    """Set the seconds each training step sleeps (the trainer reads the file every step)."""
    atomic_write(path, f"{seconds:g}", durable=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--step-time", type=float, default=0.05)
    ap.add_argument("--every-steps", type=int, default=25, help="periodic checkpoint interval")
    args = ap.parse_args()
    started = time.monotonic()
    with RedisServer() as redis_server, tempfile.TemporaryDirectory() as tmp:
        run_id = make_run_id("spot-demo")
        client = redis_server.client()
        keys = RunKeys(run_id)
        pace = Path(tmp) / "pace"
        say(f"embedded Redis on {redis_server.endpoint}; run id {run_id}")
        job = LocalAgentJob(
            Path(tmp),
            redis_server.endpoint,
            run_id,
            script=str(HERE / "gpt_train.py"),
            nnodes="1:3",
            steps=args.steps,
            step_time=args.step_time,
            script_args=["--every-steps", str(args.every_steps), "--pace-file", str(pace)],
        )
        demo = Demo(job)
        try:
            for n in ("node-a", "node-b", "node-c"):
                job.start_node(n)
            say("started 3 nodes: spottrain-agent run -> torchrun --rdzv-backend=redis")
            demo.run_until(lambda: demo.status()[1] == 3, 300, "world size 3")

            demo.at_step(args.steps // 5)
            victim = next(n for n in ("node-b", "node-c") if n != job.rank0_node())
            say(f"NOTICE: spot interruption for {victim}, 60 s ahead (injected through Redis)")
            t = time.time()
            inject_notice(client, keys, victim, "terminate", 60)
            demo.recover("notice -> emergency checkpoint", 2, t)

            demo.at_step(args.steps * 2 // 5)
            say("BACKFILL: node-d starts and joins (steps slowed while it boots)")
            # The others train on while node-d boots; at full speed a short demo could end
            # before it joins, so each step sleeps longer until it has.
            set_pace(pace, max(args.step_time, 0.5))
            t = time.time()
            job.start_node("node-d")
            demo.recover("backfilled node joins", 3, t)
            set_pace(pace, args.step_time)

            demo.at_step(args.steps * 3 // 5)
            victim = next(n for n in ("node-d", "node-c", "node-b") if job.nodes[n].alive())
            say(f"SHUTDOWN: SIGTERM to every process of {victim} (systemd stopping the VM)")
            t = time.time()
            job.nodes[victim].signal_group(signal.SIGTERM)
            demo.recover("SIGTERM -> emergency checkpoint", 2, t)

            demo.at_step(args.steps * 4 // 5)
            # Any node but rank 0's (whose loss the end-to-end tests cover).
            alive = [n for n, node in job.nodes.items() if node.alive()]
            victim = next((n for n in alive if n != job.rank0_node()), "")
            if victim:
                say(f"FAULT: {victim} vanishes without notice (SIGKILL)")
                t = time.time()
                job.nodes[victim].kill()
                demo.recover("lost without notice", 1, t)

            demo.run_until(
                lambda: all(not node.alive() for node in job.nodes.values()),
                600,
                "the job to finish",
            )
            final_step = demo.status()[0]
            commits = [
                f for _, f in client.xrange(keys.events) if f[b"type"] == b"checkpoint-committed"
            ]
            emergency = sum(f[b"kind"] == b"emergency" for f in commits)
            losses = [r for r in demo.rank0() if r.step in (1, final_step)]
            say("summary")
            print(f"  steps trained            {final_step} of {args.steps}")
            print(f"  loss                     {losses[0].loss:.3f} -> {losses[-1].loss:.3f}")
            print(f"  checkpoints committed    {len(commits)} ({emergency} emergency)")
            for label, secs, lost in demo.events:
                print(f"    {label:32s} {secs:5.1f} s to train again, {lost} steps redone")
            print(f"  wall time                {time.monotonic() - started:.0f} s")
            return 0 if final_step == args.steps else 1
        finally:
            job.close(client)


if __name__ == "__main__":
    sys.exit(main())

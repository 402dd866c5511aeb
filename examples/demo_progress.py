"""What both local demos print while they run: progress lines, and waiting for a step."""

from __future__ import annotations

import time
from collections.abc import Callable

from spottrain.agent.testing.local_launcher import LocalElasticJob, Record


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Progress:
    """Follows rank 0's progress lines of a local job and prints them when the job's shape
    changes, and every few seconds otherwise."""

    def __init__(self, job: LocalElasticJob, every: float = 3.0) -> None:
        self.job = job
        self.every = every
        self.last_line = ""
        self.last_shown = 0.0

    def rank0(self) -> list[Record]:
        return [r for r in self.job.records() if r.rank == 0]

    def status(self) -> tuple[int, int, int]:
        """(step, world size, rendezvous round) of rank 0's newest line."""
        recs = self.rank0()
        if not recs:
            return 0, 0, -1
        r = recs[-1]
        return r.step, r.world, r.round

    def show(self) -> None:
        step, world, rnd = self.status()
        alive = sorted(n for n, node in self.job.nodes.items() if node.alive())
        shape = f"world size {world}  round {rnd}  nodes up: {', '.join(alive)}"
        now = time.monotonic()
        if shape != self.last_line or now - self.last_shown >= self.every:
            say(f"step {step:4d}  {shape}")
            self.last_line, self.last_shown = shape, now

    def run_until(self, pred: Callable[[], bool], timeout: float, what: str) -> None:
        """Wait for ``pred``; end the demo with a plain message when the job ended first (a
        fast machine can finish training before a scenario step) or ``timeout`` passed."""
        deadline = time.monotonic() + timeout
        while not pred():
            self.show()
            if not any(node.alive() for node in self.job.nodes.values()) and not pred():
                step = self.status()[0]
                raise SystemExit(
                    f"demo: training ended at step {step} before {what}, so the scenario "
                    "could not run in full; rerun with more --steps or a larger --step-time"
                )
            if time.monotonic() > deadline:
                raise SystemExit(f"demo: gave up waiting for {what}\n{self.job.diagnose()}")
            time.sleep(0.25)
        self.show()

    def at_step(self, step: int) -> None:
        self.run_until(lambda: self.status()[0] >= step, 600, f"step {step}")

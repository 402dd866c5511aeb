"""The examples' optional sample log (``--sample-log DIR``): which samples each rank trained
on in each optimizer step, and its loss. The end-to-end tests read it to show that a run
through preemptions and a shrink skipped no sample and saw none twice; a user's script does
not need it.

Each rank appends one JSON line per finished step to a file of its own (its host, rank and
process id in the name, so that a restarted or moved rank never writes into another's
file)::

    {"step": k, "rank": r, "world": W, "samples": [i, ...], "loss": x, "t": unix time}
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path


class SampleLog:
    """Collects one rank's samples and losses of the step under way; ``step_done`` writes
    them. ``None`` for the directory makes every call a no-op."""

    def __init__(self, directory: Path | None, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.samples: list[int] = []
        self.losses: list[float] = []
        self.path: Path | None = None
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            name = f"{socket.gethostname()}-{rank}-{os.getpid()}.jsonl"
            self.path = directory / name

    def add(self, samples: list[int], loss: float) -> None:
        """One micro-batch of the step under way: its sample indices and mean loss."""
        self.samples.extend(int(i) for i in samples)
        self.losses.append(float(loss))

    def step_done(self, step: int) -> None:
        """Step ``step`` (counted from 1) finished: log it, start the next one empty."""
        if self.path is not None and self.losses:
            row = {
                "step": step,
                "rank": self.rank,
                "world": self.world,
                "samples": self.samples,
                "loss": sum(self.losses) / len(self.losses),
                "t": time.time(),
            }
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        self.samples, self.losses = [], []

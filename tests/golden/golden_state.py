"""The training state the golden checkpoint holds, built the same way when it was written
(``capture.py``) and when a test restores it (``test_golden.py``)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from spottrain.agent.sdk import GlobalBatch, ModelState, RngState


def make_state(
    seed: int, *, lr: float, step_size: int, gamma: float, batch: GlobalBatch, note: str
) -> tuple[dict[str, Any], torch.nn.Module, torch.optim.Optimizer, Any]:
    """A Linear(4, 3) with Adam and StepLR, the generators, and a plain item holding a
    pickled SDK object: (state, model, optimizer, scheduler)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)  # RngState saves NumPy's generator too
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=step_size, gamma=gamma)
    state: dict[str, Any] = {
        "model": ModelState(model, opt, sched),
        "rng": RngState(),
        "extra": {"batch": batch, "note": note},
    }
    return state, model, opt, sched

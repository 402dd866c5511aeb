"""State wrappers for DCP (model, optimizer and schedule; the random generators) and the
in-memory copy an asynchronous save writes while training goes on."""

from __future__ import annotations

import copy
import pickle
import random
import sys
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor


class ModelState(Stateful):
    """Model, optimizer and LR schedule as one DCP item; sharded (FSDP) and replicated
    (DDP or plain) models both work, through torch's distributed state-dict helpers."""

    # Pickled under this path by the single-module SDK (old pickles name it): keep it.
    __module__ = "spottrain.agent.sdk"

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": get_model_state_dict(self.model)}
        if self.optimizer is not None:
            out["optim"] = get_optimizer_state_dict(self.model, self.optimizer)
        if self.scheduler is not None:
            out["sched"] = self.scheduler.state_dict()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict["model"])
        if self.optimizer is not None:
            set_optimizer_state_dict(self.model, self.optimizer, state_dict["optim"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state_dict["sched"])


class RngState(Stateful):
    """The default random generators (torch CPU and CUDA, Python, NumPy if present).

    Saved once for the job (rank 0's copy wins the dedup of a replicated item). Randomness
    that must not depend on the world size belongs to the samples: seed it from the global
    sample index (see ``examples/gpt_train.py``).
    """

    __module__ = "spottrain.agent.sdk"

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "python": pickle.dumps(random.getstate()),
        }
        if torch.cuda.is_available():
            out["cuda"] = torch.cuda.get_rng_state()
        np = sys.modules.get("numpy")
        if np is not None:
            out["numpy"] = pickle.dumps(np.random.get_state())
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["torch"])
        random.setstate(pickle.loads(state_dict["python"]))
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["cuda"])
        np = sys.modules.get("numpy")
        if "numpy" in state_dict and np is not None:
            np.random.set_state(pickle.loads(state_dict["numpy"]))


def stage(obj: Any) -> Any:
    """A copy of the state to write while training changes the original: Stateful objects
    are turned into their state dicts and every tensor is copied (to the CPU)."""
    if isinstance(obj, Stateful):
        return stage(obj.state_dict())
    if isinstance(obj, torch.Tensor):
        if isinstance(obj, DTensor):
            return obj.detach().clone()  # stays sharded on its device
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: stage(v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(stage(v) for v in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(stage(v) for v in obj)
    return copy.deepcopy(obj)

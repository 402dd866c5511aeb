"""Deterministic checkpoint state for the checkpoint tests: every bit depends on the step."""

from __future__ import annotations

from typing import Any

import torch


def state_for(step: int, scale: int = 1) -> dict[str, Any]:
    """Tensors of several dtypes and a plain object, about ``scale * 40`` KiB."""
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "w": torch.randn(32 * scale, 128, generator=g),
            "b": torch.randn(128, generator=g).to(torch.bfloat16),
            "ids": torch.randint(-(2**62), 2**62, (257,), generator=g, dtype=torch.int64),
            "layers": [torch.randn(8 * scale, 128, generator=g) for _ in range(4)],
        },
        "meta": {"step": step, "name": f"run-{step}"},
    }


def zeros_like(state: Any) -> Any:
    """The same structure with zeroed tensors and plain values set to None (load fills it)."""
    if isinstance(state, dict):
        return {k: zeros_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [zeros_like(v) for v in state]
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return None


def assert_bitwise_equal(got: Any, want: Any, where: str = "state") -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for k in want:
            assert_bitwise_equal(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_bitwise_equal(g, w, f"{where}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert (got.dtype, got.shape) == (want.dtype, want.shape), where
        assert (
            got.view(torch.uint8).numpy().tobytes() == want.view(torch.uint8).numpy().tobytes()
        ), f"{where} differs"
    else:
        assert got == want, where

"""The Accelerate helper's pure decisions: the gradient accumulation that keeps a global
batch, where a resumed run's data starts at the same or another world size, and the
warning when the global batch changes."""

from __future__ import annotations

import pytest

from spottrain.agent.sdk.integrations.accelerate import (
    Position,
    PositionState,
    global_batch_change,
    resume_skip,
)
from spottrain.agent.sdk.integrations.core import accumulation_for


def test_accumulation_keeps_the_global_batch_at_each_world_size() -> None:
    assert [accumulation_for(32, 4, w, "gradient_accumulation_steps") for w in (1, 2, 4, 8)] == [
        8,
        4,
        2,
        1,
    ]


def test_a_global_batch_the_world_cannot_divide_is_refused_with_the_figures() -> None:
    with pytest.raises(
        ValueError, match=r"global batch 32 is not a multiple of .* = 12.*e\.g\. 24"
    ):
        accumulation_for(32, 4, 3, "gradient_accumulation_steps")
    with pytest.raises(ValueError, match="must all be positive"):
        accumulation_for(32, 0, 2, "gradient_accumulation_steps")


def test_at_the_saved_world_size_the_resume_skips_the_batches_each_rank_took() -> None:
    saved = Position(step=5, epoch=1, batch=10, world=2, per_device=2, accumulation=2)
    assert resume_skip(saved, 2, 2) == (10, None)


def test_across_a_world_change_the_resume_skips_the_same_samples() -> None:
    # 10 batches x 2 samples x 4 ranks = 80 samples = 20 batches of 2 at 2 ranks.
    saved = Position(step=5, epoch=0, batch=10, world=4, per_device=2, accumulation=1)
    assert resume_skip(saved, 2, 2) == (20, None)


def test_across_a_world_change_that_does_not_divide_it_says_how_many_repeat() -> None:
    saved = Position(step=5, epoch=0, batch=5, world=2, per_device=2, accumulation=1)
    skip, why = resume_skip(saved, 3, 2)  # 20 samples, 6 per round
    assert skip == 3
    assert why is not None and "2 samples are seen twice" in why


def test_without_the_per_device_batch_a_world_change_is_flagged() -> None:
    saved = Position(step=5, epoch=0, batch=5, world=2, per_device=0)
    skip, why = resume_skip(saved, 4, 2)
    assert skip == 5 and why is not None and "spot.batches" in why


def test_a_changed_global_batch_is_reported_with_both_figures_and_the_fix() -> None:
    saved = Position(step=5, world=4, per_device=2, accumulation=4)
    now = Position(step=5, world=2, per_device=2, accumulation=4)
    why = global_batch_change(saved, now)
    assert why is not None
    assert "from 32 (world size 4" in why and "to 16 (world size 2" in why
    assert "global_batch=32, per_device=2" in why
    kept = Position(step=5, world=2, per_device=2, accumulation=8)
    assert global_batch_change(saved, kept) is None
    assert global_batch_change(Position(), now) is None  # unknown: nothing to compare


def test_the_position_survives_its_state_dict() -> None:
    state = PositionState()
    state.position = Position(step=7, epoch=1, batch=3, world=2, per_device=4, accumulation=2)
    again = PositionState()
    again.load_state_dict(state.state_dict())
    assert again.position == state.position

"""The Lightning integration's pure parts and its checks at start, without torchrun."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DistributedSampler, TensorDataset

from spottrain.agent.sdk.integrations.core import CheckpointPathError, SaveOrder, accumulation_for
from spottrain.agent.sdk.integrations.lightning import (
    CallbackAttachedTwiceError,
    ResumableDataLoader,
    SpotTrainCallback,
    batch_change_warning,
    check_resumed_from,
    epoch_order,
    loss_of,
    order_at,
    rank_share,
)


def test_accumulation_keeps_the_global_batch_as_the_world_shrinks() -> None:
    assert [
        accumulation_for(32, 4, world, "accumulate_grad_batches") for world in (8, 4, 2, 1)
    ] == [1, 2, 4, 8]


def test_a_global_batch_the_world_cannot_divide_is_refused_with_a_fit() -> None:
    with pytest.raises(ValueError, match=r"not a multiple of per-device batch 4 x world size 3"):
        accumulation_for(32, 4, 3, "accumulate_grad_batches")
    with pytest.raises(ValueError, match="must all be positive"):
        accumulation_for(32, 0, 2, "accumulate_grad_batches")


def test_a_changed_global_batch_is_reported_with_the_figures_and_the_fix() -> None:
    text = batch_change_warning(32, 8, 16, 4)
    assert text is not None
    assert "from 32 (world size 8) to 16 (world size 4)" in text
    assert "SpotTrainCallback(global_batch=32)" in text
    assert batch_change_warning(32, 8, 32, 4) is None
    assert batch_change_warning(0, 8, 16, 4) is None  # a checkpoint that did not record it


def test_periodic_saves_come_every_n_steps_and_agreed_ones_first() -> None:
    early = SaveOrder(10, "requested", False, 2)
    assert order_at(10, early, every_steps=5) == early
    assert order_at(10, None, every_steps=5) == SaveOrder(10, "periodic")
    assert order_at(11, None, every_steps=5) is None
    assert order_at(10, None, every_steps=0) is None


def test_the_loss_comes_from_the_step_output_then_the_logged_metrics() -> None:
    assert loss_of({"loss": torch.tensor(0.5)}, {}) == 0.5
    assert loss_of(torch.tensor(0.25), {}) == 0.25
    assert loss_of(None, {"train_loss": torch.tensor(2.0)}) == 2.0
    assert loss_of(None, {}) is None


def test_at_the_epochs_start_the_ranks_get_what_distributed_sampler_deals() -> None:
    data = TensorDataset(torch.arange(10))
    for drop_last in (False, True):
        for rank in range(3):
            want: DistributedSampler[int] = DistributedSampler(
                data, num_replicas=3, rank=rank, shuffle=True, seed=7, drop_last=drop_last
            )
            want.set_epoch(2)
            order = epoch_order(10, 2, 7, True)
            assert rank_share(order, 0, rank, 3, drop_last) == list(want)


def test_the_rest_of_an_epoch_is_dealt_to_a_new_world_without_skip_or_repeat() -> None:
    order = epoch_order(48, 0, 0, True)
    consumed = 3 * 2 * 4  # 3 batches of 2 on each of 4 ranks
    shares = [rank_share(order, consumed, rank, 3, False) for rank in range(3)]
    assert sorted(order[:consumed] + [i for share in shares for i in share]) == list(range(48))


def test_the_loaders_position_resumes_at_the_next_unseen_batch() -> None:
    data = TensorDataset(torch.arange(20))
    first = ResumableDataLoader(data, batch_size=3, shuffle=True, seed=1)
    first.resumable.set_epoch(1)
    it = iter(first)
    seen = [next(it)[0].tolist() for _ in range(2)]
    state = first.state_dict()
    assert (state["epoch"], state["consumed"]) == (1, 6)
    rest_uninterrupted = [b[0].tolist() for b in it]

    again = ResumableDataLoader(data, batch_size=3, shuffle=True, seed=1)
    again.load_state_dict(state)
    again.resumable.set_epoch(1)  # Lightning sets the epoch after loading: it keeps the position
    assert [b[0].tolist() for b in again] == rest_uninterrupted
    assert len(again) == len(first)  # Lightning counts the epoch's batches itself
    assert sorted(i for b in seen + rest_uninterrupted for i in b) == list(range(20))


def test_a_new_epoch_starts_at_its_first_sample() -> None:
    data = TensorDataset(torch.arange(8))
    loader = ResumableDataLoader(data, batch_size=2, shuffle=False)
    loader.load_state_dict({**loader.state_dict(), "consumed": 4})
    loader.resumable.set_epoch(1)
    assert [b[0].tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_a_callback_attached_twice_is_refused_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPOTTRAIN_CKPT_DIR", str(tmp_path))
    spot = SpotTrainCallback()
    for callbacks in ([spot, spot], [spot, SpotTrainCallback()]):
        trainer = pl.Trainer(callbacks=callbacks, logger=False, enable_progress_bar=False)
        with pytest.raises(CallbackAttachedTwiceError, match=r"pass it once in Trainer"):
            spot.setup(trainer, pl.LightningModule(), "fit")


def test_a_resume_from_outside_the_volume_is_refused_naming_the_fix(tmp_path: Path) -> None:
    with pytest.raises(CheckpointPathError, match=r"ckpt_path=last_checkpoint\(\)"):
        check_resumed_from(tmp_path / "elsewhere" / "last.ckpt", tmp_path / "vol")
    check_resumed_from(tmp_path / "vol" / "step-000000005" / "lightning.ckpt", tmp_path / "vol")
    check_resumed_from(None, tmp_path / "vol")


def test_model_checkpoints_outside_the_volume_are_warned_of_naming_the_fix(
    tmp_path: Path,
) -> None:
    trainer = pl.Trainer(
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "elsewhere")],
        logger=False,
        enable_progress_bar=False,
    )
    with pytest.warns(UserWarning, match=r"ModelCheckpoint\(dirpath=\.\.\.\) to a directory"):
        SpotTrainCallback.warn_outside(trainer, tmp_path / "vol")

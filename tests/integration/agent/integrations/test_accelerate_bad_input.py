"""SpotAccelerate with a real Accelerator in one process: bad input gets a one-line error
naming the fix, and spottrain's save goes where the commit expects it whatever the
accelerator's own checkpoint naming."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

from spottrain.agent.sdk.integrations.accelerate import (
    AttachedTwiceError,
    SpotAccelerate,
    explicit_save_dir,
)
from spottrain.agent.sdk.integrations.core import CheckpointPathError


@pytest.fixture
def volume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    vol = tmp_path / "vol"
    vol.mkdir()
    for name in ("SPOTTRAIN_REDIS", "SPOTTRAIN_INTEGRATION", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SPOTTRAIN_CKPT_DIR", str(vol))
    yield vol


def test_a_second_helper_on_one_accelerator_is_refused(volume: Path) -> None:
    accelerator = Accelerator(cpu=True)
    spot = SpotAccelerate(accelerator, install_signal_handlers=False)
    try:
        with pytest.raises(AttachedTwiceError, match="make one SpotAccelerate per training"):
            SpotAccelerate(accelerator, install_signal_handlers=False)
    finally:
        spot.finish(0)
    SpotAccelerate(accelerator, install_signal_handlers=False).finish(0)  # after finish: free


def test_a_project_dir_outside_the_checkpoint_volume_is_refused_naming_the_fix(
    volume: Path, tmp_path: Path
) -> None:
    accelerator = Accelerator(cpu=True, project_dir=str(tmp_path / "elsewhere"))
    with pytest.raises(
        CheckpointPathError, match=r"set Accelerator\(project_dir=\.\.\.\) to a directory under"
    ):
        SpotAccelerate(accelerator, install_signal_handlers=False)


def test_a_ckpt_dir_outside_the_agents_volume_is_refused_naming_the_fix(
    volume: Path, tmp_path: Path
) -> None:
    with pytest.raises(
        CheckpointPathError, match=r"set SpotAccelerate\(ckpt_dir=\.\.\.\) to a directory under"
    ):
        SpotAccelerate(Accelerator(cpu=True), ckpt_dir=tmp_path, install_signal_handlers=False)


def test_an_accelerator_that_sees_fewer_processes_than_torchrun_is_refused(
    volume: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    accelerator = Accelerator(cpu=True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"sees 1 process\(es\) but torchrun started 2.*cpu=True"):
        SpotAccelerate(accelerator, install_signal_handlers=False)


def test_a_global_batch_without_the_per_device_batch_is_refused(volume: Path) -> None:
    with pytest.raises(ValueError, match="needs per_device="):
        SpotAccelerate(Accelerator(cpu=True), global_batch=8, install_signal_handlers=False)


def test_the_global_batch_sets_the_accelerators_gradient_accumulation(volume: Path) -> None:
    accelerator = Accelerator(cpu=True)
    spot = SpotAccelerate(accelerator, global_batch=8, per_device=2, install_signal_handlers=False)
    assert accelerator.gradient_accumulation_steps == 4
    spot.finish(0)


def test_our_save_goes_to_the_staging_path_even_with_automatic_naming(volume: Path) -> None:
    config = ProjectConfiguration(
        project_dir=str(volume / "proj"), automatic_checkpoint_naming=True
    )
    accelerator = Accelerator(cpu=True, project_config=config)
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    assert model is not None
    target = volume / "staged"
    with explicit_save_dir(accelerator):
        accelerator.save_state(str(target))
    assert (target / "model.safetensors").exists()
    assert not (volume / "proj" / "checkpoints").exists()
    # The user's own numbering, and naming, are as they were.
    assert config.automatic_checkpoint_naming and config.iteration == 0

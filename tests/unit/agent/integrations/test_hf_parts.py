"""The Trainer integration's pure parts: when a checkpoint's copy would be lost to a move."""

from __future__ import annotations

from pathlib import Path

from spottrain.agent.sdk.integrations.hf import copy_warning


def test_an_output_dir_below_the_volume_with_copies_on_is_warned_of_naming_the_fix(
    tmp_path: Path,
) -> None:
    text = copy_warning(tmp_path / "hf", tmp_path, "s3://bucket/ckpt")
    assert text is not None
    assert "would start fresh" in text and "set output_dir to the volume itself" in text
    assert "$SPOTTRAIN_CKPT_DIR" in text


def test_the_volume_itself_or_no_copies_is_no_warning(tmp_path: Path) -> None:
    assert copy_warning(tmp_path, tmp_path, "s3://bucket/ckpt") is None
    assert copy_warning(tmp_path / "x" / "..", tmp_path, "s3://bucket/ckpt") is None
    assert copy_warning(tmp_path / "hf", tmp_path, "") is None

"""A checkpoint copy's name: its path in the volume, kept on the way out and checked on the
way back (a name read from the store is untrusted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from spottrain.agent.checkpoint.copy_names import (
    CopyName,
    copy_name_problem,
    parse_copy_name,
    place_problem,
    volume_name,
)


def test_a_copy_name_gives_its_directory_its_frameworks_prefix_and_its_step() -> None:
    assert parse_copy_name("step-000000120") == CopyName("step-000000120", "", "step-", 120)
    assert parse_copy_name("hf/checkpoint-40") == CopyName(
        "hf/checkpoint-40", "hf", "checkpoint-", 40
    )
    assert parse_copy_name("runs/a/ckpt_7") == CopyName("runs/a/ckpt_7", "runs/a", "ckpt_", 7)
    assert parse_copy_name("hf/notes") is None
    assert parse_copy_name("hf/40") is None


@pytest.mark.parametrize("name", ["step-000000120", "checkpoint-5", "hf/checkpoint-40", "a/b/c-1"])
def test_a_name_inside_the_volume_is_fine(name: str) -> None:
    assert copy_name_problem(name) is None


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("", "empty"),
        ("../checkpoint-9", "'..' part"),
        ("hf/../../checkpoint-9", "'..' part"),
        ("/etc/checkpoint-9", "absolute path"),
        ("hf//checkpoint-9", "empty, '.' or '..' part"),
        ("./checkpoint-9", "'.' or '..' part"),
        (".epochs/checkpoint-9", "starting with '.'"),
        ("hf/.tmp-checkpoint-9", "starting with '.'"),
        ("hf\\..\\checkpoint-9", "backslash"),
        ("hf/checkpoint-9\x00", "NUL"),
        ("hf/notes", "ends in no step"),
    ],
)
def test_a_name_that_could_leave_the_volume_or_hit_spottrains_own_files_is_refused(
    name: str, why: str
) -> None:
    problem = copy_name_problem(name)
    assert problem is not None and why in problem


def test_a_checkpoint_below_the_volume_is_named_by_its_path_there(tmp_path: Path) -> None:
    (tmp_path / "hf" / "checkpoint-5").mkdir(parents=True)
    assert volume_name(tmp_path / "hf" / "checkpoint-5", tmp_path) == "hf/checkpoint-5"
    assert volume_name(tmp_path / "step-000000005", tmp_path) == "step-000000005"
    # Reached through a link inside the volume: named where it really is.
    (tmp_path / "link").symlink_to(tmp_path / "hf")
    assert volume_name(tmp_path / "link" / "checkpoint-5", tmp_path) == "hf/checkpoint-5"


def test_a_checkpoint_outside_the_volume_has_no_name_and_the_error_names_the_fix(
    tmp_path: Path,
) -> None:
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "out").symlink_to(tmp_path / "elsewhere")
    for path in (tmp_path / "elsewhere" / "checkpoint-5", volume / "out" / "checkpoint-5"):
        with pytest.raises(ValueError, match="outside the checkpoint volume") as err:
            volume_name(path, volume)
        assert "$SPOTTRAIN_CKPT_DIR" in str(err.value) and "output_dir" in str(err.value)
    with pytest.raises(ValueError, match="outside the checkpoint volume"):
        volume_name(volume, volume)
    with pytest.raises(ValueError, match=r"\.hidden/checkpoint-5, cannot name a copy"):
        volume_name(volume / ".hidden" / "checkpoint-5", volume)


def test_a_copy_is_brought_in_only_through_real_directories_of_the_volume(
    tmp_path: Path,
) -> None:
    assert place_problem(tmp_path, "hf/checkpoint-5") is None
    (tmp_path / "hf").symlink_to(tmp_path.parent)
    problem = place_problem(tmp_path, "hf/checkpoint-5")
    assert problem is not None and "is a symbolic link" in problem
    (tmp_path / "hf").unlink()
    (tmp_path / "hf").write_text("a file")
    problem = place_problem(tmp_path, "hf/checkpoint-5")
    assert problem is not None and "is not a directory" in problem
    (tmp_path / "checkpoint-7").symlink_to(tmp_path / "hf")
    problem = place_problem(tmp_path, "checkpoint-7")
    assert problem is not None and "is a symbolic link" in problem

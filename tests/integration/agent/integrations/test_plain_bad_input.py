"""SpotCheckpoints in one process: bad input gets a one-line error naming the fix, and a
save that fails commits nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from spottrain.agent.checkpoint.directory import CheckpointDir
from spottrain.agent.sdk.integrations.plain import AttachedTwiceError, SpotCheckpoints


@pytest.fixture
def volume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    vol = tmp_path / "vol"
    vol.mkdir()
    for name in ("SPOTTRAIN_REDIS", "SPOTTRAIN_INTEGRATION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SPOTTRAIN_CKPT_DIR", str(vol))
    yield vol


def write_state(directory: Path) -> None:
    (directory / "state.txt").write_text("7")


def read_state(directory: Path) -> int:
    return int((directory / "state.txt").read_text())


def test_a_second_open_helper_in_one_process_is_refused(volume: Path) -> None:
    first = SpotCheckpoints(write_state, read_state, install_signal_handlers=False)
    second = SpotCheckpoints(write_state, read_state, install_signal_handlers=False)
    with (
        first,
        pytest.raises(AttachedTwiceError, match="open one, once, around the whole training"),
        second,
    ):
        pass
    with SpotCheckpoints(write_state, read_state, install_signal_handlers=False) as spot:
        assert spot.resume() == 0  # the first one closed: free again


def test_a_save_and_resume_round_trip_through_the_users_functions(volume: Path) -> None:
    with SpotCheckpoints(write_state, read_state, install_signal_handlers=False) as spot:
        result = spot.save(7)
        assert result.committed and result.path == CheckpointDir(volume).step_path(7)
    with SpotCheckpoints(write_state, read_state, install_signal_handlers=False) as spot:
        assert spot.resume() == 7


def test_a_save_function_that_raises_commits_nothing(volume: Path) -> None:
    def broken(directory: Path) -> None:
        (directory / "half").write_text("x")
        raise OSError(28, "No space left on device")

    with SpotCheckpoints(broken, read_state, install_signal_handlers=False) as spot:
        result = spot.save(3)
        assert not result.committed
        assert result.error is not None and "No space left" in result.error
    assert CheckpointDir(volume).committed() == []
    assert [p.name for p in volume.iterdir() if "step" in p.name] == []


def test_using_it_outside_its_with_block_says_how(volume: Path) -> None:
    spot = SpotCheckpoints(write_state, read_state, install_signal_handlers=False)
    with pytest.raises(RuntimeError, match=r"use it as `with SpotCheckpoints\(\.\.\.\) as spot:`"):
        spot.step(1)


def test_a_final_save_at_a_step_just_committed_is_not_made_twice(volume: Path) -> None:
    with SpotCheckpoints(write_state, read_state, install_signal_handlers=False) as spot:
        spot.save(5)
        spot.finish(5, save=True)
    (only,) = CheckpointDir(volume).committed()
    manifest = CheckpointDir(volume).newest_manifest()
    assert only[0] == 5 and manifest is not None and manifest.kind == "periodic"

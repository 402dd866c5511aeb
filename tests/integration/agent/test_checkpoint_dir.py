"""The checkpoint directory with real DCP saves in one process: commit, restore, ``latest``,
pruning, skipping what fails verification, fencing by round, and a directory that is missing,
a file, read-only or full (the last two on a small tmpfs, since root writes through chmod)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from spottrain.agent.checkpoint import dcp_io
from spottrain.agent.checkpoint.directory import (
    LATEST,
    CheckpointDir,
    CheckpointDirError,
    StaleCommitError,
    step_name,
)
from spottrain.agent.checkpoint.manifest import MANIFEST_NAME, FileSum, Manifest, verify_files

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# -- state ------------------------------------------------------------------------------------
def state_for(step: int, scale: int = 1) -> dict[str, Any]:
    """Tensors of several dtypes whose every bit depends on ``step``."""
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "w": torch.randn(64 * scale, 128, generator=g),
            "b": torch.randn(128, generator=g).to(torch.bfloat16),
            "ids": torch.randint(-(2**62), 2**62, (257,), generator=g, dtype=torch.int64),
        },
        "meta": {"step": step, "name": f"run-{step}"},
    }


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = zeros_like(v)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        else:
            out[k] = None
    return out


def assert_bitwise_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for k, w in want.items():
        g = got[k]
        if isinstance(w, dict):
            assert_bitwise_equal(g, w)
        elif isinstance(w, torch.Tensor):
            assert g.dtype == w.dtype and g.shape == w.shape, k
            assert g.view(torch.uint8).numpy().tobytes() == w.view(torch.uint8).numpy().tobytes(), k
        else:
            assert g == w, k


def restore(ckdir: CheckpointDir, like: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    found = ckdir.find_restorable()
    assert found is not None
    assert verify_files(found.path, found.manifest) == []
    loaded = zeros_like(like)
    dcp_io.load(loaded, found.path)
    return found.manifest.step, loaded


def save(ckdir: CheckpointDir, step: int, round_: int = 0, **kw: Any) -> dcp_io.SaveResult:
    state = kw.pop("state", None) or state_for(step)
    return dcp_io.save(state, ckdir, step=step, round_=round_, kind="periodic", **kw)


def hidden(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


@pytest.fixture
def ckdir(tmp_path: Path) -> CheckpointDir:
    return CheckpointDir(tmp_path)


# -- commit and restore -----------------------------------------------------------------------
def test_saved_checkpoint_restores_bitwise_with_its_manifest(ckdir: CheckpointDir) -> None:
    result = dcp_io.save(
        state_for(5), ckdir, step=5, round_=3, kind="emergency", request_id=9, extra={"n": 1}
    )
    assert result.committed and result.refused is None
    assert result.path == ckdir.root / "step-000000005"
    found = ckdir.find_restorable()
    assert found is not None and found.skipped == []
    assert found.path == result.path
    assert found.manifest == result.manifest
    m = found.manifest
    assert (m.step, m.round, m.world_size, m.kind, m.request_id, m.extra) == (
        5,
        3,
        1,
        "emergency",
        9,
        {"n": 1},
    )
    on_disk = {p.name for p in result.path.iterdir()} - {MANIFEST_NAME}
    assert set(m.files) == on_disk and ".metadata" in on_disk
    assert m.total_bytes == sum((result.path / n).stat().st_size for n in on_disk)
    step, loaded = restore(ckdir, state_for(5))
    assert step == 5
    assert_bitwise_equal(loaded, state_for(5))
    assert hidden(ckdir.root) == []  # no temporary directory, no probe, no latest.tmp


def test_restore_of_an_empty_directory_finds_nothing(ckdir: CheckpointDir) -> None:
    assert ckdir.find_restorable() is None
    assert ckdir.read_latest() is None


def test_latest_points_at_the_newest_commit(ckdir: CheckpointDir) -> None:
    save(ckdir, 1)
    assert ckdir.read_latest() == "step-000000001"
    save(ckdir, 2)
    assert ckdir.read_latest() == "step-000000002"
    assert (ckdir.root / LATEST).read_text() == "step-000000002\n"


def test_keep_prunes_all_but_the_newest_k(ckdir: CheckpointDir) -> None:
    for step in range(1, 6):
        save(ckdir, step, keep=2)
    assert [s for s, _ in ckdir.committed()] == [4, 5]
    step, loaded = restore(ckdir, state_for(5))
    assert step == 5
    assert_bitwise_equal(loaded, state_for(5))


def test_prune_never_deletes_good_checkpoints_for_newer_damaged_ones(tmp_path: Path) -> None:
    """keep=2 counts only checkpoints that verify: with the newest ones damaged (a flipped
    byte, a lost shard, a torn manifest), the last good ones stay and restore finds them.
    Each save is by a new process (as after each restart), which knows nothing yet."""

    def fresh() -> CheckpointDir:
        return CheckpointDir(tmp_path)

    save(fresh(), 1, keep=2)
    save(fresh(), 2, keep=2)
    flip_byte(biggest_shard(save(fresh(), 3, keep=2).path or Path("/nonexistent")))
    assert [s for s, _ in fresh().committed()] == [2, 3]  # step 3 was good when it committed
    biggest_shard(save(fresh(), 4, keep=2).path or Path("/nonexistent")).unlink()
    tear_manifest(save(fresh(), 5, keep=2).path or Path("/nonexistent"))
    assert save(fresh(), 6, keep=2).committed
    assert [s for s, _ in fresh().committed()] == [2, 3, 4, 5, 6]
    flip_byte(biggest_shard(fresh().step_path(6)))
    found = fresh().find_restorable()
    assert found is not None and found.manifest.step == 2
    assert [name for name, _ in found.skipped] == [step_name(s) for s in (6, 5, 4, 3)]
    step, loaded = restore(fresh(), state_for(2))
    assert step == 2
    assert_bitwise_equal(loaded, state_for(2))
    # Two newer good ones: everything older than the second of them goes, damaged or not.
    save(fresh(), 7, keep=2)
    assert [s for s, _ in fresh().committed()] == [2, 3, 4, 5, 6, 7]
    save(fresh(), 8, keep=2)
    assert [s for s, _ in fresh().committed()] == [7, 8]


def test_prune_reads_again_a_checkpoint_changed_since_it_verified(ckdir: CheckpointDir) -> None:
    for step in (1, 2, 3):
        save(ckdir, step, keep=2)
    assert [s for s, _ in ckdir.committed()] == [2, 3]
    # Damaged after this very process wrote it (and so took it as verified).
    shard = biggest_shard(ckdir.step_path(3))
    shard.write_bytes(shard.read_bytes()[:-1])
    save(ckdir, 4, keep=2)
    assert [s for s, _ in ckdir.committed()] == [2, 3, 4]
    save(ckdir, 5, keep=2)
    assert [s for s, _ in ckdir.committed()] == [4, 5]


def test_an_emergency_save_leaves_pruning_to_the_next_save(ckdir: CheckpointDir) -> None:
    for step in (1, 2):
        save(ckdir, step, keep=1)
    assert dcp_io.save(state_for(3), ckdir, step=3, round_=0, kind="emergency", keep=1).committed
    assert [s for s, _ in ckdir.committed()] == [2, 3]
    save(ckdir, 4, keep=1)
    assert [s for s, _ in ckdir.committed()] == [4]


def biggest_shard(path: Path) -> Path:
    return max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def tear_manifest(path: Path) -> None:
    raw = (path / MANIFEST_NAME).read_bytes()
    (path / MANIFEST_NAME).write_bytes(raw[: len(raw) // 2])


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: flip_byte(biggest_shard(p)), "fails its CRC32"),
        (lambda p: biggest_shard(p).unlink(), "is missing"),
        (lambda p: (p / ".metadata").unlink(), ".metadata is missing"),
        (tear_manifest, "torn write"),
        (lambda p: (p / MANIFEST_NAME).unlink(), f"no {MANIFEST_NAME}"),
    ],
    ids=["flipped-byte", "deleted-shard", "deleted-metadata", "torn-manifest", "no-manifest"],
)
def test_restore_skips_a_newer_damaged_checkpoint_and_says_why(
    ckdir: CheckpointDir,
    damage: Callable[[Path], None],
    reason: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    save(ckdir, 1)
    damage(save(ckdir, 2).path or Path("/nonexistent"))
    with caplog.at_level(logging.WARNING, logger="spottrain.agent.checkpoint.directory"):
        found = ckdir.find_restorable()
    assert found is not None
    assert found.manifest.step == 1
    assert [name for name, _ in found.skipped] == ["step-000000002"]
    assert reason in found.skipped[0][1]
    assert "skipping checkpoint step-000000002" in caplog.text and reason in caplog.text
    step, loaded = restore(ckdir, state_for(1))
    assert step == 1
    assert_bitwise_equal(loaded, state_for(1))


def test_restore_skips_a_checkpoint_whose_manifest_names_another_step(
    ckdir: CheckpointDir,
) -> None:
    save(ckdir, 1)
    path = save(ckdir, 2).path
    assert path is not None
    os.rename(path, ckdir.step_path(3))  # a directory renamed by hand
    found = ckdir.find_restorable()
    assert found is not None and found.manifest.step == 1
    assert found.skipped == [("step-000000003", "its manifest is for step 2")]


def test_restore_never_uses_temporary_directories(ckdir: CheckpointDir) -> None:
    path = save(ckdir, 4).path
    assert path is not None
    # Complete-looking copies with a valid manifest under names that are not commits, and a
    # set-aside copy of step 4 while step 4 itself is there.
    for name in (".tmp-step-000000009-r0", "step-9", "step-x", ".old-step-000000004-r1-5"):
        shutil.copytree(path, ckdir.root / name)
    found = ckdir.find_restorable()
    assert found is not None and found.path == path and found.skipped == []
    shutil.rmtree(path)
    shutil.rmtree(ckdir.root / ".old-step-000000004-r1-5")
    assert ckdir.find_restorable() is None


def test_a_step_set_aside_by_a_replacement_that_died_is_restored(ckdir: CheckpointDir) -> None:
    # Round 2 saving step 7 again died between its two renames: the committed step 7 of
    # round 1 is set aside, and its own complete copy is still a temporary directory.
    save(ckdir, 6, round_=1, state=state_for(60))
    path = save(ckdir, 7, round_=1, state=state_for(70)).path
    assert path is not None
    shutil.copytree(path, ckdir.tmp_path(7, 2))
    os.rename(path, ckdir.root / ".old-step-000000007-r2-1000")
    os.rename(ckdir.tmp_path(7, 2), ckdir.root / ".old-step-000000007-r2-900")  # an older one

    assert [s for s, _ in ckdir.committed()] == [6, 7]
    found = ckdir.find_restorable()
    assert found is not None and found.path.name == ".old-step-000000007-r2-1000"
    assert found.manifest.step == 7 and found.manifest.round == 1
    _, loaded = restore(ckdir, state_for(70))
    assert_bitwise_equal(loaded, state_for(70))

    # A later save keeps it while it stands for step 7 (dropping only the older copy), and
    # the keep rule drops it in its turn.
    assert save(ckdir, 8, round_=3, keep=2).committed
    assert [s for s, _ in ckdir.committed()] == [7, 8]
    assert hidden(ckdir.root) == [".old-step-000000007-r2-1000"]
    assert save(ckdir, 9, round_=3, keep=2).committed
    assert [s for s, _ in ckdir.committed()] == [8, 9]
    assert hidden(ckdir.root) == []


# -- fencing ----------------------------------------------------------------------------------
def test_rounds_restarting_at_zero_under_a_new_generation_still_commit(
    ckdir: CheckpointDir,
) -> None:
    """The issue's case: round 7 commits step 100, then the rendezvous state is new (Redis
    lost its data, or a relaunch under a new --rdzv-id) and rounds start again."""
    old = ckdir.claim_epoch("run a round 7")
    assert save(ckdir, 100, round_=7, epoch=old, keep=10).committed
    new = ckdir.claim_epoch("run b round 1")
    assert new > old
    for step in (125, 150, 175):
        result = save(ckdir, step, round_=1, epoch=new, keep=10)
        assert result.committed, result.refused
    emergency = dcp_io.save(
        state_for(180), ckdir, step=180, round_=1, kind="emergency", epoch=new, keep=10
    )
    assert emergency.committed, emergency.refused
    assert [s for s, _ in ckdir.committed()] == [100, 125, 150, 175, 180]
    step, loaded = restore(ckdir, state_for(180))
    assert step == 180
    assert_bitwise_equal(loaded, state_for(180))


def test_a_frozen_writer_of_an_older_generation_is_refused(ckdir: CheckpointDir) -> None:
    frozen = ckdir.claim_epoch("run a round 3")
    assert save(ckdir, 10, round_=3, epoch=frozen).committed
    # The peers moved on while it was frozen: a new generation (here with a lower round,
    # as after Redis lost its data) claimed its epoch, before committing anything.
    newer = ckdir.claim_epoch("run a round 0 after a restart")
    result = save(ckdir, 11, round_=3, epoch=frozen)
    assert not result.committed and result.manifest is None and result.refused is not None
    assert f"fencing epoch {frozen}" in result.refused
    assert f"newer generation holds fencing epoch {newer}" in result.refused
    assert "run a round 0 after a restart" in result.refused
    assert [s for s, _ in ckdir.committed()] == [10]
    assert hidden(ckdir.root) == [".epochs"]  # the refused temporary directory is gone
    assert ckdir.read_latest() == "step-000000010"
    # Once the newer generation commits, the frozen one still cannot, even a newer step.
    assert save(ckdir, 12, round_=0, epoch=newer).committed
    assert not save(ckdir, 13, round_=3, epoch=frozen).committed
    step, loaded = restore(ckdir, state_for(12))
    assert step == 12
    assert_bitwise_equal(loaded, state_for(12))


def test_checkpoint_dir_commit_raises_stale_commit_and_removes_the_tmp_dir(
    ckdir: CheckpointDir,
) -> None:
    stale = ckdir.claim_epoch("old")
    ckdir.claim_epoch("new")
    tmp = ckdir.tmp_path(11, 4, stale)
    tmp.mkdir()
    (tmp / "__0_0.distcp").write_bytes(b"data")
    manifest = Manifest(11, 1, 4, "periodic", 0.0, {"__0_0.distcp": FileSum(4, 0)}, epoch=stale)
    with pytest.raises(
        StaleCommitError, match=r"refused to commit step 11 from rendezvous round 4 \(fencing"
    ):
        ckdir.commit(tmp, manifest)
    assert not tmp.exists()
    assert ckdir.committed() == []


def test_a_generation_claiming_again_gets_its_own_epoch(ckdir: CheckpointDir) -> None:
    assert ckdir.newest_epoch() == -1
    assert [ckdir.claim_epoch(g) for g in ("a", "b", "a", "c", "b")] == [0, 1, 0, 2, 1]
    assert ckdir.newest_epoch() == 2
    assert ckdir.epoch_generation(1) == "b"
    with pytest.raises(ValueError, match="one non-empty line"):
        ckdir.claim_epoch("")


def test_concurrent_claims_give_one_epoch_per_generation(tmp_path: Path) -> None:
    """Processes claim at once, several per generation (as the members of a round would):
    each generation gets one epoch, no two generations share one, and epochs are dense."""
    generations = [f"gen-{i}" for i in range(4)]
    script = (
        "import sys, time\n"
        "from spottrain.agent.checkpoint.directory import CheckpointDir\n"
        "d = CheckpointDir(sys.argv[1])\n"
        "time.sleep(max(0.0, float(sys.argv[3]) - time.time()))\n"
        "print(d.claim_epoch(sys.argv[2]))\n"
    )
    start_at = f"{time.time() + 2.0:.3f}"  # all start claiming together
    procs = [
        (
            g,
            subprocess.Popen(
                [sys.executable, "-c", script, str(tmp_path), g, start_at],
                stdout=subprocess.PIPE,
                text=True,
            ),
        )
        for g in generations
        for _ in range(3)
    ]
    got: dict[str, set[int]] = {}
    for g, proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        got.setdefault(g, set()).add(int(out.strip()))
    assert all(len(epochs) == 1 for epochs in got.values()), got
    epochs = sorted(e for es in got.values() for e in es)
    assert epochs == list(range(len(generations)))
    assert {CheckpointDir(tmp_path).epoch_generation(e) for e in epochs} == set(generations)
    assert sorted(p.name for p in (tmp_path / ".epochs").iterdir()) == [
        f"epoch-{e:012d}" for e in epochs
    ]


def test_commit_refused_when_the_fence_says_a_newer_round_trains(ckdir: CheckpointDir) -> None:
    save(ckdir, 1, round_=3)
    asked: list[int] = []

    def fence(round_: int) -> str | None:
        asked.append(round_)
        return "rendezvous round 9 is training now" if round_ < 9 else None

    result = save(ckdir, 2, round_=3, fence=fence)
    assert asked == [3]
    assert result.refused is not None and "round 9 is training now" in result.refused
    assert [s for s, _ in ckdir.committed()] == [1]
    assert hidden(ckdir.root) == []
    assert save(ckdir, 2, round_=9, fence=fence).committed
    assert asked == [3, 9]


def test_same_and_newer_rounds_commit(ckdir: CheckpointDir) -> None:
    assert save(ckdir, 1, round_=3).committed
    assert save(ckdir, 2, round_=3).committed
    assert save(ckdir, 3, round_=4).committed


def test_round_minus_one_is_not_fenced(ckdir: CheckpointDir) -> None:
    save(ckdir, 1, round_=5)
    result = save(ckdir, 2, round_=-1, fence=lambda r: "never")
    assert result.committed


def test_same_step_committed_again_by_a_newer_round_replaces_the_old_one(
    ckdir: CheckpointDir,
) -> None:
    save(ckdir, 7, round_=1, state=state_for(100))
    result = save(ckdir, 7, round_=2, state=state_for(200))
    assert result.committed
    found = ckdir.find_restorable()
    assert found is not None and found.manifest.round == 2
    assert [s for s, _ in ckdir.committed()] == [7]
    assert hidden(ckdir.root) == []  # the replaced one (.old-...) is removed
    _, loaded = restore(ckdir, state_for(200))
    assert_bitwise_equal(loaded, state_for(200))


def test_prune_drops_leftovers_no_writer_can_commit_and_keeps_live_ones(
    ckdir: CheckpointDir,
) -> None:
    for name in (
        ".tmp-step-000000002-r3",  # older round
        ".old-step-000000006-r3-99",  # older round, set aside and replaced
        ".tmp-step-000000004-r5",  # this round, below the committed step: a failed save
        ".tmp-step-000000009-r5",  # this round, ahead: kept
        ".tmp-step-000000001-r6",  # a newer round may be writing it: kept
    ):
        (ckdir.root / name).mkdir()
    assert save(ckdir, 6, round_=5).committed
    assert hidden(ckdir.root) == [".tmp-step-000000001-r6", ".tmp-step-000000009-r5"]


def test_runs_without_rendezvous_free_their_crashed_saves(ckdir: CheckpointDir) -> None:
    # Every run without the spottrain rendezvous is round -1: a crashed save's directory
    # must still go once a later step commits, or each crash keeps a checkpoint's worth.
    (ckdir.root / ".tmp-step-000000003-r-1").mkdir()
    assert save(ckdir, 5, round_=-1).committed
    assert hidden(ckdir.root) == []


# -- a writer thread that fails ---------------------------------------------------------------
class Unpicklable:
    def __reduce__(self) -> Any:
        raise RuntimeError("this object refuses to be pickled")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("thread_count", [1, 4])
def test_a_failure_in_any_writer_thread_fails_the_save(
    ckdir: CheckpointDir, thread_count: int
) -> None:
    save(ckdir, 1)
    state = {**state_for(2), "bad": Unpicklable(), "more": [Unpicklable()]}
    with pytest.raises(dcp_io.CheckpointWriteError, match="refuses to be pickled") as info:
        save(ckdir, 2, state=state, thread_count=thread_count)
    assert "the previous checkpoint is intact" in str(info.value)
    assert hidden(ckdir.root) == []
    assert [s for s, _ in ckdir.committed()] == [1]
    step, loaded = restore(ckdir, state_for(1))
    assert step == 1
    assert_bitwise_equal(loaded, state_for(1))


# -- bad input --------------------------------------------------------------------------------
def test_missing_directory_is_refused_saying_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(CheckpointDirError) as info:
        CheckpointDir(tmp_path / "not-mounted")
    msg = str(info.value)
    assert f"checkpoint directory {tmp_path / 'not-mounted'} does not exist" in msg
    assert "mount the checkpoint volume there or create the directory" in msg
    assert not (tmp_path / "not-mounted").exists()  # not created behind the user's back


def test_a_file_is_refused_as_checkpoint_directory(tmp_path: Path) -> None:
    (tmp_path / "ckpt").write_text("x")
    with pytest.raises(CheckpointDirError, match="is not a directory: point --ckpt-dir at a"):
        CheckpointDir(tmp_path / "ckpt")


def test_check_writable_passes_and_leaves_nothing(ckdir: CheckpointDir) -> None:
    ckdir.check_writable()
    assert list(ckdir.root.iterdir()) == []


# -- read-only and full volumes (a small tmpfs) -----------------------------------------------
Mount = Callable[[str], Path]


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Mount]:
    """Mount a tmpfs of the given size; unmounted in teardown. Skips unless root."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root (chmod does not stop root from writing)")
        point = tmp_path / f"mnt{len(mounted)}"
        point.mkdir()
        out = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip() or out.returncode}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], check=True)


def remount_read_only(point: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(point)], check=True)


def test_read_only_directory_refuses_writes_and_keeps_the_previous_checkpoint(
    tmpfs: Mount,
) -> None:
    root = tmpfs("8m")
    ckdir = CheckpointDir(root)
    ckdir.check_writable()
    assert save(ckdir, 1).committed
    remount_read_only(root)

    with pytest.raises(
        CheckpointDirError, match="a test write failed because it is on a read-only"
    ):
        ckdir.check_writable()
    with pytest.raises(dcp_io.CheckpointWriteError) as info:
        save(ckdir, 2)
    assert "read-only file system" in str(info.value)
    assert "remount it read-write" in str(info.value)

    assert [s for s, _ in ckdir.committed()] == [1]
    step, loaded = restore(ckdir, state_for(1))
    assert step == 1
    assert_bitwise_equal(loaded, state_for(1))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_full_directory_fails_the_save_and_keeps_the_previous_checkpoint(
    tmpfs: Mount,
) -> None:
    root = tmpfs("2m")
    ckdir = CheckpointDir(root)
    assert save(ckdir, 1).committed  # ~40 KiB
    big = state_for(2, scale=128)  # ~4 MiB: more than the volume holds
    with pytest.raises(dcp_io.CheckpointWriteError) as info:
        save(ckdir, 2, state=big)
    msg = str(info.value)
    assert "full (no space left on the device)" in msg
    assert "free space or point the checkpoint directory at a larger volume" in msg
    assert "the previous checkpoint is intact" in msg

    assert hidden(ckdir.root) == []  # the partial temporary directory is gone
    assert ckdir.read_latest() == "step-000000001"
    step, loaded = restore(ckdir, state_for(1))
    assert step == 1
    assert_bitwise_equal(loaded, state_for(1))
    # The space the failed save took is free again: a save that fits commits.
    assert save(ckdir, 3).committed


def test_step_names_sort_as_numbers() -> None:
    assert step_name(7) == "step-000000007"
    assert sorted([step_name(10), step_name(9)]) == [step_name(9), step_name(10)]

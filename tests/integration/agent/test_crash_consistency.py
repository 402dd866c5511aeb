"""A writer SIGKILLed at every named point of the save path leaves exactly the newest
checkpoint committed before the kill restorable, bitwise, and the next writer carries on.

The rename of the temporary directory is the commit point: a kill at ``after-rename``,
``latest`` or ``after-latest`` of save k leaves step k restorable; a kill at ``shard``,
``before-manifest``, ``manifest`` or ``before-rename`` leaves step k - 1. A kill at
``replace`` (a newer round saving step k again, between setting the committed step k aside
and renaming its own into place) leaves the step k that was set aside.

Each trial is one writer process (``tests/ckpt_writer.py``), forked by a server that imported
torch once, so that a trial costs a fork rather than a torch import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from ckpt_state import assert_bitwise_equal, state_for, zeros_like

from spottrain.agent.checkpoint import dcp_io
from spottrain.agent.checkpoint.directory import CheckpointDir, step_name
from spottrain.agent.checkpoint.manifest import Manifest, verify_files
from spottrain.protocol.env import ENV_FAILPOINT

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    # The saves below run in this process: an armed failpoint would kill pytest.
    pytest.mark.skipif(
        bool(os.environ.get(ENV_FAILPOINT)), reason=f"{ENV_FAILPOINT} is set for the test process"
    ),
]

WRITER = Path(__file__).resolve().parents[2] / "ckpt_writer.py"
BEFORE_COMMIT = ("shard", "before-manifest", "manifest", "before-rename")
AFTER_COMMIT = ("after-rename", "latest", "after-latest")
REPLACE = "replace"
NAMES = (*BEFORE_COMMIT, *AFTER_COMMIT, REPLACE)
WRITER_ROUND = 1


@dataclass(frozen=True)
class Trial:
    failpoint: str
    dies_in: int  # the step (and save number) the writer dies in
    scale: int  # state_for(step, scale): about scale * 40 KiB
    threads: int

    @property
    def id(self) -> str:
        return f"{self.failpoint}-save{self.dies_in}-{self.scale * 40}KiB-t{self.threads}"

    @property
    def expected(self) -> int:
        """The newest step committed before the kill (0: none)."""
        if self.failpoint in (*AFTER_COMMIT, REPLACE):
            return self.dies_in
        return self.dies_in - 1

    @property
    def printed(self) -> list[int]:
        """The steps whose save returned in the writer."""
        return list(range(1, self.dies_in + (1 if self.failpoint == REPLACE else 0)))

    @property
    def arm_later(self) -> bool:
        # A shard failpoint is passed once per write, so "save k dies" needs the writer to
        # arm it only from step k on, under the next round (see tests/ckpt_writer.py); a
        # replacement needs step k committed by one round and saved again by the next.
        return (self.failpoint == "shard" and self.dies_in > 1) or self.failpoint == REPLACE

    @property
    def last_round(self) -> int:
        return WRITER_ROUND + 1 if self.arm_later else WRITER_ROUND

    def argv(self, root: Path) -> list[str]:
        argv = [str(root), "--round", str(WRITER_ROUND), "--last", str(self.dies_in + 2)]
        argv += ["--scale", str(self.scale), "--threads", str(self.threads)]
        if self.arm_later:
            argv += ["--arm", self.failpoint, "--arm-at", str(self.dies_in)]
        if self.failpoint == REPLACE:
            argv.append("--redo")
        return argv

    def env(self) -> dict[str, str]:
        return {} if self.arm_later else {ENV_FAILPOINT: f"{self.failpoint}:{self.dies_in}"}


TRIALS = (
    [Trial(name, 1, 1, 1) for name in NAMES]
    + [Trial(name, 3, 1, 2) for name in NAMES]
    + [Trial(name, 2, 100, 4) for name in NAMES]  # ~4 MiB over four writer threads
)


@dataclass(frozen=True)
class Outcome:
    returncode: int
    output: str

    @property
    def committed(self) -> list[int]:
        return [int(ln.split()[1]) for ln in self.output.splitlines() if ln.startswith("committed")]


class WriterServer:
    """``tests/ckpt_writer.py --serve``: runs each writer in a fresh forked process."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(WRITER), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={
                **{k: v for k, v in os.environ.items() if k != ENV_FAILPOINT},
                "OMP_NUM_THREADS": "1",
            },
        )
        assert self._reply() == {"ready": True}

    def _reply(self) -> dict[str, object]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the writer server died (exit {self.proc.wait()})"
        reply: dict[str, object] = json.loads(line)
        return reply

    def run(self, argv: list[str], env: dict[str, str], out: Path) -> Outcome:
        assert self.proc.stdin is not None
        request = {"argv": argv, "env": env, "out": str(out)}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        code = self._reply()["returncode"]
        assert isinstance(code, int)
        return Outcome(code, out.read_text())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def writer() -> Iterator[WriterServer]:
    server = WriterServer()
    yield server
    server.close()


def committed_steps(ckdir: CheckpointDir) -> list[int]:
    return [s for s, _ in ckdir.committed()]


def hidden(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("trial", TRIALS, ids=lambda t: t.id)
def test_kill_leaves_exactly_the_newest_committed_checkpoint(
    writer: WriterServer, trial: Trial, tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    out = writer.run(trial.argv(root), trial.env(), tmp_path / "writer.log")
    assert out.returncode == -9, f"the writer was not SIGKILLed:\n{out.output}"
    k, want = trial.dies_in, trial.expected
    # Every save before the dying one returned, and the dying one never did.
    assert out.committed == trial.printed, out.output

    ckdir = CheckpointDir(root)
    assert committed_steps(ckdir) == list(range(1, want + 1))
    found = ckdir.find_restorable()
    if want == 0:
        assert found is None
    else:
        assert found is not None
        assert found.skipped == []  # a crash never leaves a committed checkpoint broken
        assert found.manifest.step == want
        assert verify_files(found.path, found.manifest) == []
        loaded = zeros_like(state_for(want, trial.scale))
        dcp_io.load(loaded, found.path)
        assert_bitwise_equal(loaded, state_for(want, trial.scale))
        set_aside = found.path.name.startswith(f".old-{step_name(k)}-r{trial.last_round}-")
        assert set_aside == (trial.failpoint == REPLACE)

    # `latest` is written after the rename: at most one behind, never ahead.
    if trial.failpoint in ("after-latest", REPLACE):
        assert ckdir.read_latest() == step_name(k)
    else:
        assert ckdir.read_latest() == (step_name(k - 1) if k > 1 else None)
    # What the kill left behind shows where it struck.
    leftover = f".tmp-{step_name(k)}-r{trial.last_round}"
    if trial.failpoint in (*BEFORE_COMMIT, REPLACE):
        assert leftover in hidden(root)
    if trial.failpoint == "latest":
        assert ".latest.tmp" in hidden(root)

    # A writer of the next round saves the next step over whatever the kill left.
    nxt = want + 1
    result = dcp_io.save(
        state_for(nxt, trial.scale),
        ckdir,
        step=nxt,
        round_=trial.last_round + 1,
        kind="periodic",
        keep=10,
    )
    assert result.committed
    # The older round's temporary directory is gone; a checkpoint set aside stays while it
    # stands for its step.
    assert hidden(root) == ([found.path.name] if trial.failpoint == REPLACE else [])
    assert ckdir.read_latest() == step_name(nxt)
    assert committed_steps(ckdir) == list(range(1, nxt + 1))
    found = ckdir.find_restorable()
    assert found is not None and found.manifest.step == nxt and found.skipped == []
    loaded = zeros_like(state_for(nxt, trial.scale))
    dcp_io.load(loaded, found.path)
    assert_bitwise_equal(loaded, state_for(nxt, trial.scale))


def test_every_failpoint_is_covered_at_least_twenty_times_in_all() -> None:
    assert {t.failpoint for t in TRIALS} == set(NAMES)
    assert len(TRIALS) >= 20


def test_an_armed_shard_failpoint_not_yet_due_writes_intact_checkpoints(
    writer: WriterServer, tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    argv = [str(root), "--round", "1", "--last", "2", "--threads", "2", "--scale", "4"]
    out = writer.run(argv, {ENV_FAILPOINT: "shard:1000000"}, tmp_path / "writer.log")
    assert out.returncode == 0, out.output
    ckdir = CheckpointDir(root)
    assert ckdir.find_restorable() is not None
    for step, path in ckdir.committed():
        assert verify_files(path, Manifest.read(path)) == []
        loaded = zeros_like(state_for(step, 4))
        dcp_io.load(loaded, path)
        assert_bitwise_equal(loaded, state_for(step, 4))
    assert committed_steps(ckdir) == [1, 2]

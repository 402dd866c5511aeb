"""A node's workers failing, with literals: torchrun's output read line by line into failures,
the line that says why, what makes a crash loop on one VM (and what breaks the streak), the
record the controller reads, and the relay that copies torchrun's output on."""

from __future__ import annotations

from pathlib import Path

import pytest

from spottrain.agent.crashes import (
    CrashWatch,
    OutputLines,
    OutputRelay,
    WorkerFailure,
    loop_crash,
)
from spottrain.protocol.crashes import (
    CRASH_LOOP_FAILURES,
    TRAINED_S,
    Crash,
    crash_key,
    failing_line,
    same_crash,
)

TORCH_FAILED = (
    "E1128 19:53:12.031000 6182 torch/distributed/elastic/multiprocessing/api.py:1002] "
    "failed (exitcode: {code}) local_rank: {rank} (pid: 6195) of binary: /usr/bin/python3"
)
TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "/srv/runs/job-1795895586/nodes/n0/code/train.py", line 1, in <module>',
    "    import no_such_module",
    "    ^^^^^^^^^^^^^^^^^^^^^",
    "ModuleNotFoundError: No module named 'no_such_module'",
]
IMPORT_ERROR = "ModuleNotFoundError: No module named 'no_such_module'"


def _failure(line: str = IMPORT_ERROR, code: int = 1, rank: int = 0) -> WorkerFailure:
    return WorkerFailure(code, rank, ("Traceback (most recent call last):", line))


# -- torchrun's output -------------------------------------------------------------------------
def test_torchruns_line_for_a_failed_worker_is_a_failure_with_the_workers_lines_before_it() -> None:
    out = OutputLines()
    assert [out.feed(x) for x in ["step 1", *TRACEBACK]] == [None] * 6
    warn = "W1128 19:53:11.000000 6182 torch/distributed/run.py:803] Setting OMP_NUM_THREADS"
    assert out.feed(warn) is None
    failure = out.feed(TORCH_FAILED.format(code=1, rank=3))
    assert failure == WorkerFailure(1, 3, ("step 1", *TRACEBACK))
    # What follows is the restarted workers': the next failure has only their lines.
    out.feed("usage: train.py [-h] --steps STEPS")
    killed = out.feed(TORCH_FAILED.format(code=-9, rank=0))
    assert killed == WorkerFailure(-9, 0, ("usage: train.py [-h] --steps STEPS",))


def test_the_failing_line_is_what_the_error_says_not_a_frame_or_a_caret() -> None:
    assert failing_line(TRACEBACK) == IMPORT_ERROR
    argparse = ["usage: train.py [-h] --steps STEPS", "train.py: error: the following ...", ""]
    assert failing_line(argparse) == "train.py: error: the following ..."
    assert failing_line(['  File "x.py", line 3, in f', "   ~~~^^^"]) == ""
    assert failing_line([]) == ""


def test_the_failing_line_is_not_the_abort_of_a_worker_that_raised_with_a_thread_running() -> None:
    """Seen under load: a worker raised, then aborted on its way out (exit code -6) with a
    gloo thread still running; the C++ runtime's last words are not the cause."""
    error = "[rank0]: RuntimeError: the batch has 3 rows, the model expects 4"
    lines = ["[rank0]: Traceback (most recent call last):", error]
    assert failing_line([*lines, "terminate called without an active exception"]) == error
    assert failing_line([*lines, "terminate called recursively", ""]) == error


def test_a_crash_key_blanks_what_differs_between_vms_and_keeps_the_exit_code() -> None:
    line = "FileNotFoundError: /srv/runs/job-1795895586/nodes/n0/data.bin"
    other = "FileNotFoundError: /srv/runs/job-1795895586/nodes/n7/data.bin"
    assert crash_key(1, line, "n0") == crash_key(1, other, "n7")
    assert crash_key(1, line, "n0") != crash_key(2, line, "n0")
    assert crash_key(1, "pid 31337 died", "n0") == crash_key(1, "pid 4242 died", "n1")
    assert same_crash("a", 7, "b", 7) and same_crash("a", None, "a", 3)
    assert not same_crash("a", None, "b", None) and not same_crash("a", 7, "b", 8)


# -- a crash loop on one VM ----------------------------------------------------------------
def test_three_failures_in_a_row_without_training_are_a_loop() -> None:
    watch = CrashWatch("n0", started=0.0)
    counts = []
    for i in range(CRASH_LOOP_FAILURES):
        crash = watch.failed(_failure(), now=2.0 * (i + 1), step=None, gone="")
        counts.append((crash.count, crash.loop))
    assert counts == [(1, False), (2, False), (3, True)]
    assert crash.line == IMPORT_ERROR and crash.rank == 0 and crash.code == 1
    assert crash.ran_s == pytest.approx(2.0)


def test_an_abort_on_the_way_out_does_not_hide_the_loop_and_the_loop_keeps_the_real_error() -> None:
    watch = CrashWatch("n0", started=0.0)
    watch.failed(_failure(), 1.0, None, "")
    watch.failed(_failure("terminate called without an active exception", code=-6), 2.0, None, "")
    crash = watch.failed(_failure(), 3.0, None, "")
    assert crash.loop and crash.count == 3
    assert (crash.line, crash.code) == (IMPORT_ERROR, 1)


def test_a_peer_leaving_between_two_failures_starts_a_new_streak() -> None:
    """A preemption: the survivors' workers fail on the lost connection, and the
    rendezvous marks the peer gone; that failure is the membership change's, not a bug."""
    watch = CrashWatch("n0", started=0.0)
    lost = "RuntimeError: Connection closed by peer [10.0.0.7]:29400"
    assert watch.failed(_failure(lost), 1.0, None, "3").count == 1
    assert watch.failed(_failure(lost), 2.0, None, "4").count == 1
    assert watch.failed(_failure(lost), 3.0, None, "5").count == 1
    # A Redis that does not answer cannot say: no streak either.
    assert watch.failed(_failure(lost), 4.0, None, None).count == 1
    assert watch.failed(_failure(lost), 5.0, None, None).count == 1


def test_a_step_beyond_the_last_failures_starts_a_new_streak_and_the_same_step_does_not() -> None:
    watch = CrashWatch("n0", started=0.0)
    nan = "FloatingPointError: loss is nan"
    assert watch.failed(_failure(nan), 10.0, 40, "").count == 1
    assert watch.failed(_failure(nan), 20.0, 80, "").count == 1  # it trained 40 steps
    assert watch.failed(_failure(nan), 30.0, 80, "").count == 2
    # Long attempts do not matter when steps say it: it failed at the same one again.
    crash = watch.failed(_failure(nan), 30.0 + 10 * TRAINED_S, 80, "")
    assert crash.count == 3 and crash.loop and crash.step == 80


def test_without_steps_workers_that_ran_for_a_while_trained() -> None:
    watch = CrashWatch("n0", started=0.0)
    assert watch.failed(_failure(), 1.0, None, "").count == 1
    assert watch.failed(_failure(), 1.0 + TRAINED_S, None, "").count == 1
    assert watch.failed(_failure(), 2.0 + TRAINED_S, None, "").count == 2


def test_a_loop_stands_for_the_reason_most_of_its_failures_had() -> None:
    a = Crash(1, "A", "ka", step=None, count=1)
    b = Crash(-6, "B", "kb", step=None, count=2)
    c = Crash(1, "A2", "ka", step=None, count=3, loop=True)
    assert loop_crash([a, b, c]) == Crash(1, "A2", "ka", count=3, loop=True)
    # The same step is the same reason, whatever each rank said.
    d, e = Crash(1, "D", "kd", step=9), Crash(1, "E", "ke", step=9)
    assert loop_crash([a, d, e]).line == "E"


def test_the_node_is_marked_trained_once_per_stretch_without_a_failure_in_the_rendezvous() -> None:
    watch = CrashWatch("n0", started=0.0)
    assert not watch.trains(TRAINED_S - 1, joined=True)
    assert not watch.trains(TRAINED_S + 1, joined=False)
    assert watch.trains(TRAINED_S + 1, joined=True)
    assert not watch.trains(TRAINED_S + 2, joined=True)  # once
    watch.failed(_failure(), TRAINED_S + 5, None, "")
    assert not watch.trains(TRAINED_S + 6, joined=True)
    assert watch.trains(2 * TRAINED_S + 5, joined=True)


def test_a_torchrun_that_gave_up_by_itself_names_its_last_words() -> None:
    out = OutputLines()
    for line in ["Traceback (most recent call last):", "RendezvousTimeoutError: no peers"]:
        out.feed(line)
    crash = CrashWatch("n0", 0.0).gave_up(1, out)
    assert (crash.code, crash.line, crash.loop, crash.rank) == (
        1,
        "RendezvousTimeoutError: no peers",
        True,
        -1,
    )
    watch = CrashWatch("n0", 0.0)
    watch.failed(_failure(), 1.0, None, "")
    assert watch.gave_up(1, out).line == IMPORT_ERROR


def test_a_crash_record_reads_back_and_garbage_is_no_crash() -> None:
    crash = Crash(1, IMPORT_ERROR, "k", tuple(TRACEBACK), 0, 7, 1.5, 3, True)
    assert Crash.from_json(crash.to_json()) == crash
    for bad in (None, "", "[]", "{}", '{"code": "x"}', "not json"):
        assert Crash.from_json(bad) is None
    assert crash.why() == (
        f"its workers failed 3 times in a row (local rank 0, exit code 1): {IMPORT_ERROR}"
    )


# -- the relay -----------------------------------------------------------------------------
def test_the_relay_copies_whole_lines_on_and_passes_each_line_to_the_watcher(
    tmp_path: Path,
) -> None:
    path = tmp_path / "torchrun.out"
    copied: list[bytes] = []
    lines: list[str] = []
    relay = OutputRelay(str(path), copied.append, lines.append)
    with open(path, "ab") as f:
        f.write(b"step 1\nstep 2\rstep 3\nhalf a li")
        f.flush()
        assert relay.pump()
        assert copied == [b"step 1\nstep 2\rstep 3\n"]
        assert lines == ["step 1", "step 2", "step 3"]
        f.write(b"ne\n")
        f.flush()
        assert relay.pump()
    assert copied[-1] == b"half a line\n" and lines[-1] == "half a line"
    # A line left unfinished is copied once a look found nothing more.
    with open(path, "ab") as f:
        f.write(b"50%|#####     |")
    assert relay.pump() and not relay.pump() and not relay.pump()
    assert copied[-1] == b"50%|#####     |"


def test_what_a_crash_keeps_of_the_workers_lines_is_redacted() -> None:
    secret = "s3cr3t-redis-pw"
    watch = CrashWatch("n0", 0.0, redact=lambda line: line.replace(secret, "[redacted]"))
    lines = ("Traceback (most recent call last):", f"ConnectionError: redis://:{secret}@10.0.0.2")
    crash = watch.failed(WorkerFailure(1, 0, lines), 1.0, None, "")
    assert secret not in crash.to_json()
    assert crash.line == "ConnectionError: redis://:[redacted]@10.0.0.2"
    out = OutputLines()
    out.feed(f"password={secret}")
    assert secret not in CrashWatch("n1", 0.0, redact=watch.redact).gave_up(1, out).to_json()

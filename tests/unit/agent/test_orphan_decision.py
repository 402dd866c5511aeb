"""The dead man's switch's decisions, with literals: when a node counts as training (its
SDK's steps, or, without steps, its workers' CPU over the whole orphan timeout), and how the
workers' CPU readings are folded in."""

from __future__ import annotations

from spottrain.agent.orphan import (
    MIN_TRAINING_CORES,
    OrphanView,
    not_training,
    note_cpu,
    note_step,
    orphaned,
)

TIMEOUT = 100.0
TORCHRUN = 4242


def _view(readings: list[tuple[float, float | None]], root: int = TORCHRUN) -> OrphanView:
    """A view that saw ``(when, CPU seconds of torchrun's tree)`` at each look (None: none
    alive), with the controller long gone."""
    view = OrphanView(started_at=0.0, controller_absent_s=1e6)
    for at, seconds in readings:
        note_cpu(view, at, None if seconds is None else (root, seconds), keep_s=TIMEOUT)
    return view


def test_workers_that_keep_a_core_busy_train_without_reporting_a_step() -> None:
    view = _view([(t, t * 0.9) for t in range(0, 301, 5)])
    assert not_training(view, 300.0, TIMEOUT) is None
    assert orphaned(view, 300.0, TIMEOUT) is None


def test_workers_that_stopped_using_cpu_for_the_timeout_do_not_train() -> None:
    busy = [(t, t * 0.9) for t in range(0, 201, 5)]
    idle = [(t, 180.0 + (t - 200) * 0.001) for t in range(205, 401, 5)]
    # At 260 the window still holds 40 busy seconds; at 400 it holds none.
    assert not_training(_view([r for r in busy + idle if r[0] <= 260]), 260.0, TIMEOUT) is None
    reason = orphaned(_view(busy + idle), 400.0, TIMEOUT)
    assert reason is not None
    assert "no step reported (the SDK's) and its workers used 0.1 CPU s in 100 s" in reason
    assert f"training needs {MIN_TRAINING_CORES:g} of a core" in reason


def test_short_bursts_of_an_idle_process_do_not_count_as_training() -> None:
    # 0.3 CPU s every 30 s (a logging thread, a heartbeat): 1 % of a core.
    readings, used = [], 0.0
    for t in range(0, 401, 5):
        if t % 30 == 0:
            used += 0.3
        readings.append((float(t), used))
    view = _view(readings)
    assert not_training(view, 400.0, TIMEOUT) is not None


def test_a_node_without_live_workers_does_not_train() -> None:
    view = _view([(t, None) for t in range(0, 201, 5)])
    assert not_training(view, 200.0, TIMEOUT) is not None


def test_nothing_fires_before_a_whole_timeout_was_watched() -> None:
    view = _view([(t, None) for t in range(0, 100, 5)])
    assert not_training(view, 99.0, TIMEOUT) is None


def test_once_a_step_was_seen_only_steps_count() -> None:
    view = _view([(t, t * 1.0) for t in range(0, 401, 5)])
    note_step(view, 10.0, 7)
    note_step(view, 20.0, 7)  # the same step again is no progress
    reason = not_training(view, 400.0, TIMEOUT)
    assert reason == "no training step on this node for 390 s (step 7)"
    note_step(view, 399.0, 8)
    assert not_training(view, 400.0, TIMEOUT) is None


def test_a_reading_that_dips_and_recovers_adds_nothing() -> None:
    """A worker reaped between two reads of /proc is missed once: its time must not be
    counted again when the next reading finds it in its parent's."""
    view = OrphanView(started_at=0.0)
    note_cpu(view, 0.0, (TORCHRUN, 500.0), keep_s=TIMEOUT)
    note_cpu(view, 5.0, (TORCHRUN, 20.0), keep_s=TIMEOUT)
    note_cpu(view, 10.0, (TORCHRUN, 500.1), keep_s=TIMEOUT)
    assert [round(total, 3) for _, total in view.cpu] == [500.0, 500.0, 500.1]


def test_a_new_torchrun_counts_from_its_own_start() -> None:
    view = OrphanView(started_at=0.0)
    note_cpu(view, 0.0, (TORCHRUN, 500.0), keep_s=TIMEOUT)
    note_cpu(view, 5.0, None, keep_s=TIMEOUT)
    note_cpu(view, 10.0, (TORCHRUN + 1, 2.0), keep_s=TIMEOUT)
    note_cpu(view, 15.0, (TORCHRUN + 1, 4.0), keep_s=TIMEOUT)
    note_cpu(view, 20.0, None, keep_s=TIMEOUT)
    note_cpu(view, 25.0, (TORCHRUN, 3.0), keep_s=TIMEOUT)  # its pid reused by a new one
    assert [total for _, total in view.cpu] == [500.0, 500.0, 502.0, 504.0, 504.0, 507.0]


def test_only_the_window_and_one_sample_before_it_are_kept() -> None:
    view = _view([(t, float(t)) for t in range(0, 1001, 5)])
    assert view.cpu[0][0] <= 1000 - TIMEOUT < view.cpu[1][0]
    assert len(view.cpu) == int(TIMEOUT / 5) + 1


def test_a_controller_that_answers_keeps_every_vm() -> None:
    view = _view([(t, None) for t in range(0, 1001, 5)])
    view.controller_absent_s = TIMEOUT - 1
    assert not_training(view, 1000.0, TIMEOUT) is not None
    assert orphaned(view, 1000.0, TIMEOUT) is None

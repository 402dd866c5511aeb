"""The SDK's fault-tolerance mode (pure): which mode a session takes, and the step's work
whose weights make the gradient the mean over the global batch in either mode."""

from __future__ import annotations

import pytest
import torch

from spottrain.agent.replica.plan import micro_batches
from spottrain.agent.sdk import TrainSession
from spottrain.agent.sdk.modes import ELASTIC, REPLICA, StepWork, resolve_mode
from spottrain.protocol.env import ENV_FAULT_TOLERANCE


def test_the_argument_wins_then_the_environment_then_elastic() -> None:
    env = {ENV_FAULT_TOLERANCE: "replica"}
    assert resolve_mode("elastic", env) == ELASTIC
    assert resolve_mode(None, env) == REPLICA
    assert resolve_mode(None, {}) == ELASTIC
    assert resolve_mode("", {ENV_FAULT_TOLERANCE: ""}) == ELASTIC
    assert resolve_mode(" Replica ", {}) == REPLICA


def test_a_bad_mode_is_one_line_naming_where_it_came_from() -> None:
    with pytest.raises(ValueError, match=r"^fault_tolerance='hsdp' .*use elastic or replica$"):
        resolve_mode("hsdp", {})
    with pytest.raises(ValueError, match=rf"^\${ENV_FAULT_TOLERANCE}='x' "):
        resolve_mode(None, {ENV_FAULT_TOLERANCE: "x"})


def test_a_bad_mode_is_refused_before_the_session_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_FAULT_TOLERANCE, "bogus")
    with pytest.raises(ValueError, match=ENV_FAULT_TOLERANCE):
        TrainSession("/nonexistent", install_signal_handlers=False)


def test_replica_mode_makes_the_replica_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's environment switches the same call to the replica session, which is still
    a TrainSession (scripts' type hints hold); nothing is started here."""
    from spottrain.agent.sdk.replica_mode import ReplicaMode

    monkeypatch.setenv(ENV_FAULT_TOLERANCE, "replica")
    made = TrainSession.__new__(TrainSession)
    assert isinstance(made, ReplicaMode) and isinstance(made, TrainSession)
    assert type(TrainSession.__new__(TrainSession, fault_tolerance="elastic")) is TrainSession
    monkeypatch.delenv(ENV_FAULT_TOLERANCE)
    assert type(TrainSession.__new__(TrainSession)) is TrainSession


def test_replica_mode_without_torch_distributed_says_what_to_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_FAULT_TOLERANCE, "replica")
    with pytest.raises(RuntimeError, match="init_process_group"):
        TrainSession(install_signal_handlers=False)


def test_step_work_iterates_its_micro_batches_and_weights_each_sample_the_same() -> None:
    work = StepWork(step=3, micro_ranges=(range(96, 104), range(104, 106)), sample_scale=1 / 32)
    assert list(work) == [range(96, 104), range(104, 106)] and len(work) == 2
    assert work.weight(range(96, 104)) == 8 / 32 and work.weight(range(104, 106)) == 2 / 32
    assert work.samples == list(range(96, 106))


@pytest.mark.parametrize("participants", [1, 2, 3, 5])
def test_replica_weights_summed_over_the_replicas_give_the_global_batch_gradient(
    participants: int,
) -> None:
    """Replica mode sums the replicas' gradients of ``loss * weight`` (sample scale
    1 / global batch): the mean-loss gradient over the step's samples, however many
    replicas took part and however unevenly the batch splits."""
    torch.manual_seed(0)
    global_size, micro = 30, 4
    xs, ys = torch.randn(global_size, 6), torch.randn(global_size, 1)
    model = torch.nn.Linear(6, 1)

    def grads() -> torch.Tensor:
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    model.zero_grad()
    torch.nn.functional.mse_loss(model(xs), ys).backward()
    want = grads()
    summed = torch.zeros_like(want)
    for rank in range(participants):
        work = StepWork(0, micro_batches(0, global_size, micro, participants, rank), 1 / 30)
        model.zero_grad()
        for r in work:
            idx = torch.tensor(list(r))
            (torch.nn.functional.mse_loss(model(xs[idx]), ys[idx]) * work.weight(r)).backward()
        summed += grads()
    torch.testing.assert_close(summed, want, rtol=1e-5, atol=1e-6)

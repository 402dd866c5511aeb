"""The SDK's mode-neutral loop in elastic mode (one process): ``begin_step``, ``commit``
and ``end_step`` train, save and report exactly as the elastic loop with ``session.step``.
Replica mode runs the same loop in tests/integration/agent/replica/."""

from __future__ import annotations

from pathlib import Path

import torch

from spottrain.agent.checkpoint.directory import CheckpointDir
from spottrain.agent.sdk import GlobalBatch, ModelState, RngState, TrainSession

GLOBAL, MICRO = 12, 4


def setup(tmp_path: Path) -> tuple[TrainSession, dict[str, object], torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": ModelState(model, opt), "rng": RngState()}
    session = TrainSession(tmp_path, every_steps=3, install_signal_handlers=False, redis_url="")
    return session, state, model


def data(ids: range) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.arange(ids.start, ids.stop, dtype=torch.float32).unsqueeze(1).repeat(1, 3) / 50
    return x, x.sum(dim=1, keepdim=True)


def loss_of(model: torch.nn.Module, ids: range) -> torch.Tensor:
    x, y = data(ids)
    return torch.nn.functional.mse_loss(model(x), y)


def test_the_mode_neutral_loop_is_the_elastic_loop(tmp_path: Path) -> None:
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    # The elastic loop as scripts write it today.
    old, old_state, old_model = setup(tmp_path / "old")
    opt = old_state["model"].optimizer  # type: ignore[attr-defined]
    step = old.restore(old_state)
    batch = GlobalBatch(GLOBAL, MICRO, world=old.world, rank=old.rank)
    while step < 7:
        opt.zero_grad()
        for ids in batch.micro_ranges(step):
            (loss_of(old_model, ids) * batch.weight(ids)).backward()
        opt.step()
        step += 1
        old.step(step, old_state, loss=1.0)
    old.finish(step, old_state)

    # The same training through the calls that also run in replica mode.
    new, state, model = setup(tmp_path / "new")
    opt = state["model"].optimizer  # type: ignore[attr-defined]
    step = new.restore(state)
    net = new.wrap_ddp(model)  # one process: the model itself
    assert net is model
    batch = GlobalBatch(GLOBAL, MICRO, world=new.world, rank=new.rank)
    seen = []
    while step < 7:
        work = new.begin_step(batch)
        assert work.step == step and list(work) == batch.micro_ranges(step)
        assert [work.weight(r) for r in work] == [batch.weight(r) for r in work]
        seen.extend(work.samples)
        opt.zero_grad()
        loss = torch.zeros(1)
        for ids in work:
            part = loss_of(net, ids) * work.weight(ids)
            part.backward()
            loss += part.detach()
        assert new.commit(model.parameters(), extra=[loss])
        opt.step()
        step = new.end_step(state, loss=float(loss[0]))
    new.finish(step, state)

    assert step == 7 and new.discarded == 0
    assert seen == list(range(7 * GLOBAL))
    for a, b in zip(old_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    steps = [[s.manifest.step for s in sess.saves if s.manifest] for sess in (old, new)]
    assert steps[0] == steps[1] == [3, 6, 7]
    found = CheckpointDir(tmp_path / "new").find_restorable()
    assert found is not None and found.manifest.step == 7


def test_an_elastic_session_after_a_restore_begins_at_the_restored_step(tmp_path: Path) -> None:
    first, state, _ = setup(tmp_path)
    first.restore(state)
    first.end_step(state)  # step 1
    first.end_step(state)  # step 2
    first.end_step(state)  # step 3: saved (every 3)
    first.finish(3, state)
    again, state, _ = setup(tmp_path)
    assert again.restore(state) == 3
    assert again.begin_step(GlobalBatch(GLOBAL, MICRO, 1, 0)).step == 3
    again.close()

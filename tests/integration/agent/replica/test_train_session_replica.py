"""``TrainSession(fault_tolerance="replica")`` with the Redis quorum and real managers: a run
with a preemption (through ``examples/replica_train.py``, which uses it) ends with the loss
curve of a run without; the SDK's own calls in one process. The kill, freeze, heal and
lighthouse tests of test_replica_faults.py run the same example, so they go through the
TrainSession too.

**The claim and its tolerance.** A step's loss and update depend only on the state before it
and on which replicas computed it: step ``s`` always consumes the same samples, split over
the step's sorted members, and the replicas' float32 sums are added in the all-reduce. So:

- bitwise: every step of a live run equals a one-process replay of the same membership
  history (two replicas: ``a + b`` is what gloo's all-reduce of two adds), and two live runs
  agree bitwise for as long as their membership histories agree;
- within a tolerance: a step computed by one replica instead of two sums the same per-sample
  gradients in another order (one accumulation over four micro-batches instead of two plus
  two), which moves the last bits (float32, about 6e-8 relative per addition). SGD on this
  small regression does not amplify that much (measured: at most about 3e-7 relative over
  100 steps with a few dozen taken alone), so the preempted run's losses must stay within
  ``REL_TOL`` (1e-4 relative). The test also checks that the tolerance is far below what it
  guards against: one step's update lost moves the curve by more than ``20 x REL_TOL``
  (measured: about 6e-2).

Its figures are printed (``pytest -s ... | grep FIGURE``)."""

from __future__ import annotations

import functools
import importlib.util
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import redis
import torch
from replica_cluster import (
    TRAIN,
    Cluster,
    Replica,
    figure,
    max_gap,
    wait_for,
)

from spottrain.agent.replica.plan import micro_batches
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.ports import free_port
from spottrain.protocol.keys import RunKeys

pytestmark = pytest.mark.slow

STEPS = 100
GLOBAL, MICRO = 32, 8
ARGS = ("--steps", str(STEPS), "--step-time", "0.05", "--global-batch", str(GLOBAL))
REL_TOL = 1e-4


@functools.cache
def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("replica_train_example", TRAIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.batch = functools.cache(module.batch)  # every replay computes the same samples
    return module


def curve(replicas: list[Replica]) -> tuple[list[float], list[tuple[str, ...]]]:
    """The run's loss per step and the step's sorted members (the replicas that committed
    it), from every replica's rows; members of one step must agree on its loss bitwise."""
    losses: dict[int, float] = {}
    members: dict[int, list[str]] = {}
    for rep in replicas:
        for row in rep.committed():
            s = row["step"]
            assert losses.setdefault(s, row["loss"]) == row["loss"], (s, rep.name)
            members.setdefault(s, []).append(rep.name)
    assert sorted(losses) == list(range(STEPS)), sorted(set(range(STEPS)) - set(losses))
    return [losses[s] for s in range(STEPS)], [tuple(sorted(set(members[s]))) for s in range(STEPS)]


def replay(history: list[int], skip: int = -1) -> list[float]:
    """One process, the example's own model, samples and loss: step ``s`` computed by
    ``history[s]`` replicas (their float32 parts summed as the all-reduce does); ``skip``:
    that step's update is lost (what a broken run would do)."""
    ex = _example()
    args = ex.parse_args([*ARGS, "--micro-batch", str(MICRO)])
    model, opt, sched = ex.build(args)
    params = list(model.parameters())
    out = []
    for step, n in enumerate(history):
        grads: list[torch.Tensor] | None = None
        loss = torch.zeros(1)
        for rank in range(n):
            opt.zero_grad(set_to_none=False)
            part = 0.0
            for ids in micro_batches(step, GLOBAL, MICRO, n, rank):
                part += ex.backward(model, args, ids)
            loss = loss + torch.tensor([part]) if rank else torch.tensor([part])
            mine = [p.grad.detach().clone() for p in params if p.grad is not None]
            grads = mine if grads is None else [a + b for a, b in zip(grads, mine, strict=True)]
        assert grads is not None
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        if step != skip:
            opt.step()
            sched.step()
        out.append(float(loss[0]))
    return out


def run(cluster: Cluster, preempt: bool) -> tuple[list[Replica], float]:
    a = cluster.start("replica-0", *ARGS)
    b = cluster.start("replica-1", *ARGS)
    reps = [a, b]
    stall = 0.0
    if preempt:
        wait_for(
            lambda: sum(1 for r in a.committed() if r["participants"] == 2) >= 10,
            90,
            "both replicas training together",
        )
        noticed_at = time.time()
        cluster.notice(b)  # the replica leaves at a step boundary
        assert b.proc.wait(timeout=60) == 0, b.tail()
        c = cluster.start("replica-1", *ARGS)  # the backfill joins and heals from the survivor
        reps.append(c)
        healed = wait_for(lambda: c.events("healed"), 90, "the joiner to heal")[0]
        # The survivor's longest pause from the notice to the joiner's heal (the leave).
        stall = max_gap([r for r in a.steps() if r["t"] <= healed["t"] - 0.2], noticed_at - 0.5)
    for rep in reps:
        rep.proc.wait(timeout=120)
        assert rep.proc.returncode == 0, rep.tail()
    return reps, stall


@pytest.fixture
def unbroken_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """Forms no quorum with fewer than two replicas, so the unbroken run has both replicas
    in every step from the first (the other cluster's quorum takes whoever came first)."""
    (tmp_path / "unbroken").mkdir()
    c = Cluster(tmp_path / "unbroken", min_replicas=2)
    try:
        yield c
    finally:
        c.stop_all()


def test_a_preempted_run_ends_with_the_loss_curve_of_an_unbroken_one(
    cluster: Cluster,
    unbroken_cluster: Cluster,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    run_keys: RunKeys,
) -> None:
    unbroken, _ = run(unbroken_cluster, preempt=False)
    cluster.redis_url, cluster.run_id = redis_server.endpoint, run_keys.run_id
    preempted, stall = run(cluster, preempt=True)
    ref, ref_members = curve(unbroken)
    got, members = curve(preempted)
    assert any(len(m) == 1 for m in members), "the survivor never trained alone"
    assert members[-1] == ("replica-0", "replica-1"), "the joiner did not take part again"
    # The survivor's discarded attempts: a noticed leave costs none.
    survivor = preempted[0].steps()
    assert survivor[-1]["discarded"] == 0, [r for r in survivor if not r["committed"]]
    # The controller's view, as the elastic SDK reports it, with the discarded count.
    progress = {k.decode(): v.decode() for k, v in redis_client.hgetall(run_keys.progress).items()}
    assert progress["finished"] == "1" and progress["final_step"] == str(STEPS), progress
    assert float(progress["discarded"]) == 0 and "loss" in progress, progress

    # Bitwise: each live run is the replay of its own membership history ...
    assert got == replay([len(m) for m in members])
    assert ref == replay([len(m) for m in ref_members])
    assert ref_members == [("replica-0", "replica-1")] * STEPS  # unbroken indeed
    # ... so two live runs agree bitwise while their memberships agree (the preempted run
    # may start with one replica: the second one's process came up later).
    same = next((s for s in range(STEPS) if members[s] != ref_members[s]), STEPS)
    assert got[:same] == ref[:same]
    assert got != ref  # after it, sums in another order: the last bits differ

    # Within the tolerance everywhere, and the tolerance catches a lost step.
    rel = [abs(g - r) / abs(r) for g, r in zip(got, ref, strict=True)]
    assert max(rel) <= REL_TOL, (max(rel), rel.index(max(rel)))
    lost = replay([len(m) for m in ref_members], skip=same + 5)
    lost_rel = max(abs(g - r) / abs(r) for g, r in zip(lost, ref, strict=True))
    assert lost_rel > 20 * REL_TOL, lost_rel
    figure("loss_curve_max_rel_diff_ppm", max(rel) * 1e6)
    figure("loss_curve_lost_step_rel_diff", lost_rel)
    figure("loss_curve_bitwise_steps", same)
    figure("notice_stall_s", stall)
    figure("solo_steps", sum(1 for m in members if len(m) == 1))


@pytest.mark.parametrize("layout", ["plain", "fsdp"])
def test_the_sdk_calls_in_replica_mode_in_one_process(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """One replica in this process, the SDK's own calls: the mode from the environment,
    the step from the manager, periodic and final checkpoints of ModelState and RngState
    from the replica, and a restart that restores them bitwise; ``session.step`` (which
    cannot tell a discarded step) is refused with the fix. ``fsdp``: the model is FSDP2
    (a one-rank mesh), so its gradients take the sharded path across replicas."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from spottrain.agent.sdk import GlobalBatch, ModelState, RngState, TrainSession
    from spottrain.agent.sdk.replica_mode import ReplicaMode
    from spottrain.protocol.env import (
        ENV_FAULT_TOLERANCE,
        ENV_MANAGER_PORT,
        ENV_MIN_REPLICAS,
        ENV_REPLICA_ID,
    )

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    env = {
        ENV_FAULT_TOLERANCE: "replica",
        ENV_REPLICA_ID: "replica-0",
        **cluster.quorum_env("replica-0"),
        ENV_MIN_REPLICAS: "1",
        "MASTER_ADDR": "127.0.0.1",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "RUST_LOG": "warn",  # torchft's managers log every quorum at info
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)

    def start() -> tuple[TrainSession, dict[str, object], torch.nn.Module]:
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        monkeypatch.setenv(ENV_MANAGER_PORT, str(free_port()))
        dist.init_process_group("gloo", init_method="env://")
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        session = TrainSession(ckpt, every_steps=3, install_signal_handlers=False, redis_url="")
        if layout == "fsdp":
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)
            session.use_fsdp(model)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        return session, {"model": ModelState(model, opt), "rng": RngState()}, model

    session, state, model = start()
    try:
        assert isinstance(session, ReplicaMode)
        step = session.restore(state)
        assert step == 0
        with pytest.raises(RuntimeError, match="begin_step/commit/end_step"):
            session.step(1, state)
        batch = GlobalBatch(8, 4, world=session.world, rank=session.rank)
        while step < 4:
            work = session.begin_step(batch)
            assert work.step == step and work.participants == 1
            assert work.samples == list(range(8 * step, 8 * step + 8))
            opt = state["model"].optimizer  # type: ignore[attr-defined]
            opt.zero_grad()
            for ids in work:
                x = torch.arange(ids.start, ids.stop, dtype=torch.float32).repeat(4, 1).T
                (model(x).pow(2).mean() * work.weight(ids)).backward()
            assert session.commit(model.parameters())
            opt.step()
            step = session.end_step(state, loss=1.0)
        assert step == 4 and session.discarded == 0
        if layout == "fsdp":
            assert all(isinstance(p.grad, DTensor) for p in model.parameters())
        final = full(model)
        rng = torch.get_rng_state()
        session.finish(step, state, exit_process=False)
    finally:
        dist.destroy_process_group()
    saved = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-"))
    assert saved[-2:] == ["step-000000003", "step-000000004"], saved

    torch.manual_seed(1)  # another RNG state: the restore must bring back the saved one
    session, state, model = start()
    try:
        assert session.restore(state) == 4
        assert all(torch.equal(final[k], v) for k, v in full(model).items())
        assert torch.equal(torch.get_rng_state(), rng)
        session.finish(4, state, exit_process=False)
    finally:
        dist.destroy_process_group()


def full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }

"""The step protocol's pure decisions: which samples each participant takes."""

from __future__ import annotations

import pytest

from spottrain.agent.replica.plan import make_plan, micro_batches, share


@pytest.mark.parametrize("participants", [1, 2, 3, 5, 7, 32])
def test_shares_cover_the_global_batch_once_whatever_the_participants(participants: int) -> None:
    seen = [i for r in range(participants) for i in share(32, participants, r)]
    assert seen == list(range(32))
    sizes = {len(share(32, participants, r)) for r in range(participants)}
    assert max(sizes) - min(sizes) <= 1


def test_micro_batches_are_the_steps_samples_cut_to_size() -> None:
    # Step 3 of a global batch of 10: samples 30..39; participant 1 of 3 takes 34..36.
    assert micro_batches(3, 10, 2, 3, 1) == (range(34, 36), range(36, 37))
    assert micro_batches(3, 10, 2, 3, None) == ()


def test_a_redone_step_takes_the_same_samples_with_fewer_participants() -> None:
    before = [i for r in range(2) for m in micro_batches(7, 16, 4, 2, r) for i in m]
    after = [i for m in micro_batches(7, 16, 4, 1, 0) for i in m]
    assert sorted(before) == after == list(range(112, 128))


def test_every_sample_weighs_the_same_so_summed_gradients_are_the_mean() -> None:
    plans = [
        make_plan(
            step=0,
            quorum_id=1,
            participants=3,
            participant_rank=r,
            healed=False,
            global_batch=10,
            micro_batch=4,
        )
        for r in range(3)
    ]
    total = sum(p.weight(m) for p in plans for m in p.micro_batches)
    assert total == pytest.approx(1.0)
    assert [p.samples for p in plans] == [4, 3, 3]


def test_a_healed_replica_takes_part_with_its_share() -> None:
    plan = make_plan(
        step=5,
        quorum_id=2,
        participants=2,
        participant_rank=1,
        healed=True,
        global_batch=8,
        micro_batch=8,
    )
    assert plan.participating and plan.micro_batches == (range(44, 48),)


def test_more_replicas_than_samples_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--global-batch"):
        share(2, 3, 0)
    with pytest.raises(ValueError, match="outside"):
        share(8, 2, 2)
    with pytest.raises(ValueError, match="micro batch"):
        micro_batches(0, 8, 0, 1, 0)


def test_the_ranks_of_a_replica_split_its_share() -> None:
    plan = make_plan(
        step=0,
        quorum_id=1,
        participants=1,
        participant_rank=0,
        healed=False,
        global_batch=12,
        micro_batch=4,
    )
    parts = [plan.local(r, 2) for r in range(2)]
    assert parts == [(range(0, 4), range(8, 12)), (range(4, 8),)]
    assert plan.local(3, 4) == ()

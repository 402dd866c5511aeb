"""The integrations' pure decisions: the save an agreement orders, whether a framework's
version is inside spottrain's extra, whether a path is inside the checkpoint volume."""

from __future__ import annotations

from pathlib import Path

import pytest

from spottrain.agent.checkpoint.in_place import step_of
from spottrain.agent.sdk.integrations.core import (
    SaveOrder,
    order_from_flags,
    outside_root,
    version_problem,
)

REQUIRES = [
    'transformers<5.19,>=5.18; extra == "hf"',
    'accelerate<1.16,>=1.15; extra == "hf"',
    'accelerate<1.16,>=1.15; extra == "accelerate"',
    'lightning<2.7,>=2.6.6; extra == "lightning"',
    "redis>=6.0,<7",
]


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        ([0, 0, 0, 0, 0, 1], None),
        ([1, 0, 0, 4, 0, 1], SaveOrder(9, "emergency", True, 4)),
        ([0, 0, 0, 0, 1, 1], SaveOrder(9, "emergency", True, 0)),  # a rank's SIGTERM
        ([1, 1, 0, 6, 0, 1], SaveOrder(9, "emergency", True, 6)),  # a drain wins
        ([0, 1, 0, 2, 0, 1], SaveOrder(9, "requested", False, 2)),
        ([0, 0, 1, 0, 0, 1], SaveOrder(9, "periodic", False, 0)),
    ],
)
def test_the_agreed_flags_order_the_save(flags: list[int], want: SaveOrder | None) -> None:
    assert order_from_flags(9, flags) == want


def test_a_version_inside_the_extra_is_no_problem() -> None:
    assert version_problem("transformers", "5.18.0", REQUIRES, "hf") is None
    assert version_problem("lightning", "2.6.9", REQUIRES, "lightning") is None
    assert version_problem("transformers", None, REQUIRES, "hf") is None  # not installed


def test_a_version_outside_the_extra_names_the_range_and_the_fix() -> None:
    text = version_problem("transformers", "5.20.1", REQUIRES, "hf")
    assert text == (
        "transformers 5.20.1 is outside the versions spottrain's integration was tested with "
        "(transformers<5.19,>=5.18): install spottrain[hf] to get them, or expect the "
        "integration to break"
    )
    lightning = version_problem("lightning", "2.5.0", REQUIRES, "lightning")
    assert lightning is not None and "spottrain[lightning]" in lightning


def test_a_package_the_extra_does_not_name_is_not_checked() -> None:
    assert version_problem("lightning", "1.0", REQUIRES, "hf") is None


def test_paths_inside_and_outside_the_volume(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    assert not outside_root(root, root)
    assert not outside_root(root / "hf" / "checkpoint-3", root)
    assert outside_root(tmp_path / "ckpt2", root)  # a prefix of the name is not inside
    assert outside_root(tmp_path, root)


def test_checkpoint_names_give_their_step() -> None:
    assert step_of("checkpoint-40", "checkpoint-") == 40
    assert step_of(".torn-checkpoint-40-123", "checkpoint-") is None
    assert step_of("checkpoint-4a", "checkpoint-") is None

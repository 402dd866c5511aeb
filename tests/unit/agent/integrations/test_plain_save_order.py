"""The plain script helper's pure decisions: which save a step makes."""

from __future__ import annotations

import pytest

from spottrain.agent.sdk.integrations.core import SaveOrder
from spottrain.agent.sdk.integrations.plain import check_save_every, save_order


def test_an_agreed_order_wins_over_the_periodic_save() -> None:
    order = SaveOrder(10, "emergency", True, 3)
    assert save_order(order, 10, 5) is order


def test_a_periodic_save_comes_every_save_every_steps_and_never_at_step_zero() -> None:
    assert [s for s in range(0, 13) if save_order(None, s, 4)] == [4, 8, 12]
    assert save_order(None, 8, 4) == SaveOrder(8, "periodic")
    assert save_order(None, 8, None) is None


def test_a_save_every_below_one_is_refused_naming_the_fix() -> None:
    with pytest.raises(ValueError, match=r"save_every=0: give a number of steps >= 1, or None"):
        check_save_every(0)
    check_save_every(None)
    check_save_every(1)

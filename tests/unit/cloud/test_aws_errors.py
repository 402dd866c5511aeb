"""AWS error text that is matched rather than classified by code."""

from __future__ import annotations

from spottrain.cloud.aws.errors import lifecycle_action_gone


def test_no_active_lifecycle_action_means_there_is_nothing_left_to_complete() -> None:
    gone = Exception(
        "An error occurred (ValidationError) when calling the CompleteLifecycleAction "
        "operation: No active Lifecycle Action found with instance ID i-0123456789abcdef0"
    )
    assert lifecycle_action_gone(gone)
    assert not lifecycle_action_gone(Exception("Rate exceeded"))
    # The match is exact, as the agent's copy has always been.
    assert not lifecycle_action_gone(Exception("no active lifecycle action"))

"""The injected-notice format on the floor: what inject_notice queues, and how it is read."""

from __future__ import annotations

import json
from typing import Any

import pytest

from spottrain.protocol.keys import RunKeys
from spottrain.protocol.notices import decode_injected, inject_notice


class _Client:
    def __init__(self) -> None:
        self.pushed: list[tuple[str, str]] = []

    def rpush(self, key: str, value: str) -> None:
        self.pushed.append((key, value))


def test_inject_notice_queues_kind_and_seconds_on_the_nodes_list() -> None:
    client = _Client()
    keys = RunKeys("r1")
    inject_notice(client, keys, "n1", "terminate", 60)  # type: ignore[arg-type]
    [(key, value)] = client.pushed
    assert key == keys.notices("n1")
    assert json.loads(value) == {"kind": "terminate", "in": 60}
    assert decode_injected(value) == {"kind": "terminate", "in": 60}


@pytest.mark.parametrize("raw", [b"[1]", b"3", b"not json"])
def test_a_body_that_is_not_a_json_object_is_refused(raw: Any) -> None:
    with pytest.raises(ValueError):
        decode_injected(raw)

"""The floor's event stream module (spottrain.protocol.events) against the golden stream:
its writers rebuild every captured entry field for field and in order, its reader reads the
captured stream as ``RunState.events()`` did, and the archived log round-trips line for line."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from spottrain.protocol import events
from spottrain.protocol.keys import RunKeys

HERE = Path(__file__).parent
DUMP = json.loads((HERE / "redis_dump.json").read_text())
EVENTS: list[dict[str, str]] = json.loads((HERE / "events.json").read_text())
KEYS = RunKeys(DUMP["run_id"])
# The stream as Redis held it: (id, [(field, value), ...]) in order.
RAW = DUMP["keys"][KEYS.events]["value"]
# The SDK's checkpoint reports: type, then the fields of the hash they mirror.
RECORD_TYPES = {"checkpoint-committed", "checkpoint-refused"}


def _text(v: dict[str, str]) -> str:
    return base64.b64decode(v["b64"]).decode() if "b64" in v else v["s"]


def rebuild(row: dict[str, str]) -> dict[str, str]:
    """The entry the writers make from what a reader read (its ``id`` dropped)."""
    fields = {k: v for k, v in row.items() if k != "id"}
    if fields["type"] in RECORD_TYPES:
        return events.record_event(fields.pop("type"), fields)
    type_, node, at = fields.pop("type"), fields.pop("node"), float(fields.pop("at"))
    return events.envelope(type_, node, at=at, **fields)


@pytest.fixture
def client(redis_client: redis.Redis) -> Iterator[redis.Redis]:
    redis_client.delete(KEYS.events)
    yield redis_client
    redis_client.delete(KEYS.events)


def test_the_golden_stream_covers_both_shapes() -> None:
    types = {row["type"] for row in EVENTS}
    assert types & RECORD_TYPES and types - RECORD_TYPES


def test_the_writers_rebuild_every_captured_entry_in_order() -> None:
    assert len(RAW) == len(EVENTS)
    for (entry_id, pairs), row in zip(RAW, EVENTS, strict=True):
        assert entry_id == row["id"]
        want = [(_text(k), _text(v)) for k, v in pairs]
        assert list(rebuild(row).items()) == want


def test_appended_entries_read_back_as_the_golden_stream(client: redis.Redis) -> None:
    for row in EVENTS:
        client.xadd(KEYS.events, rebuild(row), id=row["id"])
    assert events.read(client, KEYS.events) == EVENTS
    # Raw, as Redis holds it: the same fields in the same order.
    raw = client.xrange(KEYS.events)
    assert [(i.decode(), [(k.decode(), v.decode()) for k, v in f.items()]) for i, f in raw] == [
        (i, [(_text(k), _text(v)) for k, v in p]) for i, p in RAW
    ]


def test_read_after_an_id_is_exclusive_and_count_caps_it(client: redis.Redis) -> None:
    for row in EVENTS:
        client.xadd(KEYS.events, rebuild(row), id=row["id"])
    assert events.read(client, KEYS.events, after=events.START) == EVENTS
    assert events.read(client, KEYS.events, after="-") == EVENTS
    for n in (0, 1, len(EVENTS) // 2, len(EVENTS) - 1):
        assert events.read(client, KEYS.events, after=EVENTS[n]["id"]) == EVENTS[n + 1 :]
    assert events.read(client, KEYS.events, count=3) == EVENTS[:3]
    assert events.read(client, KEYS.events, after=EVENTS[-1]["id"]) == []


def test_decode_takes_bytes_or_text() -> None:
    row = EVENTS[0]
    fields = {k: v for k, v in row.items() if k != "id"}
    as_bytes = {k.encode(): v.encode() for k, v in fields.items()}
    assert events.decode(row["id"].encode(), as_bytes) == row
    assert events.decode(row["id"], fields) == row


def test_the_archived_log_round_trips_line_for_line() -> None:
    lines = (HERE / "events.jsonl").read_text().splitlines()
    assert [events.from_archive_line(line) for line in lines] == EVENTS
    assert [events.to_archive_line(row) for row in EVENTS] == lines


def test_append_trims_the_stream(client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    assert events.EVENTS_MAXLEN == 100_000  # the cap every writer used
    monkeypatch.setattr(events, "EVENTS_MAXLEN", 10)
    for i in range(1_000):
        events.append(client, KEYS.events, events.envelope("tick", "n0", i=i))
    # Approximate trimming (XADD MAXLEN ~): whole macro nodes go, at least the cap stays.
    assert 10 <= client.xlen(KEYS.events) < 1_000
    assert events.read(client, KEYS.events)[-1]["i"] == "999"


def test_append_queues_in_a_pipeline(client: redis.Redis) -> None:
    pipe = client.pipeline(transaction=False)
    events.append(pipe, KEYS.events, events.envelope("tick", "n0"))
    assert client.xlen(KEYS.events) == 0
    pipe.execute()
    assert [r["type"] for r in events.read(client, KEYS.events)] == ["tick"]


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ("as is", "as is"),
        ("", ""),
        (3, "3"),
        (0.25, "0.25"),
        (True, "true"),
        (None, "null"),
        ({"a": [1, 2]}, '{"a": [1, 2]}'),
    ],
)
def test_values_are_text_or_json(value: Any, text: str) -> None:
    assert events.encode_value(value) == text


def test_the_envelope_orders_type_node_at_then_fields() -> None:
    before = time.time()
    entry = events.envelope("state", "n1", state="joined", round=2)
    assert list(entry) == ["type", "node", "at", "state", "round"]
    assert entry["round"] == "2"
    assert before - 0.001 <= float(entry["at"]) <= time.time() + 0.001
    assert len(entry["at"].split(".")[1]) == 3
    assert events.envelope("x", "", at=1795543770.0874)["at"] == "1795543770.087"


def test_a_record_event_keeps_str_of_each_value() -> None:
    record = {"node": "", "step": 2, "write_s": 0.0233, "at": 1795543771.9901626}
    assert events.record_event("checkpoint-committed", record) == {
        "type": "checkpoint-committed",
        "node": "",
        "step": "2",
        "write_s": "0.0233",
        "at": "1795543771.9901626",
    }

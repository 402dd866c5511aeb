"""The run's event stream (``RunKeys.events``): how an event is written and how it is read.

Every event is one Redis stream entry whose fields and values are text. The envelope most
writers use (the controller, the agent's node record, the SDK's progress and restore
reports) is built by :func:`envelope`::

    type   what happened ("launched", "state", "notice", "progress", ...)
    node   who says so: a node id, "controller", or "" (a worker that knows no node id)
    at     Unix seconds with three decimals ("1795543770.087")
    ...    the event's own fields, in the order given: text as it is, anything else as JSON

The SDK's checkpoint reports are record events (:func:`record_event`): ``type`` and then the
same fields as the hash they mirror (``ckpt:last``, ``ckpt:refused``), each ``str()`` of its
value, ``node`` and ``at`` among them. Every entry goes through :func:`append`, which trims
the stream to about :data:`EVENTS_MAXLEN` entries.

Readers get an entry as a ``dict[str, str]`` of its fields plus its stream id as ``id``
(:func:`decode`, :func:`read`); the archived log (``events.jsonl``, one JSON object per line)
holds the same objects (:func:`to_archive_line`, :func:`from_archive_line`).

This is a format: fleets keep their stream across an upgrade (``tests/golden/``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import redis

# Every writer of a run's event stream trims it to about this many entries.
EVENTS_MAXLEN = 100_000

# Stream ids: before the first entry, and "everything" for XRANGE.
START = "0-0"
_ALL = "-"


def encode_value(value: Any) -> str:
    """One field's value as the stream holds it: text as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def envelope(type_: str, node: str, at: float | None = None, **fields: Any) -> dict[str, str]:
    """The fields of one event: ``type``, ``node``, ``at`` (now unless given), then ``fields``
    in their order, each through :func:`encode_value`."""
    return {
        "type": type_,
        "node": node,
        "at": f"{time.time() if at is None else at:.3f}",
        **{k: encode_value(v) for k, v in fields.items()},
    }


def record_event(type_: str, record: Mapping[str, Any]) -> dict[str, str]:
    """A record event: ``type`` and then ``record``'s fields, each ``str()`` of its value (the
    SDK's checkpoint reports, whose fields mirror the hash written beside them)."""
    return {"type": type_, **{k: str(v) for k, v in record.items()}}


def append(client: redis.Redis, key: str, entry: Mapping[str, str]) -> Any:
    """Add one entry to the stream ``key`` and trim it to about :data:`EVENTS_MAXLEN`.

    ``client`` may be a pipeline (the entry is then queued with the pipeline's other
    commands); returns what ``XADD`` returns (the new id, or the pipeline)."""
    return client.xadd(key, dict(entry), maxlen=EVENTS_MAXLEN, approximate=True)


def decode(entry_id: bytes | str, fields: Mapping[bytes | str, bytes | str]) -> dict[str, str]:
    """One stream entry as readers see it: its fields as text, and its id as ``id``."""
    row = {_text(k): _text(v) for k, v in fields.items()}
    row["id"] = _text(entry_id)
    return row


def read(
    client: redis.Redis, key: str, after: str = START, count: int | None = None
) -> list[dict[str, str]]:
    """The entries of stream ``key`` after id ``after`` (exclusive; :data:`START`: from the
    first), oldest first, at most ``count`` of them (all when None), each :func:`decode`'d."""
    low = _ALL if after in (START, _ALL) else f"({after}"
    return [decode(i, f) for i, f in client.xrange(key, min=low, max="+", count=count)]


def to_archive_line(row: Mapping[str, str]) -> str:
    """One read entry (with its ``id``) as a line of the archived log, without the newline."""
    return json.dumps(dict(row))


def from_archive_line(line: str) -> dict[str, str]:
    """One line of the archived log back as the entry it was (every value as text)."""
    return {str(k): str(v) for k, v in json.loads(line).items()}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

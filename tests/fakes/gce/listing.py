"""List filters and pages, as the Compute API reads ``filter``, ``maxResults`` and
``pageToken``: plain lists and aggregated (per-zone) lists."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from typing import Any

from .common import API, ApiError

_Read = Callable[[dict[str, Any]], dict[str, Any]]

_TERM_RE = re.compile(
    r"""\s*(?P<open>\()?\s*
    (?P<field>[A-Za-z][A-Za-z0-9_]*(\.[A-Za-z0-9_-]+)*)\s*
    (?P<op>!=|=)\s*
    ("(?P<quoted>[^"\\]*)"|(?P<bare>[A-Za-z0-9_.:/-]+))\s*
    (?(open)\))\s*""",
    re.VERBOSE,
)


def parse_filter(text: str) -> list[tuple[str, str, str]]:
    """``(field, op, value)`` terms of a filter that all must hold.

    Raises:
        ApiError: 400 for any syntax beyond ``field = value``, ``field != value`` and their
            conjunction (by juxtaposition of parenthesised terms or ``AND``).
    """
    terms: list[tuple[str, str, str]] = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _TERM_RE.match(text, pos)
        if m is None:
            raise ApiError(
                400,
                f"Invalid value for field 'filter': '{text}'. The fake Compute API understands "
                'only field = "value", field != "value" and their conjunction.',
                "invalid",
            )
        value = m["quoted"] if m["quoted"] is not None else m["bare"]
        terms.append((m["field"], m["op"], value))
        pos = m.end()
        conj = re.compile(r"AND\s+").match(text, pos)
        if conj is not None:
            pos = conj.end()
            if pos >= len(text):
                raise ApiError(400, f"Invalid value for field 'filter': '{text}'.", "invalid")
    return terms


def _field(resource: dict[str, Any], path: str) -> Any:
    value: Any = resource
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def matches(resource: dict[str, Any], terms: list[tuple[str, str, str]]) -> bool:
    for path, op, expected in terms:
        value = _field(resource, path)
        text = (
            json.dumps(value) if isinstance(value, bool) else None if value is None else str(value)
        )
        if (text == expected) != (op == "="):
            return False
    return True


def _filtered(
    items: list[dict[str, Any]], query: dict[str, str], read: _Read | None
) -> list[dict[str, Any]]:
    """The items the filter matches, each read (a read may move a VM's status on)."""
    terms = parse_filter(query.get("filter", ""))
    return [read(i) if read else copy.deepcopy(i) for i in items if matches(i, terms)]


def page_bounds(query: dict[str, str], total: int, page_size: int) -> tuple[int, int]:
    try:
        start = int(query.get("pageToken") or 0)
        size = int(query.get("maxResults") or page_size)
    except ValueError:
        raise ApiError(400, "Invalid value for pageToken or maxResults.", "invalid") from None
    if not 0 <= start <= total or not 0 < size <= 500:
        raise ApiError(400, "Invalid value for pageToken or maxResults.", "invalid")
    return start, min(start + min(size, page_size), total)


def list_page(
    link: str,
    kind: str,
    items: list[dict[str, Any]],
    query: dict[str, str],
    page_size: int,
    read: _Read | None = None,
) -> dict[str, Any]:
    chosen = _filtered(items, query, read)
    start, end = page_bounds(query, len(chosen), page_size)
    body: dict[str, Any] = {
        "kind": kind,
        "id": link,
        "items": chosen[start:end],
        "selfLink": f"{API}/{link}",
    }
    if end < len(chosen):
        body["nextPageToken"] = str(end)
    return body


def aggregated_page(
    link: str,
    kind: str,
    key: str,
    scoped: dict[str, list[dict[str, Any]]],
    query: dict[str, str],
    page_size: int,
    read: _Read | None = None,
) -> dict[str, Any]:
    """An aggregated list page: items keyed ``zones/ZONE``; zones without matches carry the
    API's ``NO_RESULTS_ON_PAGE`` warning. Pages cut across zones in zone order."""
    flat = [
        (zone, item) for zone, items in scoped.items() for item in _filtered(items, query, read)
    ]
    start, end = page_bounds(query, len(flat), page_size)
    page: dict[str, Any] = {}
    for zone in scoped:
        mine = [item for z, item in flat[start:end] if z == zone]
        if mine:
            page[f"zones/{zone}"] = {key: mine}
        else:
            page[f"zones/{zone}"] = {
                "warning": {
                    "code": "NO_RESULTS_ON_PAGE",
                    "message": f"There are no results for scope 'zones/{zone}' on this page.",
                    "data": [{"key": "scope", "value": f"zones/{zone}"}],
                }
            }
    body: dict[str, Any] = {"kind": kind, "id": link, "items": page, "selfLink": f"{API}/{link}"}
    if end < len(flat):
        body["nextPageToken"] = str(end)
    return body

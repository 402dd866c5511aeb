"""The agent's systemd unit as shipped in the package, and a reader for unit files.

The unit (``systemd/spottrain-agent.service`` next to this module) is what a VM image
installs. Tests here and the Terraform tests read it through :func:`parse_unit` so that a
setting the drain depends on (``KillMode=mixed``, a stop timeout covering the notice window)
cannot change unnoticed.
"""

from __future__ import annotations

import math
import re
from importlib.resources import files
from pathlib import Path

UNIT_NAME = "spottrain-agent.service"
_PACKAGE = "spottrain.agent"


class UnitSyntaxError(ValueError):
    """A unit file line that is neither a section, a comment nor ``Key=value``."""


def unit_path() -> Path:
    """Where the packaged ``spottrain-agent.service`` is.

    Raises:
        FileNotFoundError: The installed package lacks it: the wheel was built without the
            ``systemd/`` folder as package data.
    """
    found = files(_PACKAGE).joinpath("systemd", UNIT_NAME)
    # A wheel installed into a venv is always a folder on disk; only a zipped import would
    # give something else, and the image never installs one.
    path = Path(str(found))
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: {_PACKAGE} was installed without its systemd/ folder; "
            "list it under [tool.setuptools.package-data] in pyproject.toml and rebuild"
        )
    return path


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """Read a systemd unit file into section -> key -> values, in file order.

    Follows systemd's syntax (systemd.syntax(7)): lines starting with ``#`` or ``;`` are
    comments, a line ending in a backslash continues on the next one (the backslash becomes
    a space), a key may repeat (each value is kept), and an empty assignment (``Key=``)
    resets the key's list, as systemd does. A section may appear more than once; its keys
    merge. Values are not unquoted or split: ``ExecStart`` stays one string.

    Args:
        text: The unit file's contents.

    Returns:
        ``{"Service": {"KillMode": ["mixed"], ...}, ...}``

    Raises:
        UnitSyntaxError: A setting outside any section, or a line that is not a section
            header, a comment or ``Key=value`` (the message gives the line number).
    """
    units: dict[str, dict[str, list[str]]] = {}
    section: dict[str, list[str]] | None = None
    pending = ""
    pending_line = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if stripped.startswith(("#", ";")):
            continue  # comments are ignored even between continued lines
        if not pending:
            pending_line = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        line, pending = (pending + stripped).strip(), ""
        if not line:
            continue
        if line.startswith("["):
            if not line.endswith("]") or len(line) < 3:
                raise UnitSyntaxError(f"line {pending_line}: bad section header {line!r}")
            section = units.setdefault(line[1:-1], {})
            continue
        key, eq, value = line.partition("=")
        key = key.strip()
        if not eq or not key:
            raise UnitSyntaxError(
                f"line {pending_line}: {line!r} is not a section header, a comment or Key=value"
            )
        if section is None:
            raise UnitSyntaxError(f"line {pending_line}: {key}= comes before any [Section] header")
        value = value.strip()
        if value:
            section.setdefault(key, []).append(value)
        else:
            section[key] = []
    if pending.strip():
        raise UnitSyntaxError(f"line {pending_line}: the file ends inside a continued line")
    return units


_SPAN_UNITS = {
    **dict.fromkeys(("us", "usec", "µs", "μs"), 1e-6),
    **dict.fromkeys(("ms", "msec"), 1e-3),
    **dict.fromkeys(("", "s", "sec", "second", "seconds"), 1.0),
    **dict.fromkeys(("m", "min", "minute", "minutes"), 60.0),
    **dict.fromkeys(("h", "hr", "hour", "hours"), 3600.0),
    **dict.fromkeys(("d", "day", "days"), 86400.0),
    **dict.fromkeys(("w", "week", "weeks"), 7 * 86400.0),
    **dict.fromkeys(("M", "month", "months"), 30.44 * 86400.0),
    **dict.fromkeys(("y", "year", "years"), 365.25 * 86400.0),
}
_SPAN_PART = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-zµμ]*)")


def parse_timespan(value: str) -> float:
    """Seconds in a systemd time span (systemd.time(7)): ``170``, ``170s``, ``3min``,
    ``2min 30s``, ``infinity``. A bare number is seconds, as in ``TimeoutStopSec=``.

    Raises:
        ValueError: Not a time span (the message names the part that is not).
    """
    text = value.strip()
    if text == "infinity":
        return math.inf
    total, pos = 0.0, 0
    while pos < len(text):
        m = _SPAN_PART.match(text, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"{value!r} is not a systemd time span: cannot read {text[pos:]!r}")
        number, unit = m.groups()
        if unit not in _SPAN_UNITS:
            raise ValueError(
                f"{value!r} is not a systemd time span: unknown unit {unit!r} "
                "(use s, min, h, ms, ...)"
            )
        total += float(number) * _SPAN_UNITS[unit]
        pos = m.end()
    if not text:
        raise ValueError("an empty string is not a systemd time span")
    return total

"""Text from a VM or a worker made safe to show: secrets spottrain knows replaced, control
characters escaped.

Anything a VM writes (its boot output, a worker's lines, an event field) can hold terminal
escapes (a worker holds the Redis password in its environment and can write to the event
stream) or a secret a process printed. Before such text reaches an operator's terminal,
``status`` or the live view, :func:`escape_controls` turns every control character into a
visible escape, and :func:`redact` replaces every value spottrain knows to be secret.

Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

REDACTED = "[redacted]"
# Shorter values would match ordinary text ("ab" inside every word): a secret this short is
# no secret, and replacing it would garble the line without protecting anything.
MIN_SECRET_LEN = 6

# C0 controls but tab, and DEL: what a value bound for one line of a file (a lock, a unit's
# setting) or for a shell must not hold. Public: every such check uses this one.
LINE_CONTROLS = re.compile("[\x00-\x08\x0a-\x1f\x7f]")
# The same and the C1 controls (U+0080..U+009F: a terminal reads U+009B as
# CSI, the same as ESC '[').
_CONTROLS = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f]")
# The same but newline: text spottrain itself puts on several lines.
_CONTROLS_BUT_NEWLINE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# What a node's own output keeps on a terminal: its colours (SGR, ``ESC [ params m``, which
# only recolour) and CRLF line ends. Every other sequence can move the cursor over earlier
# lines, retitle the window, or make the terminal answer back as if typed.
_KEPT_OR_CONTROL = re.compile("(\x1b\\[[0-9;:]{0,64}m|\r\n)|[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _escape(m: re.Match[str]) -> str:
    c = m.group()
    return {"\n": "\\n", "\r": "\\r", "\x1b": "\\e"}.get(c, f"\\x{ord(c):02x}")


def escape_controls(text: str) -> str:
    """``text`` with every control character but tab written as a visible escape (``\\e``,
    ``\\n``, ``\\x07``...), so no byte of it can move the cursor, recolour or retitle a
    terminal."""
    return _CONTROLS.sub(_escape, text)


def escape_lines(text: str) -> str:
    """``text`` with every control character but tab and newline written as a visible escape:
    for lines spottrain composed itself, some of whose parts came from a node."""
    return _CONTROLS_BUT_NEWLINE.sub(_escape, text)


def escape_output(text: str) -> str:
    """A node's output made safe for a terminal: as :func:`escape_lines`, but its colour
    codes (SGR) and CRLF line ends kept."""
    return _KEPT_OR_CONTROL.sub(lambda m: m.group(1) or _escape(m), text)


def redact(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every occurrence of each secret (at least :data:`MIN_SECRET_LEN`
    characters; longest first, so a secret containing another is replaced whole) replaced by
    :data:`REDACTED`."""
    for s in sorted({s for s in secrets if len(s) >= MIN_SECRET_LEN}, key=len, reverse=True):
        text = text.replace(s, REDACTED)
    return text


def one_line(text: str, limit: int = 300) -> str:
    """``text`` as one safe line: control characters escaped, cut at ``limit`` characters
    (with an ellipsis)."""
    line = escape_controls(text.strip())
    return line if len(line) <= limit else line[: limit - 1] + "…"

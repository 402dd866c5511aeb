"""What reaches a terminal from a node: :func:`escape_output` keeps a node's colours (SGR)
and CRLF line ends and escapes every other control; :func:`escape_lines` keeps newlines
only; both leave text without controls as it was."""

from __future__ import annotations

import pytest

from spottrain.safetext import escape_controls, escape_lines, escape_output


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("\x1b[1;31mred\x1b[0m\n", "\x1b[1;31mred\x1b[0m\n"),
        ("\x1b[38:2::255:0:0mrgb\x1b[m", "\x1b[38:2::255:0:0mrgb\x1b[m"),
        ("line\r\n", "line\r\n"),
        ("50%\r60%\n", "50%\\r60%\n"),
        ("\x1b]0;pwned\x07", "\\e]0;pwned\\x07"),
        ("\x1b[2J\x1b[1A\x1b[6n", "\\e[2J\\e[1A\\e[6n"),
        ("\x9b31m", "\\x9b31m"),
        ("\x1b[31;", "\\e[31;"),
        ("tab\tkept", "tab\tkept"),
    ],
)
def test_a_nodes_output_keeps_its_colours_and_nothing_else(raw: str, shown: str) -> None:
    assert escape_output(raw) == shown


def test_escape_lines_keeps_newlines_and_escapes_the_rest() -> None:
    assert escape_lines("a\n\x1b[31mb\r") == "a\n\\e[31mb\\r"
    assert escape_lines("plain text, ünïcode") == "plain text, ünïcode"
    assert escape_controls(escape_lines("a\nb")) == "a\\nb"

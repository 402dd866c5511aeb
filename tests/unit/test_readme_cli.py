"""The README's "The command line" keeps up with the parser: every `spottrain` command has
its item, and every option of it is named there (by any of its spellings). `simulate` is the
exception the README states: its `--help` lists the simulator's many knobs. And the README
has no HTML comment left open, which would hide everything after it on GitHub."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from spottrain.controller.cli.parser import build_parser

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
# Commands whose item points at `--help` for their options instead of naming each.
SEE_HELP = {"simulate"}


def _items() -> dict[str, str]:
    section = README.split("\n## The command line\n", 1)[1].split("\n## ", 1)[0]
    items: dict[str, str] = {}
    for m in re.finditer(r"^- `spottrain ([\w-]+)[^\n]*(?:\n  [^\n]*)*", section, re.M):
        items[m.group(1)] = items.get(m.group(1), "") + m.group(0)
    return items


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_command_and_option_is_in_the_readme() -> None:
    items = _items()
    missing = []
    for name, parser in _commands().items():
        if name not in items:
            missing.append(f"spottrain {name}")
            continue
        if name in SEE_HELP:
            assert "--help" in items[name], f"spottrain {name}'s item should point at --help"
            continue
        for action in parser._actions:
            spellings = [o for o in action.option_strings if o not in ("-h", "--help")]
            if spellings and not any(re.search(rf"{o}\b", items[name]) for o in spellings):
                missing.append(f"spottrain {name} {spellings[-1]}")
    assert not missing, f"not in the README's command line section: {missing}"


def test_the_readme_has_no_open_html_comment() -> None:
    assert README.count("<!--") == README.count("-->"), "an HTML comment is left open"

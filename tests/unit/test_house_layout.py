"""The house's shape, checked: no product module over 500 lines, no function over 80, and
every package folder is one that setuptools ships (a folder missing from pyproject's list
works in an editable checkout and is absent from the wheel a VM installs)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = {
    "spottrain": "spottrain",
    "agent": "spottrain.agent",
    "controller": "spottrain.controller",
    "cloud": "spottrain.cloud",
}
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def _modules() -> list[Path]:
    return sorted(p for root in ROOTS for p in (REPO / root).rglob("*.py"))


def test_no_function_is_over_80_lines() -> None:
    long = {}
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{p.relative_to(REPO)}:{node.lineno} {node.name}"] = n
    assert not long, f"shorten these: {long}"


def test_every_package_folder_is_shipped() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for root, name in ROOTS.items():
        for init in (REPO / root).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / root)
            found.add(".".join([name, *rel.parts]))
    # Folders of package data only (no __init__.py) ship as packages too.
    found |= set(config["package-data"])
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - found == set(), "these are listed in pyproject.toml but have no folder"

"""Read a Terraform module the way the tests check it, without a Terraform binary.

python-hcl2 (8.x) keeps HCL's quotes around string values and block labels and marks
blocks with ``__is_block__``; :func:`load_module` strips both, so tests compare plain
values: ``module.resources("aws_launch_template")["fleet"]["metadata_options"][0]``.
Expressions stay as text (``"${var.x > 0}"``) and tests look into them as text.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hcl2

REPO = Path(__file__).resolve().parents[1]
TERRAFORM = REPO / "terraform"

_VAR_REF = re.compile(r"\bvar\.([A-Za-z_][A-Za-z0-9_-]*)")
_TEMPLATE_REF = re.compile(r"\$\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}")


def _unquote(v: Any) -> Any:
    if isinstance(v, str) and len(v) >= 2 and v[0] == '"' and v[-1] == '"':
        return v[1:-1]
    return v


def clean(v: Any) -> Any:
    """hcl2's output with quotes and block markers removed."""
    if isinstance(v, dict):
        return {_unquote(k): clean(x) for k, x in v.items() if k != "__is_block__"}
    if isinstance(v, list):
        return [clean(x) for x in v]
    return _unquote(v)


@dataclass
class Module:
    """Every ``.tf`` file of one module folder, parsed and merged."""

    path: Path
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)

    def blocks(self, kind: str) -> list[dict[str, Any]]:
        """Every top-level block of ``kind`` (``variable``, ``resource``...), from all files."""
        out: list[dict[str, Any]] = []
        for parsed in self.files.values():
            out.extend(parsed.get(kind, []))
        return out

    def labelled(self, kind: str) -> dict[str, dict[str, Any]]:
        """Blocks with one label (``variable "x"``, ``output "y"``), by label."""
        found: dict[str, dict[str, Any]] = {}
        for b in self.blocks(kind):
            for name, body in b.items():
                assert name not in found, f"{kind} {name!r} is declared twice in {self.path}"
                found[name] = body
        return found

    def resources(self, rtype: str, kind: str = "resource") -> dict[str, dict[str, Any]]:
        """Resources (or data sources, ``kind="data"``) of one type, by name."""
        found: dict[str, dict[str, Any]] = {}
        for b in self.blocks(kind):
            for t, named in b.items():
                if t == rtype:
                    found.update(named)
        return found

    def resource_types(self, kind: str = "resource") -> set[str]:
        return {t for b in self.blocks(kind) for t in b}

    @property
    def variables(self) -> dict[str, dict[str, Any]]:
        return self.labelled("variable")

    @property
    def outputs(self) -> dict[str, dict[str, Any]]:
        return self.labelled("output")

    def text(self) -> str:
        """Every ``.tf`` file and template of the module, joined (for reference checks)."""
        return "\n".join(self.texts.values())

    def used_variables(self) -> set[str]:
        """Names read as ``var.NAME`` anywhere in the module's ``.tf`` files."""
        used: set[str] = set()
        for name, text in self.texts.items():
            if name.endswith(".tf"):
                used.update(_VAR_REF.findall(text))
        return used


def load_module(path: Path) -> Module:
    """Parse every ``.tf`` file in ``path``; templates (``*.tftpl``) are kept as text."""
    mod = Module(path=path)
    tf_files = sorted(path.glob("*.tf"))
    assert tf_files, f"no .tf files in {path}"
    for f in tf_files:
        with f.open() as fh:
            mod.files[f.name] = clean(hcl2.load(fh))
        mod.texts[f.name] = f.read_text()
    for f in sorted(path.glob("*.tftpl")):
        mod.texts[f.name] = f.read_text()
    return mod


def template_names(text: str) -> set[str]:
    """The ``${name}`` placeholders of a Terraform template (``$${...}`` is an escape)."""
    return set(_TEMPLATE_REF.findall(text.replace("$${", "\0")))


def render_template(text: str, values: dict[str, str]) -> str:
    """Render a Terraform template that uses plain ``${name}`` placeholders only, as
    ``templatefile`` would: ``$${`` becomes a literal ``${``. Directives (``%{ if }``) are
    refused, so a template this cannot render fails its test instead of passing half-read."""
    assert "%{" not in text.replace("%%{", ""), "templates must not use %{ } directives"
    missing = template_names(text) - set(values)
    assert not missing, f"no value for template placeholders {sorted(missing)}"
    escaped = text.replace("$${", "\0")
    out = _TEMPLATE_REF.sub(lambda m: values[m.group(1)], escaped)
    return out.replace("\0", "${").replace("%%{", "%{")


def block_text(text: str, header: str) -> str:
    """The source of one top-level block (``variable "x" {`` ... its closing ``}``), as
    written, for a scratch module that evaluates it with a real Terraform."""
    start = text.index(header + " {\n")
    end = text.index("\n}\n", start) + 3
    return text[start:end]


def terraform_console(
    module_text: str, expression: str, variables: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Evaluate ``expression`` with ``terraform console`` in a scratch module holding only
    ``module_text`` (no provider, no state), with ``-var`` for each of ``variables``.
    A refused variable does not change the exit status: its ``Error:`` is on stderr.
    The caller skips when there is no ``terraform`` on PATH."""
    args = [f"-var={k}={v}" for k, v in (variables or {}).items()]
    with tempfile.TemporaryDirectory() as scratch:
        Path(scratch, "main.tf").write_text(module_text)
        return subprocess.run(
            ["terraform", "console", "-no-color", *args],
            input=expression + "\n",
            cwd=scratch,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "TF_CLI_CONFIG_FILE": os.devnull, "CHECKPOINT_DISABLE": "1"},
        )

"""Run the parts of a Terraform module's rendered boot script that read secrets, the way a VM
runs them, for the tests of ``train.secret_env`` and ``code.git.token_secret`` in
terraform/aws and terraform/gcp.

The boot reads secrets with the installed spottrain's boot loader
(``python -m spottrain.cloud.vmboot.loader``), so the part runs with ``VENV`` set to this
test's own environment, whose spottrain is the one under test. Only where the part writes
are changed: ``/etc/spottrain`` (and any other root-owned path the caller names) moves into a
temporary folder, and the loader's settings gain the fakes' endpoints. bash runs the part
with ``-x``, so its trace holds every command it ran with its arguments expanded: a secret
that never shows there was never on a command line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from terraform_hcl import block_text, terraform_console

ETC = "/etc/spottrain"


def section(script: str, start: str, end: str) -> str:
    """The script from the line that starts with ``start`` up to (not including) the first
    line after it that starts with ``end``."""
    assert start in script, f"the script has no {start!r}"
    i = script.index(start)
    assert i == 0 or script[i - 1] == "\n", f"{start!r} does not start a line"
    assert "\n" + end in script[i:], f"no line starting {end!r} after {start!r}"
    j = script.index("\n" + end, i) + 1
    return script[i:j]


def shell_function(script: str, name: str) -> str:
    """The definition of the shell function ``name`` (``name() {`` to its closing ``}``)."""
    assert f"\n{name}() {{\n" in script, f"the script defines no shell function {name}"
    i = script.index(f"\n{name}() {{\n") + 1
    return script[i : script.index("\n}\n", i) + 3]


def run_part(
    part: str,
    tmp_path: Path,
    *,
    conf: Mapping[str, Any],
    env: Mapping[str, str],
    moved: Mapping[str, Path] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``part`` with bash as root's boot would, with ``/etc/spottrain`` at
    ``tmp_path/etc`` and each path of ``moved`` at its folder. The loader's settings file
    the part writes gets ``conf`` instead of its one line ``{"cloud": ...}`` (the same
    cloud, pointed at the fakes). Returns the finished process: its stderr is bash's trace."""
    etc = tmp_path / "etc"
    etc.mkdir(exist_ok=True)
    cloud_line = f'{{"cloud": "{conf["cloud"]}"}}\n'
    assert part.count(f"<<'JSON'\n{cloud_line}JSON\n") == 1, "the loader's settings changed"
    text = part.replace(cloud_line, json.dumps(dict(conf)) + "\n")
    for path, there in (moved or {}).items():
        text = text.replace(path, str(there))
    text = text.replace(ETC, str(etc))
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return subprocess.run(
        ["bash", "-x", "-euo", "pipefail", "-c", text],
        env={
            "PATH": os.environ["PATH"],
            "HOME": str(home),
            "VENV": sys.prefix,
            "GIT_CONFIG_NOSYSTEM": "1",
            **env,
        },
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )


def variable_blocks(variables_tf: str, *names: str) -> str:
    """The declarations of the variables ``names``, as written (validations included)."""
    for name in names:
        assert f'variable "{name}" {{' in variables_tf, f"no variable {name}"
    return "".join(block_text(variables_tf, f'variable "{name}"') for name in names)


def evaluate(module_text: str, expression: str, variables: Mapping[str, str]) -> Any:
    """``expression`` evaluated by a real Terraform in a scratch module of ``module_text``
    (its variables' validations included), as JSON; the caller skips without terraform."""
    out = terraform_console(module_text, f"jsonencode({expression})", dict(variables))
    assert out.returncode == 0 and "Error" not in out.stderr, out.stderr
    return json.loads(json.loads(out.stdout.strip()))


def refusal(module_text: str, variable: str, value: str) -> str:
    """What Terraform says about ``var.<variable> = value`` (its validations'
    error, on one line), or "" when it takes the value."""
    out = terraform_console(module_text, f"var.{variable}", {variable: value})
    if "Error: Invalid value for variable" not in out.stderr:
        assert out.returncode == 0, out.stderr
        return ""
    return " ".join(out.stderr.split())

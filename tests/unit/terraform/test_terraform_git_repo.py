"""Both fleet modules refuse a git_repo that holds credentials: the URL is rendered into the
VMs' boot script, which anyone who can describe a VM reads (the job spec refuses it too)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from terraform_hcl import block_text, terraform_console

ROOT = Path(__file__).resolve().parents[3] / "terraform"
MODULES = ["aws", "gcp"]
URLS = [
    ("https://github.com/acme/gpt.git", True),
    ("ssh://git@github.com/acme/gpt.git", True),
    ("git@github.com:acme/gpt.git", True),
    ("https://x-access-token:ghp_SECRET123@github.com/acme/gpt.git", False),
    ("https://ghp_SECRET123@github.com/acme/gpt.git", False),
]


def _variable(module: str) -> str:
    return block_text((ROOT / module / "variables.tf").read_text(), 'variable "git_repo"')


@pytest.mark.parametrize("module", MODULES)
def test_the_credentials_rule_is_declared_on_git_repo(module: str) -> None:
    text = _variable(module)
    rule = re.search(r'!can\(regex\("([^"]+)", var\.git_repo\)\)', text)
    assert rule, f"terraform/{module}: git_repo has no rule against credentials in the URL"
    # Terraform's regex (RE2) and Python's agree on this simple pattern.
    pattern = re.compile(rule.group(1))
    for url, accepted in URLS:
        assert (pattern.search(url) is None) is accepted, url


@pytest.mark.skipif(shutil.which("terraform") is None, reason="no terraform binary here")
@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize(("url", "accepted"), URLS)
def test_terraform_refuses_a_git_repo_with_credentials(
    module: str, url: str, accepted: bool
) -> None:
    out = terraform_console(_variable(module), "var.git_repo", {"git_repo": url})
    refused = "Error: Invalid value for variable" in out.stderr
    assert refused is not accepted, out.stderr
    if refused:
        assert "must not hold credentials" in " ".join(out.stderr.split())

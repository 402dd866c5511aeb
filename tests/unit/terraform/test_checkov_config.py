"""terraform/.checkov.yaml, the skip list of scripts/test's checkov step: every skipped check
has its reason written above it, and the step really runs it over terraform/."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "terraform" / ".checkov.yaml"


def test_every_skipped_check_says_why() -> None:
    lines = CONFIG.read_text().splitlines()
    skips = [i for i, line in enumerate(lines) if re.match(r"^\s+- CKV2?_[A-Z]+_\d+\s*$", line)]
    assert skips, "no skipped check found"
    for i in skips:
        reason = []
        for line in reversed(lines[:i]):
            if not line.strip().startswith("#"):
                break
            reason.append(line.strip("# "))
        assert len(" ".join(reason)) > 40, f"{lines[i].strip()} is skipped without a reason"


def test_config_scans_terraform_offline_and_lists_only_checks() -> None:
    config = yaml.safe_load(CONFIG.read_text())
    assert config["directory"] == ["terraform"]
    assert config["framework"] == ["terraform"]
    assert config["skip-download"] is True
    assert all(re.fullmatch(r"CKV2?_[A-Z]+_\d+", c) for c in config["skip-check"])
    assert len(set(config["skip-check"])) == len(config["skip-check"])


def test_scripts_test_runs_checkov_with_this_config() -> None:
    script = (REPO / "scripts" / "test").read_text()
    assert '/bin/checkov" --config-file terraform/.checkov.yaml' in script
    setup = (REPO / "scripts" / "setup").read_text()
    assert re.search(r"^CHECKOV_PIN=checkov==\d+\.\d+\.\d+$", setup, re.M), "checkov is pinned"

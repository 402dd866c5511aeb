"""Fixtures of the end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ._fleet import down_every_run


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    """A ``SPOTTRAIN_HOME`` of the test's own; every run left in it is ended afterwards."""
    h = tmp_path / "home"
    yield h
    down_every_run(h)

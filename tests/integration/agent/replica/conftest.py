"""The ``cluster`` fixture: a lighthouse and the replicas a test starts, all killed after."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from replica_cluster import Cluster, Lighthouse

from spottrain.ports import free_port


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    lighthouse = Lighthouse(free_port(), tmp_path / "lighthouse.log")
    lighthouse.start()
    c = Cluster(tmp_path, lighthouse)
    try:
        yield c
    finally:
        c.stop_all()

"""The ``cluster`` fixture: the replicas a test starts on the Redis quorum (a shim per
replica), all killed after; ``lighthouse_cluster``: the same on torchft's lighthouse."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from replica_cluster import Cluster, Lighthouse

from spottrain.ports import free_port


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.stop_all()


@pytest.fixture
def lighthouse_cluster(tmp_path: Path) -> Iterator[Cluster]:
    lighthouse = Lighthouse(free_port(), tmp_path / "lighthouse.log")
    lighthouse.start()
    c = Cluster.with_lighthouse(tmp_path, lighthouse)
    try:
        yield c
    finally:
        c.stop_all()

"""The local elastic job the end-to-end tests drive (examples/elastic_train.py on torchrun)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spottrain.agent.testing.local_launcher import LocalElasticJob, Record

REPO = Path(__file__).resolve().parents[2]
TRAIN_SCRIPT = str(REPO / "examples" / "elastic_train.py")

__all__ = ["ElasticJob", "Record"]


def ElasticJob(workdir: Path, endpoint: str, run_id: str, **kwargs: Any) -> LocalElasticJob:
    return LocalElasticJob(workdir, endpoint, run_id, script=TRAIN_SCRIPT, **kwargs)

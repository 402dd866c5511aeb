"""The spec's ``logs:`` section: its defaults, its bounds and where the logs go."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from spec_samples import LOCAL, VALID, spec_with

from spottrain.spec import SpecError, parse_spec


def _problems(data: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as err:
        parse_spec(yaml.safe_dump(data, sort_keys=False), "job.yaml")
    return err.value.problems


def test_logs_default_beside_the_checkpoint_copies_and_can_be_named() -> None:
    spec = parse_spec(yaml.safe_dump(VALID), "job.yaml").spec
    assert (spec.logs.chunk_seconds, spec.logs.chunk_mb) == (15, 4)
    assert (spec.logs.max_mb, spec.logs.backlog_mb) == (1024, 64)
    assert spec.logs_url() == "file:///mnt/shared/ckpt/logs"
    # No copy location and no logs.to: nothing is shipped.
    assert parse_spec(yaml.safe_dump(LOCAL), "job.yaml").spec.logs_url() is None
    named = spec_with(LOCAL, "logs", {"to": "/srv/logs", "chunk_seconds": 5, "chunk_mb": 1})
    spec = parse_spec(yaml.safe_dump(named), "job.yaml").spec
    assert spec.logs_url() == "/srv/logs"
    assert spec.logs.chunk_seconds == 5


def test_logs_refuses_bad_stores_bounds_and_another_clouds_bucket() -> None:
    assert _problems(spec_with(LOCAL, "logs", {"to": "logs/here"})) == [
        "logs.to (line 29): use s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, file:///DIR or an "
        "absolute path (got 'logs/here')"
    ]
    (p,) = _problems(spec_with(LOCAL, "logs", {"chunk_seconds": 0}))
    assert p.startswith("logs.chunk_seconds") and "greater than or equal to 1" in p
    (p,) = _problems(spec_with(LOCAL, "logs", {"chunk_mb": 8, "backlog_mb": 4}))
    assert "backlog_mb (4) must hold at least one chunk (chunk_mb 8)" in p
    (p,) = _problems(spec_with(LOCAL, "logs", {"lines": 3}))
    assert "logs.lines" in p and "unknown key" in p
    (p,) = _problems(spec_with(VALID, "logs", {"to": "s3://acme-logs/run"}))
    assert "logs.to: aws storage cannot be written by gcp VMs" in p

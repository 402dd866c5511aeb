"""Job specs that tests start from: a valid multi-cloud one and a valid local one."""

from __future__ import annotations

import copy
from typing import Any

DIGEST = "sha256:" + "ab" * 32
COMMIT = "0123456789abcdef0123456789abcdef01234567"

VALID: dict[str, Any] = {
    "name": "gpt-small",
    "code": {"image": f"ghcr.io/acme/train@{DIGEST}"},
    "train": {"command": ["python", "train.py", "--lr", "3e-4"]},
    "nodes": {"min": 2, "max": 4, "gpus": 8},
    "resources": {
        "clouds": ["aws", "gcp"],
        "regions": ["us-east-1", "us-central1"],
        "instance_types": ["p4d.24xlarge", "a2-highgpu-8g"],
        "max_price_per_hour": 20,
    },
    "spot": {"policy": "spot-then-on-demand", "fallback_after_minutes": 15},
    "budget": {"max_usd": 1000},
    "checkpoint": {
        "volume": {"path": "/mnt/spottrain/ckpt", "write_gbps": 4},
        "every_steps": 500,
        "params": "7B",
        # Both clouds' VMs must read it: s3:// or gs:// would be refused for aws + gcp.
        "copy_to": "file:///mnt/shared/ckpt",
    },
    "redis": {"url": "rediss://redis.internal:6380", "password_secret": "spottrain/redis"},
    "aws": {"images": {"us-east-1": "ami-0123456789abcdef0"}},
    "gcp": {
        "project": "acme-train",
        "image": "projects/p/global/images/family/f",
        "service_account": "spottrain-agent@acme-train.iam.gserviceaccount.com",
    },
}

LOCAL: dict[str, Any] = {
    "name": "tiny",
    "code": {"archive": {"path": "."}},
    "train": {"command": "examples/gpt_train.py --steps 100"},
    "nodes": {"min": 1, "max": 2, "gpus": 0, "workers": 2},
    "resources": {"clouds": ["local"]},
    "budget": {"max_usd": 5},
    "checkpoint": {"volume": {"path": "/tmp/ckpt", "write_gbps": 1}, "every_steps": 25},
    "local": {"zones": {"local-a": {"capacity": 2}, "local-b": {"capacity": 2}}},
}


def spec_with(base: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of ``base`` with the dotted ``path`` set to ``value`` (``...`` deletes it)."""
    data = copy.deepcopy(base)
    *parents, last = path.split(".")
    node = data
    for p in parents:
        node = node[p]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return data


# A job on a fleet that terraform/aws provisioned: the controller adopts the group's VMs.
FLEET_AWS: dict[str, Any] = {
    **{k: copy.deepcopy(v) for k, v in VALID.items() if k not in ("aws", "gcp", "resources")},
    "resources": {"clouds": ["aws"]},
    "fleet": {
        "managed_by": "terraform",
        "cloud": "aws",
        "group": "spottrain-gpt-small",
        "run_id": "gpt-small-1",
        "region": "us-east-1",
        "lifecycle_hook": "spottrain-gpt-small-drain",
    },
}

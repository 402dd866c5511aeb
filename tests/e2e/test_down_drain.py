"""``spottrain down`` on the local cloud with real agents and torchrun: every node's
emergency checkpoint commits before its VM is ended."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from spottrain.agent.checkpoint.directory import CheckpointDir

from ._fleet import REPO, cli, wait

pytestmark = [pytest.mark.slow, pytest.mark.waits]


def _spec(tmp: Path) -> dict[str, Any]:
    return {
        "name": "drain",
        "code": {"archive": {"path": str(REPO)}},
        # Far more steps than the test lets it train: only `down` ends it.
        "train": {"command": "examples/gpt_train.py --steps 100000 --step-time 0.1"},
        "nodes": {"min": 1, "max": 2, "gpus": 0, "workers": 1},
        "resources": {"clouds": ["local"]},
        "budget": {"max_usd": 50},
        "checkpoint": {
            "volume": {"path": str(tmp / "volume"), "write_gbps": 1},
            "every_steps": 100_000,
        },
        "local": {"zones": {"local-a": {"capacity": 2}}, "notice_s": 30},
    }


def test_down_commits_every_nodes_emergency_checkpoint_before_its_vm_ends(
    tmp_path: Path, home: Path
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_spec(tmp_path)))
    up = cli(home, "up", str(path), "--detach", "--interval", "0.5")
    assert up.returncode == 0, up.stderr
    run_id = up.stdout.split()[1].rstrip(":")

    def both_joined() -> bool:
        out = cli(home, "status", run_id, "--json")
        status = json.loads(out.stdout) if out.returncode == 0 else {}
        nodes = status.get("nodes", {})
        return len(nodes) == 2 and set(nodes.values()) == {"joined"} and status["step"] >= 5

    wait(both_joined, "two joined nodes past step 5", 300)
    down = cli(home, "down", run_id)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "draining 2 node(s)" in down.stdout, down.stdout
    assert "every node drained: emergency checkpoint at step" in down.stdout, down.stdout
    events = [json.loads(line) for line in (home / "runs" / run_id / "events.jsonl").open()]
    ended = {e["node_name"]: i for i, e in enumerate(events) if e["type"] == "terminate"}
    assert sorted(ended) == ["n0", "n1"]
    for node in ("n0", "n1"):
        drained = [
            (i, e) for i, e in enumerate(events) if e["type"] == "drained" and e["node"] == node
        ]
        assert drained, f"{node} never drained"
        i, e = drained[0]
        assert json.loads(e["committed_step"]) is not None, e
        assert e["source"] == "redis", e  # the drain `down` asked for, not a shutdown's
        assert i < ended[node], f"{node}'s VM was ended before its drain finished"
    # The emergency checkpoint is on the volume, complete and verified.
    volume = tmp_path / "volume" / run_id
    found = [CheckpointDir(str(z)).find_restorable() for z in volume.iterdir()]
    newest = max((r for r in found if r is not None), key=lambda r: r.manifest.step)
    assert newest.manifest.extra.get("drain")

"""Jobs whose workers fail at every start, on the local cloud: each ends by itself through
the give-up policy (``controller.max_failed_launches``), ``spottrain up`` exits 1 with the
failing line, and the ledger holds at most ``max_failed_launches`` x ``nodes.max`` launches.

Each node's agent ends torchrun after three failures in a row for the same reason (not its
hundred restarts), and each such VM counts once; a node joining the rendezvous is no sign
that the job trains."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from ._fleet import Cli

pytestmark = [pytest.mark.slow, pytest.mark.waits]

# A plain torchrun script (no SDK): the two nodes all-reduce a few times, then rank 0 hits a
# bug; the other node's worker fails on the lost connection, with a line of its own.
PLAIN = """\
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
x = torch.ones(4)
for _ in range(3):
    dist.all_reduce(x)
if dist.get_rank() == 0:
    raise RuntimeError("the batch has 3 rows, the model expects 4")
dist.barrier()
"""

# With the SDK: a checkpoint every 2 steps, and the loss turns NaN at step 5 after every
# resume (from step 4).
NAN = """\
import torch
from spottrain.agent.sdk import TrainSession

session = TrainSession(every_steps=2, async_periodic=False, tracking=False)
state = {"w": torch.zeros(2)}
step = session.restore(state)
while step < 8:
    step += 1
    if step == 5:
        raise FloatingPointError(f"loss is nan at step {step}")
    state["w"] += 1
    session.step(step, state, loss=1.0 / step)
session.finish(step, state)
"""

ARGS = """\
import argparse

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, required=True)
p.parse_args()
"""

# name: (script, command, nodes.max, controller.max_failed_launches, the failing line). Two
# VMs in a row where it shows something (the same line twice; two nodes whose workers fail
# with lines of their own), one where a VM is slow to fail (the NaN imports torch each time).
CASES: dict[str, tuple[str, str, int, int, str]] = {
    "import": (
        "import spottrain_no_such_module\n",
        "train.py",
        1,
        2,
        "ModuleNotFoundError: No module named 'spottrain_no_such_module'",
    ),
    "argument": (
        ARGS,
        "train.py --stpes 10",
        1,
        1,
        "train.py: error: the following arguments are required: --steps",
    ),
    "plain": (PLAIN, "train.py", 2, 2, "RuntimeError: the batch has 3 rows, the model expects 4"),
    "nan": (NAN, "train.py", 1, 1, "FloatingPointError: loss is nan at step 5"),
}


# Each case ends in well under a minute; a job still relaunching VMs after this never ends.
UP_TIMEOUT = 180


def _job(tmp: Path, script: str, command: str, nodes: int, max_failed: int) -> Path:
    code = tmp / "code"
    code.mkdir()
    (code / "train.py").write_text(script)
    spec: dict[str, Any] = {
        "name": "crashy",
        "code": {"archive": {"path": str(code)}},
        "train": {"command": command},
        "nodes": {"min": 1, "max": nodes, "gpus": 0, "workers": 1},
        "resources": {"clouds": ["local"]},
        "budget": {"max_usd": 50},
        "checkpoint": {
            "volume": {"path": str(tmp / "volume"), "write_gbps": 1},
            "every_steps": 2,
            "size_gb": 0.002,
        },
        "controller": {"max_failed_launches": max_failed},
        "local": {"zones": {"local-a": {"capacity": 2 * nodes + 2}}, "notice_s": 13},
    }
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_job_whose_workers_fail_at_every_start_ends_by_itself_with_the_failing_line(
    case: str, tmp_path: Path, home: Path
) -> None:
    script, command, nodes, max_failed, line = CASES[case]
    cli = Cli(home)
    job = _job(tmp_path, script, command, nodes, max_failed)
    try:
        up = cli.run("up", str(job), "--interval", "0.5", timeout=UP_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"spottrain up did not end by itself in {UP_TIMEOUT} s") from e
    out = up.stdout + up.stderr
    assert up.returncode == 1, out[-3000:]
    ended = next(x for x in up.stdout.splitlines() if x.startswith("run ended (failed):"))
    # One more than the limit where VMs that found the rendezvous closed were counted before
    # the one whose crash loop closed it (the run's error waits for that one's line).
    counted = re.search(r"(\d+) VMs? (in a row )?failed before training", ended)
    assert counted is not None and int(counted[1]) in (max_failed, max_failed + 1), ended
    assert line in ended, ended
    assert "crash loop: its workers failed 3 times in a row" in ended, ended
    run_id = up.stdout.split()[1].rstrip(":")
    launches = json.loads((home / "runs" / run_id / "launches.json").read_text())
    assert len(launches) <= max_failed * nodes, launches
    # `status` of the ended run names the failing line too.
    status = cli.run("status", run_id)
    assert status.returncode == 0 and line in status.stdout, status.stdout

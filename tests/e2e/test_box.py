"""VMs in a box: ``spottrain up`` on AWS (moto) and GCP (the GCE fake) launches instances whose
real boot script runs as root in a sandbox of its own (Linux namespaces: its own address,
mount table, PID space), installs the run's lock from a local index with no spottrain on it,
and trains across two VMs, each on its own address (``tests/box/``).

Which image each VM booted from is asserted: the first two VMs of a run install the
environment from the lock (an empty ``/opt``); a VM launched after one of them booted boots
from the image the box baked from it, whose venv the boot's own check recognises by the
lock's mark and does not install again.

What differs from a real cloud VM is in the README ("VMs in a box").
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from box.kits import Kit, kit
from box.network import leftover_namespaces
from box.run import BoxRun, job_spec, wait

pytestmark = pytest.mark.slow


@pytest.fixture
def aws(tmp_path: Path, box_index: Any) -> Iterator[Kit]:
    volume = tmp_path / "volume"
    volume.mkdir()
    with kit("aws", tmp_path / "kit", box_index.port, volume=volume, api_grace_s=30) as k:
        yield k


@pytest.fixture
def gcp(tmp_path: Path, box_index: Any) -> Iterator[Kit]:
    volume = tmp_path / "volume"
    volume.mkdir()
    with kit("gcp", tmp_path / "kit", box_index.port, volume=volume, api_grace_s=30) as k:
        yield k


def _train_through_a_notice_and_a_kill(run: BoxRun, window_s: float) -> None:
    """n0 gets a spot notice (reclaimed when the window ends), n1 is then killed without
    one; both are backfilled and the job trains to its last step."""
    box = run.kit.box
    wait(lambda: run.step() >= 10, "training on two VMs", 420, run)
    n0, n1 = run.vm_of("n0"), run.vm_of("n1")
    addresses = {run.node(n)["address"] for n in ("n0", "n1")}
    assert addresses == {box.vms[n0].net.address, box.vms[n1].net.address}, run.report()
    assert all(a.startswith("10.77.0.") for a in addresses) and len(addresses) == 2
    # The first two VMs installed the lock; nothing was baked yet.
    assert box.booted_from[n0] == box.booted_from[n1] == "empty /opt"

    box.notice(n0, window_s)
    drained = wait(lambda: [e for e in run.events("drained") if e["node"] == "n0"], "n0", 120, run)
    assert drained[0]["committed_step"] != "-1", drained
    wait(lambda: run.node("n2").get("state") == "joined", "n2 (n0's backfill) to join", 240, run)
    n2 = run.vm_of("n2")
    assert box.booted_from[n2] != "empty /opt"  # from the image baked from n0 or n1
    box.kill(n1)
    wait(lambda: run.vm_of("n3"), "n3 (n1's backfill) to launch", 240, run)

    code = run.wait_up(600)
    out = run.output()
    assert code == 0, run.report()
    assert "training finished" in out and "steps trained          150" in out, out[-2000:]
    assert "preemptions survived   2" in out, out[-2000:]
    # The notice cost no step: the restore after it resumed at the step training had reached.
    restores = run.state().restores()
    notice_step = int(drained[0]["committed_step"])
    assert any(r.restored_step == r.reached_step == notice_step for r in restores), restores


def _down_leaves_nothing(run: BoxRun) -> None:
    down = run.cli("down", run.run_id, timeout=240)
    assert down.returncode == 0, down.stdout + down.stderr
    box = run.kit.box
    box.wait_for(
        "every VM of the box and its namespace to be gone",
        lambda: (
            not any(vm.alive() for vm in box.vms.values())
            and leftover_namespaces(box.network.box_id) == [box.network.switch]
        ),
        90,
    )
    assert not [i for i in box.cloud.instances() if i.alive]
    assert not [p for p in _processes() if run.run_id in p], _processes()


def _processes() -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                found.append(
                    Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                )
            except OSError:
                continue
    return found


def test_an_archive_job_on_aws_trains_through_a_notice_and_a_kill(aws: Kit, tmp_path: Path) -> None:
    run = BoxRun(aws, tmp_path / "run")
    spec = job_spec(aws, "box-aws", {"archive": {"path": "code"}})
    spec["train"]["command"] = "gpt_train.py --steps 150 --every-steps 10 --step-time 0.2"
    run.up(run.write_job(spec))
    _train_through_a_notice_and_a_kill(run, window_s=40)
    moto = {i.vm_id: i.alive for i in aws.box.cloud.instances()}
    assert sum(moto.values()) == 0 or all(not v for v in moto.values()), moto
    _down_leaves_nothing(run)

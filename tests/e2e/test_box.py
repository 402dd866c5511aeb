"""VMs in a box: ``spottrain up`` on AWS (moto) and GCP (the GCE fake) launches instances whose
real boot script runs as root in a sandbox of its own (Linux namespaces: its own address,
mount table, PID space), installs the run's lock from a local index with no spottrain on it,
and trains across two VMs, each on its own address (``tests/box/``).

Which image each VM booted from is asserted: the first two VMs of a run install the
environment from the lock (an empty ``/opt``); a VM launched after one of them booted boots
from the image the box baked from it, whose venv the boot's own check recognises by the
lock's mark and does not install again.

What differs from a real cloud VM is in docs/real-clouds.md ("VMs in a box").
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from box.kits import AwsKit, Kit, kit
from box.network import box_capable, leftover_namespaces
from box.run import RUN_BUDGET_S, BoxRun, job_spec, wait

# A run takes 2 to 5 minutes on 2 cores (boots that install torch, training, backfills), most
# of it waiting: scripts/test runs these side by side (pytest -m box -n 4). The timeout is a
# run's budget for its waits (box.run.RUN_BUDGET_S) plus its down and fixtures.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.box,
    pytest.mark.timeout(RUN_BUDGET_S + 600),
    pytest.mark.skipif(not box_capable(), reason=box_capable.__doc__ or ""),
]


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
    assert "training finished" in out and "steps trained          120" in out, out[-2000:]
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
    spec["train"]["command"] = "gpt_train.py --steps 120 --every-steps 10 --step-time 0.2"
    run.up(run.write_job(spec))
    _train_through_a_notice_and_a_kill(run, window_s=30)
    moto = {i.vm_id: i.alive for i in aws.box.cloud.instances()}
    assert sum(moto.values()) == 0 or all(not v for v in moto.values()), moto
    _down_leaves_nothing(run)


def test_a_private_git_job_on_gcp_trains_through_a_preemption_and_a_kill(
    gcp: Kit, tmp_path: Path
) -> None:
    from box.kits import GcpKit
    from box.run import TRAIN

    assert isinstance(gcp, GcpKit)
    token = "ghp_box_token_that_must_not_leak"
    repo, commit = gcp.git_repo("gpt-train", {"gpt_train.py": TRAIN.read_text()}, token)
    gcp.secrets.add("box-git-token", token)
    run = BoxRun(gcp, tmp_path / "run")
    code = {"git": {"repo": repo, "commit": commit, "token_secret": "box-git-token"}}
    spec = job_spec(gcp, "box-gcp", code)
    spec["train"]["command"] = "gpt_train.py --steps 120 --every-steps 10 --step-time 0.2"
    run.up(run.write_job(spec))
    _train_through_a_notice_and_a_kill(run, window_s=30)
    # The token reached git through its askpass helper only: never the boot's output.
    assert gcp.git.count(status=200) > 0
    for vm in gcp.box.vms.values():
        assert token not in vm.console()
    _down_leaves_nothing(run)


# --- VMs that cannot boot ------------------------------------------------------------------
OLD_PYTHONS = sorted(Path("/root/.pyenv/versions").glob("3.10.*"))


@pytest.mark.skipif(not OLD_PYTHONS, reason="no Python 3.10 installation on this machine")
def test_a_box_whose_only_python_is_too_old_fails_at_boot_and_the_run_ends(
    tmp_path: Path, box_index: Any
) -> None:
    """Every region's image has Python 3.10 only: each VM's boot stops in 'check the image'
    with the reason, reported to Redis at once (not at the boot timeout); each failure blocks
    its region first; after controller.max_failed_launches (3) the run ends, exit 1."""
    from box.kits import REGIONS

    with kit("aws", tmp_path / "kit", box_index.port, python=OLD_PYTHONS[-1]) as k:
        run = BoxRun(k, tmp_path / "run")
        spec = job_spec(k, "box-old-python", {"archive": {"path": "code"}})
        spec["resources"]["regions"] = list(REGIONS)
        run.up(run.write_job(spec))
        assert run.wait_up(420) == 1, run.report()
        out = run.output()
        version = OLD_PYTHONS[-1].name
        why = (
            f"boot failed in 'check the image': the image's python3 is {version}, but the "
            "run's environment is locked for Python 3.11"
        )
        assert "run ended (failed): 3 VMs in a row failed at boot: n" in out, run.report()
        assert why in out
        # Each failure was known from Redis, not from the boot timeout or the console.
        boots = [e for e in run.events("boot") if e["state"] == "failed"]
        assert len({e["node"] for e in boots}) >= 3 and all(
            "python3 is" in e["reason"] for e in boots
        )
        # Each region's offers were blocked after its image failed.
        blocked = run.events("blocked")
        assert len(blocked) >= 2, run.events()
        status = run.cli("status", run.run_id)
        assert why in status.stdout, status.stdout
        node = boots[0]["node"]
        logs = run.cli("logs", run.run_id, "--node", node)
        assert why in logs.stderr, logs.stderr
        # The boot's own output, shipped from its first line.
        assert (
            f"spottrain-boot: {node} " in logs.stdout and "stage 'check the image'" in logs.stdout
        )
        assert not [i for i in k.box.cloud.instances() if i.alive]


def test_bad_input_ends_each_run_with_its_own_reason(tmp_path: Path, box_index: Any) -> None:
    """A file of the run changed in its store (the lock, spottrain's wheel), a store the VMs
    may not read, a code archive they may not read, a Redis password secret that does not
    exist: each VM's boot stops with its reason; each run (max_failed_launches: 1) ends
    with it in one line, its record and its VMs' shipped output kept."""
    with kit("aws", tmp_path / "kit", box_index.port) as k:
        assert isinstance(k, AwsKit)
        runs: dict[str, BoxRun] = {}
        lock_file = _one_lock(k, tmp_path)
        k.box.hold.set()
        for case in ("lock", "wheel", "store", "archive", "secret"):
            run = BoxRun(k, tmp_path / case)
            spec = job_spec(k, f"box-bad-{case}", {"archive": {"path": "code"}})
            spec["nodes"] = {"min": 1, "max": 1, "gpus": 0, "workers": 1}
            spec["controller"] = {"max_failed_launches": 1}
            if case == "secret":
                spec["redis"]["password_secret"] = "box-no-such-secret"
            run.up(run.write_job(spec), "--env-lock", f"aws={lock_file}")
            runs[case] = run
        wait(lambda: all(r.vm_of("n0") for r in runs.values()), "every run's first VM", 120)
        files = {
            c: json.loads((r.home / "runs" / r.run_id / "run.json").read_text())
            for c, r in runs.items()
        }
        s3 = k.admin("s3")
        for case, what in (("lock", "lock"), ("wheel", "wheel")):
            # Someone with write access to the bucket replaced the file after the run began.
            bucket, key = _split(files[case]["boot_files"]["aws"][what]["url"])
            s3.put_object(Bucket=bucket, Key=key, Body=b"not what the run shipped\n")
        bucket, prefix = _split(k.store("box-bad-store"))
        k.front.deny_object(bucket, prefix + "/")
        bucket, key = _split(files["archive"]["code_url"])
        k.front.deny_object(bucket, key)
        k.box.hold.clear()
        reasons = {
            "lock": "/locks/",
            "wheel": "spottrain-0.1.0-py3-none-any.whl does not match the sha256",
            "store": "the instance role may not: grant it s3:GetObject on the bucket's prefix",
            "archive": "S3 refused the credentials for s3://",
            "secret": "cannot read the secret 'box-no-such-secret': no such secret in us-east-1",
        }
        for case, run in runs.items():
            assert run.wait_up(300) == 1, run.report()
            out = run.output()
            line = next(ln for ln in out.splitlines() if ln.startswith("run ended (failed):"))
            assert reasons[case] in line, (case, line)
            status = run.cli("status", run.run_id)
            assert status.returncode == 0 and reasons[case] in status.stdout, status.stdout
        assert "does not match the sha256" in runs["lock"].output()


def _split(url: str) -> tuple[str, str]:
    bucket, _, key = url.removeprefix("s3://").partition("/")
    return bucket, key


def _one_lock(k: Kit, tmp_path: Path) -> Path:
    """The runs' lock, resolved once (``spottrain lock`` in the box) for all of them."""
    run = BoxRun(k, tmp_path / "lock")
    job = run.write_job(job_spec(k, "box-lock", {"archive": {"path": "code"}}))
    out = tmp_path / "aws.lock"
    done = run.cli("lock", str(job), "--cloud", "aws", "-o", str(out))
    assert done.returncode == 0, done.stderr
    return out

"""The workers' unprivileged user, with real processes: the boot script creates it with fixed
ids, an agent running as root starts torchrun and the training processes as that user and
hands it the checkpoint directory, and a bad setting stops the node with a plain error.

These need root (the agent's situation on a VM). Users are created only inside a private
mount namespace whose /etc is an overlay, so the machine's own accounts never change; the
workers run as ``nobody``, which every machine has.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from spottrain.agent.processes import hand_over, resolve_worker_user
from spottrain.controller.run.boot import WORKER_UID, WORKER_USER, worker_user_lines
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dropping privileges needs root")

NOBODY = pwd.getpwnam("nobody")


def _private_overlay(*paths: str) -> str:
    """Shell lines that lay a writable overlay (on a tmpfs) over each path, in this mount
    namespace only: what is written there vanishes with the namespace, and the overlay's
    root takes the tmpfs' mode (0755), so ``/root`` (where this interpreter lives) becomes
    traversable for ``nobody`` without changing the real one."""
    lines = ['D=$(mktemp -d) && mount -t tmpfs tmpfs "$D"']
    for i, path in enumerate(paths):
        lines.append(
            f'mkdir "$D/u{i}" "$D/w{i}" && chmod 0755 "$D/u{i}" && mount -t overlay overlay '
            f'-o "lowerdir={path},upperdir=$D/u{i},workdir=$D/w{i}" {path}'
        )
    return " && ".join(lines)


def in_namespace(
    script: str,
    overlays: tuple[str, ...],
    *args: str,
    timeout: float = 60,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a bash ``script`` (with ``args`` as ``$@``) in a private mount namespace where
    each of ``overlays`` is a throwaway writable overlay."""
    return subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--",
            "bash",
            "-c",
            f"set -e; {_private_overlay(*overlays)}\n{script}",
            "bash",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.fixture(scope="module")
def namespaces() -> None:
    if shutil.which("unshare") is None or shutil.which("useradd") is None:
        pytest.skip("needs unshare(1) and useradd(8)")
    probe = in_namespace("true", ("/etc",))
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace with overlays here: {probe.stderr.strip()}")


# -- the boot script's lines ------------------------------------------------------------------


def test_boot_creates_the_worker_user_with_fixed_ids_once(namespaces: None) -> None:
    lines = worker_user_lines()
    res = in_namespace(
        f"{lines}\nid -u {WORKER_USER}; id -g {WORKER_USER}\n{lines}\n"
        f"getent passwd {WORKER_USER}; stat -c %U {pwd_home()}; id -Gn {WORKER_USER} | tr ' ' ,",
        ("/etc", "/var/lib"),
    )
    assert res.returncode == 0, res.stderr
    out = res.stdout.split()
    assert out[:2] == [str(WORKER_UID), str(WORKER_UID)]
    fields = out[2].split(":")
    assert fields[0] == WORKER_USER and fields[2] == fields[3] == str(WORKER_UID)
    assert fields[6].endswith("nologin"), "nobody logs in as the workers' user"
    assert out[3] == WORKER_USER, "its home (the workers' caches) is its own"
    groups = set(out[4].split(","))
    for gpu_group in ("video", "render"):
        if _group_exists(gpu_group):
            assert gpu_group in groups, f"GPU device files may belong to {gpu_group}"
    assert f":x:{WORKER_UID}:" not in Path("/etc/passwd").read_text(), "the host is untouched"


def test_boot_stops_when_the_image_has_the_user_with_other_ids(namespaces: None) -> None:
    res = in_namespace(
        f"groupadd --gid 2471 {WORKER_USER} && useradd --uid 2471 --gid 2471 {WORKER_USER}\n"
        f"{worker_user_lines()}\necho reached",
        ("/etc",),
    )
    assert res.returncode == 1
    assert "reached" not in res.stdout
    assert f"is 2471:2471, not {WORKER_UID}:{WORKER_UID}" in res.stderr


def _group_exists(name: str) -> bool:
    return subprocess.run(["getent", "group", name], capture_output=True).returncode == 0


def pwd_home() -> str:
    return f"/var/lib/{WORKER_USER}"


# -- the agent: which user the workers get ----------------------------------------------------


def test_an_unknown_worker_user_is_a_plain_configuration_error() -> None:
    with pytest.raises(ValueError, match="no such user on this machine; create it"):
        resolve_worker_user(f"no-such-{uuid.uuid4().hex[:8]}")


def test_root_is_refused_as_the_worker_user() -> None:
    with pytest.raises(ValueError, match="is root: name an unprivileged user"):
        resolve_worker_user("root")


def test_no_worker_user_keeps_the_workers_as_the_agent() -> None:
    assert resolve_worker_user("") is None


def test_workers_started_as_the_worker_user_have_none_of_roots_ids() -> None:
    worker = resolve_worker_user("nobody")
    assert worker is not None
    # The child and its own child (torchrun's workers), as the agent starts torchrun.
    out = subprocess.run(
        ["/bin/sh", "-c", "id -u; /bin/sh -c 'id -u; id -G'; echo $HOME"],
        capture_output=True,
        text=True,
        check=True,
        start_new_session=True,
        env=worker.env({"PATH": os.environ["PATH"], "HOME": "/root"}),
        **worker.popen_kwargs(),
    )
    uid, child_uid, groups, home = out.stdout.splitlines()
    assert uid == child_uid == str(NOBODY.pw_uid)
    assert "0" not in groups.split(), "root's groups must not follow the workers"
    assert home == NOBODY.pw_dir, "caches under ~ must not point at root's home"


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory ``nobody`` can reach (pytest's tmp_path is root's, mode 0700)."""
    path = Path(tempfile.mkdtemp(prefix="spottrain-worker-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _owner(path: Path) -> int:
    return path.lstat().st_uid


def test_hand_over_gives_the_workers_what_the_agent_made_and_follows_no_link(
    shared_dir: Path,
) -> None:
    worker = resolve_worker_user("nobody")
    assert worker is not None
    ckpt = shared_dir / "ckpt"
    (ckpt / "step-000000010").mkdir(parents=True)  # brought in from object storage
    (ckpt / "step-000000010" / "MANIFEST.json").write_text("{}")
    (ckpt / "latest").write_text("step-000000010")
    outside = shared_dir / "outside"
    outside.mkdir()
    (outside / "secret").write_text("root's")
    (ckpt / "link-to-outside").symlink_to(outside)
    (ckpt / "file-link").symlink_to(outside / "secret")
    theirs = ckpt / "step-000000020"  # saved by the workers: not walked again
    theirs.mkdir()
    os.chown(theirs, worker.uid, worker.gid)

    hand_over(str(ckpt), worker)

    for path in (ckpt, ckpt / "step-000000010", ckpt / "step-000000010" / "MANIFEST.json"):
        assert _owner(path) == worker.uid, path
    assert _owner(ckpt / "latest") == worker.uid
    assert _owner(outside) == _owner(outside / "secret") == 0, "a link led the walk outside"
    assert _owner(ckpt / "link-to-outside") == _owner(ckpt / "file-link") == 0


def test_hand_over_refuses_a_path_that_is_not_a_directory(shared_dir: Path) -> None:
    worker = resolve_worker_user("nobody")
    assert worker is not None
    with pytest.raises(OSError):
        hand_over(str(shared_dir / "missing"), worker)


# -- the agent end to end ---------------------------------------------------------------------

WHO = """
import os, pathlib
ckpt = pathlib.Path(os.environ["SPOTTRAIN_CKPT_DIR"])
torchrun = open(f"/proc/{os.getppid()}/status").read()
torchrun_uid = next(l.split()[1] for l in torchrun.splitlines() if l.startswith("Uid:"))
(ckpt / f"step-000000030").mkdir()  # a checkpoint in the directory the agent handed over
(ckpt / "who").write_text(f"{os.getuid()} {os.geteuid()} {torchrun_uid} {os.environ['HOME']}")
"""


@pytest.fixture
def run_id(redis_client: redis.Redis) -> Iterator[str]:
    rid = f"wu-{uuid.uuid4().hex[:8]}"
    yield rid
    keys = list(redis_client.scan_iter(match=RunKeys(rid).pattern))
    if keys:
        redis_client.delete(*keys)


@pytest.mark.slow
def test_the_agent_as_root_runs_torchrun_and_the_workers_as_the_worker_user(
    namespaces: None, redis_server: RedisServer, run_id: str, shared_dir: Path
) -> None:
    ckpt = shared_dir / "ckpt"
    ckpt.mkdir()  # as the unit's ExecStartPre makes it: root's
    (ckpt / "step-000000010").mkdir()  # as a copy brought in at boot is: root's
    script = shared_dir / "who.py"
    script.write_text(WHO)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPOTTRAIN_")}
    agent = [
        sys.executable,
        "-m",
        "spottrain.agent.cli",
        "run",
        f"--redis={redis_server.endpoint}",
        f"--run-id={run_id}",
        "--node-id=n1",
        "--no-health-check",
        f"--ckpt-dir={ckpt}",
        "--max-restarts=0",
        "--",
        str(script),
    ]
    # /root holds this interpreter: the overlay makes it reachable for nobody in there only.
    res = in_namespace(
        'exec "$@"',
        ("/root",),
        *agent,
        timeout=300,
        env={**clean, "OMP_NUM_THREADS": "1", "SPOTTRAIN_WORKER_USER": "nobody"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    uid, euid, torchrun_uid, home = (ckpt / "who").read_text().split()
    assert uid == euid == torchrun_uid == str(NOBODY.pw_uid)
    assert home == NOBODY.pw_dir
    assert _owner(ckpt) == _owner(ckpt / "step-000000010") == NOBODY.pw_uid
    assert _owner(ckpt / "step-000000030") == NOBODY.pw_uid


def test_the_agent_refuses_an_unknown_worker_user_before_anything_runs(
    redis_server: RedisServer, redis_client: redis.Redis, run_id: str, shared_dir: Path
) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPOTTRAIN_")}
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "spottrain.agent.cli",
            "run",
            f"--redis={redis_server.endpoint}",
            f"--run-id={run_id}",
            "--node-id=n1",
            "--no-health-check",
            "--",
            "t.py",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, "SPOTTRAIN_WORKER_USER": "no-such-worker-user"},
    )
    assert res.returncode == 2, res.stderr
    assert "SPOTTRAIN_WORKER_USER=no-such-worker-user: no such user" in res.stderr
    state = redis_client.hget(RunKeys(run_id).node("n1"), "state")
    assert state == b"failed"

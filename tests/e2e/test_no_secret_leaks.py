"""The README job, run with secrets, leaks none of them: the embedded Redis's per-run password
and a ``train.secret_env`` value reach the processes that need them (the workers check theirs)
and nowhere else: not a command line of any process while it runs, not the event stream
(every write to Redis is in its append-only file), not ``controller.log`` or any other file
the run leaves, not the local VMs' consoles, not what ``up``, ``status`` and ``logs`` print,
and not the boot script a cloud VM would get."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from boot_text import whole_boot
from redis.backoff import NoBackoff
from redis.retry import Retry
from spec_samples import COMMIT, VALID, spec_with

from spottrain.controller.run.boot import NodeIdentity
from spottrain.spec import parse_spec

pytestmark = [pytest.mark.slow, pytest.mark.waits]

REPO = Path(__file__).resolve().parents[2]

# Checks the secret variable's value (by hash: the hash is no secret) before training.
WRAPPER = """\
import hashlib, os, runpy, sys
value = os.environ.get("JOB_TOKEN", "")
if hashlib.sha256(value.encode()).hexdigest() != sys.argv[1]:
    sys.exit("JOB_TOKEN is missing or wrong in the worker's environment")
# How the worker logs in to Redis (the password by its hash only).
login = os.environ.get("SPOTTRAIN_REDIS_USERNAME", "") + " " + hashlib.sha256(
    os.environ.get("SPOTTRAIN_REDIS_PASSWORD", "").encode()
).hexdigest()
with open(os.path.join(sys.argv[2], f"seen-{os.getpid()}"), "w") as f:
    f.write(login)
sys.argv = sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _spec(tmp: Path, token_hash: str, markers: Path) -> dict[str, Any]:
    """examples/local_job.yaml, shorter, with a secret variable and one noticed preemption."""
    spec = yaml.safe_load((REPO / "examples" / "local_job.yaml").read_text())
    (tmp / "check_env.py").write_text(WRAPPER)
    (tmp / "preemptions.yaml").write_text(yaml.safe_dump([{"at_s": 12, "notice": True}]))
    train = "examples/gpt_train.py --steps 60 --every-steps 20 --step-time 0.1"
    spec["code"]["archive"]["path"] = str(REPO)
    spec["train"] = {
        "command": [str(tmp / "check_env.py"), token_hash, str(markers), *train.split()],
        "secret_env": {"JOB_TOKEN": "job-token"},
    }
    spec["nodes"]["workers"] = 1
    spec["checkpoint"]["volume"]["path"] = str(tmp / "volume")
    spec["checkpoint"]["every_steps"] = 20
    spec["local"]["preemptions"]["trace"] = "preemptions.yaml"
    return dict(spec)


class ProcWatch(threading.Thread):
    """Reads every process's command line again and again while the run goes, looking for
    the secrets; once the run's password file exists, checks that Redis refuses a client
    without it."""

    def __init__(self, home: Path, token: str) -> None:
        super().__init__(daemon=True)
        self.home, self.token = home, token
        self.password: str | None = None
        self.stop = threading.Event()
        self.leaks: list[str] = []
        self.seen: set[str] = set()
        self.passes = 0
        self.anonymous_refused = False

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.anonymous_refused:
                self._find_password()
            for entry in os.listdir("/proc"):
                if not entry.isdigit():
                    continue
                try:
                    cmd = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
                except OSError:
                    continue
                for what, secret in (("token", self.token), ("password", self.password)):
                    if secret and secret in cmd:
                        self.leaks.append(f"the {what} on pid {entry}'s command line")
                for mark in (
                    "redis-server",
                    "spottrain.agent.cli",
                    "torch.distributed.run",
                    "check_env.py",
                ):
                    if mark in cmd:
                        self.seen.add(mark)
            self.passes += 1
            time.sleep(0.1)

    def _find_password(self) -> None:
        for path in self.home.glob("runs/*/redis/password"):
            run_json = path.parents[1] / "run.json"
            password = path.read_text().strip()
            if not (password and run_json.exists()):
                return  # being written: the next pass reads it
            url = json.loads(run_json.read_text())["redis_url"]
            self.password = password
            port = int(url.rsplit(":", 1)[1].split("/")[0])
            # No retries (a Redis not listening yet is tried again on the next pass): redis-py
            # retries a refused password with 8 s of backoff, reading no command line meanwhile.
            anonymous = redis.Redis(
                host="127.0.0.1", port=port, socket_timeout=2, retry=Retry(NoBackoff(), 0)
            )
            try:
                anonymous.ping()
            except redis.AuthenticationError:
                self.anonymous_refused = True
            except redis.RedisError:
                pass


def _files(root: Path, skip: set[Path]) -> Iterator[Path]:
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink() and path not in skip:
            yield path


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    h = tmp_path / "home"
    yield h
    env = {**os.environ, "SPOTTRAIN_HOME": str(h)}
    for run in (h / "runs").glob("*") if (h / "runs").exists() else []:
        subprocess.run(
            [sys.executable, "-m", "spottrain.controller.cli", "down", run.name],
            env=env,
            cwd=REPO,
            capture_output=True,
            timeout=180,
        )


def test_the_readme_job_with_secrets_leaks_them_nowhere(home: Path, tmp_path: Path) -> None:
    token = "tok-" + secrets.token_hex(16)
    store = home / "secrets"
    store.mkdir(parents=True)
    fd = os.open(store / "job-token", os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, token.encode() + b"\n")
    os.close(fd)
    markers = tmp_path / "markers"
    markers.mkdir()
    spec_path = tmp_path / "job.yaml"
    spec = _spec(tmp_path, hashlib.sha256(token.encode()).hexdigest(), markers)
    spec_path.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "SPOTTRAIN_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    env.pop("SPOTTRAIN_REDIS_PASSWORD", None)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "spottrain.controller.cli", *args],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )

    watch = ProcWatch(home, token)
    watch.start()
    try:
        # Detached, as a long run is: the controller runs in the background and logs to
        # controller.log.
        up = cli("up", str(spec_path), "--detach", "--interval", "0.5")
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        run_id = up.stdout.split()[1].rstrip(":")
        deadline = time.monotonic() + 480
        while (status := cli("status", run_id, "--json")).returncode != 0 or json.loads(
            status.stdout
        )["final_step"] is None:
            assert time.monotonic() < deadline, "the run did not finish"
            time.sleep(1.0)
        logs = cli("logs", run_id)
        node_output = cli("logs", run_id, "--node", "n0")
        down = cli("down", run_id)
        assert down.returncode == 0, down.stderr
    finally:
        watch.stop.set()
        watch.join(10)
    run_dir = home / "runs" / run_id
    password = (run_dir / "redis" / "password").read_text().strip()
    assert watch.password == password

    # The secrets were really there to leak: the workers got the token (each checked it),
    # Redis refused a client without the password, and the watch saw every kind of process.
    assert list(markers.iterdir()), "no worker saw JOB_TOKEN"
    # The workers never held the run's password: they logged in as the run's workers' user
    # (limited to the run's keys), and trained with it.
    run_hash = hashlib.sha256(password.encode()).hexdigest()
    for seen in markers.iterdir():
        user, said_hash = seen.read_text().split(" ")
        assert user == f"spottrain-workers-{run_id}" and said_hash != run_hash
    assert watch.anonymous_refused
    assert watch.seen == {
        "redis-server",
        "spottrain.agent.cli",
        "torch.distributed.run",
        "check_env.py",
    }
    assert watch.passes > 20
    assert "inject-preemption" in logs.stdout

    assert watch.leaks == []
    printed = {"up": up.stdout + up.stderr, "logs": logs.stdout + logs.stderr}
    printed["status"] = status.stdout + status.stderr
    printed["logs --node"] = node_output.stdout + node_output.stderr
    printed["down"] = down.stdout + down.stderr
    # Every file the run left: its directory (controller.log, events.jsonl, the Redis
    # append-only file with every write to Redis), the VMs' records and consoles, the
    # checkpoints; all but the password file and the secret store themselves.
    skip = {run_dir / "redis" / "password", store / "job-token"}
    consoles = list((home / "local").rglob("*.log"))
    assert consoles and (run_dir / "controller.log").exists()
    assert list((run_dir / "redis").rglob("*.aof")), "no append-only file to scan"
    assert (run_dir / "events.jsonl").exists()
    for path in _files(tmp_path, skip):
        data = path.read_bytes()
        for what, secret in (("token", token), ("password", password)):
            assert secret.encode() not in data, f"the {what} is in {path}"
    for name, text in printed.items():
        assert token not in text and password not in text, f"`spottrain {name}` printed a secret"


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_a_cloud_vms_boot_script_holds_no_secret(cloud: str) -> None:
    """The same secrets for a cloud job: the script names where they are, never what."""
    data = spec_with(VALID, "train.secret_env", {"JOB_TOKEN": "job-token"})
    data = spec_with(
        data,
        "code",
        {"git": {"repo": "https://github.com/acme/t", "commit": COMMIT, "token_secret": "gh"}},
    )
    spec = parse_spec(yaml.safe_dump(data)).spec
    zone, itype = ("us-east-1a", "p4d.24xlarge") if cloud == "aws" else ("us-central1-a", "a2")
    node = NodeIdentity("gpt-small-1", "n1", cloud, zone, itype)
    script = whole_boot(
        spec, node, "rediss://redis.internal:6380", password_secret="spottrain/redis"
    )
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    assert "job-token" in script and "spottrain/redis" in script
    assert " secret gh /etc/spottrain/git-token" in script
    for line in script.splitlines():
        assert not line.startswith("JOB_TOKEN="), "the secret variable is inline"

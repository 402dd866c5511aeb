"""The boot's loader (``spottrain.cloud.vmboot``) against the clouds' fakes, run as a VM runs
it: the two files side by side in a folder, executed by the system's ``python3`` (no
spottrain, no boto3: the standard library only), with the VM's identity from a fake metadata
server (IMDSv2 credentials; the GCE token).

Every case a VM meets at boot: a file fetched and verified, one changed after the run
started, one missing, one the role may not read; a secret read into a root-only file and
redacted from everything printed or shipped afterwards; a secret the role may not read; no
instance profile at all; a failed stage's reason reported to Redis and its output shipped
where ``spottrain logs --node`` reads it.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import stat
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from fakes.metadata_server import MetadataServer
from moto.server import ThreadedMotoServer

from spottrain.cloud.stores import open_store
from spottrain.cloud.vmboot import fetch as fetch_module
from spottrain.cloud.vmboot import loader as loader_module
from spottrain.protocol.boot import BootState, parse_console, report_from_fields
from spottrain.protocol.keys import RunKeys
from spottrain.protocol.node_logs import parse_chunk_key

PYTHON = "/usr/bin/python3"  # an image's python3: spottrain is not installed in it
REGION = "us-east-1"
ROLE = "spottrain-agent"


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def _client(service: str, url: str) -> Any:
    return boto3.client(
        service,
        endpoint_url=url,
        region_name=REGION,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


@pytest.fixture
def aws_md() -> Iterator[MetadataServer]:
    with MetadataServer() as md:
        meta = "/latest/meta-data/"
        md.set_aws_value(meta + "instance-id", "i-0123456789abcdef0")
        md.set_aws_value(meta + "placement/region", REGION)
        md.set_aws_value(meta + "iam/security-credentials/", ROLE)
        creds = {
            "Code": "Success",
            "AccessKeyId": "ASIAEXAMPLE",
            "SecretAccessKey": "s3cr3t",
            "Token": "session-token",
            "Expiration": "2099-01-01T00:00:00Z",
        }
        md.set_aws_value(meta + f"iam/security-credentials/{ROLE}", json.dumps(creds))
        yield md


class Vm:
    """The loader's folder on a VM, and a way to run its commands there."""

    def __init__(self, folder: Path, conf: dict[str, Any], md: MetadataServer) -> None:
        self.folder, self.conf, self.md = folder, conf, md
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(fetch_module.__file__, folder / "fetch.py")
        shutil.copy(loader_module.__file__, folder / "loader.py")
        self.conf.setdefault("redact_file", str(folder / "redact"))
        (folder / "started-ms").write_text("1795000000123\n")
        self.save()

    def save(self) -> None:
        (self.folder / "boot.json").write_text(json.dumps(self.conf))

    def run(
        self, script: str, *args: str, python: str = PYTHON
    ) -> subprocess.CompletedProcess[str]:
        env = {"PATH": "/usr/bin:/bin", "AWS_EC2_METADATA_SERVICE_ENDPOINT": self.md.url}
        env["GCE_METADATA_HOST"] = self.md.host
        return subprocess.run(
            [python, str(self.folder / script), str(self.folder / "boot.json"), *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )


def _aws_conf(moto_url: str, bucket: str, redis_url: str, run: str) -> dict[str, Any]:
    keys = RunKeys(run)
    return {
        "cloud": "aws",
        "run_id": run,
        "node": "n3",
        "endpoints": {"s3": moto_url, "secretsmanager": moto_url},
        "files": {},
        "logs": {"url": f"s3://{bucket}/logs", "prefix": f"{run}/n3/"},
        "redis": {
            "url": redis_url,
            "password_file": "",
            "boot_key": keys.boot("n3"),
            "events_key": keys.events,
            "events_maxlen": 1000,
        },
        "pip": {},
    }


@pytest.fixture
def aws_vm(tmp_path: Path, moto_url: str, aws_md: MetadataServer, redis_server: Any) -> Vm:
    bucket = f"box-{uuid.uuid4().hex[:10]}"
    _client("s3", moto_url).create_bucket(Bucket=bucket)
    run = f"r-{uuid.uuid4().hex[:8]}"
    return Vm(tmp_path / "boot", _aws_conf(moto_url, bucket, redis_server.url, run), aws_md)


def _put(vm: Vm, name: str, data: bytes) -> str:
    bucket = vm.conf["logs"]["url"].split("/")[2]
    key = f"run/code/{name}"
    _client("s3", vm.conf["endpoints"]["s3"]).put_object(Bucket=bucket, Key=key, Body=data)
    url = f"s3://{bucket}/{key}"
    vm.conf["files"][name] = {"url": url, "sha256": hashlib.sha256(data).hexdigest()}
    vm.save()
    return url


def test_a_vm_fetches_a_file_signed_with_its_instance_role_and_checks_its_sha256(
    aws_vm: Vm, tmp_path: Path
) -> None:
    data = b"#!/bin/bash\necho the job's boot\n" * 1000
    _put(aws_vm, "script", data)
    dest = tmp_path / "job.sh"
    done = aws_vm.run("fetch.py", "script", str(dest))
    assert done.returncode == 0, done.stderr
    assert dest.read_bytes() == data and stat.S_IMODE(dest.stat().st_mode) == 0o644
    # The role's credentials came from IMDSv2, with a token.
    assert aws_vm.md.count("/latest/api/token", "PUT") >= 1
    assert aws_vm.md.count(f"/latest/meta-data/iam/security-credentials/{ROLE}") >= 1


def test_a_file_changed_after_the_run_started_is_refused_in_one_line(
    aws_vm: Vm, tmp_path: Path
) -> None:
    _put(aws_vm, "lock", b"numpy==2.1.0 --hash=sha256:" + b"a" * 64 + b"\n")
    aws_vm.conf["files"]["lock"]["sha256"] = "b" * 64  # what the controller pinned
    aws_vm.save()
    done = aws_vm.run("fetch.py", "lock", str(tmp_path / "env.lock"))
    assert done.returncode == 3
    line = done.stderr.strip()
    assert "\n" not in line and line.startswith("spottrain: s3://")
    assert "does not match the sha256 the controller pinned (bbbbbbbbbbbbbbbb" in line
    assert not (tmp_path / "env.lock").exists()


def test_a_missing_file_and_a_vm_without_an_instance_profile_say_so(
    aws_vm: Vm, tmp_path: Path
) -> None:
    bucket = aws_vm.conf["logs"]["url"].split("/")[2]
    aws_vm.conf["files"]["wheel"] = {"url": f"s3://{bucket}/nothing.whl", "sha256": "c" * 64}
    aws_vm.save()
    done = aws_vm.run("fetch.py", "wheel", str(tmp_path / "w.whl"))
    assert done.returncode == 3 and "no such object or bucket" in done.stderr
    aws_vm.md.set_aws_value("/latest/meta-data/iam/security-credentials/", None)
    done = aws_vm.run("fetch.py", "wheel", str(tmp_path / "w.whl"))
    assert done.returncode == 3
    assert "the VM has no instance profile (IAM role): set aws.instance_profile" in done.stderr


def test_a_secret_lands_in_a_root_only_file_and_is_redacted_from_what_follows(
    aws_vm: Vm, tmp_path: Path
) -> None:
    value = "pa55-w0rd-that-must-not-leak"
    _client("secretsmanager", aws_vm.conf["endpoints"]["secretsmanager"]).create_secret(
        Name=f"{aws_vm.conf['run_id']}/redis", SecretString=value
    )
    dest = tmp_path / "redis-password"
    done = aws_vm.run("loader.py", "secret", f"{aws_vm.conf['run_id']}/redis", str(dest))
    assert done.returncode == 0, done.stderr
    assert dest.read_text() == value and stat.S_IMODE(dest.stat().st_mode) == 0o600
    assert value not in (aws_vm.folder / "redact").read_text()  # kept encoded, root-only
    # A stage that fails printing the secret: its reason and its shipped output hide it.
    log = tmp_path / "boot.log"
    log.write_text(f"pip install...\nERROR: cannot reach https://u:{value}@mirror/simple\n")
    done = aws_vm.run("loader.py", "fail", "install the environment", str(log), "0")
    assert done.returncode == 0, done.stderr
    assert value not in done.stdout + done.stderr and "[redacted]" in done.stdout


def test_a_secret_that_does_not_exist_names_itself_and_the_fix(aws_vm: Vm, tmp_path: Path) -> None:
    done = aws_vm.run("loader.py", "secret", "no/such-secret", str(tmp_path / "x"))
    assert done.returncode == 3
    assert "cannot read the secret 'no/such-secret': no such secret in us-east-1" in done.stderr
    assert not (tmp_path / "x").exists()


def test_a_failed_stage_is_reported_to_redis_and_the_console_and_its_output_shipped(
    aws_vm: Vm, tmp_path: Path, redis_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "spottrain-agent.log"
    log.write_text(
        "spottrain-boot: n3 i-0123456789abcdef0: stage 'check the image'\n"
        "Collecting torch==2.13.0\n"
        "spottrain-boot: n3 i-0123456789abcdef0: stage 'install the environment'\n"
        "ERROR: Could not find a version that satisfies the requirement torch==2.13.0\n"
        "ERROR: No matching distribution found for torch==2.13.0\n"
    )
    offset = log.read_text().index("spottrain-boot: n3 i-0123456789abcdef0: stage 'install")
    done = aws_vm.run("loader.py", "fail", "install the environment", str(log), str(offset))
    assert done.returncode == 0, done.stderr
    # The console line the controller parses when Redis never heard of the VM.
    report = parse_console(done.stdout, "n3")
    assert report is not None and report.state is BootState.FAILED
    assert report.line() == (
        "n3: boot failed in 'install the environment': pip: No matching distribution found "
        "for torch==2.13.0"
    )
    # The same in Redis: the node's boot hash and an event.
    client = redis_server.client(decode_responses=True)
    keys = RunKeys(aws_vm.conf["run_id"])
    fields = client.hgetall(keys.boot("n3"))
    got = report_from_fields("n3", fields)
    assert got is not None and got.failed and got.vm == "i-0123456789abcdef0"
    assert got.reason == report.reason
    events = client.xrange(keys.events)
    assert events[-1][1]["type"] == "boot" and events[-1][1]["state"] == "failed"
    # The boot's output, whole, as the VM's first log chunk, readable by spottrain's store.
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", aws_vm.conf["endpoints"]["s3"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    store = open_store(aws_vm.conf["logs"]["url"])
    chunks = store.list(aws_vm.conf["logs"]["prefix"])
    assert len(chunks) == 1
    name = parse_chunk_key(chunks[0])
    assert name is not None and (name.vm, name.seq, name.started_ms) == (
        "i-0123456789abcdef0",
        0,
        1795000000123,
    )
    assert gzip.decompress(store.get_bytes(chunks[0])).decode() == log.read_text()


def test_the_loader_runs_on_an_old_python_too(aws_vm: Vm, tmp_path: Path) -> None:
    old = sorted(Path("/root/.pyenv/versions").glob("3.7.*/bin/python3.7"))
    if not old:
        pytest.skip("no Python 3.7 on this machine")
    data = b"x" * 10
    _put(aws_vm, "script", data)
    done = aws_vm.run("fetch.py", "script", str(tmp_path / "s"), python=str(old[0]))
    assert done.returncode == 0, done.stderr
    missing = aws_vm.run("loader.py", "secret", "missing", str(tmp_path / "m"), python=str(old[0]))
    assert missing.returncode == 3 and "no such secret" in missing.stderr


def test_the_loader_imports_the_standard_library_only() -> None:
    """A fresh VM has no spottrain and no boto3: the loader's two files import nothing else
    (the loader imports the fetch part beside it)."""
    import ast
    import sys

    for module in (fetch_module, loader_module):
        tree = ast.parse(Path(module.__file__).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level or node.module == "fetch":
                    continue
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top == "__future__", (module, name)


def test_an_image_jobs_secret_variables_reach_its_agent_exact_and_no_docker_setting(
    aws_vm: Vm, tmp_path: Path
) -> None:
    """An image job's secret variables go to a root-only file of JSON lines the agent reads
    in its container (not docker's --env-file, which `docker inspect` shows): the values
    arrive exact, quotes, dollars and backslashes included, and the loader remembers them
    for redaction."""
    from spottrain.agent.agent import read_secret_env

    values = {"HF_TOKEN": "hf_\"q'uo$te\\d`x`", "WANDB_API_KEY": "0123456789abcdef=="}
    sm = _client("secretsmanager", aws_vm.conf["endpoints"]["secretsmanager"])
    dest = tmp_path / "secret-env.jsonl"
    for var, value in values.items():
        sm.create_secret(Name=f"{aws_vm.conf['run_id']}/{var}", SecretString=value)
        name = f"{aws_vm.conf['run_id']}/{var}"
        done = aws_vm.run("loader.py", "secret-env-json", var, name, str(dest))
        assert done.returncode == 0, done.stderr
        assert values[var] not in done.stdout + done.stderr
    assert stat.S_IMODE(dest.stat().st_mode) == 0o600
    assert read_secret_env(str(dest)) == values
    redact = (aws_vm.folder / "redact").read_text()
    assert len(redact.splitlines()) == 2 and values["WANDB_API_KEY"] not in redact

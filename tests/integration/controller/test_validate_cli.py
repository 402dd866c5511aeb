"""``spottrain validate`` as a user runs it: a subprocess, its exit code and its words, and
the providers built from a spec."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from spec_samples import LOCAL, VALID, spec_with

from spottrain.cloud.base import Market
from spottrain.cloud.local.compute import LocalProvider
from spottrain.controller.reconcile.offers import offer_query
from spottrain.controller.run.providers import build_provider
from spottrain.spec import parse_spec

REPO = Path(__file__).resolve().parents[3]


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spottrain.controller.cli", "validate", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=REPO,
        timeout=120,
    )


def _write(tmp_path: Path, data: dict[str, object], name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize(
    "example",
    ["local_job.yaml", "local_replica_job.yaml", "aws_job.yaml", "gcp_job.yaml", "fsdp_job.yaml"],
)
def test_every_example_spec_is_valid(example: str) -> None:
    out = _run(f"examples/{example}")
    assert out.returncode == 0, out.stderr
    assert "valid job spec" in out.stdout and "fits" in out.stdout


def test_invalid_spec_exits_2_with_one_line_per_problem(tmp_path: Path) -> None:
    bad = spec_with(spec_with(VALID, "name", "Bad_Name"), "nodes.gpu", 8)
    out = _run(str(_write(tmp_path, bad)))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert lines[0].endswith("job.yaml: the job spec is not valid:")
    assert lines[1].startswith("  name (line 1): use 1-48 lowercase letters")
    assert lines[2] == "  nodes.gpu (line 14): unknown key; allowed here: min, max, gpus, workers"


def test_window_that_does_not_fit_exits_3_and_json_says_which(tmp_path: Path) -> None:
    spec = spec_with(VALID, "checkpoint.volume.write_gbps", 2)  # 84 GB: 42 s
    path = _write(tmp_path, spec)
    out = _run(str(path))
    assert out.returncode == 3
    assert "aws: 84 GB at 2 GB/s takes 42.0 s" in out.stdout and "fits, 65 s to spare" in out.stdout
    assert "gcp: 84 GB at 2 GB/s" in out.stdout and "does NOT fit: 25 s short" in out.stdout
    result = json.loads(_run(str(path), "--json").stdout)
    assert result["valid"] and result["checkpoint_gb"] == pytest.approx(84.0)
    assert {w["cloud"]: w["fits"] for w in result["windows"]} == {"aws": True, "gcp": False}


def test_a_copy_to_another_allowed_cloud_cannot_read_exits_2(tmp_path: Path) -> None:
    # A GCP VM has neither the S3 client nor AWS credentials: it could not restore the copy.
    out = _run(str(_write(tmp_path, spec_with(VALID, "checkpoint.copy_to", "s3://acme/ckpt"))))
    assert out.returncode == 2
    assert "checkpoint.copy_to: s3:// (aws storage) cannot be read by gcp VMs" in out.stderr, (
        out.stderr
    )
    assert "use one cloud (resources.clouds: [aws])" in out.stderr


def test_validate_warns_where_vms_are_reachable_from_the_internet(tmp_path: Path) -> None:
    spec = spec_with(VALID, "checkpoint.params", "1B")  # fits both notice windows: exit 0
    spec = spec_with(spec, "aws.public_ip", True)
    spec = spec_with(spec, "gcp.external_ip", True)
    spec = spec_with(spec, "gcp.service_account", "default")
    path = _write(tmp_path, spec)

    out = _run(str(path))

    assert out.returncode == 0, out.stderr
    warnings = [line for line in out.stderr.splitlines() if line.startswith("  warning: ")]
    assert any("aws.public_ip is true" in w for w in warnings)
    assert any("aws.security_groups is empty" in w for w in warnings)
    assert any("gcp.external_ip is true" in w for w in warnings)
    assert any("gcp.service_account is 'default'" in w for w in warnings)
    result = json.loads(_run(str(path), "--json").stdout)
    assert result["valid"] and len(result["warnings"]) == len(warnings)


@pytest.mark.parametrize("example", ["local_job.yaml", "aws_job.yaml", "gcp_job.yaml"])
def test_the_example_specs_leave_no_vm_reachable_from_the_internet(example: str) -> None:
    out = _run(f"examples/{example}", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["warnings"] == []


def test_invalid_spec_as_json(tmp_path: Path) -> None:
    out = _run(str(_write(tmp_path, spec_with(VALID, "budget.max_usd", 0))), "--json")
    assert out.returncode == 2
    result = json.loads(out.stdout)
    assert result == {
        "valid": False,
        "source": str(tmp_path / "job.yaml"),
        "problems": [
            "budget.max_usd (line 29): use a number above 0 up to 100,000,000 USD (got 0)"
        ],
    }


def test_a_missing_trace_file_is_reported(tmp_path: Path) -> None:
    spec = spec_with(LOCAL, "local.preemptions", {"trace": "nope.yaml"})
    out = _run(str(_write(tmp_path, spec)))
    assert out.returncode == 2
    assert "local.preemptions.trace: preemption trace" in out.stderr
    assert "cannot read it" in out.stderr


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _no_credentials(tmp_path: Path) -> dict[str, str]:
    # Nothing to find anywhere: no keys, no files, no metadata server to ask.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "GOOGLE_"))}
    dead = f"127.0.0.1:{_dead_port()}"
    return {
        **env,
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_EC2_METADATA_DISABLED": "true",
        "CLOUDSDK_CONFIG": str(tmp_path / "gcloud"),
        "GCE_METADATA_HOST": dead,
        "GCE_METADATA_IP": dead,
        # google-auth asks even a dead metadata server three times with backoff (5 s).
        "NO_GCE_CHECK": "true",
        "HOME": str(tmp_path),
    }


def _check_clouds(example: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "spottrain.controller.cli", "validate", example, "--check-clouds"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)


def test_check_clouds_without_aws_credentials_says_how_to_give_them(tmp_path: Path) -> None:
    out = _check_clouds("examples/aws_job.yaml", _no_credentials(tmp_path))
    assert out.returncode == 1
    assert "aws: cannot use it:" in out.stderr
    assert "AWS_PROFILE" in out.stderr and "AWS_ACCESS_KEY_ID" in out.stderr


def test_check_clouds_without_google_credentials_says_how_to_give_them(tmp_path: Path) -> None:
    out = _check_clouds("examples/gcp_job.yaml", _no_credentials(tmp_path))
    assert out.returncode == 1
    assert "gcp: cannot use it:" in out.stderr
    assert "gcloud auth application-default login" in out.stderr


@pytest.fixture
def moto_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def test_check_clouds_lists_the_cheapest_aws_offer(tmp_path: Path, moto_endpoint: str) -> None:
    env = {
        **_no_credentials(tmp_path),
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_ENDPOINT_URL": moto_endpoint,
    }
    out = _check_clouds("examples/aws_job.yaml", env)
    assert out.returncode == 0, out.stderr
    assert "aws: " in out.stdout and "offers; cheapest p4d.24xlarge spot in us-" in out.stdout


def test_offer_query_follows_the_spot_policy_and_each_clouds_names() -> None:
    spec = parse_spec(yaml.safe_dump(VALID)).spec
    aws = offer_query(spec, "aws")
    assert aws.regions == ("us-east-1",) and aws.instance_types == ("p4d.24xlarge",)
    assert aws.markets == (Market.SPOT, Market.ON_DEMAND)
    assert aws.max_price_per_hour == 20 and aws.min_gpus == 8
    gcp = offer_query(spec, "gcp")
    assert gcp.regions == ("us-central1",) and gcp.instance_types == ("a2-highgpu-8g",)
    spot_only = parse_spec(yaml.safe_dump(spec_with(VALID, "spot", {"policy": "spot"}))).spec
    assert offer_query(spot_only, "aws").markets == (Market.SPOT,)
    od = parse_spec(yaml.safe_dump(spec_with(VALID, "spot", {"policy": "on-demand"}))).spec
    assert offer_query(od, "gcp").markets == (Market.ON_DEMAND,)


def test_local_provider_is_built_from_the_spec(tmp_path: Path) -> None:
    spec = parse_spec(yaml.safe_dump(LOCAL)).spec
    provider = build_provider(spec, "local", local_state_dir=tmp_path)
    assert isinstance(provider, LocalProvider)
    assert provider.capacity() == {"local-a": 2, "local-b": 2}
    offers = provider.offers(offer_query(spec, "local"))
    assert {o.zone for o in offers} == {"local-a", "local-b"}
    assert {o.market for o in offers} == {Market.SPOT}


def test_preemption_injector_is_built_from_the_spec_and_its_trace(tmp_path: Path) -> None:
    from spottrain.controller.run.providers import preemption_injector

    (tmp_path / "trace.yaml").write_text("- {at_s: 5, notice: false}\n")
    data = spec_with(LOCAL, "local.preemptions", {"rate_per_hour": 2, "trace": "trace.yaml"})
    spec = parse_spec(yaml.safe_dump(data), base_dir=tmp_path).spec
    provider = build_provider(spec, "local", local_state_dir=tmp_path / "cloud")
    inj = preemption_injector(spec, provider, "job-1", started_at=10.0, base_dir=tmp_path)
    assert inj is not None
    assert inj.rate_per_hour == 2 and [t.at_s for t in inj.trace] == [5.0]
    quiet = parse_spec(yaml.safe_dump(LOCAL)).spec
    assert preemption_injector(quiet, provider, "j", started_at=0, base_dir=tmp_path) is None

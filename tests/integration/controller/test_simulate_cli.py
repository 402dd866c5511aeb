"""``spottrain simulate`` through its argparse front: the table, ``--json``, ``--png``, a
spec, a trace, and every kind of bad input refused with exit 2 and one clear line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from spottrain.controller.sim.command import add_parser, command

REPO = Path(__file__).resolve().parents[3]


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="spottrain")
    sub = parser.add_subparsers(dest="command")
    add_parser(sub)
    args = parser.parse_args(["simulate", *argv])
    return command(args)


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert _run(*argv, "--json") == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    data = json.loads(out[0])
    assert isinstance(data, dict)
    return data


def test_table_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run("--gpus", "800", "--hours", "24", "--rate-per-node-hour", "0.01") == 0
    out = capsys.readouterr().out
    assert "800 GPUs (100 x p5.48xlarge, aws us-east-1a) for 24 h" in out
    for word in ("sync", "elastic", "replica", "$/useful GPU-h", "x on-demand", "preemptions"):
        assert word in out


def test_json_figures(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(
        capsys,
        "--gpus",
        "1600",
        "--days",
        "2",
        "--rate-per-node-hour",
        "0.01",
        "--seed",
        "4",
        "--policies",
        "sync,replica",
    )
    assert data["gpus"] == 1600 and data["nodes"] == 200 and data["hours"] == 48
    assert isinstance(data["preemptions"], int) and data["preemptions"] > 0
    policies = data["policies"]
    assert isinstance(policies, dict) and list(policies) == ["sync", "replica"]
    for fig in policies.values():
        assert 0 <= fig["effective"] <= 1
        assert fig["usd_per_useful_gpu_h"] > data["spot_usd_per_gpu_h"]
        assert "lost_gpu_h_per_preemption" in fig and "vs_on_demand" in fig
    assert policies["replica"]["effective"] > policies["sync"]["effective"]
    settings = data["settings"]
    assert isinstance(settings, dict)
    assert settings["rendezvous_s"] == 4.4 and settings["save_s"] == 21.0


def test_replica_parameters_and_their_sources(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(capsys, "--gpus", "800", "--hours", "24", "--rate-per-node-hour", "0.01")
    params = data["replica_parameters"]
    assert isinstance(params, dict)
    for name in ("step_s", "heartbeat_s", "kill_stall_s", "join_start_s", "quorum_b_s"):
        assert params[name]["kind"] in {"measured", "modelled", "setting"}
        assert params[name]["source"]
    # 100 replicas on the Redis quorum: the spec's auto timeout, 1 s, and a silent loss
    # 1.08 x it (bench/quorum_scale.py: 1.01-1.11 s at 1 s).
    assert params["heartbeat_s"] == {**params["heartbeat_s"], "value": 1.0, "kind": "setting"}
    assert "auto at 100 replicas" in params["heartbeat_s"]["source"]
    assert params["kill_stall_s"] == {**params["kill_stall_s"], "value": 1.08, "kind": "measured"}
    at = params["at_replicas"]
    assert at["replicas"] == 100 and at["quorum_kind"] == "measured"
    assert 0 < at["step_share"] < 1
    assert set(data["policies"]) == {"sync", "elastic", "replica", "replica-ideal"}
    # Options replace the measured values: a free quorum and process group, and the
    # measured policy comes close to the ideal one.
    free = _json(
        capsys,
        *("--gpus", "800", "--hours", "24", "--rate-per-node-hour", "0.01"),
        *("--quorum", "lighthouse", "--quorum-a-s", "0", "--quorum-b-s", "0"),
        *("--pg-base-s", "0"),
        *("--pg-per-replica-s", "0", "--step-s", "2"),
    )
    assert free["replica_parameters"]["at_replicas"]["step_share"] == 1.0
    assert free["replica_parameters"]["step_s"]["value"] == 2.0
    assert free["policies"]["replica"]["effective"] > data["policies"]["replica"]["effective"]
    # At thousands of replicas the stock lighthouse's quorum is extrapolated, and says so;
    # the Redis quorum (the default) was measured up to 12,500 replicas.
    big = _json(
        capsys,
        *("--gpus", "40000", "--hours", "2", "--policies", "replica"),
        "--quorum",
        "lighthouse",
    )
    assert "extrapolated" in big["replica_parameters"]["at_replicas"]["quorum_kind"]
    big_redis = _json(capsys, "--gpus", "40000", "--hours", "2", "--policies", "replica")
    at_redis = big_redis["replica_parameters"]["at_replicas"]
    assert at_redis["quorum"] == "redis" and at_redis["quorum_kind"] == "measured"
    assert (
        at_redis["quorum_s_per_step"]
        < big["replica_parameters"]["at_replicas"]["quorum_s_per_step"]
    )
    assert big_redis["policies"]["replica"]["effective"] > big["policies"]["replica"]["effective"]
    assert big_redis["replica_parameters"]["redis_b_s"]["kind"] == "measured"
    assert _run("--gpus", "800", "--hours", "2") == 0
    text = capsys.readouterr().out
    assert "replica policy (torchft 0.2.0, quorum: redis): parameters and sources" in text
    assert "[measured] bench/quorum_scale.py" in text and "redis_b_s" in text


def test_a_replica_specs_heartbeat_timeout_is_simulated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A spec's explicit train.replica.heartbeat_timeout_s is the simulated one (and a silent
    loss scales with it); --heartbeat-s wins over it; its auto is the simulator's own."""
    spec = yaml.safe_load((REPO / "examples/aws_job.yaml").read_text())
    spec["train"]["fault_tolerance"] = "replica"
    spec["train"]["replica"] = {"nodes_per_replica": 1, "min_replicas": 1}
    auto = tmp_path / "auto.yaml"
    auto.write_text(yaml.safe_dump(spec))
    spec["train"]["replica"]["heartbeat_timeout_s"] = 3
    given = tmp_path / "given.yaml"
    given.write_text(yaml.safe_dump(spec))
    cases = [
        ((given,), 3.0, "given"),
        ((given, "--heartbeat-s", "2"), 2.0, "given"),
        ((auto,), 1.0, "auto at"),
    ]
    for (path, *more), timeout, said in cases:
        data = _json(capsys, "--spec", str(path), "--hours", "1", *more)
        params = data["replica_parameters"]
        assert params["heartbeat_s"]["value"] == timeout and said in params["heartbeat_s"]["source"]
        assert params["kill_stall_s"]["value"] == pytest.approx(1.08 * timeout)


def test_default_rate_comes_from_the_catalog_band(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(capsys, "--gpus", "8000", "--hours", "12")
    settings = data["settings"]
    assert isinstance(settings, dict)
    assert settings["rate_per_node_hour"] == pytest.approx(0.25 / 730)  # p5: ">20%"
    assert settings["notice_s"] == 120
    gcp = _json(capsys, "--gpus", "800", "--hours", "1", "--cloud", "gcp")
    assert "a3-highgpu-8g" in str(gcp["instance"])
    gcp_settings = gcp["settings"]
    assert isinstance(gcp_settings, dict) and gcp_settings["notice_s"] == 30


def test_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "sim.png"
    assert (
        _run("--gpus", "800", "--hours", "24", "--rate-per-node-hour", "0.02", "--png", str(png))
        == 0
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {png}" in capsys.readouterr().out


def test_trace_file(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(
        capsys,
        "--gpus",
        "800",
        "--days",
        "1",
        "--trace",
        str(REPO / "examples/preemption_trace_sim.yaml"),
    )
    # A trace alone: no rate unless one is given; every row within the day happens.
    assert data["preemptions"] == 10 and data["with_notice"] == 8


def test_spec_sets_size_prices_and_checkpoints(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(capsys, "--spec", str(REPO / "examples/aws_job.yaml"), "--hours", "24")
    # nodes.max 4 of the cheapest allowed spot type (p4d, 8 GPUs); 7B at 12 B/param.
    assert data["nodes"] == 4 and data["gpus"] == 32
    assert "p4d.24xlarge" in str(data["instance"])
    settings = data["settings"]
    assert isinstance(settings, dict)
    assert settings["ckpt_gb"] == pytest.approx(84.0) and settings["write_gbps"] == 4
    assert settings["ckpt_every_min"] == 20
    # Options on the command line win over the spec.
    data = _json(
        capsys, "--spec", str(REPO / "examples/aws_job.yaml"), "--hours", "24", "--gpus", "64"
    )
    assert data["nodes"] == 8


def test_local_spec_uses_its_injected_preemptions(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(
        capsys,
        "--spec",
        str(REPO / "examples/local_job.yaml"),
        "--gpus-per-node",
        "8",
        "--hours",
        "1",
    )
    # examples/preemptions.yaml: one with notice at 25 s, one without at 55 s.
    assert data["preemptions"] == 2 and data["with_notice"] == 1
    settings = data["settings"]
    assert isinstance(settings, dict) and settings["notice_s"] == 20


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--gpus", "0"], "--gpus must be at least 1"),
        (["--gpus", "12"], "not a whole number of 8-GPU nodes"),
        (["--gpus", "80", "--replica-nodes", "3"], "do not split into replicas of 3"),
        (["--policies", "sync,bogus"], "bogus; choose from sync, elastic, replica, replica-ideal"),
        (["--step-s", "0"], "--step-s must be a number > 0"),
        (["--quorum-b-s", "-1"], "--quorum-b-s must be a number >= 0"),
        (["--pg-per-replica-s", "nan"], "--pg-per-replica-s must be a number >= 0"),
        (["--policies", "sync,sync"], "name each policy once"),
        (["--rate-per-node-hour", "-1"], "--rate-per-node-hour must be a number >= 0"),
        (["--write-gbps", "0"], "--write-gbps must be a number > 0"),
        (["--notice-fraction", "1.5"], "--notice-fraction is a share in [0, 1]"),
        (["--instance-type", "p9.huge"], "p9.huge"),
        (["--region", "mars-1"], "mars-1"),
        (["--trace", "/nonexistent/trace.yaml"], "cannot read it"),
        (["--png", "/nonexistent/dir/out.png"], "does not exist"),
        (["--spec", "/nonexistent/job.yaml"], "cannot read the file"),
        (["--gpus", "8000000", "--rate-per-node-hour", "1"], "at most 125,000"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run("--hours", "1", *argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert words in captured.err and captured.err.startswith("spottrain simulate: ")


def test_bad_trace_rows_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "trace.yaml"
    bad.write_text(yaml.safe_dump([{"at_s": -5}]))
    assert _run("--hours", "1", "--trace", str(bad)) == 2
    assert "at_s must be seconds >= 0" in capsys.readouterr().err


def test_local_spec_without_gpus_says_how_to_count_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _run("--spec", str(REPO / "examples/local_job.yaml"), "--hours", "1") == 2
    assert "--gpus-per-node" in capsys.readouterr().err


def test_a_replica_specs_nodes_per_replica_sizes_the_replicas(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    spec = yaml.safe_load((REPO / "examples/aws_job.yaml").read_text())
    spec["train"]["fault_tolerance"] = "replica"
    spec["train"]["replica"] = {"nodes_per_replica": 2, "min_replicas": 1}
    path = tmp_path / "replica_job.yaml"
    path.write_text(yaml.safe_dump(spec))
    data = _json(capsys, "--spec", str(path), "--hours", "24")
    settings = data["settings"]
    assert isinstance(settings, dict) and settings["replica_nodes"] == 2
    # The command line still wins.
    data = _json(capsys, "--spec", str(path), "--hours", "24", "--replica-nodes", "4")
    assert data["settings"]["replica_nodes"] == 4

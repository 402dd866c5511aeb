"""The agent's systemd unit and its environment file example (agent/systemd/), read with
spottrain.agent.systemd_unit: the settings the drain depends on, and the unit-file reader."""

from __future__ import annotations

import math
import re
import shlex
import shutil
import subprocess
from pathlib import Path, PurePosixPath

import pytest

from spottrain.agent.cli import RUN_ENV_VARS, build_parser
from spottrain.agent.systemd_unit import (
    UnitSyntaxError,
    parse_timespan,
    parse_unit,
    unit_path,
)

# Every variable `spottrain-agent run` reads from the environment file.
build_parser()
AGENT_VARIABLES = set(RUN_ENV_VARS)
# AWS gives 2 minutes between the interruption notice and the shutdown.
AWS_NOTICE_SECONDS = 120
# An assignment, active or commented out ("# SPOTTRAIN_NODE_ID="), but not prose.
ASSIGNMENT = re.compile(r"^\s*(#\s*)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


@pytest.fixture(scope="module")
def unit() -> dict[str, dict[str, list[str]]]:
    return parse_unit(unit_path().read_text())


@pytest.fixture(scope="module")
def env_example() -> dict[str, tuple[bool, str]]:
    """name -> (active, value) for each assignment in agent.env.example."""
    found: dict[str, tuple[bool, str]] = {}
    for line in unit_path().with_name("agent.env.example").read_text().splitlines():
        m = ASSIGNMENT.match(line)
        if m:
            found[m.group(2)] = (m.group(1) is None, m.group(3))
    return found


def one(unit: dict[str, dict[str, list[str]]], section: str, key: str) -> str:
    values = unit.get(section, {}).get(key, [])
    assert len(values) == 1, f"[{section}] {key}= should be set once, is {values}"
    return values[0]


def test_unit_ships_inside_the_package() -> None:
    path = unit_path()
    assert path.name == "spottrain-agent.service"
    assert path.parent.name == "systemd"
    assert path.with_name("agent.env.example").is_file()


def test_stop_signal_goes_to_the_agent_alone(unit: dict[str, dict[str, list[str]]]) -> None:
    assert one(unit, "Service", "KillMode") == "mixed"
    assert one(unit, "Service", "KillSignal") == "SIGTERM"
    assert one(unit, "Service", "SendSIGKILL") == "yes"


def test_stop_timeout_covers_the_aws_notice_window(unit: dict[str, dict[str, list[str]]]) -> None:
    seconds = parse_timespan(one(unit, "Service", "TimeoutStopSec"))
    assert seconds >= 150
    assert seconds > AWS_NOTICE_SECONDS
    assert not math.isinf(seconds), "an infinite stop timeout would hang the VM's shutdown"


def test_exec_start_runs_the_agent_with_no_options(unit: dict[str, dict[str, list[str]]]) -> None:
    argv = shlex.split(one(unit, "Service", "ExecStart"))
    assert PurePosixPath(argv[0]).name == "spottrain-agent"
    assert PurePosixPath(argv[0]).is_absolute()
    assert argv[1:] == ["run"]


def test_environment_file_is_required(unit: dict[str, dict[str, list[str]]]) -> None:
    # A leading "-" would make a missing file silently fine, and the agent start unconfigured.
    assert one(unit, "Service", "EnvironmentFile") == "/etc/spottrain/agent.env"


def test_failures_restart_and_clean_exits_do_not(unit: dict[str, dict[str, list[str]]]) -> None:
    assert one(unit, "Service", "Restart") == "on-failure"
    assert 0 < parse_timespan(one(unit, "Service", "RestartSec")) <= 30


def test_starts_after_the_network_is_online(unit: dict[str, dict[str, list[str]]]) -> None:
    assert "network-online.target" in unit["Unit"]["After"]
    assert "network-online.target" in unit["Unit"]["Wants"]


def test_checkpoint_dir_is_on_a_mount_the_unit_keeps(
    unit: dict[str, dict[str, list[str]]], env_example: dict[str, tuple[bool, str]]
) -> None:
    mounts = [PurePosixPath(p) for v in unit["Unit"]["RequiresMountsFor"] for p in v.split()]
    ckpt = PurePosixPath(env_example["SPOTTRAIN_CKPT_DIR"][1])
    assert any(ckpt.is_relative_to(m) for m in mounts), (ckpt, mounts)


def test_service_type_and_limits(unit: dict[str, dict[str, list[str]]]) -> None:
    assert one(unit, "Service", "Type") in ("exec", "simple")
    assert int(one(unit, "Service", "LimitNOFILE")) >= 65536
    assert one(unit, "Install", "WantedBy") == "multi-user.target"


def test_env_example_lists_every_agent_variable_and_only_those(
    env_example: dict[str, tuple[bool, str]],
) -> None:
    assert all(name.startswith("SPOTTRAIN_") for name in env_example)
    assert set(env_example) == AGENT_VARIABLES


def test_node_id_is_left_to_its_hostname_default(
    env_example: dict[str, tuple[bool, str]],
) -> None:
    # An empty SPOTTRAIN_NODE_ID= would set the variable to "" rather than leave it unset.
    active, _ = env_example["SPOTTRAIN_NODE_ID"]
    assert not active


def test_env_example_train_command_splits_like_a_shell(
    env_example: dict[str, tuple[bool, str]],
) -> None:
    _, value = env_example["SPOTTRAIN_TRAIN_CMD"]
    # systemd strips one pair of quotes around the value; the agent splits the rest.
    inner = shlex.split(value)
    assert len(inner) == 1
    assert shlex.split(inner[0])[-2:] == ["--name", "gpt 1.3b"]


# Sandboxing. The hardening directives the unit may use, each with the only value that
# still lets a node train on GPUs (why each is safe, and why the others are left out, is in
# the unit's comments). A directive systemd knows as hardening that is not here fails the
# test below: adding one means checking it against CUDA, NCCL, EFA and docker first.
HARDENING_ALLOWED = {
    "NoNewPrivileges": "yes",
    "RestrictSUIDSGID": "yes",
    "ProtectSystem": "full",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes",
    "ProtectHostname": "yes",
    "LockPersonality": "yes",
    "RestrictRealtime": "yes",
    "SystemCallArchitectures": "native",
}
# Each of these breaks GPU training: hides /dev/nvidia* or /dev/infiniband (PrivateDevices,
# DevicePolicy, DeviceAllow, ProtectClock through its implied DeviceAllow=char-rtc), the
# W+X pages CUDA and Triton JIT need (MemoryDenyWriteExecute), NCCL's and EFA's netlink and
# unix sockets (RestrictAddressFamilies), shared memory, peers or device owners (PrivateIPC,
# PrivateNetwork, PrivateUsers, IPAddressDeny), or a syscall a driver makes (SystemCallFilter).
HARDENING_BREAKS_GPUS = {
    "PrivateDevices",
    "DevicePolicy",
    "DeviceAllow",
    "ProtectClock",
    "MemoryDenyWriteExecute",
    "RestrictAddressFamilies",
    "PrivateIPC",
    "PrivateNetwork",
    "PrivateUsers",
    "IPAddressDeny",
    "SystemCallFilter",
}
# Every other sandboxing directive of systemd.exec(5) and systemd.resource-control(5): none
# may appear unless moved to HARDENING_ALLOWED after checking it.
HARDENING_UNCHECKED = {
    "ProtectProc",
    "ProcSubset",
    "RestrictNamespaces",
    "RestrictFileSystems",
    "PrivateMounts",
    "CapabilityBoundingSet",
    "AmbientCapabilities",
    "DynamicUser",
    "RemoveIPC",
    "ReadOnlyPaths",
    "InaccessiblePaths",
    "ReadWritePaths",
    "TemporaryFileSystem",
    "BindPaths",
    "BindReadOnlyPaths",
    "RootDirectory",
    "RootImage",
    "SystemCallErrorNumber",
    "SocketBindDeny",
    "SocketBindAllow",
    "NetworkNamespacePath",
    "IPCNamespacePath",
    "KeyringMode",
    "SecureBits",
    "User",
    "Group",
    "SupplementaryGroups",
    "MemoryMax",
    "MemoryHigh",
}


def _hardening(unit: dict[str, dict[str, list[str]]]) -> dict[str, list[str]]:
    known = set(HARDENING_ALLOWED) | HARDENING_BREAKS_GPUS | HARDENING_UNCHECKED
    return {k: v for k, v in unit["Service"].items() if k in known}


def test_hardening_is_exactly_the_allowlist(unit: dict[str, dict[str, list[str]]]) -> None:
    assert _hardening(unit) == {k: [v] for k, v in HARDENING_ALLOWED.items()}


def test_nothing_that_hides_gpus_or_breaks_nccl_is_set(
    unit: dict[str, dict[str, list[str]]],
) -> None:
    assert not HARDENING_BREAKS_GPUS & set(unit["Service"])
    # /dev/shm stays the host's: NCCL and data loaders need it large.
    assert not any("/dev/shm" in v for vs in unit["Service"].values() for v in vs)


def test_limits_let_rdma_pin_memory_and_workers_spawn_threads(
    unit: dict[str, dict[str, list[str]]],
) -> None:
    assert one(unit, "Service", "LimitMEMLOCK") == "infinity"
    assert one(unit, "Service", "TasksMax") == "infinity"


def test_the_agent_stays_root_and_names_an_unprivileged_worker_user(
    unit: dict[str, dict[str, list[str]]], env_example: dict[str, tuple[bool, str]]
) -> None:
    # docker, powering the VM off and reading the root-only password file need root.
    assert "User" not in unit["Service"] and "DynamicUser" not in unit["Service"]
    env = dict(e.split("=", 1) for e in unit["Service"]["Environment"])
    assert env["SPOTTRAIN_WORKER_USER"] == "spottrain"
    assert env_example["SPOTTRAIN_WORKER_USER"] == (False, "spottrain")


def test_the_output_goes_to_the_file_the_agent_ships_and_bounds(
    unit: dict[str, dict[str, list[str]]], env_example: dict[str, tuple[bool, str]]
) -> None:
    # Torchrun and the workers inherit stdout and stderr: all of it lands in one file, in a
    # directory that exists before the unit opens it (systemd does not create it).
    kind, _, path = one(unit, "Service", "StandardOutput").partition(":")
    assert kind == "append"
    assert one(unit, "Service", "StandardError") == "inherit"
    assert PurePosixPath(path).parent == PurePosixPath("/var/log")
    env = dict(e.split("=", 1) for e in unit["Service"]["Environment"])
    assert env["SPOTTRAIN_LOGS_FILE"] == path
    assert env_example["SPOTTRAIN_LOGS_FILE"] == (False, path)
    # Bounded (a week of output must not fill the disk), yet above the default backlog.
    assert 64 < float(env["SPOTTRAIN_LOGS_FILE_MAX_MB"]) <= 1024


def test_gpu_device_nodes_are_made_outside_the_sandbox(
    unit: dict[str, dict[str, list[str]]],
) -> None:
    # NoNewPrivileges stops the setuid nvidia-modprobe that CUDA runs on first use, and
    # ProtectKernelModules stops root loading nvidia-uvm: a "+" line does it before.
    [pre] = [v for v in unit["Service"]["ExecStartPre"] if "nvidia-modprobe" in v]
    flags, _, command = pre.partition("/")
    assert set(flags) == {"-", "+"}
    assert "nvidia-modprobe -u -c=0" in command


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not here")
def test_systemd_itself_accepts_every_setting(tmp_path: Path) -> None:
    # verify refuses a missing ExecStart binary, which only exists on a VM: point it at one
    # that exists here; every other line is checked as written.
    text = unit_path().read_text()
    copy = tmp_path / "spottrain-agent.service"
    copy.write_text(text.replace("/opt/spottrain/venv/bin/spottrain-agent", "/bin/true"))
    out = subprocess.run(
        ["systemd-analyze", "verify", str(copy)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.stderr.strip() == "", out.stderr


# The reader itself.


def test_parse_unit_keeps_repeated_keys_in_order_and_skips_comments() -> None:
    text = """
# a comment
; another comment
[Unit]
After=a.target
After = b.target c.target
[Service]
Environment=A=1
  Environment=B=2
"""
    assert parse_unit(text) == {
        "Unit": {"After": ["a.target", "b.target c.target"]},
        "Service": {"Environment": ["A=1", "B=2"]},
    }


def test_parse_unit_empty_assignment_resets_the_list() -> None:
    assert parse_unit("[Unit]\nAfter=a\nAfter=\nAfter=b\n") == {"Unit": {"After": ["b"]}}


def test_parse_unit_joins_continued_lines_and_ignores_comments_inside() -> None:
    text = "[Service]\nExecStart=/bin/x \\\n# a comment\n  --flag \\\n  value\n"
    [value] = parse_unit(text)["Service"]["ExecStart"]
    assert value.split() == ["/bin/x", "--flag", "value"]


def test_parse_unit_merges_a_repeated_section() -> None:
    text = "[Service]\nType=exec\n[Install]\nWantedBy=x\n[Service]\nRestart=no\n"
    assert parse_unit(text)["Service"] == {"Type": ["exec"], "Restart": ["no"]}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("KillMode=mixed\n", "line 1: KillMode= comes before any"),
        ("[Service]\nKillMode mixed\n", "line 2: 'KillMode mixed' is not a section header"),
        ("[Service\n", "line 1: bad section header"),
        ("[Service]\nExecStart=/bin/x \\\n", "line 2: the file ends inside a continued line"),
        ("[Service]\n=mixed\n", "line 2"),
    ],
)
def test_parse_unit_names_the_bad_line(text: str, message: str) -> None:
    with pytest.raises(UnitSyntaxError, match=re.escape(message)):
        parse_unit(text)


@pytest.mark.parametrize(
    ("span", "seconds"),
    [
        ("170", 170),
        ("170s", 170),
        ("170sec", 170),
        ("3min", 180),
        ("2min 30s", 150),
        ("2min30s", 150),
        ("1h", 3600),
        ("500ms", 0.5),
        (" 90 s ", 90),
        ("1.5min", 90),
    ],
)
def test_parse_timespan_reads_systemd_spans(span: str, seconds: float) -> None:
    assert parse_timespan(span) == pytest.approx(seconds)


def test_parse_timespan_infinity() -> None:
    assert math.isinf(parse_timespan("infinity"))


@pytest.mark.parametrize("span", ["", "3 fortnights", "soon", "-5s", "3min!"])
def test_parse_timespan_refuses_what_is_not_a_span(span: str) -> None:
    with pytest.raises(ValueError, match="time span"):
        parse_timespan(span)

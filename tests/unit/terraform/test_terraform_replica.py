"""Replica mode (``fault_tolerance = "replica"``) in both Terraform modules, without a
Terraform binary: the variables and their checks (evaluated here from the modules' own
conditions), the agent's environment file a replica-mode VM writes (rendered and run for
real, then read back as systemd would, and by the agent's own parser), the replica extra on
the fleet (and on the controller VM with the lighthouse), and the quorum: the Redis quorum by
default, which adds nothing to the network or the controller VM; with ``replica_quorum =
"lighthouse"`` the one new opening, the lighthouse port from the fleet to the controller VM
only."""

from __future__ import annotations

import math
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import test_terraform_aws as aws_t
import test_terraform_gcp as gcp_t
import yaml
from packaging.requirements import Requirement
from replica_values import LIGHTHOUSE_ADDRESS, env_line_templates, heartbeat_timeout_s
from terraform_hcl import TERRAFORM, Module, load_module, render_template

from spottrain.agent import cli as agent_cli
from spottrain.controller.run.boot import parse_env_file
from spottrain.protocol.env import (
    ENV_FAULT_TOLERANCE,
    ENV_LIGHTHOUSE,
    ENV_MANAGER_PORT,
    ENV_MIN_REPLICAS,
    ENV_NODES_PER_REPLICA,
    ENV_QUORUM,
    ENV_QUORUM_HEARTBEAT_TIMEOUT,
    ENV_QUORUM_JOIN_TIMEOUT,
    ENV_QUORUM_RELAY_GROUP,
    ENV_QUORUM_WAIT_REPLICAS,
)
from spottrain.spec.fields import MAX_NODES
from spottrain.spec.heartbeat import auto_heartbeat_timeout_s
from spottrain.spec.replica import auto_join_timeout_ms

CLOUDS = ["aws", "gcp"]
REPLICA_VARIABLES = {
    "fault_tolerance": "elastic",
    "nodes_per_replica": 1,
    "min_replicas": 1,
    "replica_quorum": "redis",
    "lighthouse_port": 29510,
    "manager_port": 29512,
    "replica_wait_replicas": 0,
    "replica_heartbeat_timeout_s": "auto",
    "replica_join_timeout_ms": "auto",
    "replica_relay_group_size": "auto",
    "integration": "sdk",
}
# A replica-mode fleet: 3 replicas of 2 nodes at most, a quorum of at least 2, in Redis.
REPLICA = {
    "fault_tolerance": "replica",
    "nodes_per_replica": 2,
    "min_replicas": 2,
    "replica_quorum": "redis",
    "lighthouse_port": 29610,
    "manager_port": 29612,
    "replica_wait_replicas": 1,
    "replica_heartbeat_timeout_s": "2.5",
    "replica_join_timeout_ms": "auto",
    "replica_relay_group_size": "auto",
}
# The same with torchft's lighthouse on the controller VM (whose settings are its own).
REDIS_SETTINGS = {"replica_wait_replicas": 0, "replica_heartbeat_timeout_s": "auto"}
LIGHTHOUSE = {**REPLICA, **REDIS_SETTINGS, "replica_quorum": "lighthouse"}
# Each module names the fleet's size its own way.
NODES = {"aws": ("nodes_min", "nodes_max"), "gcp": ("nnodes_min", "nnodes_max")}
FLEET_RESOURCE = {
    "aws": ("aws_launch_template", "fleet"),
    "gcp": ("google_compute_instance_template", "fleet"),
}
CONTROLLER_RESOURCE = {
    "aws": ("aws_instance", "controller"),
    "gcp": ("google_compute_instance", "controller"),
}
SPEC_VARIABLE = {"aws": "controller_job_spec_yaml", "gcp": "controller_job_spec"}


@pytest.fixture(scope="module", params=CLOUDS)
def cloud(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def mods() -> dict[str, Module]:
    return {c: load_module(TERRAFORM / c) for c in CLOUDS}


# --- the modules' own conditions, evaluated ----------------------------------------------


def _hcl_condition(condition: str, variables: dict[str, Any]) -> bool:
    """A validation or precondition of the kind these modules write for replica mode
    (comparisons, arithmetic, &&, ||, !, floor, contains over var.X and local.replica),
    evaluated in Python. Anything else in it fails the translation."""
    expr = condition.strip()
    assert expr.startswith("${") and expr.endswith("}"), condition
    expr = expr[2:-1]
    allowed = re.sub(
        r'"[^"]*"|var\.\w+|local\.replica|floor|contains|can|regex|try|tonumber|true|false',
        "",
        expr,
    )
    assert re.fullmatch(r"[\s\d.()\[\],<>=!&|%*+-]*", allowed), f"cannot evaluate: {condition}"
    expr = re.sub(r"var\.(\w+)", r'V["\1"]', expr)
    expr = expr.replace("local.replica", '(V["fault_tolerance"] == "replica")')
    expr = expr.replace("&&", " and ").replace("||", " or ")
    expr = re.sub(r"!(?!=)", " not ", expr)
    expr = expr.replace("true", "True").replace("false", "False")
    expr = re.sub(r"\btry\(", "try_(", expr)  # a Python keyword
    names = {
        "V": variables,
        "floor": math.floor,
        "contains": lambda xs, x: x in xs,
        # Terraform's regex() fails where nothing matches, and can() makes that false; try()
        # makes a failed tonumber() its fallback: here NaN, which no comparison holds for.
        "can": lambda x: x is not None,
        "regex": lambda pattern, s: re.search(pattern, s),
        "try_": lambda x, fallback: x,
        "tonumber": lambda s: float(s) if re.fullmatch(r"-?[0-9.]+", s) else math.nan,
    }
    return bool(eval(expr, {"__builtins__": {}}, names))


def _validation_accepts(mod: Module, name: str, value: Any) -> bool:
    return all(
        _hcl_condition(v["condition"], {name: value}) for v in mod.variables[name]["validation"]
    )


def _replica_preconditions(mod: Module, cloud: str) -> list[dict[str, str]]:
    rtype, rname = FLEET_RESOURCE[cloud]
    (lifecycle,) = mod.resources(rtype)[rname]["lifecycle"]
    return [
        p
        for p in lifecycle["precondition"]
        if re.search(r"replica|nodes_per_replica|min_replicas", p["condition"])
    ]


def _fleet_accepts(mod: Module, cloud: str, **inputs: Any) -> list[str]:
    """The error messages of the replica preconditions that ``inputs`` fail."""
    names = dict(zip(("lo", "hi"), NODES[cloud], strict=True))
    variables = {**REPLICA_VARIABLES, "create_controller": True, "lo": 2, "hi": 6, **inputs}
    variables = {names.get(k, k): v for k, v in variables.items()}
    return [
        p["error_message"]
        for p in _replica_preconditions(mod, cloud)
        if not _hcl_condition(p["condition"], variables)
    ]


def test_replica_variables_are_declared_with_their_defaults(
    mods: dict[str, Module], cloud: str
) -> None:
    mod = mods[cloud]
    for name, default in REPLICA_VARIABLES.items():
        var = mod.variables[name]
        assert var["default"] == default, name
        assert var["type"] == ("string" if isinstance(default, str) else "number"), name
        assert var.get("validation"), f"{name} is not validated"
        assert all(name in v["error_message"] for v in var["validation"]), name
        assert name in mod.used_variables(), name


@pytest.mark.parametrize(
    ("name", "good", "bad"),
    [
        ("fault_tolerance", ["elastic", "replica"], ["Replica", "hsdp", ""]),
        ("nodes_per_replica", [1, 2, 8], [0, -1, 1.5]),
        ("min_replicas", [1, 3], [0, 2.5]),
        ("replica_quorum", ["redis", "lighthouse"], ["Redis", "etcd", ""]),
        ("lighthouse_port", [29510, 1024, 65535], [80, 0, 65536, 29510.5]),
        ("manager_port", [29512], [22, 70000]),
        ("replica_wait_replicas", [0, 1, 16], [-1, 17, 0.5]),
        (
            "replica_heartbeat_timeout_s",
            ["auto", "0.2", "1", "2.5", "5", "300"],
            ["", "Auto", "0.1", "0", "301", "300.5", "1e3", "-1", "5s"],
        ),
        (
            "replica_join_timeout_ms",
            ["auto", "50", "1350", "60000"],
            ["", "Auto", "49", "1e3", "60001", "250.5", "-250"],
        ),
        (
            "replica_relay_group_size",
            ["auto", "0", "2", "100", "1000"],
            ["", "Auto", "1", "1001", "1e2", "10.5", "-2", "off"],
        ),
    ],
)
def test_replica_variables_refuse_what_cannot_work(
    mods: dict[str, Module], cloud: str, name: str, good: list[Any], bad: list[Any]
) -> None:
    for value in good:
        assert _validation_accepts(mods[cloud], name, value), (name, value)
    for value in bad:
        assert not _validation_accepts(mods[cloud], name, value), (name, value)


def test_the_aws_module_takes_the_specs_largest_fleet(mods: dict[str, Module]) -> None:
    # 12,500 one-node replicas (100,000 GPUs at 8 a node), up to the spec's own cap; one Auto
    # Scaling group has no size limit of its own. (GCP's module is one zonal MIG: 256 VMs.)
    mod = mods["aws"]
    for name in ("nodes_max", "nodes_per_replica", "min_replicas"):
        assert _validation_accepts(mod, name, 12_500), name
        assert _validation_accepts(mod, name, MAX_NODES), name
        assert not _validation_accepts(mod, name, MAX_NODES + 1), name
    big = {**REPLICA, "nodes_per_replica": 1, "min_replicas": 6_250}
    assert _fleet_accepts(mod, "aws", **big, lo=12_500, hi=12_500) == []


def test_fleet_refuses_a_replica_mode_that_cannot_form_a_quorum(
    mods: dict[str, Module], cloud: str
) -> None:
    mod = mods[cloud]
    assert len(_replica_preconditions(mod, cloud)) == 6
    assert _fleet_accepts(mod, cloud) == [], "elastic mode at the defaults"
    assert _fleet_accepts(mod, cloud, **REPLICA, lo=4, hi=6) == []
    assert _fleet_accepts(mod, cloud, **LIGHTHOUSE, lo=4, hi=6) == []
    # The Redis quorum needs no controller VM; the lighthouse runs on it.
    assert _fleet_accepts(mod, cloud, **REPLICA, lo=4, hi=6, create_controller=False) == []
    (no_vm,) = _fleet_accepts(mod, cloud, **LIGHTHOUSE, lo=4, hi=6, create_controller=False)
    assert no_vm.startswith('replica_quorum = \\"lighthouse\\" needs create_controller = true')
    (too_few,) = _fleet_accepts(mod, cloud, **REPLICA, lo=2, hi=6)
    assert "is below min_replicas x nodes_per_replica" in too_few
    (partial,) = _fleet_accepts(mod, cloud, **REPLICA, lo=4, hi=7)
    assert "multiples of nodes_per_replica" in partial
    (stray,) = _fleet_accepts(mod, cloud, nodes_per_replica=2, lo=2, hi=6)
    assert "apply only with fault_tolerance" in stray
    # Replica mode runs only the SDK (issue 27), as the spec says.
    for integration in ("hf", "accelerate", "lightning", "plain"):
        (other,) = _fleet_accepts(mod, cloud, **REPLICA, integration=integration, lo=4, hi=6)
        assert other.startswith('integration = \\"${var.integration}\\" cannot run with')
        assert _fleet_accepts(mod, cloud, integration=integration, lo=2, hi=6) == []
    (stray,) = _fleet_accepts(mod, cloud, replica_quorum="lighthouse", lo=2, hi=6)
    assert "replica_quorum (${var.replica_quorum}) apply only with fault_tolerance" in stray
    # The Redis quorum's own settings mean nothing to the lighthouse: refused, as the spec does.
    for name, value in (
        ("replica_wait_replicas", 1),
        ("replica_heartbeat_timeout_s", "5"),
        ("replica_join_timeout_ms", "500"),
        ("replica_relay_group_size", "0"),
    ):
        (own,) = _fleet_accepts(mod, cloud, **{**LIGHTHOUSE, name: value}, lo=4, hi=6)
        assert own.startswith("replica_wait_replicas (${var.replica_wait_replicas}), ")
        assert "apply to the Redis quorum only" in own
    assert _fleet_accepts(mod, cloud, **{**REPLICA, "replica_join_timeout_ms": "500"}, lo=4) == []


def test_controller_refuses_a_job_spec_in_another_mode(mods: dict[str, Module], cloud: str) -> None:
    rtype, rname = CONTROLLER_RESOURCE[cloud]
    (lifecycle,) = mods[cloud].resources(rtype)[rname]["lifecycle"]
    spec = SPEC_VARIABLE[cloud]
    (check,) = [p for p in lifecycle["precondition"] if "fault_tolerance" in p["condition"]]
    condition = " ".join(check["condition"].split())
    for key, default, variable in [
        ("train.fault_tolerance", '"elastic"', "fault_tolerance"),
        ("train.replica.nodes_per_replica", "1", "nodes_per_replica"),
        ("train.replica.min_replicas", "1", "min_replicas"),
        ("train.replica.quorum", '"redis"', "replica_quorum"),
        ("train.replica.wait_replicas", "0", "replica_wait_replicas"),
    ]:
        # The spec's defaults are the job spec's own (spottrain/spec/sections.py).
        assert f"try(yamldecode(var.{spec}).{key}, {default}) == var.{variable}" in condition
    # "auto" or a number in the spec; the variable is text either way.
    join = f'try(tostring(yamldecode(var.{spec}).train.replica.join_timeout_ms), "auto")'
    assert f"{join} == var.replica_join_timeout_ms" in condition
    # The heartbeat timeout compares as a number unless either side is "auto" (see below).
    beat = f"yamldecode(var.{spec}).train.replica.heartbeat_timeout_s"
    assert (
        f'(try(tostring({beat}), "auto") == var.replica_heartbeat_timeout_s || '
        f"try(tonumber({beat}) == tonumber(var.replica_heartbeat_timeout_s), false) || "
    ) in condition
    assert check["error_message"].startswith(f"{spec}: ")
    assert "replica_join_timeout_ms (${var.replica_join_timeout_ms})" in check["error_message"]
    relay = f'try(tostring(yamldecode(var.{spec}).train.replica.relay_group_size), "auto")'
    assert f"{relay} == var.replica_relay_group_size" in condition
    assert "replica_relay_group_size (${var.replica_relay_group_size})" in check["error_message"]


def _lazy_try(expr: str) -> str:
    """``expr`` with each ``try(a, b)`` as ``try_(lambda: (a), b)``: Terraform's try() falls
    back when evaluating ``a`` fails, which an eager Python call could not catch."""
    out, i = "", 0
    while (j := expr.find("try(", i)) >= 0:
        depth, k, comma = 0, j + 4, -1
        while depth >= 0:
            depth += {"(": 1, ")": -1}.get(expr[k], 0)
            if expr[k] == "," and depth == 0 and comma < 0:
                comma = k
            k += 1
        inner, rest = _lazy_try(expr[j + 4 : comma]), _lazy_try(expr[comma + 1 : k - 1])
        out += f"{expr[i:j]}try_(lambda: ({inner}),{rest})"
        i = k
    return out + expr[i:]


class _Yaml(dict[str, Any]):
    """A yamldecode() result: ``.key`` reads a key and fails when it is absent."""

    def __getattr__(self, key: str) -> Any:
        value = self[key]
        return _Yaml(value) if isinstance(value, dict) else value


def _tf_tostring(v: Any) -> str:
    # Terraform writes a number in its shortest form (5.0 is "5") and a bool as true/false.
    if isinstance(v, bool):
        return str(v).lower()
    return f"{v:g}" if isinstance(v, int | float) else str(v)


def _tf_tonumber(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float | str):
        raise ValueError(f"tonumber({v!r})")
    return float(v)  # a string that is no number raises, as Terraform fails


def _controller_accepts(mod: Module, cloud: str, spec_yaml: str, **inputs: Any) -> bool:
    """The controller's spec precondition, evaluated in Python for ``spec_yaml``."""
    rtype, rname = CONTROLLER_RESOURCE[cloud]
    (lifecycle,) = mod.resources(rtype)[rname]["lifecycle"]
    (check,) = [p for p in lifecycle["precondition"] if "fault_tolerance" in p["condition"]]
    expr = " ".join(check["condition"].split())
    assert expr.startswith("${") and expr.endswith("}")
    allowed = re.sub(r'"[^"]*"|var\.\w+|\.\w+|yamldecode|tostring|tonumber|try|false', "", expr)
    assert re.fullmatch(r"[\s\d${}(),=!&|]*", allowed), f"cannot evaluate: {allowed}"
    expr = _lazy_try(expr[2:-1])
    expr = re.sub(r"var\.(\w+)", r'V["\1"]', expr)
    expr = expr.replace("&&", " and ").replace("||", " or ").replace("false", "False")

    def try_(attempt: Any, fallback: Any) -> Any:
        try:
            return attempt()
        except (KeyError, TypeError, ValueError):
            return fallback

    variables = {**REPLICA_VARIABLES, **inputs, SPEC_VARIABLE[cloud]: spec_yaml}
    names = {
        "V": variables,
        "try_": try_,
        "yamldecode": lambda text: _Yaml(yaml.safe_load(text)),
        "tostring": _tf_tostring,
        "tonumber": _tf_tonumber,
    }
    # Globals, not locals: the lambdas try() became see only the globals.
    return bool(eval(expr, {"__builtins__": {}, **names}))


@pytest.mark.parametrize(
    ("in_spec", "in_tfvars", "match"),
    [
        (None, "auto", True),  # absent: the spec's default
        ("auto", "auto", True),
        (5, "5.0", True),  # the same number, however each side writes it
        (5.0, "5", True),
        (2.5, "2.50", True),
        ("0.5", "0.5", True),  # quoted in the YAML
        (5, "auto", False),
        ("auto", "5", False),
        (None, "5", False),
        (5, "6", False),
        (2.5, "2", False),
    ],
)
def test_the_controller_compares_the_heartbeat_timeout_as_a_number(
    mods: dict[str, Module], cloud: str, in_spec: Any, in_tfvars: str, match: bool
) -> None:
    replica: dict[str, Any] = {"nodes_per_replica": 2, "min_replicas": 2, "wait_replicas": 1}
    if in_spec is not None:
        replica["heartbeat_timeout_s"] = in_spec
    spec = yaml.safe_dump({"train": {"fault_tolerance": "replica", "replica": replica}})
    fleet = {**REPLICA, "replica_heartbeat_timeout_s": in_tfvars}
    assert _controller_accepts(mods[cloud], cloud, spec, **fleet) is match
    # The other settings still count: a spec in another mode is refused whatever the timeout.
    other = spec.replace("wait_replicas: 1", "wait_replicas: 0")
    assert not _controller_accepts(mods[cloud], cloud, other, **fleet)
    assert _controller_accepts(mods[cloud], cloud, "", **fleet)  # no spec: nothing to match


@pytest.mark.parametrize(("in_spec", "match"), [(None, True), (1, True), (1.0, True), (5, False)])
def test_a_lighthouse_spec_may_spell_out_its_own_heartbeat_timeout(
    mods: dict[str, Module], cloud: str, in_spec: Any, match: bool
) -> None:
    # The fleet takes no timeout with the lighthouse ("auto"); the spec may say its 1 s.
    replica: dict[str, Any] = {"nodes_per_replica": 2, "min_replicas": 2, "quorum": "lighthouse"}
    if in_spec is not None:
        replica["heartbeat_timeout_s"] = in_spec
    spec = yaml.safe_dump({"train": {"fault_tolerance": "replica", "replica": replica}})
    assert _controller_accepts(mods[cloud], cloud, spec, **LIGHTHOUSE) is match
    redis_fleet = {**LIGHTHOUSE, "replica_quorum": "redis"}  # with Redis, "auto" is not 1
    redis_spec = spec.replace("quorum: lighthouse", "quorum: redis")
    assert _controller_accepts(mods[cloud], cloud, redis_spec, **redis_fleet) is (in_spec is None)


# --- the agent's environment and packages -------------------------------------------------


def _replica_env(
    mods: dict[str, Module], cloud: str, tmp_path: Path, **variables: Any
) -> tuple[str, dict[str, str], str]:
    """The rendered boot script, the environment file it writes and the lighthouse address
    the test gave for the controller VM."""
    mod = mods[cloud]
    if cloud == "aws":
        script = aws_t._render(mod, **{k: str(v) for k, v in variables.items()})
        env = parse_env_file(aws_t._write_agent_env(script, tmp_path).read_text())
        address = aws_t.CONTROLLER_IP
    else:
        script, _ = gcp_t._render_startup(mod, **variables)
        env = gcp_t._written_env(script, tmp_path, "")
        address = gcp_t.CONTROLLER_ADDRESS
    return script, env, address


REDIS_NAMES = {
    ENV_QUORUM_WAIT_REPLICAS,
    ENV_QUORUM_HEARTBEAT_TIMEOUT,
    ENV_QUORUM_JOIN_TIMEOUT,
    ENV_QUORUM_RELAY_GROUP,
}
REPLICA_NAMES = {
    ENV_FAULT_TOLERANCE,
    ENV_NODES_PER_REPLICA,
    ENV_MIN_REPLICAS,
    ENV_QUORUM,
    ENV_MANAGER_PORT,
    ENV_LIGHTHOUSE,
} | REDIS_NAMES


def test_replica_mode_gives_the_agent_its_replica_settings(
    mods: dict[str, Module], cloud: str, tmp_path: Path
) -> None:
    script, env, _ = _replica_env(mods, cloud, tmp_path, **REPLICA)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    assert {k: env[k] for k in REPLICA_NAMES - {ENV_LIGHTHOUSE}} == {
        ENV_FAULT_TOLERANCE: "replica",
        ENV_NODES_PER_REPLICA: "2",
        ENV_MIN_REPLICAS: "2",
        ENV_QUORUM: "redis",
        ENV_MANAGER_PORT: "29612",
        ENV_QUORUM_WAIT_REPLICAS: "1",
        ENV_QUORUM_HEARTBEAT_TIMEOUT: "2.5",
        # "auto" at 4 replicas (8 nodes of 2): the spec's own rule, resolved here.
        ENV_QUORUM_JOIN_TIMEOUT: str(auto_join_timeout_ms(4)),
        ENV_QUORUM_RELAY_GROUP: "0",  # "auto" at 4 replicas: no relays
    }
    assert ENV_LIGHTHOUSE not in env  # the Redis quorum has no address of its own
    (tmp_path / "lighthouse").mkdir()
    script, env, address = _replica_env(mods, cloud, tmp_path / "lighthouse", **LIGHTHOUSE)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    assert (env[ENV_QUORUM], env[ENV_LIGHTHOUSE]) == ("lighthouse", f"{address}:29610")
    assert not REDIS_NAMES & set(env)  # the lighthouse's settings are its own
    # The lines the module writes use exactly the protocol's names, nothing more.
    locals_ = aws_t._locals(mods[cloud])
    written = {t.split("=", 1)[0] for t in env_line_templates(locals_)}
    assert written == REPLICA_NAMES
    # The lighthouse is reached at the controller VM's own private address.
    lighthouse = str(locals_["lighthouse_address"])
    assert f"{LIGHTHOUSE_ADDRESS[cloud]}}}:${{var.lighthouse_port}}" in lighthouse
    assert lighthouse.startswith("${local.lighthouse && var.create_controller ? ")


def test_elastic_mode_gives_the_agent_no_replica_setting(
    mods: dict[str, Module], cloud: str, tmp_path: Path
) -> None:
    script, env, _ = _replica_env(mods, cloud, tmp_path)
    assert not REPLICA_NAMES & set(env)
    assert "replica" not in script.lower().replace("replicas", "")


def test_the_agent_reads_the_replica_settings(
    mods: dict[str, Module], cloud: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent_cli.build_parser()  # fills RUN_ENV_VARS
    # A fleet of 5,000 replicas, where "auto" is past 250 ms and 1 s, and a join timeout given.
    big = {
        **REPLICA,
        NODES[cloud][1]: 10_000,
        "nodes_per_replica": 2,
        "replica_heartbeat_timeout_s": "auto",
    }
    given = {**REPLICA, "replica_join_timeout_ms": "700"}
    for n, variables in enumerate((REPLICA, LIGHTHOUSE, big, given)):
        (tmp_path / str(n)).mkdir()
        _, env, address = _replica_env(mods, cloud, tmp_path / str(n), **variables)
        unread = set(env) - agent_cli.RUN_ENV_VARS
        assert unread == set(), f"the agent never reads {sorted(unread)}"
        for name in agent_cli.RUN_ENV_VARS:
            monkeypatch.delenv(name, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        args = agent_cli.build_parser().parse_args(["run"])
        assert args.fault_tolerance == "replica"
        assert (int(args.nodes_per_replica), int(args.min_replicas)) == (2, 2)
        assert args.quorum == variables["replica_quorum"]
        lighthouse = f"{address}:29610" if args.quorum == "lighthouse" else ""
        assert args.lighthouse == lighthouse
        assert int(args.manager_port) == 29612
        # The Redis quorum's settings reach the agent's own flags (defaults with the
        # lighthouse, which the module writes none of).
        redis = variables["replica_quorum"] == "redis"
        wait, heartbeat = (1, 2.5) if redis else (0, 1.0)
        heartbeat = auto_heartbeat_timeout_s(5000) if n == 2 else heartbeat
        assert int(args.quorum_wait_replicas) == wait
        assert float(args.quorum_heartbeat_timeout) == heartbeat
        join = int(args.quorum_join_timeout)
        assert join == {0: 250, 1: 250, 2: auto_join_timeout_ms(5000), 3: 700}[n]
        # Relays from 1,000 replicas on ("auto"), as the spec resolves it.
        assert int(args.quorum_relay_group) == {0: 0, 1: 0, 2: 100, 3: 0}[n]
    assert (auto_join_timeout_ms(5000), auto_heartbeat_timeout_s(5000)) == (540, 2.0)


def test_the_modules_resolve_the_heartbeat_timeout_as_the_spec_does(
    mods: dict[str, Module], cloud: str, tmp_path: Path
) -> None:
    locals_ = aws_t._locals(mods[cloud])
    sizes = [(1, 1), (256, 1), (1000, 1), (2500, 1), (2501, 1), (3751, 1), (12_500, 1)]
    for nodes, k in [*sizes, (25_000, 2), (100_000, 1), (10_000_000, 1)]:
        inputs = {NODES[cloud][1]: nodes, "nodes_per_replica": k}
        auto = heartbeat_timeout_s(locals_, {**inputs, "replica_heartbeat_timeout_s": "auto"})
        assert auto == auto_heartbeat_timeout_s(nodes // k), (nodes, k)
    # A number given wins, and reaches the agent as Terraform prints it.
    given = {**REPLICA, "replica_heartbeat_timeout_s": "7.50"}
    assert heartbeat_timeout_s(locals_, given) == 7.5
    _, env, _ = _replica_env(mods, cloud, tmp_path, **given)
    assert env[ENV_QUORUM_HEARTBEAT_TIMEOUT] == "7.5"
    # 12,500 replicas: the README's 5 s, past the modules' own nodes_max caps today.
    (tmp_path / "big").mkdir()
    big = {**REPLICA, NODES[cloud][1]: 12_500, "nodes_per_replica": 1, "min_replicas": 1}
    big["replica_heartbeat_timeout_s"] = "auto"
    _, env, _ = _replica_env(mods, cloud, tmp_path / "big", **big)
    assert env[ENV_QUORUM_HEARTBEAT_TIMEOUT] == "5"


def _pip_requirements(script: str) -> list[Requirement]:
    """The requirements of the script's one `pip install` of spottrain from the index."""
    (line,) = [
        ln for ln in script.splitlines() if re.search(r"pip\"? install -q '(spottrain\[)", ln)
    ]
    return [Requirement(a) for a in shlex.split(line.split("install -q", 1)[1])]


def test_replica_mode_installs_the_replica_extra(
    mods: dict[str, Module], cloud: str, tmp_path: Path
) -> None:
    version = (
        aws_t.VARIABLES["spottrain_version"]
        if cloud == "aws"
        else gcp_t._inputs(mods[cloud])["spottrain_version"]
    )
    script, _, _ = _replica_env(mods, cloud, tmp_path, **REPLICA)
    requirements = _pip_requirements(script)
    assert {r.name for r in requirements} == {"spottrain"}
    assert {str(r.specifier) for r in requirements} == {f"=={version}"}
    assert set().union(*(r.extras for r in requirements)) == {"agent", cloud, "replica"}
    (tmp_path / "elastic").mkdir()
    elastic, _, _ = _replica_env(mods, cloud, tmp_path / "elastic")
    assert set().union(*(r.extras for r in _pip_requirements(elastic))) == {"agent", cloud}
    # With an env_lock the venv is the lock's, whichever the mode (`spottrain lock` of a
    # replica job locks torchft with the rest).
    assert "--require-hashes --no-deps --only-binary=:all: -r /etc/spottrain/env.lock" in script


# --- the controller VM ----------------------------------------------------------------------


def test_aws_controller_installs_the_extra_and_learns_its_lighthouse_address(
    mods: dict[str, Module],
) -> None:
    locals_ = aws_t._locals(mods["aws"])
    assert (
        locals_["controller_replica_setup"]
        == '${local.lighthouse ? local.controller_replica_script : ""}'
    )
    user_data = str(locals_["controller_user_data"])
    assert "${local.controller_replica_setup}JOB_SPEC_B64=" in user_data
    setup = str(locals_["controller_replica_script"])
    pip = "/opt/spottrain/venv/bin/pip install -q 'spottrain[aws]==${var.spottrain_version}'"
    assert pip + "${local.replica_requirement}\n" in setup
    assert "[ ! -x /opt/spottrain/venv/bin/torchft_lighthouse ]" in setup
    rendered = setup.replace("${var.spottrain_version}", "1.2.3").replace(
        "${var.lighthouse_port}", "29610"
    )
    rendered = rendered.replace("${local.replica_requirement}", " 'spottrain[replica]==1.2.3'")
    assert "${" not in rendered
    subprocess.run(["bash", "-n"], input=rendered, text=True, check=True)
    assert "Environment=SPOTTRAIN_LIGHTHOUSE=%s:29610" in rendered
    assert "export SPOTTRAIN_LIGHTHOUSE=$private_ip:29610" in rendered
    assert "X-aws-ec2-metadata-token: $imds_token" in rendered  # IMDSv2, as the VM requires


def test_gcp_controller_installs_the_extra_and_learns_its_lighthouse_address(
    mods: dict[str, Module],
) -> None:
    mod = mods["gcp"]
    inputs = gcp_t._inputs(
        mod, fault_tolerance="replica", replica_quorum="lighthouse", lighthouse_port=29610
    )
    controller_vars = gcp_t._locals(mod)["controller_vars"]
    known = {"job_spec_b64": ""}
    values = {
        k: known[k] if k in known else gcp_t._resolve(mod, v, inputs, {})
        for k, v in controller_vars.items()
    }
    script = render_template(mod.texts["controller.sh.tftpl"], values)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    assert (
        "FAULT_TOLERANCE='replica'\nREPLICA_QUORUM='lighthouse'\nLIGHTHOUSE_PORT='29610'\n"
    ) in script
    # Only the lighthouse quorum sets anything up here.
    assert (
        '\nif [ "$FAULT_TOLERANCE" = replica ] && [ "$REPLICA_QUORUM" = lighthouse ]; then\n'
        in (script)
    )
    version = inputs["spottrain_version"]
    assert f"install -q 'spottrain[gcp]=={version}' 'spottrain[replica]=={version}'\n" in script
    assert "Environment=SPOTTRAIN_LIGHTHOUSE=%s:%s" in script
    # Set up before the script can stop for want of a job spec (an operator may start it).
    assert script.index("lighthouse.conf") < script.index('if [ -z "$JOB_SPEC_B64" ]')
    # The address the nodes are given is reserved, and the VM takes it.
    (nic,) = mod.resources("google_compute_instance")["controller"]["network_interface"]
    assert (
        nic["network_ip"]
        == "${local.lighthouse ? google_compute_address.controller[0].address : null}"
    )
    address = mod.resources("google_compute_address")["controller"]
    assert address["address_type"] == "INTERNAL"
    assert address["count"] == "${local.lighthouse && var.create_controller ? 1 : 0}"


# --- the network ------------------------------------------------------------------------------


def test_aws_lighthouse_port_opens_from_the_fleet_to_the_controller_only(
    mods: dict[str, Module],
) -> None:
    mod = mods["aws"]
    rules = mod.resources("aws_vpc_security_group_ingress_rule")
    lighthouse = {n: r for n, r in rules.items() if "lighthouse_port" in str(r)}
    assert set(lighthouse) == {"controller_lighthouse_from_fleet"}
    rule = lighthouse["controller_lighthouse_from_fleet"]
    assert rule["count"] == "${local.lighthouse && var.create_controller ? 1 : 0}"
    assert (rule["ip_protocol"], rule["from_port"], rule["to_port"]) == (
        "tcp",
        "${var.lighthouse_port}",
        "${var.lighthouse_port}",
    )
    assert rule["referenced_security_group_id"] == "${aws_security_group.fleet.id}"
    assert not {"cidr_ipv4", "cidr_ipv6", "prefix_list_id"} & set(rule)
    # It is the controller VM's only inbound rule.
    to_controller = [
        n
        for n, r in rules.items()
        if "aws_security_group.controller" in str(r["security_group_id"])
    ]
    assert to_controller == ["controller_lighthouse_from_fleet"]
    assert not mod.resources("aws_security_group")["controller"].get("ingress")
    # The managers, cross-replica process groups and state transfers (torchft's HTTP
    # transport serves on a random port) ride the fleet's all-traffic rule.
    assert rules["fleet_from_fleet"]["ip_protocol"] == "-1"


def test_gcp_lighthouse_port_opens_from_the_fleet_to_the_controller_only(
    mods: dict[str, Module],
) -> None:
    mod = mods["gcp"]
    rules = mod.resources("google_compute_firewall")
    rule = rules["lighthouse"]
    assert rule["count"] == "${local.lighthouse && var.create_controller ? 1 : 0}"
    assert rule["direction"] == "INGRESS"
    assert rule["source_tags"] == ["${local.fleet_tag}"] and "source_ranges" not in rule
    assert rule["target_tags"] == ["${local.controller_tag}"]
    assert rule["allow"] == [{"protocol": "tcp", "ports": ["${tostring(var.lighthouse_port)}"]}]
    # No other rule targets the controller VM's tag.
    targeting = [
        n for n, r in rules.items() if "${local.controller_tag}" in r.get("target_tags", [])
    ]
    assert targeting == ["lighthouse"]
    assert rules["fleet_internal"]["allow"] == [{"protocol": "all"}]


def test_readmes_document_replica_mode(cloud: str) -> None:
    readme = (TERRAFORM / cloud / "README.md").read_text()
    for name in REPLICA_VARIABLES:
        assert f"`{name}`" in readme, name
    assert "## Replica mode" in readme

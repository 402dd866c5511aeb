"""VMs that fail at boot, against a real Redis and real clouds' doubles (the local cloud's VM
processes, moto's EC2): a boot report or a console failure line ends the VM at once, a
streak of the same reason stops the run with it, and a console that cannot be read stops
nothing. The controller's clock is a variable, so "a minute later" takes no minute."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from spec_samples import LOCAL, spec_with

from spottrain.cloud.base import Instance, LaunchRequest, Market, TransientError
from spottrain.cloud.local.compute import LocalProvider
from spottrain.cloud.local.settings import LocalSettings
from spottrain.controller.reconcile.controller import Controller, policy_from_spec
from spottrain.controller.reconcile.execute import Executor
from spottrain.controller.reconcile.ledger import FAILED_LAUNCHES
from spottrain.controller.reconcile.state import RunState
from spottrain.controller.reconcile.types import FailedLaunches, NodeObs, Stop, Terminate
from spottrain.controller.run.drive import final_report
from spottrain.protocol.boot import STAGE_ENV, BootReport, BootSource, BootState, console_failed
from spottrain.protocol.keys import RunKeys
from spottrain.protocol.states import LedgerStatus
from spottrain.spec import JobSpec, parse_spec

PIP = "pip: no matching distribution for torch==2.13.0 for Python 3.10"


@pytest.fixture
def cloud(tmp_path: Path) -> Iterator[LocalProvider]:
    p = LocalProvider(LocalSettings(tmp_path / "cloud", zones={"local-a": 8}, notice_s=2))
    yield p
    for rec in p.store.all():
        if rec["state"] != "terminated":
            p.preempt(rec["id"], notice=False)


def _spec(max_nodes: int = 1, max_failed: int = 3) -> JobSpec:
    data = spec_with(LOCAL, "nodes", {"min": 1, "max": max_nodes, "gpus": 0})
    data = spec_with(data, "budget", {"max_usd": 1000})
    data = spec_with(data, "controller", {"max_failed_launches": max_failed})
    return parse_spec(yaml.safe_dump(data)).spec


def _fails_in_env(node: str, _offer: object) -> str:
    """A boot that says, as the boot's loader does on the console, that pip failed (before it
    could reach Redis), and then idles like a VM whose boot script stopped."""
    line = console_failed(node, "$SPOTTRAIN_VM_ID", STAGE_ENV, PIP)
    return json.dumps({"argv": ["sh", "-c", f'echo "{line}"; exec sleep 600']})


def _idle(_node: str, _offer: object) -> str:
    return json.dumps({"argv": ["sleep", "600"]})


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def _controller(
    provider: Any,
    client: redis.Redis,
    keys: RunKeys,
    boot: Callable[[str, object], str],
    clock: Clock,
    spec: JobSpec | None = None,
) -> Controller:
    spec = spec or _spec()
    return Controller(
        spec=spec,
        run_id=keys.run_id,
        providers={"local": provider},
        state=RunState(client, keys),
        boot=boot,  # type: ignore[arg-type]
        policy=policy_from_spec(spec),
        interval_s=0.1,
        clock=clock,
    )


def _events(client: redis.Redis, keys: RunKeys, kind: str) -> list[dict[str, str]]:
    rows = [{k.decode(): v.decode() for k, v in f.items()} for _, f in client.xrange(keys.events)]
    return [r for r in rows if r["type"] == kind]


def _wait(cond: Callable[[], object], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _printed(cloud: LocalProvider, keys: RunKeys, node: str) -> bool:
    vm = next((i for i in cloud.list(keys.run_id) if i.node == node), None)
    return vm is not None and "failed in" in cloud.console_output(vm.id)


def test_a_vm_whose_console_shows_a_failure_gets_its_boot_hash_and_is_ended_at_once(
    cloud: LocalProvider, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    clock = Clock()
    ctl = _controller(cloud, redis_client, run_keys, _fails_in_env, clock)
    ctl.step()
    _wait(lambda: _printed(cloud, run_keys, "n0"), "n0's failure line on its console")
    # Within its first minute the controller does not read its console.
    clock.now += 30
    assert ctl.step().of(Stop) == []
    assert not redis_client.exists(run_keys.boot("n0"))
    clock.now += 31
    p = ctl.step()
    fields = {k.decode(): v.decode() for k, v in redis_client.hgetall(run_keys.boot("n0")).items()}
    vm = ctl.state.ledger().records["n0"].instance_id
    assert fields["source"] == "console" and fields["state"] == "failed"
    assert (fields["vm"], fields["stage"], fields["reason"]) == (vm, STAGE_ENV, PIP)
    (event,) = _events(redis_client, run_keys, "boot")
    assert (event["node"], event["source"], event["reason"]) == ("n0", "console", PIP)
    # Ended in this same pass, long before its boot timeout, with the reason; a new VM
    # replaces it and the streak counts one.
    why = f"boot failed in 'install the environment': {PIP}"
    assert [(t.node, t.why) for t in p.of(Terminate) if isinstance(t, Terminate)] == [("n0", why)]
    ends = [e for e in _events(redis_client, run_keys, "terminate") if e["node_name"] == "n0"]
    assert [e["why"] for e in ends] == [why]
    assert ctl.state.ledger().records["n0"].reason == why
    streak = FailedLaunches.from_json(ctl.state.ctl()[FAILED_LAUNCHES])
    assert streak.count == 1 and streak.last == f"n0: {why}"
    assert "n1" in ctl.state.ledger().records


def test_three_vms_failing_the_same_way_stop_the_run_with_the_reason(
    cloud: LocalProvider, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    clock = Clock()
    ctl = _controller(cloud, redis_client, run_keys, _fails_in_env, clock)
    ctl.step()
    for node in ("n0", "n1", "n2"):
        _wait(lambda node=node: _printed(cloud, run_keys, node), f"{node}'s failure line")
        clock.now += 61
        ctl.step()
    ctl_hash = ctl.state.ctl()
    assert ctl_hash["error"] == (
        "3 VMs in a row failed at boot: n2: boot failed in 'install the environment': "
        f"{PIP}; fix that and run spottrain up again"
    )
    assert ctl_hash["stopped"] == ctl_hash["error"]
    assert "n3" not in ctl.state.ledger().records, "nothing launched after the third"
    # The next passes end every VM; the run is then over, failed, and `spottrain up` says
    # why in one line as it exits 1.
    summary = ctl.run()
    assert summary.phase == "failed" and summary.final_step is None
    assert final_report(summary)[0] == f"run ended (failed): {ctl_hash['error']}"
    assert all(r.status != LedgerStatus.LAUNCHED for r in ctl.state.ledger().records.values())


def test_a_boot_report_in_redis_ends_the_vm_on_the_next_pass(
    cloud: LocalProvider, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    clock = Clock()
    ctl = _controller(cloud, redis_client, run_keys, _idle, clock)
    ctl.step()
    vm = ctl.state.ledger().records["n0"].instance_id
    # What the boot's loader writes once it could reach Redis.
    report = BootReport("n0", vm, STAGE_ENV, BootState.FAILED, PIP, 1_795_000_000.25)
    redis_client.hset(run_keys.boot("n0"), mapping=report.fields())
    clock.now += 5
    seen, _, _ = ctl.observe(clock.now)
    (n0,) = [n for n in seen.nodes if n.name == "n0"]
    assert n0.boot == report
    ctl.step()
    assert ctl.state.ledger().records["n0"].reason.startswith("boot failed in 'install the")
    assert _events(redis_client, run_keys, "launch-failed")[0]["node_name"] == "n0"


class FlakyConsole:
    """The local cloud, whose console reads fail (a missing permission, a timeout)."""

    def __init__(self, inner: LocalProvider) -> None:
        self.inner = inner
        self.cloud = "local"
        self.reads = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def console_output(self, instance_id: str) -> str:
        self.reads += 1
        raise TransientError("local", "console read timed out")


def test_a_console_that_cannot_be_read_stops_nothing_and_is_tried_again_later(
    cloud: LocalProvider, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    clock = Clock()
    flaky = FlakyConsole(cloud)
    ctl = _controller(flaky, redis_client, run_keys, _idle, clock)
    ctl.step()
    clock.now += 61
    ctl.step()
    assert flaky.reads == 1
    clock.now += 10
    ctl.step()
    assert flaky.reads == 1, "not again within 30 s"
    clock.now += 25
    ctl.step()
    assert flaky.reads == 2
    assert ctl.state.ledger().records["n0"].status == LedgerStatus.LAUNCHED
    assert not redis_client.exists(run_keys.boot("n0"))


def test_a_vm_past_the_boot_timeout_is_ended_with_its_consoles_last_line(
    cloud: LocalProvider, redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    clock = Clock()

    def hangs(node: str, _offer: object) -> str:
        return json.dumps(
            {"argv": ["sh", "-c", "echo 'cloud-init: waiting for network'; exec sleep 600"]}
        )

    ctl = _controller(cloud, redis_client, run_keys, hangs, clock)
    ctl.step()
    _wait(
        lambda: any("waiting" in cloud.console_output(i.id) for i in cloud.list(run_keys.run_id)),
        "the console line",
    )
    clock.now += 901
    ctl.step()
    why = "not healthy 900 s after launch; its console's last line: cloud-init: waiting for network"
    assert ctl.state.ledger().records["n0"].reason == why


def test_a_console_read_on_ec2_writes_the_failure_it_shows(
    redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    from harnesses.aws import AwsHarness

    aws = AwsHarness()
    try:
        offer = next(o for o in aws.provider.offers(aws.query()) if o.market is Market.SPOT)
        inst: Instance = aws.provider.launch(
            LaunchRequest(request_id="r-boot-0", job=run_keys.run_id, node="n0", offer=offer)
        )
        aws.set_console(
            inst.id, "[   3.1] booting\n" + console_failed("n0", inst.id, STAGE_ENV, PIP)
        )
        state = RunState(redis_client, run_keys)
        execute = Executor(
            _spec(), run_keys.run_id, {"aws": aws.provider}, state, _idle, lambda o: 0.0
        )
        node = NodeObs("n0", inst, offer, time.time() - 120)
        reads = execute.read_consoles([node], 5000.0)
        assert reads["n0"].report is not None and reads["n0"].report.failed
        assert state.boot_reports(["n0"])["n0"] == BootReport(
            "n0", inst.id, STAGE_ENV, BootState.FAILED, PIP, 5000.0, BootSource.CONSOLE
        )
        # moto's own canned console (no boot line) is read, and writes nothing.
        other = aws.provider.launch(
            LaunchRequest(request_id="r-boot-1", job=run_keys.run_id, node="n1", offer=offer)
        )
        quiet = execute.read_consoles([NodeObs("n1", other, offer, 0.0)], 5000.0)
        assert quiet["n1"].report is None and quiet["n1"].last_line
        assert state.boot_reports(["n1"]) == {}
    finally:
        aws.close()

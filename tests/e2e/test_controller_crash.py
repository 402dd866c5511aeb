"""Crash safety of the controller against moto in server mode.

For every crash point of the reconcile loop
(:data:`spottrain.controller.reconcile.execute.CRASH_POINTS`) a controller process
(``tests/ctl_runner.py``) is killed there (``SPOTTRAIN_CRASH_AT``, exit status 137), a new
one is started on the same run, and once it has settled the fleet in moto must match the
spec: exactly the target number of live VMs, at most one live VM per node and per request id
(0 duplicated), and every live VM in the Redis launch ledger as ``launched`` with its
instance id (0 leaked); the ledger must agree with moto both ways and never give two records
one request id.

Each test has its own moto server and account (:class:`harnesses.aws.AwsHarness`) and its own
run id. The spec allows one 8-GPU type (p4d.24xlarge) that moto offers in four zones of
us-east-1, 1 to 2 nodes, spot only, no placement group (moto lacks CreatePlacementGroup).

How each point is reached:

* ``after-intent``, ``after-launch``, ``after-launch-record``, ``after-pass``: the first pass
  of a fresh run (which launches both nodes) dies there; ``after-intent`` and
  ``after-launch`` also at their second time (the second node, the first one done).
* ``after-terminate``: with the fleet at size, one node's agent reports ``left``; the
  planner terminates its VM (and backfills), and the controller dies right after the
  terminate call. Also halfway through a stop: one VM ended, the other still running.
* ``after-block``: with the fleet at size, EC2 takes one spot VM back and the job's zone is
  stocked out; the backfill launch is refused for capacity, and the controller dies right
  after recording the refusal (the offer blocked for a second, the launch failed). The zone
  has capacity again when the next controller starts, and the block has expired.
* ``after-notice``: with the fleet at size and both agents joined, a zero budget makes the
  planner checkpoint and stop; the controller dies after queueing the agents' notices. The
  next controller must finish the stop (after its stop timeout) and end every VM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from harnesses.aws import REGION, AwsHarness
from spec_samples import VALID

from spottrain.cloud.base import TAG_JOB, TAG_NODE, TAG_REQUEST
from spottrain.controller.reconcile.execute import CRASH_ENV, CRASH_POINTS
from spottrain.controller.reconcile.records import Ledger
from spottrain.controller.reconcile.state import RunState
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys
from spottrain.protocol.states import LedgerStatus

pytestmark = pytest.mark.slow

RUNNER = Path(__file__).resolve().parents[1] / "ctl_runner.py"
REPO = Path(__file__).resolve().parents[2]
MAX_NODES = 2
KILLED = 137
ALIVE = ("pending", "running")
# Short passes; a VM the cloud does not list for 20 s is lost (moto lists it at once, and a
# restart takes ~2 s, so a killed launch's intent is sent again rather than given up on).
PASS_FLAGS = ("--interval", "0.2", "--policy", "lost_grace_s=20")
RUNNER_TIMEOUT_S = 90
# moto prices spot p4d.24xlarge at $0.00001/h, so only a zero budget is "at the cap".
NO_BUDGET = ("--policy", "budget_usd=0")


@dataclass
class Run:
    """One controller process: how it was started and what it said."""

    label: str
    args: list[str]
    crash: str | None
    returncode: int
    stdout: str
    stderr: str

    def describe(self) -> str:
        crash = f" {CRASH_ENV}={self.crash}" if self.crash else ""
        return (
            f"--- {self.label}: exit {self.returncode}{crash}\n"
            f"    args: {' '.join(self.args)}\n"
            f"    stdout:\n{_indent(self.stdout)}\n"
            f"    stderr (tail):\n{_indent(self.stderr[-6000:])}"
        )


@dataclass
class World:
    """One run of one job against a private moto account, and the controllers started on it."""

    harness: AwsHarness
    client: redis.Redis
    redis_url: str
    run_id: str
    spec_path: Path
    runs: list[Run] = field(default_factory=list)

    @property
    def keys(self) -> RunKeys:
        return RunKeys(self.run_id)

    # --- the controller ------------------------------------------------------------------

    def controller(self, label: str, *extra: str, crash: str | None = None, passes: int = 3) -> Run:
        """Run the controller for ``passes`` passes (or until it dies at ``crash``)."""
        args = [
            "--spec", str(self.spec_path),
            "--run-id", self.run_id,
            "--redis-url", self.redis_url,
            "--endpoint-url", self.harness.endpoint_url,
            "--moto-account", self.harness.account_id,
            "--region", REGION,
            "--passes", str(passes),
            *PASS_FLAGS,
            *extra,
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
        env["SPOTTRAIN_HOME"] = str(self.spec_path.parent / "home")
        if crash:
            env[CRASH_ENV] = crash
        try:
            proc = subprocess.run(
                [sys.executable, "-u", str(RUNNER), *args],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=RUNNER_TIMEOUT_S,
            )
            run = Run(label, args, crash, proc.returncode, proc.stdout, proc.stderr)
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
            err = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
            run = Run(label, args, crash, -1, out, err + f"\n(timed out after {e.timeout} s)")
        self.runs.append(run)
        return run

    def expect(self, run: Run, code: int) -> None:
        assert run.returncode == code, self.report(
            f"{run.label}: the controller exited {run.returncode}, expected {code}"
        )

    # --- what moto and Redis hold ------------------------------------------------------------

    def instances(self) -> list[dict[str, Any]]:
        """Every VM of this run in moto, terminated ones included."""
        pages = (
            self.harness.admin()
            .get_paginator("describe_instances")
            .paginate(Filters=[{"Name": f"tag:{TAG_JOB}", "Values": [self.run_id]}])
        )
        return [i for page in pages for r in page["Reservations"] for i in r["Instances"]]

    def alive(self) -> list[dict[str, Any]]:
        return [i for i in self.instances() if i["State"]["Name"] in ALIVE]

    def ledger(self) -> Ledger:
        return RunState(self.client, self.keys).ledger()

    def set_agent(self, node: str, state: str) -> None:
        self.client.hset(self.keys.node(node), "state", state)

    # --- the check -----------------------------------------------------------------------

    def check_fleet(self, target: int, when: str) -> None:
        """The fleet matches the spec: ``target`` live VMs, none duplicated, none leaked, and
        the ledger agrees with moto."""
        alive = self.alive()
        ledger = self.ledger()
        problems: list[str] = []
        if len(alive) != target:
            problems.append(f"{len(alive)} live VMs in moto, expected {target}")
        for tag in (TAG_NODE, TAG_REQUEST):
            counts = Counter(_tag(i, tag) for i in alive)
            for value, n in counts.items():
                if n > 1:
                    problems.append(f"duplicated: {n} live VMs with {tag}={value}")
        for inst in alive:
            node, iid = _tag(inst, TAG_NODE), inst["InstanceId"]
            rec = ledger.records.get(node)
            if rec is None:
                problems.append(f"leaked: live VM {iid} (node {node}) is not in the ledger")
            elif rec.status != LedgerStatus.LAUNCHED or rec.instance_id != iid:
                problems.append(
                    f"leaked: live VM {iid} (node {node}) is in the ledger as {rec.status} "
                    f"with instance {rec.instance_id or '(none)'}"
                )
            elif rec.request_id != _tag(inst, TAG_REQUEST):
                problems.append(
                    f"VM {iid} (node {node}) carries request {_tag(inst, TAG_REQUEST)}, the "
                    f"ledger {rec.request_id}"
                )
        alive_ids = {i["InstanceId"] for i in alive}
        for rec in ledger.records.values():
            if rec.status == LedgerStatus.INTENT:
                problems.append(f"node {rec.node}: its launch is still an intent after settling")
            elif rec.status == LedgerStatus.LAUNCHED and rec.instance_id not in alive_ids:
                problems.append(
                    f"node {rec.node}: launched in the ledger as {rec.instance_id or '(none)'}, "
                    "which moto does not list as live"
                )
        requests = Counter(r.request_id for r in ledger.records.values())
        for rid, n in requests.items():
            if n > 1:
                problems.append(f"{n} ledger records share request id {rid}")
        assert not problems, self.report(f"{when}:\n  " + "\n  ".join(problems))

    def report(self, headline: str) -> str:
        """What went wrong, with what moto and the ledger hold and every controller's output."""
        rows = [
            f"{i['InstanceId']} {i['State']['Name']:<13} {i['Placement']['AvailabilityZone']} "
            f"node={_tag(i, TAG_NODE)} request={_tag(i, TAG_REQUEST)}"
            for i in self.instances()
        ]
        recs = [
            f"{r.node}: {r.status:<8} {r.instance_id or '-':<20} {r.offer.zone} "
            f"request={r.request_id} reason={r.reason!r}"
            for r in sorted(self.ledger().records.values(), key=lambda r: r.launched_at)
        ]
        events = [
            json.dumps({k.decode(): v.decode() for k, v in fields.items()})
            for _id, fields in self.client.xrange(self.keys.events)
        ]
        return "\n".join(
            [
                headline,
                f"run {self.run_id}, moto account {self.harness.account_id}",
                "moto:",
                _indent("\n".join(rows) or "(no VMs)"),
                "ledger:",
                _indent("\n".join(recs) or "(empty)"),
                "ctl: " + json.dumps(RunState(self.client, self.keys).ctl()),
                "events (last 40):",
                _indent("\n".join(events[-40:])),
                "controllers:",
                *(r.describe() for r in self.runs),
            ]
        )

    # --- common phases -------------------------------------------------------------------

    def bring_up(self) -> None:
        """Run the controller, crash-free, until the fleet is at size."""
        self.expect(self.controller("bring up", passes=3), 0)
        self.check_fleet(MAX_NODES, "after bringing the fleet up")

    def settle(self, *extra: str, passes: int = 4) -> None:
        self.expect(self.controller("restart", *extra, passes=passes), 0)


def _tag(inst: dict[str, Any], key: str) -> str:
    return next((t["Value"] for t in inst.get("Tags", []) if t["Key"] == key), "")


def _indent(text: str) -> str:
    return "\n".join("      " + line for line in text.splitlines())


@pytest.fixture
def world(redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path) -> Iterator[World]:
    harness = AwsHarness()
    run_id = f"crash-{uuid.uuid4().hex[:10]}"
    spec = {k: v for k, v in VALID.items() if k != "gcp"}
    spec.update(
        name="crash-safety",
        nodes={"min": 1, "max": MAX_NODES, "gpus": 8},
        resources={
            "clouds": ["aws"],
            "regions": [REGION],
            "instance_types": [harness.instance_type],
            "max_price_per_hour": 100,
        },
        spot={"policy": "spot"},
        budget={"max_usd": 1_000_000},
        redis={"url": redis_server.url},
        aws={"images": dict(harness.settings.image_ids), "placement_group": False},
    )
    # Where the run's boot files go (the controller ships them before it launches).
    (tmp_path / "store").mkdir()
    spec["checkpoint"] = {**spec["checkpoint"], "copy_to": f"file://{tmp_path}/store"}
    spec_path = tmp_path / "job.yaml"
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    w = World(harness, redis_client, redis_server.url, run_id, spec_path)
    try:
        yield w
    finally:
        harness.close()
        stale = list(redis_client.scan_iter(match=w.keys.pattern, count=1000))
        if stale:
            redis_client.delete(*stale)


# --- the scenarios ---------------------------------------------------------------------------
# Each brings the run to where the crash point is met, runs a controller that must die there,
# checks that it died where it should have, and returns the live VMs expected once settled.


def _first_pass(w: World, crash: str) -> int:
    """A fresh run's first pass (which launches both nodes) dies at ``crash``."""
    w.expect(w.controller("crash", crash=crash), KILLED)
    return MAX_NODES


def _agent_left(w: World, crash: str) -> int:
    """One node's agent left: its VM is terminated (and a replacement launched)."""
    w.bring_up()
    node = sorted(w.ledger().records)[0]
    w.set_agent(node, "left")
    w.expect(w.controller("crash", crash=crash), KILLED)
    gone = [i for i in w.instances() if _tag(i, TAG_NODE) == node]
    assert gone and all(i["State"]["Name"] not in ALIVE for i in gone), w.report(
        f"the controller died after terminating node {node}'s VM, but moto lists it live"
    )
    return MAX_NODES


def _stocked_out(w: World, crash: str) -> int:
    """EC2 takes a spot VM back and its zone has no capacity for the replacement."""
    w.bring_up()
    alive = w.alive()
    zone = alive[0]["Placement"]["AvailabilityZone"]
    w.harness.interrupt(alive[0]["InstanceId"])
    # A one-second block, so the restarted controller may use the zone again.
    w.expect(
        w.controller("crash", "--stockout", zone, "--policy", "block_s=1", crash=crash), KILLED
    )
    blocked = RunState(w.client, w.keys).blocked()
    assert any(k[1] == zone for k in blocked), w.report(
        f"the controller died after blocking {zone}, but no block is recorded: {blocked}"
    )
    return MAX_NODES


def _budget_stop(w: World, crash: str) -> int:
    """At the budget cap the job checkpoints (notices to both joined agents) and stops."""
    w.bring_up()
    nodes = sorted(w.ledger().records)
    for node in nodes:
        w.set_agent(node, "joined")
    w.expect(w.controller("crash", *NO_BUDGET, crash=crash), KILLED)
    unwarned = [n for n in nodes if not w.client.llen(w.keys.notices(n))]
    assert not unwarned, w.report(f"no notice queued for {unwarned} before the crash")
    return 0


def _stop_ending(w: World, crash: str) -> int:
    """The stop's timeout is over and its VMs are being ended: dies after the first."""
    w.bring_up()
    for node in w.ledger().records:
        w.set_agent(node, "joined")
    w.expect(w.controller("crash", *NO_BUDGET, "--stop-timeout", "0", crash=crash), KILLED)
    assert len(w.alive()) == MAX_NODES - 1, w.report(
        "the controller died after ending one VM of the stop, but moto does not show that"
    )
    return 0


@dataclass(frozen=True)
class Case:
    crash: str  # SPOTTRAIN_CRASH_AT
    scenario: Callable[[World, str], int]  # -> the live VMs expected once settled

    @property
    def point(self) -> str:
        return self.crash.partition(":")[0]


CASES = {
    "after-intent": Case("after-intent", _first_pass),
    # The second node's intent: the first node's launch is complete.
    "after-intent-2nd": Case("after-intent:2", _first_pass),
    "after-launch": Case("after-launch", _first_pass),
    "after-launch-2nd": Case("after-launch:2", _first_pass),
    "after-launch-record": Case("after-launch-record", _first_pass),
    "after-terminate": Case("after-terminate", _agent_left),
    "after-terminate-in-stop": Case("after-terminate", _stop_ending),
    "after-block": Case("after-block", _stocked_out),
    "after-notice": Case("after-notice", _budget_stop),
    "after-pass": Case("after-pass", _first_pass),
}


def test_every_crash_point_has_a_case() -> None:
    assert {c.point for c in CASES.values()} == set(CRASH_POINTS)


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_restart_after_crash_leaves_the_fleet_whole(world: World, case: Case) -> None:
    target = case.scenario(world, case.crash)
    stopping = target == 0
    extra = NO_BUDGET if stopping else ()
    if stopping:
        # The stop must complete: agents that never leave are waited for stop_timeout_s,
        # then every VM is ended.
        world.settle(*extra, "--stop-timeout", "1", "--until-done", passes=30)
        ctl = RunState(world.client, world.keys).ctl()
        assert ctl.get("stopped"), world.report("the stop never completed")
        open_records = [
            r.node for r in world.ledger().records.values() if r.status != LedgerStatus.ENDED
        ]
        assert not open_records, world.report(f"records not ended after the stop: {open_records}")
    else:
        world.settle(passes=10)
    world.check_fleet(target, f"after a crash at {case.crash} and a restart")
    # Another controller finds nothing to change: the fleet is stable, not just passing by.
    world.settle(*extra, passes=2)
    world.check_fleet(target, f"one more controller after the crash at {case.crash}")

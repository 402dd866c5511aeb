"""The local cloud: VMs are process groups on this machine, with capacity, launch latency,
preemptions and refusals that can be injected.

It implements the same :class:`~spottrain.cloud.base.Provider` contract as AWS and GCP, and
keeps its state where a cloud does, outside the controller: a directory of records
(:mod:`spottrain.cloud.local.records`) and VM processes in sessions of their own
(:mod:`spottrain.cloud.local.vm`). A controller killed and restarted finds its VMs, with their
tags, exactly as it would on a real cloud.

The levers a real cloud does not give you:

- ``set_capacity(zone, n)``: how many VMs a zone holds; 0 is a stockout.
- ``preempt(vm, notice=True)``: the VM gets the notice window (SIGTERM to its agent, as
  systemd does at shutdown), then dies; ``notice=False`` kills it and everything under it at
  once.
- ``set_refusal(kind)``: every call fails as that typed error (``auth``, ``quota``,
  ``transient``), as a cloud that refuses everything does.
- :class:`PreemptionInjector`: preemptions at a per-node rate, or at the times of a trace.

All levers persist in the state directory, so ``spottrain local ...`` in another terminal
reaches a running controller's cloud.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spottrain.catalog import Catalog, UnknownInstanceType, bundled
from spottrain.cloud.base import (
    CONSOLE_TAIL_BYTES,
    AuthError,
    BadRequestError,
    CapacityError,
    Instance,
    InstanceState,
    LaunchRequest,
    Market,
    Offer,
    OfferQuery,
    ProviderError,
    QuotaError,
    TransientError,
    console_tail,
    sort_offers,
)
from spottrain.cloud.local.records import RecordStore
from spottrain.cloud.local.settings import LocalSettings
from spottrain.cloud.local.vm import kill_tree
from spottrain.trace import TracedPreemption

REGION = "local"
INSTANCE_TYPE = "local-cpu"
# A VM record that never got its process (the launcher died between the two steps) is
# given up after this long.
_SPAWN_TIMEOUT_S = 30.0
_REFUSALS: dict[str, type[ProviderError]] = {
    "auth": AuthError,
    "quota": QuotaError,
    "transient": TransientError,
}


def _pid_start(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (to tell a reused pid from our VM), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22, counted after the ')' that ends the command name (which may hold spaces).
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None
    return fields[19]


def _alive(rec: Mapping[str, Any]) -> bool:
    pid = rec.get("pid")
    return pid is not None and _pid_start(int(pid)) == rec.get("pid_start")


class LocalProvider:
    """The local cloud. See the module docstring for its levers.

    Args:
        settings: zones, latency, notice window, state directory.
        catalog: prices (a local VM is priced as the catalog says; see its notes).
        clock: unix seconds.
    """

    cloud = "local"

    def __init__(
        self,
        settings: LocalSettings,
        *,
        catalog: Catalog | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.catalog = catalog or bundled()
        self.clock = clock
        self.store = RecordStore(settings.state_dir)
        # Written so that `spottrain local ...` in another process can open this cloud.
        with self.store.locked():
            (self.store.root / "cloud.json").write_text(
                json.dumps(
                    {
                        "zones": dict(settings.zones),
                        "launch_latency_s": settings.launch_latency_s,
                        "notice_s": settings.notice_s,
                    }
                )
            )

    @classmethod
    def open(cls, state_dir: str | Path) -> LocalProvider:
        """The local cloud a controller created in ``state_dir``.

        Raises:
            FileNotFoundError: no local cloud lives there.
        """
        root = Path(state_dir)
        try:
            data = json.loads((root / "cloud.json").read_text())
        except FileNotFoundError:
            raise FileNotFoundError(
                f"no local cloud in {root} (start one with `spottrain up` on a local job, or "
                "pass --state-dir)"
            ) from None
        return cls(
            LocalSettings(
                root,
                zones=data["zones"],
                launch_latency_s=data["launch_latency_s"],
                notice_s=data["notice_s"],
            )
        )

    # --- levers -------------------------------------------------------------------------

    def capacity(self) -> dict[str, int]:
        """Each zone's capacity, with overrides from ``set_capacity`` applied."""
        caps = dict(self.settings.zones)
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            caps.update(json.loads((self.store.root / "capacity.json").read_text()))
        return caps

    def set_capacity(self, zone: str, n: int) -> None:
        """Set how many VMs ``zone`` holds (0: a stockout). VMs already there stay.

        Raises:
            ValueError: unknown zone or negative capacity.
        """
        if zone not in self.settings.zones:
            raise ValueError(
                f"local zone {zone!r} does not exist; zones: {', '.join(self.settings.zones)}"
            )
        if n < 0:
            raise ValueError(f"capacity must be >= 0, got {n}")
        with self.store.locked():
            path = self.store.root / "capacity.json"
            caps: dict[str, int] = {}
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                caps = json.loads(path.read_text())
            caps[zone] = n
            path.write_text(json.dumps(caps))

    def set_refusal(self, kind: str | None) -> None:
        """Make every call fail as ``kind`` (auth, quota, transient); None lifts it.

        Raises:
            ValueError: unknown kind.
        """
        path = self.store.root / "refusal"
        if kind is None:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            return
        if kind not in _REFUSALS:
            raise ValueError(f"refusal {kind!r}: use one of {', '.join(_REFUSALS)}")
        path.write_text(kind)

    def preempt(self, instance_id: str, *, notice: bool = True) -> bool:
        """Take a VM back, as a spot preemption does. Returns False if it was not running.

        With ``notice``, the VM's agent gets SIGTERM and ``notice_s`` seconds before the VM
        dies; without, the VM and every process under it die at once.
        """
        try:
            rec = self.store.read(instance_id)
        except KeyError:
            return False
        if rec["state"] == "terminated" or not _alive(rec):
            return False
        if notice:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(rec["pid"]), signal.SIGUSR1)
            return True
        kill_tree(int(rec["pid"]))
        self.store.update(
            instance_id,
            state="terminated",
            interrupted=True,
            reason="preempted without notice",
            ended_at=self.clock(),
        )
        return True

    def log_path(self, instance_id: str) -> Path:
        """The VM's console log (its boot command's output), kept after the VM is gone."""
        return self.store.log_path(instance_id)

    def record(self, instance_id: str) -> dict[str, Any]:
        """The raw record of a VM (for the CLI and tests).

        Raises:
            KeyError: no such VM.
        """
        return self.store.read(instance_id)

    # --- the Provider contract ----------------------------------------------------------

    def _check_refusal(self, what: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            kind = (self.store.root / "refusal").read_text().strip()
            cls = _REFUSALS.get(kind)
            if cls is QuotaError:
                # A used-up quota refuses launches; looking around still works.
                if what == "launch":
                    raise QuotaError("local", REGION, f"{what} refused (injected)")
                return
            if cls is not None:
                raise cls("local", f"{what} refused (injected {kind} refusal)")

    def offers(self, query: OfferQuery) -> list[Offer]:
        self._check_refusal("offers")
        out = []
        for name, t in self.catalog.types("local").items():
            for zone in self.settings.zones:
                for market in (Market.SPOT, Market.ON_DEMAND):
                    offer = Offer(
                        cloud="local",
                        region=REGION,
                        zone=zone,
                        instance_type=name,
                        gpus=t.gpus,
                        gpu_type=t.gpu_type,
                        market=market,
                        price_per_hour=self.catalog.price("local", name, REGION, market),
                        interruption_risk=t.interruption_risk if market is Market.SPOT else 0.0,
                    )
                    if query.allows(offer):
                        out.append(offer)
        return sort_offers(out)

    def launch(self, request: LaunchRequest) -> Instance:
        offer = request.offer
        if offer.cloud != "local":
            raise ValueError(f"the local provider cannot launch a {offer.cloud} offer")
        self._check_refusal("launch")
        try:
            self.catalog.get("local", offer.instance_type)
        except UnknownInstanceType as e:
            raise BadRequestError("local", str(e)) from None
        if offer.zone not in self.settings.zones:
            raise BadRequestError(
                "local",
                f"zone {offer.zone!r} does not exist; zones: {', '.join(self.settings.zones)}",
            )
        vm_id = "vm-" + hashlib.sha256(request.request_id.encode()).hexdigest()[:12]
        with self.store.locked():
            with contextlib.suppress(KeyError):
                # The same request id launched this VM before: return it, create nothing.
                return self._instance(self.store.read(vm_id))
            in_zone = [
                r for r in self.store.all() if r["zone"] == offer.zone and self._live_state(r)
            ]
            cap = self.capacity().get(offer.zone, 0)
            if len(in_zone) >= cap:
                raise CapacityError(
                    "local",
                    offer.zone,
                    offer.instance_type,
                    offer.market,
                    f"the zone holds {cap} VMs and has {len(in_zone)}",
                )
            rec: dict[str, Any] = {
                "id": vm_id,
                "request_id": request.request_id,
                "tags": request.all_tags(),
                "zone": offer.zone,
                "instance_type": offer.instance_type,
                "market": offer.market.value,
                "state": "pending",
                "launched_at": self.clock(),
                "user_data": request.user_data,
                "launch_latency_s": self.settings.launch_latency_s,
                "grace_s": self.settings.notice_s,
                "interrupted": False,
                "reason": "",
            }
            self.store.write(rec)
            pid = self._spawn(vm_id)
            rec["pid"] = pid
            rec["pid_start"] = _pid_start(pid)
            self.store.write(rec)
        return self._instance(rec)

    def _spawn(self, vm_id: str) -> int:
        cmd = [
            sys.executable,
            "-m",
            "spottrain.cloud.local.vm",
            "--spawn",
            str(self.store.path(vm_id)),
            str(self.store.log_path(vm_id)),
        ]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)
            return int(out.stdout.strip())
        except (OSError, subprocess.SubprocessError, ValueError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            self.store.update(vm_id, state="terminated", reason=f"failed to start: {detail}")
            raise TransientError("local", f"VM {vm_id} failed to start: {detail}") from None

    def list(self, job: str) -> list[Instance]:
        self._check_refusal("list")
        out = []
        for rec in self.store.all():
            if rec.get("tags", {}).get("spottrain-job") != job:
                continue
            if rec["state"] != "terminated" and not self._live_state(rec):
                rec = self.store.update(
                    rec["id"],
                    state="terminated",
                    reason=rec.get("reason") or "the VM process is gone",
                    ended_at=self.clock(),
                )
            out.append(self._instance(rec))
        return out

    def terminate(self, instance_ids: Sequence[str]) -> None:
        self._check_refusal("terminate")
        for vm_id in instance_ids:
            try:
                rec = self.store.read(vm_id)
            except KeyError:
                continue
            if rec["state"] == "terminated":
                continue
            if _alive(rec):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(rec["pid"]), signal.SIGTERM)
            else:
                self.store.update(vm_id, state="terminated", reason="deleted")

    def console_output(self, instance_id: str) -> str:
        """The end of the VM's console file (its boot command's output), kept after the VM
        is gone; ``""`` for a VM that printed nothing or that this cloud never had."""
        self._check_refusal("console_output")
        try:
            self.store.read(instance_id)
        except KeyError:
            return ""
        try:
            with open(self.store.log_path(instance_id), "rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - CONSOLE_TAIL_BYTES))
                return console_tail(f.read())
        except FileNotFoundError:
            return ""

    def _live_state(self, rec: Mapping[str, Any]) -> bool:
        """Whether a record that says pending/running/stopping has a VM behind it."""
        if rec["state"] == "terminated":
            return False
        if rec.get("pid") is None:
            return bool(self.clock() - float(rec["launched_at"]) < _SPAWN_TIMEOUT_S)
        return _alive(rec)

    def _instance(self, rec: Mapping[str, Any]) -> Instance:
        tags = rec.get("tags", {})
        return Instance(
            id=rec["id"],
            cloud="local",
            region=REGION,
            zone=rec["zone"],
            instance_type=rec["instance_type"],
            market=Market(rec["market"]),
            state=InstanceState(rec["state"]),
            job=tags.get("spottrain-job", ""),
            node=tags.get("spottrain-node", ""),
            request_id=rec["request_id"],
            interrupted=bool(rec.get("interrupted")),
            state_reason=rec.get("reason", ""),
            launched_at=rec.get("launched_at"),
            address="127.0.0.1",
        )


@dataclass
class PreemptionInjector:
    """Preempts the local cloud's VMs of one job at a per-node rate and/or at traced times.

    Call :meth:`tick` often (the controller does, once per pass); each call preempts what is
    due since the previous one. Random choices come from ``seed``, so a run can be repeated.
    """

    provider: LocalProvider
    job: str
    started_at: float
    rate_per_hour: float = 0.0
    notice_fraction: float = 1.0
    trace: Sequence[TracedPreemption] = ()
    seed: int = 0
    _rng: random.Random = field(init=False)
    _last: float = field(init=False)
    _next_trace: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._last = self.started_at

    def tick(self, now: float) -> list[tuple[str, bool]]:
        """Preempt what is due at ``now``; returns (VM id, with notice) for each."""
        running = [i for i in self.provider.list(self.job) if i.state is InstanceState.RUNNING]
        done: list[tuple[str, bool]] = []
        while (
            self._next_trace < len(self.trace)
            and self.started_at + self.trace[self._next_trace].at_s <= now
        ):
            row = self.trace[self._next_trace]
            self._next_trace += 1
            pool = [i for i in running if row.node is None or i.node == row.node]
            if pool:
                victim = self._rng.choice(pool)
                running.remove(victim)
                self.provider.preempt(victim.id, notice=row.notice)
                done.append((victim.id, row.notice))
        dt = max(0.0, now - self._last)
        self._last = now
        if self.rate_per_hour > 0 and dt > 0:
            p = 1 - math.exp(-self.rate_per_hour * dt / 3600)
            for inst in running:
                if self._rng.random() < p:
                    notice = self._rng.random() < self.notice_fraction
                    self.provider.preempt(inst.id, notice=notice)
                    done.append((inst.id, notice))
        return done

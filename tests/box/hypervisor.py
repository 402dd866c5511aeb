"""The box's hypervisor: it turns a cloud fake's instances into VMs that really boot.

It watches the fake (moto's EC2 backend, or the GCE fake) and, for each new instance, starts
a :class:`~box.vm.BoxVm` from the cloud's image with a metadata server of its own that serves
the instance's identity, its credentials, its user data (startup script) and, when a test
says so, a spot notice. It follows the instance through the API:

- an instance the API terminates, stops or deletes gets an ACPI shutdown (its units stopped
  as systemd would, within the cloud's grace period), then its VM is removed;
- a VM whose guest powers itself off (``shutdown -h now``: the dead man's switch) moves its
  instance as the cloud does: AWS per its ``InstanceInitiatedShutdownBehavior`` (spottrain
  launches with ``terminate``), GCE stopped;
- :meth:`Hypervisor.notice` serves a spot notice on the VM's own metadata server and reclaims
  it when the window ends (AWS: terminated with ``Server.SpotInstanceTermination``; GCE:
  ``preempted`` TRUE and the ACPI shutdown at once, as Compute Engine does, then stopped with
  its preemption operation); :meth:`Hypervisor.kill` reclaims it without notice.

Each VM's console is served to the console API (the EC2 front's ``GetConsoleOutput``, the
GCE fake's serial port). The first VM that boots with an empty ``/opt`` and reports
``booted`` has its ``/opt`` baked into a new image for the VMs launched after it (the boot's
own check, the lock's mark in the venv, then skips the install, as it would on a real image
baked from a VM of the run); :attr:`Hypervisor.booted_from` says which image each VM had.

The hypervisor stands in only for the machine and its image: the user data, every cloud API
call and every object store access are the product's own.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fakes.metadata_server import GCP_PREEMPTED_PATH, MetadataServer

from .network import BoxNetwork
from .vm import CGROUP_BASE, BoxVm, Image, make_base_image, start_vm

ALIVE_AWS = {"pending", "running"}
ALIVE_GCE = {"PROVISIONING", "STAGING", "RUNNING"}


@dataclass(frozen=True)
class Seen:
    """An instance as the hypervisor sees it in the fake."""

    vm_id: str
    alive: bool
    zone: str
    user_data: str


class Cloud(Protocol):
    """What the hypervisor needs of a cloud fake."""

    name: str

    def instances(self) -> list[Seen]: ...

    def identify(self, md: MetadataServer, seen: Seen, address: str) -> None: ...

    def powered_off(self, vm_id: str) -> None: ...

    def reclaim(self, vm_id: str) -> None: ...

    def notice(self, md: MetadataServer, window_s: float) -> None: ...


class AwsCloud:
    """moto's EC2 backends of one account, in the regions given, read in this process."""

    name = "aws"

    def __init__(self, account_id: str, regions: tuple[str, ...]) -> None:
        self.account_id, self.regions = account_id, regions

    def _backend(self, region: str) -> Any:
        from moto.backends import get_backend

        return get_backend("ec2")[self.account_id][region]

    def _find(self, vm_id: str) -> tuple[Any, Any, str]:
        for region in self.regions:
            backend = self._backend(region)
            if vm_id in {i.id for i in backend.all_instances()}:
                return backend, backend.get_instance(vm_id), region
        raise KeyError(vm_id)

    def instances(self) -> list[Seen]:
        out = []
        for region in self.regions:
            for inst in self._backend(region).all_instances():
                if inst.state == "terminated":
                    # moto deletes a terminated VM's interfaces again on every later
                    # TerminateInstances and then fails; EC2 accepts terminating it again.
                    for nic in inst.nics.values():
                        nic.delete_on_termination = False
                # moto keeps the user data as sent: base64 (a Base64EncodedString).
                data = inst.user_data.decode() if inst.user_data is not None else ""
                alive = inst.state in ALIVE_AWS
                out.append(Seen(inst.id, alive, inst.placement.zone or "", data))
        return out

    def identify(self, md: MetadataServer, seen: Seen, address: str) -> None:
        _, inst, region = self._find(seen.vm_id)
        meta = "/latest/meta-data/"
        values = {
            "instance-id": seen.vm_id,
            "instance-type": inst.instance_type,
            "placement/availability-zone": seen.zone,
            "placement/region": region,
            "local-ipv4": address,
            "hostname": f"ip-{address.replace('.', '-')}.ec2.internal",
        }
        profile = inst.iam_instance_profile
        if profile:
            role = (profile.get("Name") or profile.get("Arn", "").rsplit("/", 1)[-1]) or "role"
            expires = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=6)
            creds = {
                "Code": "Success",
                "Type": "AWS-HMAC",
                "AccessKeyId": "ASIA" + secrets.token_hex(8).upper(),
                "SecretAccessKey": secrets.token_urlsafe(30),
                "Token": secrets.token_urlsafe(60),
                "Expiration": expires.strftime("%Y-%m-%dT%H:%M:%SZ"),
                "LastUpdated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            values["iam/security-credentials/"] = role
            values[f"iam/security-credentials/{role}"] = json.dumps(creds)
        for path, value in values.items():
            md.set_aws_value(meta + path, value)
        md.set_aws_value("/latest/user-data", seen.user_data)

    def powered_off(self, vm_id: str) -> None:
        backend, inst, _ = self._find(vm_id)
        if inst.instance_initiated_shutdown_behavior == "terminate":
            backend.terminate_instances([vm_id])
        else:
            backend.stop_instances([vm_id])

    def reclaim(self, vm_id: str) -> None:
        from moto.ec2.models.instances import StateReason

        backend, inst, _ = self._find(vm_id)
        if inst.state not in ALIVE_AWS:
            return  # ended already (the controller ended a drained VM before the reclaim)
        backend.terminate_instances([vm_id])
        for nic in inst.nics.values():
            nic.delete_on_termination = False  # as in instances(): moto's repeat terminate
        reason = "Server.SpotInstanceTermination"
        inst.state_reason = StateReason(f"{reason}: Spot instance termination", reason)
        inst._reason = "Service initiated"

    def notice(self, md: MetadataServer, window_s: float) -> None:
        when = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=window_s)
        md.set_spot_action("terminate", when.strftime("%Y-%m-%dT%H:%M:%SZ"))


class GceCloud:
    """The GCE fake's instances."""

    name = "gcp"

    def __init__(self, fake: Any) -> None:
        self.fake = fake

    def instances(self) -> list[Seen]:
        out = []
        for inst in self.fake.instances():
            items = {
                i["key"]: i.get("value", "") for i in inst.get("metadata", {}).get("items", [])
            }
            zone = inst.get("zone", "").rsplit("/", 1)[-1]
            out.append(
                Seen(
                    inst["name"],
                    inst.get("status") in ALIVE_GCE,
                    zone,
                    items.get("startup-script", ""),
                )
            )
        return out

    def identify(self, md: MetadataServer, seen: Seen, address: str) -> None:
        md.gcp_root = True
        project = self.fake.project
        inst = self.fake.instance(seen.vm_id) or {}
        accounts = inst.get("serviceAccounts") or [{"email": "default", "scopes": []}]
        email = accounts[0].get("email", "default")
        token = {"access_token": "ya29." + secrets.token_urlsafe(40), "expires_in": 3599}
        base = "/computeMetadata/v1/"
        values = {
            "instance/name": seen.vm_id,
            "instance/id": str(abs(hash(seen.vm_id)) % 10**18),
            "instance/hostname": f"{seen.vm_id}.c.{project}.internal",
            "instance/zone": f"projects/123456789012/zones/{seen.zone}",
            "instance/network-interfaces/0/ip": address,
            "instance/attributes/startup-script": seen.user_data,
            "project/project-id": project,
            "project/numeric-project-id": "123456789012",
            "instance/service-accounts/default/email": email,
        }
        for path, value in values.items():
            md.set_gcp(base + path, value)
        info = {"email": email, "scopes": accounts[0].get("scopes", []), "aliases": ["default"]}
        md.set_gcp(base + "instance/service-accounts/default/", json.dumps(info), json=True)
        md.set_gcp(base + "instance/service-accounts/default/token", json.dumps(token), json=True)

    def powered_off(self, vm_id: str) -> None:
        with contextlib.suppress(Exception):
            self.fake.stop(vm_id)

    def reclaim(self, vm_id: str) -> None:
        with contextlib.suppress(Exception):
            self.fake.preempt(vm_id)

    def notice(self, md: MetadataServer, window_s: float) -> None:
        md.set_gcp(GCP_PREEMPTED_PATH, "TRUE")


@dataclass
class Hypervisor:
    """The box (see the module docstring). Start it with :meth:`start`; :meth:`close` ends
    every VM and removes every namespace, cgroup and folder it made."""

    cloud: Cloud
    workdir: Path
    volume: Path | None = None
    # Seconds an API terminate/stop/delete gives the guest to stop its units.
    api_grace_s: float = 60.0
    # Seconds the guest has after a spot reclaim (AWS) or preemption (GCE) starts its shutdown.
    reclaim_grace_s: float = 30.0
    python: Path | None = None  # another python3 for the image (None: the host's)
    ca_pem: bytes = b""  # a CA the image trusts besides the system's
    bake: bool = True
    # While set, new instances wait to boot (a slow provisioning: a test changes something
    # the VMs will meet, then lets them boot).
    hold: threading.Event = field(default_factory=threading.Event)
    network: BoxNetwork = field(default_factory=BoxNetwork)
    vms: dict[str, BoxVm] = field(default_factory=dict)
    booted_from: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    _image: Image | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _gone: set[str] = field(default_factory=set)
    _reclaiming: set[str] = field(default_factory=set)
    _cleaned: set[str] = field(default_factory=set)

    @property
    def cgroup(self) -> Path:
        return CGROUP_BASE / f"stb{self.network.box_id}"

    def start(self) -> Hypervisor:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.network.create()
        self._image = make_base_image(
            self.workdir / "images" / "base",
            self.cloud.name,
            python=self.python,
            ca_pem=self.ca_pem,
        )
        self._thread = threading.Thread(target=self._watch, name="box-hypervisor", daemon=True)
        self._thread.start()
        return self

    def expose(self, port: int) -> str:
        """A service of this process on 127.0.0.1:``port``, reachable from the box (the VMs
        and the controller) at the returned ``10.77.0.1:port``."""
        return self.network.expose(port)

    def console(self, vm_id: str) -> str | None:
        vm = self.vms.get(vm_id)
        return vm.console() if vm is not None else None

    def vm(self, vm_id: str) -> BoxVm:
        return self.vms[vm_id]

    # --- what a test does -------------------------------------------------------------------

    def notice(self, vm_id: str, window_s: float) -> None:
        """A spot notice now, the VM reclaimed when ``window_s`` is over."""
        vm = self.vms[vm_id]
        self._reclaiming.add(vm_id)
        self.cloud.notice(vm.metadata, window_s)
        if self.cloud.name == "gcp":
            # Compute Engine starts the guest's shutdown with the preemption notice.
            threading.Thread(target=vm.acpi_shutdown, args=(window_s,), daemon=True).start()

        def reclaim() -> None:
            if not self._stop.wait(window_s):
                self.cloud.reclaim(vm_id)

        threading.Thread(target=reclaim, daemon=True).start()

    def kill(self, vm_id: str) -> None:
        """The VM reclaimed without notice: its processes die at once, the instance goes."""
        vm = self.vms[vm_id]
        self._reclaiming.add(vm_id)
        vm.kill()
        self.cloud.reclaim(vm_id)
        self._cleanup(vm)

    # --- the loop ---------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(0.25):
            try:
                self._pass()
            except Exception as e:  # kept for the test to see, never silently
                self.errors.append(f"{type(e).__name__}: {e}")

    def _pass(self) -> None:
        for seen in self.cloud.instances():
            vm = self.vms.get(seen.vm_id)
            if vm is None:
                if seen.alive and seen.vm_id not in self._gone and not self.hold.is_set():
                    self._gone.add(seen.vm_id)  # booted once: a restart is not modelled
                    threading.Thread(target=self._boot, args=(seen,), daemon=True).start()
                continue
            if not seen.alive and vm.alive() and not vm.stopping:
                grace = self.reclaim_grace_s if self._reclaimed(seen) else self.api_grace_s
                threading.Thread(target=self._shutdown, args=(vm, grace), daemon=True).start()
        ids = {s.vm_id for s in self.cloud.instances()}
        for vm_id, vm in list(self.vms.items()):
            if vm_id not in ids and vm.alive() and not vm.stopping:
                # Deleted (GCE): the guest gets its shutdown, then the VM goes.
                threading.Thread(
                    target=self._shutdown, args=(vm, self.api_grace_s), daemon=True
                ).start()
            elif not vm.alive() and vm_id not in self._cleaned:
                # Its PID 1 ended: the guest powered off (the cloud moves the instance as it
                # does), or the box ended it (a reclaim, a shutdown past its grace).
                if not vm.stopping and vm.powered_off_by_guest():
                    self.cloud.powered_off(vm_id)
                vm.stopping = True
                self._cleanup(vm)

    def _reclaimed(self, seen: Seen) -> bool:
        return seen.vm_id in self._reclaiming

    def _boot(self, seen: Seen) -> None:
        try:
            image = self._image
            assert image is not None
            folder = self.workdir / "vms" / seen.vm_id
            md = MetadataServer().start()
            vm = start_vm(
                self.network,
                vm_id=seen.vm_id,
                cloud=self.cloud.name,
                image=image,
                folder=folder,
                metadata=md,
                volume=self.volume,
                cgroup_parent=self.cgroup,
            )
            self.cloud.identify(md, seen, vm.net.address)
            with self._lock:
                self.vms[seen.vm_id] = vm
                self.booted_from[seen.vm_id] = image.baked_from or "empty /opt"
            if self.bake and not image.baked_from:
                threading.Thread(target=self._bake_when_booted, args=(vm,), daemon=True).start()
        except Exception as e:
            self.errors.append(f"booting {seen.vm_id}: {type(e).__name__}: {e}")

    def _bake_when_booted(self, vm: BoxVm) -> None:
        """Bake the VM's /opt into an image once it reports booted (once per box)."""
        while not self._stop.wait(1.0):
            if not vm.alive():
                return
            text = vm.console()
            if f": {vm.vm_id}: booted" in text or f" {vm.vm_id}: booted" in text:
                break
        else:
            return
        with self._lock:
            if self._image is not None and self._image.baked_from:
                return
            dest = self.workdir / "images" / f"baked-{vm.vm_id}"
            (dest / "etc").parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(vm.folder / "opt-upper", dest / "opt", symlinks=True)
            assert self._image is not None
            shutil.copytree(self._image.etc, dest / "etc", symlinks=True)
            self._image = Image(f"baked from {vm.vm_id}", dest, self.python, baked_from=vm.vm_id)

    def _shutdown(self, vm: BoxVm, grace: float) -> None:
        vm.acpi_shutdown(grace)
        self._cleanup(vm)

    def _cleanup(self, vm: BoxVm) -> None:
        """Remove what the VM left (processes, cgroups, namespace, metadata server); once."""
        with self._lock:
            if vm.vm_id in self._cleaned:
                return
            self._cleaned.add(vm.vm_id)
        vm.kill()
        vm.remove_cgroups()
        self.network.remove_vm(vm.vm_id)
        vm.metadata.close()

    def close(self) -> None:
        """End every VM (no grace: the test is over) and remove what the box made."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for vm in list(self.vms.values()):
            with contextlib.suppress(Exception):
                self._cleanup(vm)
        with contextlib.suppress(OSError):
            self.cgroup.rmdir()
        self.network.close()

    def wait_for(self, what: str, pred: Callable[[], bool], timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if pred():
                return
            time.sleep(0.25)
        raise AssertionError(f"the box waited {timeout:.0f} s for {what}; errors: {self.errors}")

"""VMs: insert, get, list, delete, their serial port output, and how a VM moves from
PROVISIONING to RUNNING; what a test does to them (preempt, stop, set its console) and reads
of them."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

from .common import API, MACHINE_TYPE_RE, PREEMPTED, ApiError, not_found, parse_body, timestamp
from .listing import aggregated_page, list_page
from .state import GceState

# The serial port output Compute Engine retains per port (older output is discarded).
SERIAL_PORT_BUFFER = 1 << 20


class InstancesMixin(GceState):
    # Declared here, not in GceState: only this mixin reads them.
    _consoles: dict[str, str]  # VM name -> the text set_console gave it
    console_source: Callable[[str], str | None] | None

    def set_console(self, name: str, text: str) -> None:
        """From now on the VM ``name`` has ``text`` as its serial port 1 output (set before
        or after the VM exists; it outlives neither a later ``set_console`` nor the fake)."""
        with self._lock:
            self._consoles[name] = text

    def _serial_port(self, zone: str, name: str, query: dict[str, str]) -> dict[str, Any]:
        if name not in self._instances.get(zone, {}):
            raise not_found(f"projects/{self.project}/zones/{zone}/instances/{name}")
        try:
            port = int(query.get("port") or 1)
            start = int(query.get("start") or 0)
        except ValueError:
            raise ApiError(400, "Invalid value for field 'start' or 'port'", "invalid") from None
        if not 1 <= port <= 4:
            raise ApiError(400, f"Invalid value for field 'port': '{port}'", "invalid")
        text = self._consoles.get(name)
        if text is None and port == 1 and self.console_source is not None:
            text = self.console_source(name)
        data = (text or "").encode() if port == 1 else b""
        oldest = max(0, len(data) - SERIAL_PORT_BUFFER)
        if start < 0:
            start = len(data) + start
        start = min(max(start, oldest), len(data))
        return {
            "kind": "compute#serialPortOutput",
            "contents": data[start:].decode("utf-8", errors="replace"),
            "start": str(start),
            "next": str(len(data)),
            "selfLink": f"{API}/projects/{self.project}/zones/{zone}/instances/{name}/"
            f"serialPort?port={port}",
        }

    def preempt(self, name: str) -> None:
        """Take the VM back as Compute Engine preempts a spot VM: it is stopped
        (``TERMINATED``), or deleted if its termination action is ``DELETE``, and a
        ``compute.instances.preempted`` operation records it.

        Raises:
            KeyError: no VM of that name.
        """
        with self._lock:
            zone, body = self._find(name)
            scheduling = body.get("scheduling", {})
            if scheduling.get("instanceTerminationAction") == "DELETE":
                del self._instances[zone][name]
            else:
                body["status"] = "TERMINATED"
                body["statusMessage"] = "Instance was preempted."
                body["lastStopTimestamp"] = timestamp()
            self._new_operation(zone, PREEMPTED, body, polls=0, user="system")

    def stop(self, name: str) -> None:
        """Stop the VM without a preemption (as ``gcloud compute instances stop`` or a max
        run duration does): ``TERMINATED``, no ``compute.instances.preempted`` operation.

        Raises:
            KeyError: no VM of that name.
        """
        with self._lock:
            zone, body = self._find(name)
            body["status"] = "TERMINATED"
            body["lastStopTimestamp"] = timestamp()
            self._new_operation(zone, "stop", body, polls=0)

    @property
    def inserted(self) -> list[dict[str, Any]]:
        """Every insert body received, as sent (accepted or not)."""
        with self._lock:
            return copy.deepcopy(self._inserted)

    def instance(self, name: str) -> dict[str, Any] | None:
        """The VM's resource as the API would show it (without moving its status), or None."""
        with self._lock:
            try:
                return copy.deepcopy(self._find(name)[1])
            except KeyError:
                return None

    def instances(self) -> list[dict[str, Any]]:
        with self._lock:
            return [copy.deepcopy(b) for zone in self._instances.values() for b in zone.values()]

    def _insert(self, zone: str, body: dict[str, Any]) -> dict[str, Any]:
        self._inserted.append(copy.deepcopy(body))
        machine_type = self._validate_insert(zone, body)
        name = body["name"]
        if name in self._instances.get(zone, {}):
            raise ApiError(
                409,
                f"The resource 'projects/{self.project}/zones/{zone}/instances/{name}' "
                "already exists",
                "alreadyExists",
            )
        quota = self._quota_fault(zone)
        if quota is not None and quota[0] == "http":
            raise ApiError(403, quota[1]["message"], "quotaExceeded", domain="usageLimits")
        stockout = self._stockout_fault(zone, machine_type)
        if stockout is not None and stockout[0] == "http":
            raise ApiError(503, stockout[1]["message"], "ZONE_RESOURCE_POOL_EXHAUSTED")
        instance_id = str(next(self._ids))
        link = f"{API}/projects/{self.project}/zones/{zone}/instances/{name}"
        if quota is not None:
            return self._new_operation(
                zone,
                "insert",
                {"name": name, "id": instance_id, "selfLink": link},
                error=quota[1],
                http_status=403,
                http_message="FORBIDDEN",
            )
        if stockout is not None:
            return self._new_operation(
                zone,
                "insert",
                {"name": name, "id": instance_id, "selfLink": link},
                error=stockout[1],
                http_status=503,
                http_message="SERVICE UNAVAILABLE",
            )
        created = self._complete(zone, body, instance_id, link)
        self._instances.setdefault(zone, {})[name] = created
        self._stepped_at[(zone, name)] = time.monotonic()
        return self._new_operation(zone, "insert", created)

    def _complete(
        self, zone: str, body: dict[str, Any], instance_id: str, link: str
    ) -> dict[str, Any]:
        """The stored resource: the request plus what the server fills in."""
        out = copy.deepcopy(body)
        machine_type = MACHINE_TYPE_RE.match(body["machineType"])["type"]  # type: ignore[index]
        scheduling = out.setdefault("scheduling", {})
        scheduling.setdefault("onHostMaintenance", "MIGRATE")
        scheduling.setdefault("automaticRestart", True)
        scheduling.setdefault("provisioningModel", "STANDARD")
        scheduling.setdefault("preemptible", False)
        if scheduling["provisioningModel"] == "SPOT":
            scheduling.setdefault("instanceTerminationAction", "STOP")
        for i, nic in enumerate(out.get("networkInterfaces", [])):
            nic["name"] = f"nic{i}"
            nic["networkIP"] = f"10.128.{int(instance_id) % 250}.{2 + i}"
            nic.setdefault("network", f"{API}/projects/{self.project}/global/networks/default")
            nic["kind"] = "compute#networkInterface"
        for i, disk in enumerate(out.get("disks", [])):
            disk["deviceName"] = f"persistent-disk-{i}"
            disk["source"] = f"{API}/projects/{self.project}/zones/{zone}/disks/{out['name']}"
            disk["kind"] = "compute#attachedDisk"
            disk.pop("initializeParams", None)
        out.setdefault("metadata", {})["fingerprint"] = "fake-fingerprint="
        out["metadata"]["kind"] = "compute#metadata"
        out.update(
            kind="compute#instance",
            id=instance_id,
            creationTimestamp=timestamp(),
            zone=f"{API}/projects/{self.project}/zones/{zone}",
            machineType=f"{API}/projects/{self.project}/zones/{zone}/machineTypes/{machine_type}",
            status="PROVISIONING",
            selfLink=link,
            labelFingerprint="fake-label-fingerprint=",
            cpuPlatform="Unknown CPU Platform",
        )
        return out

    def _find(self, name: str) -> tuple[str, dict[str, Any]]:
        for zone, instances in self._instances.items():
            if name in instances:
                return zone, instances[name]
        raise KeyError(name)

    def _read(self, zone: str, name: str) -> dict[str, Any]:
        """A read of the VM, which moves it one step towards RUNNING once it is due."""
        body = self._instances[zone][name]
        following = {"PROVISIONING": "STAGING", "STAGING": "RUNNING"}.get(body["status"])
        now = time.monotonic()
        if following and now - self._stepped_at.get((zone, name), now) >= self.boot_delay:
            body["status"] = following
            self._stepped_at[(zone, name)] = now
            if following == "RUNNING":
                body["lastStartTimestamp"] = timestamp()
        return copy.deepcopy(body)

    def _read_listed(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._read(body["zone"].rsplit("/", 1)[-1], body["name"])

    def _get_instance(self, zone: str, name: str) -> dict[str, Any]:
        if name not in self._instances.get(zone, {}):
            raise not_found(f"projects/{self.project}/zones/{zone}/instances/{name}")
        return self._read(zone, name)

    def _delete(self, zone: str, name: str) -> dict[str, Any]:
        body = self._instances.get(zone, {}).pop(name, None)
        if body is None:
            raise not_found(f"projects/{self.project}/zones/{zone}/instances/{name}")
        self._stepped_at.pop((zone, name), None)
        return self._new_operation(zone, "delete", body)

    def _serve_instances(
        self, call: str, zone: str, name: str, query: dict[str, str], raw: bytes
    ) -> tuple[int, dict[str, Any]] | None:
        if call == "instances.insert":
            return 200, self._insert(zone, parse_body(raw))
        if call == "instances.get":
            return 200, self._get_instance(zone, name)
        if call == "instances.delete":
            return 200, self._delete(zone, name)
        if call == "instances.getSerialPortOutput":
            return 200, self._serial_port(zone, name, query)
        if call == "instances.list":
            stored = self._instances.get(zone, {})
            items = [stored[n] for n in sorted(stored)]
            return 200, list_page(
                f"projects/{self.project}/zones/{zone}/instances",
                "compute#instanceList",
                items,
                query,
                self.page_size,
                self._read_listed,
            )
        if call == "instances.aggregatedList":
            scoped = {
                z: [b for _, b in sorted(self._instances.get(z, {}).items())]
                for z in sorted(self._machine_types)
            }
            return 200, aggregated_page(
                f"projects/{self.project}/aggregated/instances",
                "compute#instanceAggregatedList",
                "instances",
                scoped,
                query,
                self.page_size,
                self._read_listed,
            )
        return None

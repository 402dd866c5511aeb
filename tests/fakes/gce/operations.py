"""Zone and global operations: what every mutating call answers, and their polling."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any

from .common import API, PREEMPTED, not_found, timestamp
from .listing import list_page
from .state import GceState


@dataclass
class Operation:
    body: dict[str, Any]
    polls_left: int
    error: dict[str, Any] | None = None
    http_status: int = 0
    http_message: str = ""


class OperationsMixin(GceState):
    def operations(self, zone: str) -> list[dict[str, Any]]:
        with self._lock:
            return [copy.deepcopy(op.body) for op in self._operations.get(zone, {}).values()]

    def _new_operation(
        self,
        zone: str | None,
        op_type: str,
        target: dict[str, Any],
        *,
        polls: int | None = None,
        error: dict[str, Any] | None = None,
        http_status: int = 0,
        http_message: str = "",
        user: str = "spottrain@example.com",
    ) -> dict[str, Any]:
        op_id = next(self._ids)
        name = f"operation-{int(time.time() * 1000)}-{op_id:x}"[:63]
        scope = f"zones/{zone}" if zone else "global"
        body = {
            "kind": "compute#operation",
            "id": str(op_id),
            "name": name,
            "operationType": op_type,
            "targetLink": target.get("selfLink", ""),
            "targetId": target.get("id", ""),
            "status": "RUNNING",
            "user": user,
            "progress": 0,
            "insertTime": timestamp(),
            "startTime": timestamp(),
            "selfLink": f"{API}/projects/{self.project}/{scope}/operations/{name}",
        }
        if zone:
            body["zone"] = f"{API}/projects/{self.project}/zones/{zone}"
        if op_type == PREEMPTED:
            body["statusMessage"] = "Instance was preempted."
        op = Operation(
            body,
            self.op_polls_until_done if polls is None else polls,
            error,
            http_status,
            http_message,
        )
        # Global operations are kept under the zone "" (no zone has that name).
        self._operations.setdefault(zone or "", {})[name] = op
        if op.polls_left <= 0:
            self._finish(op)
        return copy.deepcopy(body)

    def _finish(self, op: Operation) -> None:
        op.body.update(status="DONE", progress=100, endTime=timestamp())
        if op.error is not None:
            op.body["error"] = {"errors": [op.error]}
            op.body["httpErrorStatusCode"] = op.http_status
            op.body["httpErrorMessage"] = op.http_message

    def _poll(self, zone: str, name: str) -> dict[str, Any]:
        """A get or wait of the operation (``zone`` "" for a global one)."""
        op = self._operations.get(zone, {}).get(name)
        if op is None:
            scope = f"zones/{zone}" if zone else "global"
            raise not_found(f"projects/{self.project}/{scope}/operations/{name}")
        if op.body["status"] != "DONE":
            op.polls_left -= 1
            if op.polls_left <= 0:
                self._finish(op)
        return copy.deepcopy(op.body)

    def _serve_operations(
        self, call: str, zone: str, name: str, query: dict[str, str], raw: bytes
    ) -> tuple[int, dict[str, Any]] | None:
        if call == "zoneOperations.list":
            ops = [op.body for op in self._operations.get(zone, {}).values()]
            return 200, list_page(
                f"projects/{self.project}/zones/{zone}/operations",
                "compute#operationList",
                ops,
                query,
                self.page_size,
            )
        if call in ("zoneOperations.get", "zoneOperations.wait"):
            return 200, self._poll(zone, name)
        if call in ("globalOperations.get", "globalOperations.wait"):
            return 200, self._poll("", name)
        if call == "zoneOperations.delete":
            if self._operations.get(zone, {}).pop(name, None) is None:
                raise not_found(f"projects/{self.project}/zones/{zone}/operations/{name}")
            return 204, {}
        return None

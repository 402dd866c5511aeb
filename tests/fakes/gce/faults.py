"""Injected faults: stockouts, quota refusals, auth errors and failed calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .common import ApiError
from .state import GceState


@dataclass
class Faults:
    stockouts: dict[tuple[str, str], str] = field(default_factory=dict)  # -> "operation"/"http"
    quotas: dict[str, tuple[str, str]] = field(default_factory=dict)  # region -> (metric, via)
    auth_status: int | None = None
    fail_next: list[tuple[int, str | None]] = field(default_factory=list)


class FaultsMixin(GceState):
    """The faults a test injects, and how a call or an insert meets them."""

    def inject_stockout(self, zone: str, machine_type: str, *, via: str = "operation") -> None:
        """Inserts of ``machine_type`` in ``zone`` fail for capacity: ``via="operation"``, the
        way Compute Engine usually reports it (the insert is accepted and its operation
        finishes with ``ZONE_RESOURCE_POOL_EXHAUSTED``), or ``via="http"`` (the insert itself
        answers 503)."""
        if via not in ("operation", "http"):
            raise ValueError(f"via must be 'operation' or 'http', got {via!r}")
        with self._lock:
            self._faults.stockouts[(zone, machine_type)] = via

    def inject_quota_error(
        self, region: str, metric: str = "NVIDIA_A100_GPUS", *, via: str = "http"
    ) -> None:
        """Inserts in ``region`` exceed quota ``metric``: ``via="http"`` answers 403
        ``quotaExceeded``; ``via="operation"`` fails the operation with ``QUOTA_EXCEEDED``."""
        if via not in ("operation", "http"):
            raise ValueError(f"via must be 'operation' or 'http', got {via!r}")
        with self._lock:
            self._faults.quotas[region] = (metric, via)

    def inject_auth_error(self, status: int = 401) -> None:
        """Every call fails: 401 (no or revoked credentials) or 403 (no permission)."""
        if status not in (401, 403):
            raise ValueError(f"status must be 401 or 403, got {status}")
        with self._lock:
            self._faults.auth_status = status

    def fail_next(self, n: int, status: int = 503, *, method: str | None = None) -> None:
        """The next ``n`` calls (of ``method`` only, if given) answer ``status``."""
        with self._lock:
            self._faults.fail_next.extend([(status, method)] * n)

    def forget_image(self, image: str) -> None:
        """Inserts booting from ``image`` (as written in the request) get 404."""
        with self._lock:
            self._unknown_images.add(image)

    def remove_machine_type(self, zone: str, machine_type: str) -> None:
        """``zone`` no longer has ``machine_type`` (inserts get 404, lists omit it)."""
        with self._lock:
            self._machine_types.get(zone, set()).discard(machine_type)

    def clear_faults(self) -> None:
        """Undo every injected fault (not removed machine types or forgotten images)."""
        with self._lock:
            self._faults = Faults()

    def _check_faults(self, call: str) -> None:
        if self._faults.auth_status == 401:
            raise ApiError(
                401,
                "Request had invalid authentication credentials. Expected OAuth 2 access "
                "token, login cookie or other valid authentication credential.",
                "authError",
                status="UNAUTHENTICATED",
            )
        if self._faults.auth_status == 403:
            raise ApiError(
                403,
                f"Required '{call.split('.')[0].rstrip('s')}' permission for "
                f"'projects/{self.project}'",
                "forbidden",
            )
        for i, (status, method) in enumerate(self._faults.fail_next):
            if method in (None, call):
                del self._faults.fail_next[i]
                reason = "rateLimitExceeded" if status == 429 else "backendError"
                raise ApiError(status, f"Injected failure: HTTP {status}", reason)

    def _quota_fault(self, zone: str) -> tuple[str, dict[str, Any]] | None:
        """How an injected quota fault of the zone's region is raised, and the operation error
        that carries it."""
        region = zone.rsplit("-", 1)[0]
        quota = self._faults.quotas.get(region)
        if quota is None:
            return None
        metric, via = quota
        return via, {
            "code": "QUOTA_EXCEEDED",
            "message": f"Quota '{metric}' exceeded.  Limit: 0.0 in region {region}.",
            "errorDetails": [
                {
                    "quotaInfo": {
                        "metricName": f"compute.googleapis.com/{metric.lower()}",
                        "limitName": f"{metric}-per-project-region",
                        "dimensions": {"region": region},
                        "limit": 0,
                    }
                }
            ],
        }

    def _stockout_fault(self, zone: str, machine_type: str) -> tuple[str, dict[str, Any]] | None:
        """How an injected stockout is raised, and the operation error that carries it."""
        via = self._faults.stockouts.get((zone, machine_type))
        if via is None:
            return None
        return via, {
            "code": "ZONE_RESOURCE_POOL_EXHAUSTED",
            "message": (
                f"The zone 'projects/{self.project}/zones/{zone}' does not have enough "
                "resources available to fulfill the request.  Try a different zone, or try "
                "again later."
            ),
        }

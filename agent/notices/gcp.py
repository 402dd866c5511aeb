"""One poll of the GCE metadata server: the two GCP notice monitors (preempted, terminating
host maintenance) over one metadata client."""

from __future__ import annotations

import time
from collections.abc import Callable

from .gce_metadata import GceMetadata
from .gcp_maintenance import MaintenanceMonitor
from .gcp_preempted import PreemptedMonitor
from .metadata_http import DEFAULT_TIMEOUT_S, all_failed, check_all
from .notice import Notice


class GcpMetadataWatcher:
    """Watches the GCE metadata server for preemption and terminating host maintenance.

    Args:
        host: ``host[:port]`` of the metadata server. Default: ``$GCE_METADATA_HOST``, else
            ``metadata.google.internal``. An ``http://`` prefix is tolerated.
        timeout: Seconds each socket operation of a request may take; a long-poll gets its
            ``timeout_sec`` on top.
        clock: Wall clock for ``seen_at`` and derived deadlines.

    Raises:
        ValueError: On a bad timeout.
    """

    def __init__(
        self,
        host: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.metadata = GceMetadata(host, timeout=timeout)
        self.preempted = PreemptedMonitor(self.metadata, clock)
        self.maintenance = MaintenanceMonitor(self.metadata, clock)
        self.last_errors: list[str] = []

    @property
    def host(self) -> str:
        return self.metadata.host

    @property
    def timeout(self) -> float:
        return self.metadata.timeout

    def poll(self, wait: float = 0) -> list[Notice]:
        """Checks ``preempted`` and ``maintenance-event`` once.

        Args:
            wait: When > 0, long-poll ``preempted`` for up to this many seconds (rounded up
                to whole seconds) with ``wait_for_change``, returning as soon as it changes;
                ``maintenance-event`` is then read without waiting.

        Returns:
            The notices showing now. Paths that failed are in :attr:`last_errors`.

        Raises:
            WatcherError: When neither path could be checked.
        """
        self.last_errors = []
        checks: tuple[Callable[[], Notice | None], ...] = (
            lambda: self.preempted.check(wait),
            self.maintenance.check,
        )
        notices, errors = check_all(checks)
        warnings = [w for w in (self.preempted.warning, self.maintenance.warning) if w]
        self.last_errors = [str(e) for e in errors] + warnings
        if len(errors) == len(checks):
            raise all_failed(errors)
        return notices

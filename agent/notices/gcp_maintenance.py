"""The GCP maintenance monitor: ``instance/maintenance-event`` says the host's maintenance
will stop this VM (TERMINATE_ON_HOST_MAINTENANCE).

A metadata server's answer that is none of the documented values is still a terminating
maintenance, due 60 s after it was first seen, with the problem in
:attr:`MaintenanceMonitor.warning` (failing open could lose the emergency checkpoint)."""

from __future__ import annotations

import time
from collections.abc import Callable

from .gce_metadata import GCP_MAINTENANCE_PATH, GceMetadata
from .metadata_http import FirstSeen
from .notice import Notice, NoticeKind

SOURCE = "gcp:maintenance"
# A TERMINATE_ON_HOST_MAINTENANCE event comes 60 s before the VM is stopped.
GCP_MAINTENANCE_GRACE_S = 60.0


class MaintenanceMonitor:
    """Reads ``instance/maintenance-event``; the notice's id is the event's value.

    Attributes:
        warning: What was wrong with the last answer, when it was not a documented value and
            still counts as a notice; None otherwise.
    """

    def __init__(self, metadata: GceMetadata, clock: Callable[[], float] = time.time) -> None:
        self.metadata = metadata
        self._clock = clock
        self._first_seen = FirstSeen()
        self.warning: str | None = None

    def check(self) -> Notice | None:
        """The terminating maintenance showing now, or None.

        Raises:
            WatcherError: When the path could not be checked.
        """
        self.warning = None
        value = self.metadata.get(GCP_MAINTENANCE_PATH).text()
        if value in ("NONE", "MIGRATE_ON_HOST_MAINTENANCE"):
            # A live migration pauses the VM briefly; it does not end it.
            self._first_seen.clear()
            return None
        detail: dict[str, object] = {"maintenance_event": value[:200]}
        if value != "TERMINATE_ON_HOST_MAINTENANCE":
            self.warning = (
                f"GET {self.metadata.url(GCP_MAINTENANCE_PATH)} returned {value[:80]!r}, "
                "expected NONE, MIGRATE_ON_HOST_MAINTENANCE or TERMINATE_ON_HOST_MAINTENANCE; "
                f"treated as a terminating maintenance due {GCP_MAINTENANCE_GRACE_S:g}s after "
                "it was first seen"
            )
            detail["unreadable"] = True
        seen_at = self._first_seen.mark(value, self._clock())
        return Notice(
            SOURCE,
            NoticeKind.MAINTENANCE,
            seen_at + GCP_MAINTENANCE_GRACE_S,
            seen_at=seen_at,
            detail=detail,
            id=value,
        )

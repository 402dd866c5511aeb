"""The GCP preemption monitor: ``instance/preempted`` turned TRUE.

An answer of the metadata server (a 200 with its ``Metadata-Flavor`` header) that is neither
TRUE nor FALSE is still a preemption notice, due 30 s after it was first seen, with the
problem in :attr:`PreemptedMonitor.warning`: ignoring it could lose the emergency checkpoint,
as with AWS's unreadable spot notice."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from .gce_metadata import GCP_PREEMPTED_PATH, GceMetadata
from .metadata_http import FirstSeen
from .notice import Notice, NoticeKind

SOURCE = "gcp:preempted"
# GCP documents 30 s between the preemption notice and the hard stop (ACPI G2 soft off).
GCP_PREEMPT_GRACE_S = 30.0


class PreemptedMonitor:
    """Reads (or long-polls) ``instance/preempted``. A VM is preempted once, so the
    notice's id is the value itself.

    Attributes:
        warning: What was wrong with the last answer, when it was neither TRUE nor FALSE and
            still counts as a notice; None otherwise.
    """

    def __init__(self, metadata: GceMetadata, clock: Callable[[], float] = time.time) -> None:
        self.metadata = metadata
        self._clock = clock
        self._etag: str | None = None
        self._first_seen = FirstSeen()
        self.warning: str | None = None

    def _get(self, query: dict[str, str] | None = None, extra: float = 0) -> str:
        resp = self.metadata.get(GCP_PREEMPTED_PATH, query, extra)
        self._etag = resp.header("ETag") or self._etag
        return resp.text()

    def _read(self, wait: float) -> str:
        if wait <= 0 or self._etag is None:
            # Without an ETag, wait_for_change would wait for the *next* change and miss a
            # TRUE that is already there; read the value (and its ETag) first.
            value = self._get()
            if wait <= 0 or value != "FALSE" or self._etag is None:
                return value
        timeout_sec = max(1, math.ceil(wait))
        query = {
            "wait_for_change": "true",
            "timeout_sec": str(timeout_sec),
            "last_etag": self._etag,
        }
        return self._get(query, extra=timeout_sec)

    def check(self, wait: float = 0) -> Notice | None:
        """The preemption showing now, or None.

        Args:
            wait: When > 0, long-poll for up to this many seconds (rounded up).

        Raises:
            WatcherError: When the path could not be checked.
        """
        self.warning = None
        value = self._read(wait)
        if value == "FALSE":
            self._first_seen.clear()
            return None
        detail: dict[str, object] = {"preempted": value[:200]}
        if value != "TRUE":
            self.warning = (
                f"GET {self.metadata.url(GCP_PREEMPTED_PATH)} returned {value[:80]!r}, "
                f"expected TRUE or FALSE; treated as a preemption due "
                f"{GCP_PREEMPT_GRACE_S:g}s after it was first seen"
            )
            detail["unreadable"] = True
        seen_at = self._first_seen.mark(value, self._clock())
        return Notice(
            SOURCE,
            NoticeKind.PREEMPTED,
            seen_at + GCP_PREEMPT_GRACE_S,
            seen_at=seen_at,
            detail=detail,
            id=value,
        )

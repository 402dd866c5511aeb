"""The AWS Auto Scaling lifecycle monitor: the group is about to terminate this VM."""

from __future__ import annotations

from .aws_imds import AWS_LIFECYCLE_PATH, ImdsSession
from .metadata_http import FirstSeen
from .notice import Notice, NoticeKind

SOURCE = "aws-imds:asg"
# Auto Scaling gives no deadline with "Terminated". Its default lifecycle-hook timeout is
# 3600 s, but an instance without a hook goes at once, so assume little: two minutes, the
# same warning a spot interruption gets.
DEFAULT_ASG_GRACE_S = 120.0


class AsgLifecycleMonitor:
    """Reads ``autoscaling/target-lifecycle-state``; a VM is terminated once, so the
    notice's id is the state itself.

    Args:
        session: The IMDS session.
        grace: Seconds from first seeing "Terminated" to the assumed deadline.

    Raises:
        ValueError: On a negative grace.
    """

    def __init__(self, session: ImdsSession, grace: float = DEFAULT_ASG_GRACE_S) -> None:
        if not grace >= 0:
            raise ValueError(f"asg_grace must be >= 0 seconds, got {grace!r}")
        self.session = session
        self.grace = grace
        self._first_seen = FirstSeen()

    def check(self, now: float) -> Notice | None:
        """The scale-in showing now, or None.

        Raises:
            WatcherError: When the path could not be checked.
        """
        resp = self.session.get(AWS_LIFECYCLE_PATH)
        state = resp.text()
        if resp.status == 404 or state != "Terminated":
            self._first_seen.clear()
            return None
        seen_at = self._first_seen.mark(state, now)
        return Notice(
            SOURCE,
            NoticeKind.SCALE_IN,
            seen_at + self.grace,
            seen_at=seen_at,
            detail={"state": state},
            id=state,
        )

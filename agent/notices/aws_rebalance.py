"""The AWS rebalance recommendation monitor: elevated interruption risk, no deadline."""

from __future__ import annotations

from .aws_imds import AWS_REBALANCE_PATH, ImdsSession
from .metadata_http import FirstSeen, request_error
from .notice import Notice, NoticeKind

SOURCE = "aws-imds:rebalance"


class RebalanceMonitor:
    """Reads ``events/recommendations/rebalance``; the notice's id is its ``noticeTime``."""

    def __init__(self, session: ImdsSession) -> None:
        self.session = session
        self._first_seen = FirstSeen()

    def check(self, now: float) -> Notice | None:
        """The recommendation showing now, or None.

        Raises:
            WatcherError: When the path could not be checked or its answer makes no sense.
        """
        resp = self.session.get(AWS_REBALANCE_PATH)
        if resp.status == 404:
            self._first_seen.clear()
            return None
        data = self.session.json_object(AWS_REBALANCE_PATH, resp)
        notice_time = data.get("noticeTime")
        if not isinstance(notice_time, str):
            raise request_error(
                "GET",
                self.session.url(AWS_REBALANCE_PATH),
                f"returned no noticeTime string: {resp.text()!r}",
            )
        seen_at = self._first_seen.mark(notice_time, now)
        return Notice(
            SOURCE,
            NoticeKind.REBALANCE,
            None,
            seen_at=seen_at,
            detail={"noticeTime": notice_time},
            id=notice_time,
        )

"""The AWS spot instance-action monitor: the two-minute interruption warning.

A 200 on the spot path whose body is not the documented ``{"action", "time"}`` (bad JSON, an
unknown action, a bad time) is still a terminate notice, due two minutes after it was first
seen (or at its ``time``, if that is readable and sooner), with the problem in
:attr:`SpotActionMonitor.warning`: IMDS serves that path only during an interruption, and
ignoring it would lose the emergency checkpoint.
"""

from __future__ import annotations

import json
from typing import Any

from .aws_imds import AWS_SPOT_PATH, ImdsSession, parse_aws_time
from .metadata_http import FirstSeen, HttpResponse, WatcherError, request_error
from .notice import Notice, NoticeKind

SOURCE = "aws-imds:spot"
# AWS documents a two-minute warning between the spot interruption notice and the action.
AWS_SPOT_WARNING_S = 120.0

_AWS_ACTIONS = {
    "terminate": NoticeKind.TERMINATE,
    "stop": NoticeKind.STOP,
    "hibernate": NoticeKind.HIBERNATE,
}


def _readable_spot_time(resp: HttpResponse) -> float | None:
    """The ``time`` of a spot notice whose other fields are wrong, if that one is fine."""
    try:
        data = json.loads(resp.body)
        return parse_aws_time(data.get("time")) if isinstance(data, dict) else None
    except ValueError:
        return None


class SpotActionMonitor:
    """Reads ``spot/instance-action``; the notice's id is its action and time.

    Attributes:
        warning: What was wrong with the last notice read, when it could not be read but
            still counts as one; None otherwise.
    """

    def __init__(self, session: ImdsSession) -> None:
        self.session = session
        self.warning: str | None = None
        self._first_seen = FirstSeen()

    def check(self, now: float) -> Notice | None:
        """The spot notice showing now, or None.

        Raises:
            WatcherError: When the path could not be checked.
        """
        self.warning = None
        resp = self.session.get(AWS_SPOT_PATH)
        if resp.status == 404:
            self._first_seen.clear()
            return None
        # Only a notice is ever served here (404 otherwise), so a 200 we cannot read is still
        # a notice: dropping it would skip the emergency checkpoint the warning exists for.
        try:
            action, kind, when, deadline = self._parse(resp)
        except WatcherError as exc:
            return self._unreadable(resp, exc, now)
        detail: dict[str, Any] = {"action": action, "time": when}
        event_id = f"{action} {when}"
        seen_at = self._first_seen.mark(event_id, now)
        if deadline < seen_at:
            detail["late"] = True
        return Notice(SOURCE, kind, deadline, seen_at=seen_at, detail=detail, id=event_id)

    def _unreadable(self, resp: HttpResponse, exc: WatcherError, now: float) -> Notice:
        event_id = f"unreadable {resp.text()}"
        seen_at = self._first_seen.mark(event_id, now)
        self.warning = (
            f"{exc.problem}; treated as a terminate notice due "
            f"{AWS_SPOT_WARNING_S:g}s after it was first seen"
        )
        deadline = seen_at + AWS_SPOT_WARNING_S
        stated = _readable_spot_time(resp)
        if stated is not None:
            # An action we do not know yet still comes with AWS's own deadline.
            deadline = min(deadline, stated)
        return Notice(
            SOURCE,
            NoticeKind.TERMINATE,
            deadline,
            seen_at=seen_at,
            detail={"unreadable": True, "body": resp.text()[:200]},
            id=event_id,
        )

    def _parse(self, resp: HttpResponse) -> tuple[str, NoticeKind, str, float]:
        """Reads a spot notice's action, kind, raw time and deadline.

        Raises:
            WatcherError: On a body that is not the documented ``{"action", "time"}``.
        """
        data = self.session.json_object(AWS_SPOT_PATH, resp)
        action = data.get("action")
        kind = _AWS_ACTIONS.get(action) if isinstance(action, str) else None
        if kind is None or not isinstance(action, str):
            raise request_error(
                "GET",
                self.session.url(AWS_SPOT_PATH),
                f"returned unknown action {action!r} (expected terminate, stop or hibernate)",
            )
        try:
            deadline = parse_aws_time(data.get("time"))
        except ValueError as exc:
            raise request_error(
                "GET", self.session.url(AWS_SPOT_PATH), f"returned a bad time: {exc}"
            ) from None
        return action, kind, str(data["time"]), deadline

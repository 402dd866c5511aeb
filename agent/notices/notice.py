"""What a preemption notice is, whatever source it came from.

Monitors only detect: each turns what its source says into :class:`Notice` values. The
agent's notice handler (:mod:`.handler`) decides what to do with them (drain or early
checkpoint), dedups them by the event's own id, and acts against their deadline.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class NoticeKind(StrEnum):
    """What the cloud (or the operator) is about to do to the VM."""

    TERMINATE = "terminate"  # AWS spot interruption, action terminate
    STOP = "stop"  # AWS spot interruption, action stop
    HIBERNATE = "hibernate"  # AWS spot interruption, action hibernate
    REBALANCE = "rebalance"  # AWS rebalance recommendation: elevated risk, no deadline
    SCALE_IN = "scale-in"  # AWS Auto Scaling target lifecycle state "Terminated"
    PREEMPTED = "preempted"  # GCP instance/preempted turned TRUE
    MAINTENANCE = "maintenance"  # GCP maintenance-event TERMINATE_ON_HOST_MAINTENANCE
    SIGTERM = "sigterm"  # the agent was sent SIGTERM (ACPI shutdown, systemd stop)
    INJECTED = "injected"  # a notice written to Redis (the controller, operators, tests)

    @property
    def drains(self) -> bool:
        """Whether the node must leave: everything but a rebalance recommendation."""
        return self is not NoticeKind.REBALANCE

    @property
    def reclaims(self) -> bool:
        """Whether the cloud takes the VM back (a spot interruption, a preemption, a
        maintenance that terminates it): the node's drain is a preemption survived."""
        return self in _RECLAIMS


_RECLAIMS = frozenset(
    {
        NoticeKind.TERMINATE,
        NoticeKind.STOP,
        NoticeKind.HIBERNATE,
        NoticeKind.PREEMPTED,
        NoticeKind.MAINTENANCE,
    }
)


@dataclass(frozen=True)
class Notice:
    """One notice as a monitor saw it.

    Attributes:
        source: Which monitor saw it ("aws-imds:spot", "aws-imds:rebalance", "aws-imds:asg",
            "gcp:preempted", "gcp:maintenance", "signal", "redis").
        kind: What is about to happen.
        deadline: Unix seconds by which the VM goes away, or None when the source gives no
            time (a rebalance recommendation).
        seen_at: Unix seconds when the watcher saw it.
        detail: What the source said, for the event log (raw action, notice time, ...).
        id: The event's own identity within its source (a spot notice's action and time, a
            rebalance recommendation's noticeTime, an injected notice's body); empty for a
            source whose events carry none (a signal, a notice made in code), which then
            stands for one event per kind. Not part of the event log's notice fields.
    """

    source: str
    kind: NoticeKind
    deadline: float | None
    seen_at: float = field(default_factory=time.time)
    detail: dict[str, Any] = field(default_factory=dict)
    id: str = ""

    @property
    def drains(self) -> bool:
        return self.kind.drains

    @property
    def dedup_key(self) -> tuple[str, str]:
        """Notices with the same key are one event seen again (monitors re-poll)."""
        return (self.source, self.id or self.kind.value)

    def seconds_left(self, now: float | None = None) -> float | None:
        if self.deadline is None:
            return None
        return self.deadline - (time.time() if now is None else now)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "kind": self.kind.value,
            "deadline": self.deadline,
            "seen_at": self.seen_at,
            "detail": self.detail,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Notice:
        return cls(
            source=str(d["source"]),
            kind=NoticeKind(d["kind"]),
            deadline=None if d.get("deadline") is None else float(d["deadline"]),
            seen_at=float(d.get("seen_at", time.time())),
            detail=dict(d.get("detail") or {}),
            id=str(d.get("id") or ""),
        )

"""How the local cloud behaves: :class:`LocalSettings`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class LocalSettings:
    """How the local cloud behaves.

    Attributes:
        state_dir: where the cloud keeps its records and VM logs.
        zones: zone name -> how many VMs it holds (the default capacity; ``set_capacity``
            overrides it while the state directory lives).
        launch_latency_s: seconds a VM stays pending before its boot command starts.
        notice_s: the notice window: how long a VM preempted with notice, or deleted, has
            between its SIGTERM and its death.
    """

    state_dir: Path
    zones: Mapping[str, int] = field(default_factory=lambda: {"local-a": 64})
    launch_latency_s: float = 0.0
    notice_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.zones:
            raise ValueError("the local cloud needs at least one zone")
        for zone, cap in self.zones.items():
            if cap < 0:
                raise ValueError(f"zone {zone}: capacity must be >= 0, got {cap}")
        if not 0 <= self.launch_latency_s <= 3600:
            raise ValueError(f"launch_latency_s must be in [0, 3600], got {self.launch_latency_s}")
        if not 0 < self.notice_s <= 600:
            raise ValueError(f"notice_s must be in (0, 600], got {self.notice_s}")

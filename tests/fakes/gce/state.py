"""The state every part of the fake keeps, declared once: each resource's mixin reads and
writes these attributes of the one :class:`~fakes.gce.server.GceFake`, always under its lock."""

from __future__ import annotations

import itertools
import random
import threading
from collections import Counter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .faults import Faults
    from .operations import Operation
    from .reconcile import Group


class GceState:
    project: str
    boot_delay: float
    op_polls_until_done: int
    page_size: int
    auto_reconcile: bool
    internal_errors: list[str]
    _lock: threading.Lock
    _machine_types: dict[str, set[str]]  # zone -> machine types
    _instances: dict[str, dict[str, dict[str, Any]]]  # zone -> name -> body
    _stepped_at: dict[tuple[str, str], float]  # (zone, name) -> when its status last moved
    _operations: dict[str, dict[str, Operation]]  # zone ("" global) -> name -> op
    _faults: Faults
    _unknown_images: set[str]
    _calls: Counter[str]
    _hosts: Counter[str]
    _inserted: list[dict[str, Any]]
    _ids: itertools.count[int]
    _templates: dict[str, dict[str, Any]]  # name -> body
    _groups: dict[str, dict[str, Group]]  # zone -> name -> group
    _group_calls: dict[str, list[str]]  # group name -> methods, in order
    _rng: random.Random

"""A fake of the Compute Engine v1 REST API over real HTTP (see :mod:`.server`)."""

from .common import API, DEFAULT_PROJECT, PREEMPTED, ApiError
from .listing import parse_filter
from .server import GceFake

__all__ = ["API", "DEFAULT_PROJECT", "PREEMPTED", "ApiError", "GceFake", "parse_filter"]

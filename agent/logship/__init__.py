"""Shipping a node's output to the run's object store, so it outlives the VM.

The node's output (the agent's own lines, torchrun's and the workers') is appended to a file
(the systemd unit's ``StandardOutput=append:``, the local VM's console file); a thread of
the agent tails that file, cuts it into gzip chunks of whole lines by size and by time, and
a second thread uploads them under ``spottrain.protocol.node_logs``'s names. Training and
the emergency checkpoint never wait on it: nothing here sits in the workers' pipes, and a
store that falls behind costs the oldest unshipped output, never memory without bound.
"""

from __future__ import annotations

from .chunker import Chunker
from .settings import ShipSettings, add_logs_args, ship_settings
from .shipper import LogShipper, start_shipper

__all__ = [
    "Chunker",
    "LogShipper",
    "ShipSettings",
    "add_logs_args",
    "ship_settings",
    "start_shipper",
]

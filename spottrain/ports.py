"""A free TCP port on 127.0.0.1, once for the whole house."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now. It is released before it is returned, so another process may
    take it before the caller binds it: callers that cannot retry should bind port 0."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])

"""Named points in the save path where a test can have the writer SIGKILL itself.

The crash-consistency tests set ``SPOTTRAIN_FAILPOINT=<name>[:<nth>]`` in a writer process:
the ``nth`` time (default 1) the save passes ``<name>``, the process dies on the spot, as if
the VM vanished there. Unset, a failpoint costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

from spottrain.protocol.env import ENV_FAILPOINT

_spec = os.environ.get(ENV_FAILPOINT, "")
_name, _, _nth = _spec.partition(":")
_remaining = int(_nth) if _nth else 1


def failpoint(name: str) -> None:
    """Die here if this failpoint is armed and its turn has come."""
    global _remaining
    if not _spec or name != _name:
        return
    _remaining -= 1
    if _remaining <= 0:
        os.kill(os.getpid(), signal.SIGKILL)


def armed() -> str:
    """The armed failpoint spec, or "" (for logs)."""
    return _spec

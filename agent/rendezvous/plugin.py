"""torchrun's entry point for ``--rdzv-backend=redis``.

torchrun loads this module while ``torch.distributed.elastic.rendezvous`` is still being
imported, then calls :func:`get_handler_creator` with no arguments and registers what it
returns. Importing the handler (which imports that package) here at module level would make
torch skip the plugin with only a warning, so the import waits until a handler is created.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _create(params: Any) -> Any:
    from .handler import create_handler

    return create_handler(params)


def get_handler_creator() -> Callable[[Any], Any]:
    """Return the creator torchrun registers under the name ``redis``."""
    return _create

"""What every ``spottrain`` command shares: exit codes, how it speaks, a run's state."""

from __future__ import annotations

import sys

from spottrain.controller.reconcile.state import RunState
from spottrain.controller.run.records import RunError, RunInfo
from spottrain.controller.run.run_redis import open_redis
from spottrain.protocol.keys import RunKeys
from spottrain.safetext import escape_lines

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_WINDOW = 3


def err(msg: str) -> None:
    """``msg`` on stderr; control characters escaped (see :func:`say`)."""
    print(f"spottrain: {escape_lines(msg)}", file=sys.stderr)


def say(line: str) -> None:
    """``line`` on stdout, every control character but newline and tab escaped: its parts
    may come from a node (a state, a reason, an event), and any node can write the run's
    Redis."""
    print(escape_lines(line), flush=True)


def run_state(info: RunInfo) -> RunState | None:
    """The run's state in its Redis; None when that Redis does not answer."""
    try:
        return RunState(open_redis(info, info.spec()), RunKeys(info.run_id))
    except RunError:
        return None

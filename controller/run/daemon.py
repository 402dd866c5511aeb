"""``python -m spottrain.controller.run.daemon RUN_ID [READY_FD]``: a run's controller in the
background (what ``spottrain up --detach`` starts). Its output goes to the run's
``controller.log``; ``READY_FD`` (a pipe from
:func:`~spottrain.controller.run.wiring.spawn_controller`) hears once whether it holds the
run's lease. The run id rides in its argv as the run's marker
(:mod:`spottrain.controller.run.processes`)."""

from __future__ import annotations

import logging
import signal
import sys
from types import FrameType
from typing import Any

from spottrain.controller.run.drive import drive_run
from spottrain.controller.run.records import RunError, RunInfo
from spottrain.controller.run.wiring import READY, ready_reporter


def exit_on_sigterm() -> Any:
    """SIGTERM (``spottrain down``) ends the controller through its ``finally`` blocks, so
    it lets go of the run's lease at once rather than when the lease lapses. Returns the
    handler it replaced."""

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, stop)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2) or (len(args) == 2 and not args[1].isdigit()):
        print("usage: python -m spottrain.controller.run.daemon RUN_ID [READY_FD]", file=sys.stderr)
        return 2
    report = ready_reporter(int(args[1]) if len(args) == 2 else None)

    def tell(line: str) -> None:
        if line != READY:
            print(f"spottrain controller: {line}", flush=True)
        report(line)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        info = RunInfo.load(args[0])
    except RunError as e:
        tell(str(e))
        return 2
    exit_on_sigterm()
    return drive_run(info, view=lambda line: print(line, flush=True), on_claim=tell)


if __name__ == "__main__":
    raise SystemExit(main())

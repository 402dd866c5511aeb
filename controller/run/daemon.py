"""``python -m spottrain.controller.run.daemon RUN_ID``: a run's controller in the background
(what ``spottrain up --detach`` starts). Its output goes to the run's ``controller.log``."""

from __future__ import annotations

import logging
import sys

from spottrain.controller.run.drive import drive_run
from spottrain.controller.run.records import RunError, RunInfo


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m spottrain.controller.run.daemon RUN_ID", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        info = RunInfo.load(args[0])
    except RunError as e:
        print(f"spottrain controller: {e}", file=sys.stderr)
        return 2
    return drive_run(info, view=lambda line: print(line, flush=True))


if __name__ == "__main__":
    raise SystemExit(main())

"""``spottrain report RUN``: a run's timeline as a PNG and a text summary (see
:mod:`spottrain.controller.report`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# The run and report modules (and matplotlib) are imported where they are used:
# `spottrain --help` builds this command's parser and should stay quick.

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``report`` to the ``spottrain`` subcommands (``sub``: from ``add_subparsers``)."""
    p: argparse.ArgumentParser = sub.add_parser(
        "report",
        help="a run's timeline (world size, step rate, preemptions, cost) as a PNG, and a summary",
    )
    p.add_argument("run", nargs="?", help="run id or job name (default: the newest run)")
    p.add_argument(
        "--png", metavar="PATH", help="where to write the PNG (default: RUN_DIR/report.png)"
    )
    p.add_argument("--json", action="store_true", help="print the panels' data as JSON")
    p.set_defaults(func=command)
    return p


def _err(msg: str) -> None:
    print(f"spottrain: {msg}", file=sys.stderr)


def command(args: argparse.Namespace) -> int:
    """``spottrain report``: 0 done, 1 nothing to report or the PNG not written, 2 no such
    run or a PNG path in a missing directory."""
    from spottrain.controller.report.model import NoReportData
    from spottrain.controller.report.png import render_png
    from spottrain.controller.report.text import text_summary
    from spottrain.controller.run.archive import load_report_data
    from spottrain.controller.run.records import RunError, find_run

    try:
        info = find_run(args.run)
    except RunError as e:
        _err(str(e))
        return EXIT_BAD_INPUT
    png = Path(args.png) if getattr(args, "png", None) else info.dir / "report.png"
    if not png.parent.is_dir():
        _err(f"cannot write {png}: directory {png.parent} does not exist")
        return EXIT_BAD_INPUT
    try:
        data = load_report_data(info)
    except NoReportData as e:
        _err(str(e))
        return EXIT_FAILED
    code = EXIT_OK
    written: str | None = None
    try:
        written = str(render_png(data, png))
    except ImportError as e:
        _err(str(e))
        code = EXIT_FAILED
    except OSError as e:
        _err(f"cannot write {png}: {e.strerror or e}")
        code = EXIT_FAILED
    if args.json:
        print(json.dumps({**data.to_json(), "png": written}))
    else:
        print(text_summary(data))
        if written:
            print(f"  timeline      {written}")
    return code

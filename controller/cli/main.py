"""``spottrain``: the workstation command line.

Exit codes a script can rely on:

- 0: done (for ``validate``: the spec is valid and every notice window fits);
- 1: the command failed at run time (a cloud or Redis refused, see the message; for
  ``validate --check-clouds``: a cloud could not be asked or offers nothing that fits);
- 2: bad input (an invalid spec, a bad argument), nothing was changed;
- 3: ``validate`` and ``up`` (without ``--force``): the spec is valid but an emergency
  checkpoint does not fit some allowed cloud's notice window; ``up`` launched nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from spottrain.controller.cli.common import EXIT_BAD_INPUT, EXIT_OK
from spottrain.controller.cli.parser import build_parser

__all__ = ["build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # a bad argument (said in one line), --help or --version
        return e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
    if args.command == "validate":
        from spottrain.controller.cli.validate import validate

        return validate(args)
    if args.command == "local":
        from spottrain.controller.cli.local import local

        return local(args)
    if args.command == "report":
        from spottrain.controller.cli import report

        return report.command(args)
    if args.command == "simulate":
        from spottrain.controller.sim import command as simulate

        return simulate.command(args)
    if args.command == "lock":
        from spottrain.controller.cli import lock

        return lock.command(args)
    if args.command == "down":
        from spottrain.controller.cli.down import down

        return down(args)
    if args.command in ("up", "resume", "status", "logs", "scale"):
        from spottrain.controller.cli import commands

        handler = getattr(commands, args.command)
        code: int = handler(args)
        return code
    parser.print_help()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

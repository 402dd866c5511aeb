"""The ``spottrain`` argument parser: one function per subcommand (flags, help, defaults),
and the ``type=`` functions that check every value as it is parsed (:func:`finite`,
:func:`seconds`, :func:`seconds_or_zero`, :func:`count`, :func:`node_name`,
:func:`vm_id`). A bad value ends the command with exit 2 and one line that names it and
what to give instead."""

from __future__ import annotations

import argparse
import math
from typing import Any, NoReturn

from spottrain import __version__
from spottrain.controller.cli import lock, report
from spottrain.controller.cli.common import EXIT_BAD_INPUT
from spottrain.controller.sim import command as simulate
from spottrain.protocol.node_logs import node_prefix

_RUN_HELP = "run id or job name (default: the newest run)"


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose refusal is one line (argparse prints the whole usage first,
    which buries the cause), pointing at ``--help`` for the rest."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: {message} (`{self.prog} --help` says more)\n")


def _number(value: str, kind: type[int] | type[float], what: str, example: str) -> float:
    """``value`` as a finite ``kind``; the refusal names what to give instead."""
    try:
        n = kind(value)
    except ValueError:
        n = math.nan
    if not math.isfinite(n):
        raise argparse.ArgumentTypeError(f"{value!r} is not {what}: give one such as {example}")
    return n


def finite(value: str) -> float:
    """A finite number; its range is the command's to check (and to explain)."""
    return _number(value, float, "a finite number", "120")


def seconds(value: str) -> float:
    """A wait between polls or passes: seconds, finite and above 0."""
    s = _number(value, float, "a finite number of seconds", "2 or 0.5")
    if s <= 0:
        raise argparse.ArgumentTypeError(f"{value} seconds: give a number above 0, such as 2")
    return s


def seconds_or_zero(value: str) -> float:
    """A time limit: seconds, finite, 0 (do not wait) or more."""
    s = _number(value, float, "a finite number of seconds", "120")
    if s < 0:
        raise argparse.ArgumentTypeError(f"{value} seconds: give 0 or more, such as 120")
    return s


def count(value: str) -> int:
    """A count (nodes, lines, VMs): a whole number, 0 or more."""
    n = int(_number(value, int, "a whole number", "3"))
    if n < 0:
        raise argparse.ArgumentTypeError(f"{value}: give a whole number, 0 or more")
    return n


def node_name(value: str) -> str:
    """A node of a run as its logs name it (n0, n1, ...): never a path."""
    try:
        node_prefix("run", value)  # the one check of what a node's name may hold
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a node's name: give one that `spottrain status RUN` lists "
            "(n0, n1, ...)"
        ) from None
    return value


def check_vm_id(value: str) -> str:
    """``value`` when it can be a VM's id (as a cloud or the local cloud spells it), which
    names a file or an object: not empty, no '/', no control character, not '.' or '..'.

    Raises:
        ValueError: it cannot.
    """
    if value in ("", ".", "..") or "/" in value or "\\" in value or not value.isprintable():
        raise ValueError(
            f"{value!r} is not a VM's id: give one that `spottrain logs RUN --node N` names"
        )
    return value


def vm_id(value: str) -> str:
    """``--vm``: :func:`check_vm_id` for argparse."""
    try:
        return check_vm_id(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="spottrain",
        description="Train large models on spot GPU VMs as if they were reliable machines.",
        epilog="Exit codes: 0 done, 1 failed at run time, 2 bad input, 3 (validate, up) a "
        "checkpoint does not fit a notice window.",
    )
    parser.add_argument("--version", action="version", version=f"spottrain {__version__}")
    sub: Any = parser.add_subparsers(dest="command")
    _add_validate(sub)
    _add_up(sub)
    _add_run_commands(sub)
    _add_down(sub)
    _add_scale(sub)
    report.add_parser(sub)
    simulate.add_parser(sub)
    lock.add_parser(sub)
    _add_local(sub)
    return parser


def _add_validate(sub: Any) -> None:
    v = sub.add_parser(
        "validate",
        help="check a job spec without launching anything",
        description="Check a job spec: every key and value, the instance types and regions "
        "against the bundled catalog, and whether an emergency checkpoint of the job's "
        "estimated size fits each allowed cloud's notice window (AWS 120 s, GCP 30 s).",
    )
    v.add_argument("spec", help="the job's YAML file")
    v.add_argument("--json", action="store_true", help="print the result as one JSON object")
    v.add_argument(
        "--check-clouds",
        action="store_true",
        help="also ask each allowed cloud for its offers (needs credentials; launches nothing)",
    )


def _add_up(sub: Any) -> None:
    up = sub.add_parser(
        "up",
        help="launch a job and keep its fleet at size until training finishes",
        description="Start a run of the job: its Redis (embedded for the local cloud), its "
        "code archive, and the controller, which bids for VMs, backfills preemptions and "
        "shows a live view. Exit 0 when training finished, 1 when the run stopped before "
        "(budget, crash loop, a cloud or Redis refusing), 2 on bad input, 3 when an "
        "emergency checkpoint does not fit a notice window (as `validate` says; nothing "
        "launched unless --force).",
    )
    up.add_argument("spec", help="the job's YAML file")
    up.add_argument(
        "--force",
        action="store_true",
        help="launch even when an emergency checkpoint does not fit a notice window (the "
        "run's events record a warning)",
    )
    up.add_argument(
        "--detach", action="store_true", help="run the controller in the background and return"
    )
    up.add_argument("--interval", type=seconds, default=1.0, help="seconds between passes")
    up.add_argument(
        "--env-lock",
        action="append",
        metavar="[CLOUD=]FILE",
        help="install this lock (from `spottrain lock`) on the cloud's VMs instead of "
        "resolving one now; repeat for each cloud",
    )


def _add_run_commands(sub: Any) -> None:
    """``resume``, ``status`` and ``logs``: each names a run."""
    resume = sub.add_parser(
        "resume", help="start the controller of an existing run again (after a crash or Ctrl-C)"
    )
    resume.add_argument("run", nargs="?", help=_RUN_HELP)
    resume.add_argument("--detach", action="store_true")
    resume.add_argument("--interval", type=seconds, default=1.0, help="seconds between passes")
    status = sub.add_parser("status", help="a run's nodes, step, loss, preemptions and cost")
    status.add_argument("run", nargs="?", help=_RUN_HELP)
    status.add_argument("--json", action="store_true")
    status.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="keep showing the run until it ends (a terminal: one view redrawn in place; "
        "else the plain lines, or one JSON object per refresh with --json)",
    )
    status.add_argument("--interval", type=seconds, default=2.0, help="seconds between refreshes")
    logs = sub.add_parser("logs", help="a run's event stream, or a node's training output")
    logs.add_argument("run", nargs="?", help=_RUN_HELP)
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new events")
    logs.add_argument("--node", type=node_name, help="print this node's training output instead")
    logs.add_argument(
        "--vm", type=vm_id, help="with --node: only this VM's output (one of the node's VMs)"
    )
    logs.add_argument(
        "--interval", type=seconds, default=3.0, help="with --node -f: seconds between polls"
    )
    logs.add_argument(
        "--tail",
        type=int,  # 0 or more, checked by the command, which says of what (lines, events)
        metavar="N",
        help="only the last N events (with --node: the node's last N lines), then with -f "
        "what comes after",
    )


def _add_down(sub: Any) -> None:
    down = sub.add_parser(
        "down",
        help="end a run: every node drained (an emergency checkpoint), then every VM "
        "terminated (and checked), its controller stopped",
    )
    down.add_argument("run", nargs="?", help=_RUN_HELP)
    down.add_argument(
        "--timeout", type=seconds_or_zero, default=120.0, help="seconds to wait for VMs"
    )
    down.add_argument(
        "--drain-timeout",
        type=finite,  # 0 or more, checked by `down`, which names --now as the other way
        default=None,
        help="seconds to wait for the nodes' drains (an emergency checkpoint each) before "
        "their VMs end (default: the notice window + 30)",
    )
    down.add_argument(
        "--now", action="store_true", help="end the VMs at once, without draining them first"
    )


def _add_scale(sub: Any) -> None:
    scale = sub.add_parser(
        "scale",
        help="change how many nodes a run keeps (a Terraform fleet's group size follows)",
        description="Set the run's node count between the spec's nodes.min and nodes.max. "
        "The controller grows the fleet (a Terraform fleet by its group's size) or drains and "
        "removes the nodes it chooses, one checkpoint each, never letting a group pick.",
    )
    scale.add_argument("nodes", type=count, help="the node count to keep")
    scale.add_argument("run", nargs="?", help=_RUN_HELP)


def _add_local(sub: Any) -> None:
    local = sub.add_parser(
        "local", help="the local cloud's levers: list VMs, preempt, set capacity, refuse"
    )
    local.add_argument(
        "--state-dir",
        default=None,
        help="the local cloud's directory (default: $SPOTTRAIN_HOME/local)",
    )
    lsub = local.add_subparsers(dest="local_command")
    vms = lsub.add_parser("vms", help="list the local cloud's VMs")
    vms.add_argument("--job", help="only this run id")
    pre = lsub.add_parser("preempt", help="preempt VMs (with the notice window, or without)")
    pre.add_argument("vms", nargs="+", help="VM ids (see `spottrain local vms`)")
    pre.add_argument("--no-notice", action="store_true", help="kill at once, with no notice")
    cap = lsub.add_parser("capacity", help="set how many VMs a zone holds (0: a stockout)")
    cap.add_argument("zone")
    cap.add_argument("n", type=count, help="VMs the zone holds, 0 or more")
    ref = lsub.add_parser("refuse", help="make every call of the local cloud fail")
    ref.add_argument("kind", choices=["auth", "quota", "transient", "none"])

"""The ``spottrain`` argument parser: one function per subcommand (flags, help, defaults)."""

from __future__ import annotations

import argparse
from typing import Any

from spottrain import __version__
from spottrain.controller.cli import lock, report
from spottrain.controller.sim import command as simulate

_RUN_HELP = "run id or job name (default: the newest run)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spottrain",
        description="Train large models on spot GPU VMs as if they were reliable machines.",
        epilog="Exit codes: 0 done, 1 failed at run time, 2 bad input, 3 (validate, up) a "
        "checkpoint does not fit a notice window.",
    )
    parser.add_argument("--version", action="version", version=f"spottrain {__version__}")
    sub = parser.add_subparsers(dest="command")
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
    up.add_argument("--interval", type=float, default=1.0, help="seconds between passes")
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
    resume.add_argument("--interval", type=float, default=1.0)
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
    status.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    logs = sub.add_parser("logs", help="a run's event stream, or a node's training output")
    logs.add_argument("run", nargs="?", help=_RUN_HELP)
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new events")
    logs.add_argument("--node", help="print this node's training output instead")
    logs.add_argument("--vm", help="with --node: only this VM's output (one of the node's VMs)")
    logs.add_argument(
        "--interval", type=float, default=3.0, help="with --node -f: seconds between polls"
    )
    logs.add_argument(
        "--tail",
        type=int,
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
    down.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for VMs")
    down.add_argument(
        "--drain-timeout",
        type=float,
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
    scale.add_argument("nodes", type=int, help="the node count to keep")
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
    cap.add_argument("n", type=int)
    ref = lsub.add_parser("refuse", help="make every call of the local cloud fail")
    ref.add_argument("kind", choices=["auth", "quota", "transient", "none"])

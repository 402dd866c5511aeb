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

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from spottrain import __version__

if TYPE_CHECKING:
    from spottrain.spec import JobSpec

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_WINDOW = 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spottrain",
        description="Train large models on spot GPU VMs as if they were reliable machines.",
        epilog="Exit codes: 0 done, 1 failed at run time, 2 bad input, 3 (validate, up) a "
        "checkpoint does not fit a notice window.",
    )
    parser.add_argument("--version", action="version", version=f"spottrain {__version__}")
    sub = parser.add_subparsers(dest="command")

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
    resume = sub.add_parser(
        "resume", help="start the controller of an existing run again (after a crash or Ctrl-C)"
    )
    resume.add_argument("run", nargs="?", help="run id or job name (default: the newest run)")
    resume.add_argument("--detach", action="store_true")
    resume.add_argument("--interval", type=float, default=1.0)
    status = sub.add_parser("status", help="a run's nodes, step, loss, preemptions and cost")
    status.add_argument("run", nargs="?", help="run id or job name (default: the newest run)")
    status.add_argument("--json", action="store_true")
    logs = sub.add_parser("logs", help="a run's event stream, or a node's training output")
    logs.add_argument("run", nargs="?", help="run id or job name (default: the newest run)")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new events")
    logs.add_argument("--node", help="print this node's training output instead")
    down = sub.add_parser(
        "down",
        help="end a run: every node drained (an emergency checkpoint), then every VM "
        "terminated (and checked), its controller stopped",
    )
    down.add_argument("run", nargs="?", help="run id or job name (default: the newest run)")
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

    scale = sub.add_parser(
        "scale",
        help="change how many nodes a run keeps (a Terraform fleet's group size follows)",
        description="Set the run's node count between the spec's nodes.min and nodes.max. "
        "The controller grows the fleet (a Terraform fleet by its group's size) or drains and "
        "removes the nodes it chooses, one checkpoint each, never letting a group pick.",
    )
    scale.add_argument("nodes", type=int, help="the node count to keep")
    scale.add_argument("run", nargs="?", help="run id or job name (default: the newest run)")

    from spottrain.controller import report, simulate

    report.add_parser(sub)
    simulate.add_parser(sub)
    from spottrain.controller import env_lock

    env_lock.add_parser(sub)

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
    return parser


def _validate(args: argparse.Namespace) -> int:
    from spottrain.exposure import exposure_warnings
    from spottrain.spec import SpecError, check_notice_windows, load_spec

    try:
        loaded = load_spec(args.spec)
    except SpecError as e:
        if args.json:
            print(json.dumps({"valid": False, "source": e.source, "problems": e.problems}))
        else:
            print(str(e), file=sys.stderr)
        return EXIT_BAD_INPUT
    spec = loaded.spec
    checks = check_notice_windows(spec)
    size = spec.checkpoint.estimated_gb
    gbps = spec.checkpoint.volume.write_gbps
    fits = all(c.fits for c in checks)
    warnings = exposure_warnings(spec)
    if args.json:
        print(
            json.dumps(
                {
                    "valid": True,
                    "name": spec.name,
                    "checkpoint_gb": size,
                    "windows": [
                        {
                            "cloud": c.cloud,
                            "window_s": c.window_s,
                            "write_s": round(c.write_s, 3),
                            "fits": c.fits,
                        }
                        for c in checks
                    ],
                    "warnings": warnings,
                }
            )
        )
    else:
        print(f"{loaded.source}: valid job spec for {spec.name!r}")
        print(
            f"  nodes {spec.nodes.min}-{spec.nodes.max} x {spec.nodes.gpus} GPUs, "
            f"clouds {', '.join(spec.resources.clouds)}, spot policy {spec.spot.policy.value}, "
            f"budget ${spec.budget.max_usd:,.2f}"
        )
        if spec.fleet is not None:
            f = spec.fleet
            where = f.region if f.cloud == "aws" else f"{f.project}/{f.zone}"
            print(
                f"  fleet: the {f.cloud} group {f.group} in {where}, made by Terraform, "
                f"adopted as run {f.run_id}"
            )
        if size is None:
            print(
                "  emergency checkpoint: size unknown (set checkpoint.size_gb or "
                "checkpoint.params to check it against the notice windows)"
            )
        for c in checks:
            assert size is not None
            print("  " + c.describe(size, gbps))
        for warning in warnings:
            print(f"  warning: {warning}", file=sys.stderr)
    if args.check_clouds and not _check_clouds(spec, quiet=args.json):
        return EXIT_FAILED
    return EXIT_OK if fits else EXIT_WINDOW


def _check_clouds(spec: JobSpec, *, quiet: bool) -> bool:
    """Ask each allowed cloud for the spec's offers; print what each says."""
    import tempfile

    from spottrain.cloud.base import ProviderError
    from spottrain.controller.providers import build_provider, offer_query

    if spec.fleet is not None:
        return _check_group(spec, quiet=quiet)
    ok = True
    with tempfile.TemporaryDirectory(prefix="spottrain-validate-") as tmp:
        for cloud in spec.resources.clouds:
            try:
                provider = build_provider(spec, cloud, local_state_dir=Path(tmp))
                offers = provider.offers(offer_query(spec, cloud))
            except (ProviderError, ImportError, ValueError) as e:
                ok = False
                print(f"  {cloud}: cannot use it: {e}", file=sys.stderr)
                continue
            if not offers:
                ok = False
                print(
                    f"  {cloud}: no offer matches the spec (instance types, regions, zones, "
                    "max price, spot policy)",
                    file=sys.stderr,
                )
            elif not quiet:
                o = offers[0]
                print(
                    f"  {cloud}: {len(offers)} offers; cheapest {o.instance_type} {o.market} in "
                    f"{o.zone} at ${o.price_per_hour:,.2f}/h"
                )
    return ok


def _check_group(spec: JobSpec, *, quiet: bool) -> bool:
    """Ask the cloud for the Terraform fleet's group; print what it holds."""
    from spottrain.cloud.base import ProviderError
    from spottrain.controller.providers import build_group

    assert spec.fleet is not None
    cloud = spec.fleet.cloud
    try:
        view = build_group(spec).describe()
    except (ProviderError, ImportError, ValueError) as e:
        print(f"  {cloud}: cannot use the fleet's group: {e}", file=sys.stderr)
        return False
    if not quiet:
        cap = f" of at most {view.max_size}" if view.max_size is not None else ""
        print(
            f"  {cloud}: group {view.name}: size {view.target}{cap}, "
            f"{len(view.alive)} VMs running or starting"
        )
    return True


def _local(args: argparse.Namespace) -> int:
    from spottrain.cloud.local import LocalProvider
    from spottrain.controller.runs import home_dir

    state_dir = Path(args.state_dir) if args.state_dir else home_dir() / "local"
    try:
        cloud = LocalProvider.open(state_dir)
    except FileNotFoundError as e:
        print(f"spottrain local: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    cmd = args.local_command
    if cmd == "vms":
        for rec in cloud.store.all():
            tags = rec.get("tags", {})
            if args.job and tags.get("spottrain-job") != args.job:
                continue
            flag = " interrupted" if rec.get("interrupted") else ""
            print(
                f"{rec['id']}  {rec['state']:<10} {rec['zone']:<10} {rec['market']:<9} "
                f"job={tags.get('spottrain-job', '')} node={tags.get('spottrain-node', '')}"
                f"{flag}"
            )
        return EXIT_OK
    if cmd == "preempt":
        code = EXIT_OK
        for vm in args.vms:
            if cloud.preempt(vm, notice=not args.no_notice):
                how = "without notice" if args.no_notice else f"with {cloud.settings.notice_s:g} s"
                print(f"{vm}: preempted {how}")
            else:
                print(f"spottrain local: {vm} is not a running VM", file=sys.stderr)
                code = EXIT_BAD_INPUT
        return code
    if cmd == "capacity":
        try:
            cloud.set_capacity(args.zone, args.n)
        except ValueError as e:
            print(f"spottrain local: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
        print(f"{args.zone}: capacity {args.n}")
        return EXIT_OK
    if cmd == "refuse":
        cloud.set_refusal(None if args.kind == "none" else args.kind)
        print("the local cloud accepts calls" if args.kind == "none" else f"refusing: {args.kind}")
        return EXIT_OK
    print("spottrain local: give a command: vms, preempt, capacity, refuse", file=sys.stderr)
    return EXIT_BAD_INPUT


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "validate":
        return _validate(args)
    if args.command == "local":
        return _local(args)
    if args.command == "lock":
        from spottrain.controller import env_lock

        return env_lock.command(args)
    if args.command in ("report", "simulate"):
        from spottrain.controller import report, simulate

        if args.command == "report":
            return report.command(args)
        return simulate.command(args)
    if args.command in ("up", "resume", "status", "logs", "down", "scale"):
        from spottrain.controller import commands

        handler = getattr(commands, args.command)
        code: int = handler(args)
        return code
    parser.print_help()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

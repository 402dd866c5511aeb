"""``spottrain local``: the local cloud's levers (list VMs, preempt, capacity, refusals)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spottrain.controller.cli.common import EXIT_BAD_INPUT, EXIT_OK


def local(args: argparse.Namespace) -> int:
    from spottrain.cloud.local.compute import LocalProvider
    from spottrain.controller.run.records import home_dir

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

"""A checkpoint writer for the crash-consistency tests: one process, no process group.

Saves ``state_for(step, scale)`` for steps ``--first`` .. ``--last`` into DIR under rendezvous
round ``--round``, printing ``committed <step>`` after each save returns. Arm a failpoint with
``SPOTTRAIN_FAILPOINT`` and it dies by SIGKILL where the failpoint says::

    SPOTTRAIN_FAILPOINT=manifest:3 python tests/ckpt_writer.py DIR --round 1 --last 5

A failpoint counts the times it is passed in one process, and ``shard`` is passed once per
write of a shard file, so "the third save dies in a shard" cannot be said with a count. For
that, ``--arm SPEC --arm-at STEP`` has a forked child save the steps before STEP unarmed (a
writer that ran and exited), then arms SPEC and goes on from STEP under the next round.
With ``--redo`` the unarmed child saves STEP too, so the armed writer saves it again (and
replaces it, as a newer round redoing a step does).

``--serve`` reads one JSON request per line on stdin (``{"argv": [...], "env": {...},
"out": path}``), runs each writer in a child forked from this process, which has imported
torch already, and answers ``{"returncode": n}`` per line (negative: killed by that signal).
Each writer then costs a fork instead of a torch import. The child imports the checkpoint
modules itself, after its environment is set, so each one reads its own failpoint.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import traceback
import warnings
from typing import Any

from ckpt_state import state_for

FAILPOINT_ENV = "SPOTTRAIN_FAILPOINT"  # spottrain.protocol.env.ENV_FAILPOINT
CHILD_TIMEOUT_S = 60


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--round", type=int, required=True)
    p.add_argument("--first", type=int, default=1)
    p.add_argument("--last", type=int, required=True)
    p.add_argument("--scale", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--keep", type=int, default=10)
    p.add_argument("--arm", help="failpoint spec to arm from --arm-at on")
    p.add_argument("--arm-at", type=int, default=0)
    p.add_argument("--redo", action="store_true", help="the unarmed saves include --arm-at")
    return p.parse_args(argv)


def save_steps(args: argparse.Namespace, first: int, last: int, round_: int) -> None:
    # Imported here, not at the top: the failpoint is read when the module is first imported.
    from spottrain.agent.checkpoint import dcp_io
    from spottrain.agent.checkpoint.directory import CheckpointDir

    ckdir = CheckpointDir(args.dir)
    for step in range(first, last + 1):
        dcp_io.save(
            state_for(step, args.scale),
            ckdir,
            step=step,
            round_=round_,
            kind="periodic",
            thread_count=args.threads,
            keep=args.keep,
        )
        print(f"committed {step}", flush=True)


def main(argv: list[str]) -> None:
    args = parse(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    if not args.arm:
        save_steps(args, args.first, args.last, args.round)
        return
    if os.environ.get(FAILPOINT_ENV) or "spottrain.agent.checkpoint.failpoints" in sys.modules:
        raise SystemExit(f"--arm needs {FAILPOINT_ENV} unset and unread")
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            save_steps(args, args.first, args.arm_at - (0 if args.redo else 1), args.round)
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit("the unarmed saves failed")
    os.environ[FAILPOINT_ENV] = args.arm
    save_steps(args, args.arm_at, args.last, args.round + 1)


def run_child(request: dict[str, Any]) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.environ.pop(FAILPOINT_ENV, None)
            os.environ.update(request.get("env", {}))
            fd = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.stdout = os.fdopen(1, "w", buffering=1)
            sys.stderr = sys.stdout
            signal.alarm(CHILD_TIMEOUT_S)
            main(request["argv"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
            if not isinstance(exc.code, int):
                print(exc.code)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def serve() -> None:
    # The expensive imports, once; no torch work runs here, so forking is safe.
    importlib.import_module("torch.distributed.checkpoint")

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps({"returncode": run_child(json.loads(line))}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        main(sys.argv[1:])

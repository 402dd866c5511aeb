"""A controller process for the crash-safety tests: a few passes of one run against moto.

Builds the run's :class:`~spottrain.controller.reconcile.controller.Controller` the way
``spottrain up`` does (:func:`spottrain.controller.run.wiring.build_controller`), with its
AWS provider pointed at a moto server through a boto3 session of its own (fake credentials,
every request refused unless it goes to the server), then calls ``step()`` ``--passes``
times. ``SPOTTRAIN_CRASH_AT`` in the environment kills it at that crash point (exit status
137), as a killed controller dies.

Usage::

    python tests/ctl_runner.py --spec job.yaml --run-id RUN --redis-url redis://H:P/0 \\
        --endpoint-url http://127.0.0.1:PORT [--moto-account ID] [--passes N] \\
        [--interval S] [--policy NAME=VALUE ...] [--stop-timeout S] [--until-done] \\
        [--stockout ZONE ...]

``--stockout ZONE`` makes every RunInstances in ZONE fail with InsufficientInstanceCapacity
(a botocore hook on the session, before any request is sent). Each pass prints one line to
stdout, ``pass N: <plan reason>``; logs go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import boto3
from botocore.exceptions import ClientError

from spottrain.cloud.base import AuthError, ProviderError
from spottrain.controller.run.boot import CodeRef
from spottrain.controller.run.boot_files import ship_boot_files
from spottrain.controller.run.create import build_self_wheel
from spottrain.controller.run.providers import Endpoints
from spottrain.controller.run.records import RunInfo
from spottrain.controller.run.wiring import build_controller

FAKE_CREDENTIALS = {
    "aws_access_key_id": "testing",
    "aws_secret_access_key": "testing",
    "aws_session_token": "testing",
}


def _policy(pairs: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--policy wants NAME=VALUE, got {pair!r}")
        out[name.strip()] = float(value)
    return out


def moto_session(
    endpoint_url: str, region: str, *, account: str = "", stockout: frozenset[str] = frozenset()
) -> boto3.Session:
    """A boto3 session for moto at ``endpoint_url``: fake credentials, the moto account
    header when ``account`` is set, and stocked-out zones."""
    session = boto3.Session(region_name=region, **FAKE_CREDENTIALS)

    def route(request: Any, **_: Any) -> None:
        if not str(request.url).startswith(endpoint_url):
            raise RuntimeError(f"a test request escaped moto: {request.url}")
        if account:
            request.headers["x-moto-account-id"] = account

    def no_capacity(params: Mapping[str, Any], **_: Any) -> None:
        zone = params.get("Placement", {}).get("AvailabilityZone", "")
        if zone in stockout:
            raise ClientError(
                {
                    "Error": {
                        "Code": "InsufficientInstanceCapacity",
                        "Message": f"We currently do not have sufficient "
                        f"{params.get('InstanceType', '')} capacity in the Availability Zone "
                        f"you requested ({zone}).",
                    },
                    "ResponseMetadata": {"HTTPStatusCode": 500},
                },
                "RunInstances",
            )

    session.events.register("before-send.ec2", route)
    if stockout:
        session.events.register("before-parameter-build.ec2.RunInstances", no_capacity)
    return session


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", required=True, type=Path)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--redis-url", required=True)
    ap.add_argument("--endpoint-url", required=True)
    ap.add_argument("--moto-account", default="")
    ap.add_argument("--region", default="us-east-1")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--interval", type=float, default=0.2)
    ap.add_argument("--policy", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--stop-timeout", type=float, default=None)
    ap.add_argument("--until-done", action="store_true", help="stop once the run is over")
    ap.add_argument("--stockout", action="append", default=[], metavar="ZONE")
    args = ap.parse_args(argv)

    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    for noisy in ("botocore", "boto3", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    session = moto_session(
        args.endpoint_url,
        args.region,
        account=args.moto_account,
        stockout=frozenset(args.stockout),
    )
    info = RunInfo(
        run_id=args.run_id,
        spec_text=args.spec.read_text(),
        spec_source=str(args.spec),
        base_dir=str(args.spec.resolve().parent),
        redis_url=args.redis_url,
        embedded_redis=False,
        created_at=time.time(),
    )
    if info.spec().launches_vms():
        # What `spottrain up` ships for the VMs' boot (the wheel of this spottrain, the job's
        # boot script, the loader) into the spec's store: the same files every time.
        info.boot_files = ship_boot_files(info.spec(), info, CodeRef(), build_self_wheel())
    ctl = build_controller(
        info,
        interval_s=args.interval,
        endpoints=Endpoints(aws_session=session, aws_endpoint_url=args.endpoint_url),
        policy=_policy(args.policy),
    )
    if args.stop_timeout is not None:
        ctl.stop_timeout_s = args.stop_timeout
    for i in range(args.passes):
        if i:
            time.sleep(args.interval)
        try:
            p = ctl.step()
        except AuthError:
            raise
        except ProviderError as e:
            # What Controller.run does: skip a pass the clouds could not be asked for.
            print(f"pass {i}: skipped: {e}", flush=True)
            continue
        print(f"pass {i}: {p.reason}", flush=True)
        if args.until_done and ctl.done():
            print("done", flush=True)
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())

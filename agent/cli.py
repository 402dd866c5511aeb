"""``spottrain-agent``: the command that runs on every VM."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import socket
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from spottrain import __version__
from spottrain.protocol.env import (
    ENV_ADDRESS,
    ENV_ASG_LIFECYCLE_HOOK,
    ENV_ASG_NAME,
    ENV_CKPT_DIR,
    ENV_CLOUD,
    ENV_COPY_TO,
    ENV_EXPECT_GPUS,
    ENV_FAULT_TOLERANCE,
    ENV_INSTANCE_TYPE,
    ENV_INTEGRATION,
    ENV_LIGHTHOUSE,
    ENV_MANAGER_PORT,
    ENV_MAX_RESTARTS,
    ENV_METADATA_ENDPOINT,
    ENV_MIN_REPLICAS,
    ENV_NNODES,
    ENV_NODE,
    ENV_NODES_PER_REPLICA,
    ENV_NPROC_PER_NODE,
    ENV_ORPHAN_TIMEOUT,
    ENV_POWEROFF_REQUEST,
    ENV_QUORUM,
    ENV_QUORUM_HEARTBEAT_TIMEOUT,
    ENV_QUORUM_JOIN_TIMEOUT,
    ENV_QUORUM_WAIT_REPLICAS,
    ENV_REDIS,
    ENV_REDIS_PASSWORD_FILE,
    ENV_RUN_ID,
    ENV_SECRET_ENV_FILE,
    ENV_SELF_TERMINATE_CMD,
    ENV_SIGTERM_GRACE,
    ENV_TRAIN_CMD,
    ENV_WORKER_USER,
    ENV_ZONE,
)
from spottrain.protocol.keys import DEFAULT_PREFIX, RunKeys
from spottrain.redis_conn import (
    DEFAULT_PASSWORD_ENV,
    RedisAuthError,
    RedisConfigError,
    RedisSettings,
    RedisUnavailableError,
    connect,
    ping,
    settings_from_url,
)

from .logship.settings import ShipSettings, add_logs_args, ship_settings
from .notices.notice import NoticeKind
from .watch_cmd import add_watch_parser, run_watch

if TYPE_CHECKING:
    from .config import AgentConfig

CLOUDS = ("local", "aws", "gcp")
# Every variable `run` reads, filled in as its parser is built (the systemd unit's
# environment file is checked against it).
RUN_ENV_VARS: set[str] = {ENV_TRAIN_CMD}
# --rdzv-conf keys whose value is a secret itself.


def _env(name: str, default: str | None = None) -> str | None:
    RUN_ENV_VARS.add(name)
    return os.environ.get(name, default)


def _add_redis_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis", required=True, help="HOST:PORT or redis[s]://HOST:PORT of the job")
    p.add_argument("--run-id", required=True, help="the run id (torchrun's --rdzv-id)")
    p.add_argument("--key-prefix", default=DEFAULT_PREFIX)
    p.add_argument(
        "--password-file", help=f"file with the Redis password (default: ${DEFAULT_PASSWORD_ENV})"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spottrain-agent",
        description="The spottrain agent that runs on every VM of a job.",
    )
    parser.add_argument("--version", action="version", version=f"spottrain-agent {__version__}")
    sub = parser.add_subparsers(dest="command")
    _add_leave_parser(sub)
    _add_run_parser(sub)
    _add_notify_parser(sub)
    add_watch_parser(sub)
    return parser


def _add_leave_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    leave = sub.add_parser(
        "leave",
        help="make a node leave the job's rendezvous now (its peers re-form at once)",
    )
    _add_redis_args(leave)
    leave.add_argument(
        "--node-id",
        default=os.environ.get(ENV_NODE),
        help="the node to remove (default: $SPOTTRAIN_NODE_ID)",
    )


def _add_run_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = sub.add_parser(
        "run",
        help="run this node: register, health check, torchrun, notices, emergency checkpoints",
        usage="spottrain-agent run [OPTIONS] -- TRAIN_SCRIPT [ARGS...]",
        description="Every option defaults to its SPOTTRAIN_* environment variable (the "
        "systemd unit reads them from /etc/spottrain/agent.env). The training command comes "
        "after `--` or from SPOTTRAIN_TRAIN_CMD.",
    )
    _add_run_node_args(run)
    _add_run_checkpoint_args(run)
    _add_run_fleet_args(run)
    _add_run_replica_args(run)
    add_logs_args(run, _env)


def _add_run_node_args(run: argparse.ArgumentParser) -> None:
    """Where the job is, who this node is, and what it runs."""
    env = _env
    run.add_argument("--redis", default=env(ENV_REDIS), help="redis[s]://HOST:PORT")
    run.add_argument("--password-file", default=env(ENV_REDIS_PASSWORD_FILE))
    run.add_argument("--run-id", default=env(ENV_RUN_ID))
    run.add_argument("--key-prefix", default=DEFAULT_PREFIX)
    run.add_argument("--node-id", default=env(ENV_NODE) or socket.gethostname())
    run.add_argument("--cloud", default=env(ENV_CLOUD, "local"), choices=CLOUDS)
    run.add_argument("--zone", default=env(ENV_ZONE, ""))
    run.add_argument("--instance-type", default=env(ENV_INSTANCE_TYPE, ""))
    run.add_argument("--address", default=env(ENV_ADDRESS, ""))
    run.add_argument("--nnodes", default=env(ENV_NNODES, "1:1"), help="MIN:MAX nodes")
    run.add_argument("--nproc-per-node", type=int, default=int(env(ENV_NPROC_PER_NODE, "1") or 1))
    run.add_argument(
        "--expect-gpus",
        type=int,
        default=int(env(ENV_EXPECT_GPUS, "0") or 0),
        help="GPUs the health check requires",
    )
    run.add_argument("--no-health-check", action="store_true")


def _add_run_checkpoint_args(run: argparse.ArgumentParser) -> None:
    """Checkpoints, notices and their deadlines."""
    env = _env
    run.add_argument("--ckpt-dir", default=env(ENV_CKPT_DIR, ""))
    run.add_argument(
        "--ckpt-copy-to",
        default=env(ENV_COPY_TO, ""),
        help="object storage (s3://, gs://, file://) this node copies its checkpoints to, "
        "and brings the newest copy in from at boot",
    )
    run.add_argument(
        "--notice-margin",
        type=float,
        default=5.0,
        help="seconds before a notice's deadline the agent keeps for itself (leaving the "
        "rendezvous, copying the checkpoint out, shipping logs): it stops waiting for the "
        "emergency checkpoint then, and with --integration plain SIGKILLs the workers then",
    )
    run.add_argument(
        "--integration",
        default=env(ENV_INTEGRATION, "sdk"),
        help="how the training script meets spottrain (the spec's train.integration): sdk, "
        "hf, accelerate or lightning answer the agent's checkpoint request; plain (a script "
        "that imports nothing of ours) gets SIGTERM at once on a notice",
    )
    run.add_argument(
        "--sigterm-grace",
        type=float,
        default=float(env(ENV_SIGTERM_GRACE, "60") or 60),
        help="deadline given to a SIGTERM (keep it under the unit's TimeoutStopSec)",
    )
    run.add_argument("--worker-stop-timeout", type=float, default=150.0)
    run.add_argument(
        "--metadata-endpoint",
        default=env(ENV_METADATA_ENDPOINT),
        help="metadata server override (else AWS_EC2_METADATA_SERVICE_ENDPOINT/GCE_METADATA_HOST)",
    )
    run.add_argument("--poll-interval", type=float, default=2.0)


def _add_run_fleet_args(run: argparse.ArgumentParser) -> None:
    """torchrun's restarts, the fleet this VM belongs to, and how the workers run."""
    env = _env
    run.add_argument(
        "--max-restarts",
        type=int,
        default=int(env(ENV_MAX_RESTARTS, "100") or 100),
        help="worker failures torchrun retries (a peer lost without notice costs one)",
    )
    run.add_argument(
        "--asg-name",
        default=env(ENV_ASG_NAME, ""),
        help="the Auto Scaling group this VM belongs to (terraform/aws fleets)",
    )
    run.add_argument(
        "--asg-lifecycle-hook",
        default=env(ENV_ASG_LIFECYCLE_HOOK, ""),
        help="the group's termination hook: completed once the emergency checkpoint commits",
    )
    run.add_argument(
        "--orphan-timeout",
        type=float,
        default=float(env(ENV_ORPHAN_TIMEOUT, "0") or 0),
        help="seconds without a controller heartbeat and without training on this node (no "
        "new step; without the SDK's steps, workers below 0.05 of a core) after which the VM "
        "drains and ends itself (0: never)",
    )
    run.add_argument(
        "--self-terminate-cmd",
        default=env(ENV_SELF_TERMINATE_CMD, ""),
        help="how this VM powers itself off when its cloud's API did not end it (AWS: "
        "TerminateInstances, GCP: instances.delete, on itself); default `shutdown -h now`. "
        "On the local cloud it replaces the signal to the VM process",
    )
    run.add_argument(
        "--poweroff-request",
        default=env(ENV_POWEROFF_REQUEST, ""),
        help="in a container: power the host off by creating this file (a path unit of the "
        "host watches it) rather than running --self-terminate-cmd",
    )
    run.add_argument(
        "--secret-env-file",
        default=env(ENV_SECRET_ENV_FILE, ""),
        help="a root-only file of the job's secret variables (JSON lines, written by the "
        "VM's boot) passed on to the workers",
    )
    run.add_argument("--rdzv-conf", default="", help="k=v,... passed to the Redis rendezvous")
    run.add_argument(
        "--worker-user",
        default=env(ENV_WORKER_USER, ""),
        help="run torchrun and the workers as this unprivileged user (the agent must be "
        "root; the systemd unit sets spottrain); empty: the agent's own user",
    )


def _add_run_replica_args(run: argparse.ArgumentParser) -> None:
    """Replica mode: each replica of --nodes-per-replica nodes runs its own torchrun and
    takes part in a fault-tolerant quorum across replicas."""
    from spottrain.protocol.env import ENV_QUORUM_RELAY_GROUP, ENV_QUORUM_RELAY_PORT
    from spottrain.quorum.model import DEFAULT_JOIN_TIMEOUT_MS

    from .config import DEFAULT_RELAY_PORT
    from .replica_launch import DEFAULT_MANAGER_PORT, DEFAULT_SHIM_PORT

    env = _env
    run.add_argument(
        "--fault-tolerance",
        default=env(ENV_FAULT_TOLERANCE, "elastic"),
        help="elastic (one torchrun over every node, re-formed on each change) or replica",
    )
    # Read as text and converted in _run: a bad environment value gets a one-line error.
    run.add_argument("--nodes-per-replica", default=env(ENV_NODES_PER_REPLICA, "1"))
    run.add_argument("--min-replicas", default=env(ENV_MIN_REPLICAS, "1"))
    run.add_argument(
        "--lighthouse",
        default=env(ENV_LIGHTHOUSE, ""),
        help="HOST:PORT of the run's lighthouse (default: what the controller wrote in Redis)",
    )
    run.add_argument(
        "--lighthouse-wait",
        default="300",
        help="seconds a launch waits for the controller to publish the lighthouse address",
    )
    run.add_argument(
        "--manager-port",
        default=env(ENV_MANAGER_PORT, str(DEFAULT_MANAGER_PORT)),
        help="the workers' torchft manager port (0, and on the local cloud always: a free port)",
    )
    run.add_argument(
        "--quorum",
        default=env(ENV_QUORUM, "redis"),
        help="redis (the quorum in the run's Redis, served to the workers by a local "
        "lighthouse shim; the default) or lighthouse (torchft's own, run by the controller)",
    )
    run.add_argument(
        "--quorum-heartbeat-timeout",
        default=env(ENV_QUORUM_HEARTBEAT_TIMEOUT, "1"),
        help="with --quorum redis: seconds without a heartbeat before the quorum drops a "
        "replica (default 1; every agent of the run must use the same)",
    )
    run.add_argument(
        "--quorum-join-timeout",
        default=env(ENV_QUORUM_JOIN_TIMEOUT, str(DEFAULT_JOIN_TIMEOUT_MS)),
        help="with --quorum redis: milliseconds a changed quorum waits for late replicas "
        "(the spec's train.replica.join_timeout_ms, resolved by the controller)",
    )
    run.add_argument(
        "--quorum-wait-replicas",
        default=env(ENV_QUORUM_WAIT_REPLICAS, "0"),
        help="with --quorum redis: Redis replicas that must hold each formed round before "
        "its answer is used (Redis WAIT; 0: none)",
    )
    run.add_argument(
        "--quorum-port",
        default=str(DEFAULT_SHIM_PORT),
        help="the local lighthouse shim's port with --quorum redis (0, and on the local "
        "cloud always: a free port)",
    )
    run.add_argument(
        "--quorum-relay-group",
        default=env(ENV_QUORUM_RELAY_GROUP, "0"),
        help="with --quorum redis: replicas per quorum relay (0: none; relay_group_size)",
    )
    run.add_argument(
        "--quorum-relay-port",
        default=env(ENV_QUORUM_RELAY_PORT, str(DEFAULT_RELAY_PORT)),
        help="a relay's port on --address (0, and on the local cloud always: a free port)",
    )


def _number(args: argparse.Namespace, name: str, kind: type[int] | type[float]) -> int | float:
    """Flag ``name`` as a number, or a one-line ValueError naming the flag."""
    raw = getattr(args, name)
    try:
        return kind(raw)
    except ValueError:
        flag = "--" + name.replace("_", "-")
        what = "a whole number" if kind is int else "a number"
        raise ValueError(f"{flag} {raw!r} (or its SPOTTRAIN_* variable) must be {what}") from None


def _add_notify_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    notify = sub.add_parser(
        "notify", help="inject a preemption notice for a node through Redis (local cloud)"
    )
    _add_redis_args(notify)
    notify.add_argument("--node-id", required=True)
    notify.add_argument("--kind", default="injected", choices=[k.value for k in NoticeKind])
    notify.add_argument("--in", dest="in_s", type=float, default=120.0, help="seconds left")


def _secret_rdzv_keys(conf: dict[str, str]) -> list[str]:
    """The ``--rdzv-conf`` keys that would carry a secret (``password``); ``password_env`` and
    ``password_file`` only name where it is, and stay allowed."""
    from .config import SECRET_RDZV_KEYS

    return sorted(k for k in conf if k.lower() in SECRET_RDZV_KEYS)


def _rdzv_conf(text: str) -> dict[str, str]:
    """``--rdzv-conf k=v,...`` as a mapping.

    Raises:
        AgentConfigError: an item is not ``k=v``, or names a secret: refused before anything
            starts, since torchrun would carry the value on its command line (world-readable
            in /proc) and the torchrun-started event would store it in Redis.
    """
    from .config import AgentConfigError

    conf = {}
    for item in filter(None, text.split(",")):
        k, sep, v = item.partition("=")
        if not sep:
            raise AgentConfigError(f"--rdzv-conf item {item!r} is not k=v")
        conf[k.strip()] = v.strip()
    if refused := _secret_rdzv_keys(conf):
        raise AgentConfigError(
            f"--rdzv-conf {', '.join(refused)} is refused: it would put the secret on "
            f"torchrun's command line and in the run's event stream; set "
            f"${DEFAULT_PASSWORD_ENV} or --password-file (SPOTTRAIN_REDIS_PASSWORD_FILE) instead"
        )
    return conf


def _run(args: argparse.Namespace) -> int:
    from .config import AgentConfig, AgentConfigError

    missing = [n for n in ("redis", "run_id") if not getattr(args, n)]
    if missing:
        names = ", ".join(f"--{n.replace('_', '-')} (SPOTTRAIN_{n.upper()})" for n in missing)
        print(f"spottrain-agent run: missing {names}", file=sys.stderr)
        return 2
    command = args.train_cmd or shlex.split(os.environ.get(ENV_TRAIN_CMD, ""))
    try:
        conf = _rdzv_conf(args.rdzv_conf)
        address = _address(args)
    except AgentConfigError as e:
        print(f"spottrain-agent run: {e}", file=sys.stderr)
        return 2
    cfg = AgentConfig(
        redis_url=args.redis,
        run_id=args.run_id,
        node_id=args.node_id,
        train_cmd=command,
        nnodes=args.nnodes,
        nproc_per_node=args.nproc_per_node,
        cloud=args.cloud,
        zone=args.zone,
        instance_type=args.instance_type,
        address=address,
        expect_gpus=args.expect_gpus,
        health_check=not args.no_health_check,
        ckpt_dir=args.ckpt_dir,
        ckpt_copy_to=args.ckpt_copy_to,
        password_file=args.password_file,
        key_prefix=args.key_prefix,
        notice_margin=args.notice_margin,
        sigterm_grace=args.sigterm_grace,
        worker_stop_timeout=args.worker_stop_timeout,
        integration=args.integration,
        metadata_endpoint=args.metadata_endpoint,
        poll_interval=args.poll_interval,
        max_restarts=args.max_restarts,
        asg_name=args.asg_name,
        asg_lifecycle_hook=args.asg_lifecycle_hook,
        orphan_timeout=args.orphan_timeout,
        self_terminate_cmd=args.self_terminate_cmd,
        poweroff_request=args.poweroff_request,
        secret_env_file=args.secret_env_file,
        rdzv_conf=conf,
        worker_user=args.worker_user,
        fault_tolerance=args.fault_tolerance,
        nodes_per_replica=int(_number(args, "nodes_per_replica", int)),
        min_replicas=int(_number(args, "min_replicas", int)),
        lighthouse=args.lighthouse,
        lighthouse_wait=_number(args, "lighthouse_wait", float),
        manager_port=int(_number(args, "manager_port", int)),
        quorum=args.quorum,
        quorum_port=int(_number(args, "quorum_port", int)),
        quorum_wait_replicas=int(_number(args, "quorum_wait_replicas", int)),
        quorum_heartbeat_timeout_s=float(_number(args, "quorum_heartbeat_timeout", float)),
        quorum_join_timeout_ms=int(_number(args, "quorum_join_timeout", int)),
        quorum_relay_group=int(_number(args, "quorum_relay_group", int)),
        quorum_relay_port=int(_number(args, "quorum_relay_port", int)),
    )
    logs = ship_settings(args)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s spottrain-agent[{args.node_id}] %(levelname)s %(message)s",
    )
    return _run_shipping_logs(cfg, logs)


def _address(args: argparse.Namespace) -> str:
    """``--address``, else on a real cloud the address of the route to the run's Redis:
    every peer (torchrun's store and collectives, a quorum relay) dials it. The local
    cloud's "VMs" share this host's loopback."""
    from .config import own_address

    if args.address or args.cloud == "local":
        return str(args.address)
    return own_address(args.redis)


def _run_shipping_logs(cfg: AgentConfig, logs: ShipSettings | None) -> int:
    """The agent, inside its log shipper: a node that fails to start ships why, and the
    last flush comes after the drain (emergency checkpoint, copy) is over, bounded."""
    from .agent import Agent
    from .logship.shipper import FINAL_FLUSH_S, start_shipper

    shipper = start_shipper(logs)
    try:
        return Agent(cfg).run()
    except Exception as exc:
        if shipper is not None:
            # Said here too, before the last flush: main prints it only once that is over.
            logging.getLogger("spottrain.agent").error("stopped: %s", exc)
        raise
    finally:
        if shipper is not None:
            shipper.close(FINAL_FLUSH_S)


def _notify(args: argparse.Namespace) -> int:
    from spottrain.protocol.notices import inject_notice

    settings = _settings(args)
    client = connect(settings)
    ping(client, settings)
    inject_notice(client, RunKeys(args.run_id, args.key_prefix), args.node_id, args.kind, args.in_s)
    print(f"notice {args.kind} queued for node {args.node_id} ({args.in_s:g} s left)")
    return 0


def _settings(args: argparse.Namespace) -> RedisSettings:
    return settings_from_url(args.redis, password_file=args.password_file)


def _leave(args: argparse.Namespace) -> int:
    from spottrain.agent.rendezvous.membership import leave_node

    if not args.node_id:
        print("spottrain-agent leave: give --node-id or set SPOTTRAIN_NODE_ID", file=sys.stderr)
        return 2
    settings = _settings(args)
    client = connect(settings)
    ping(client, settings)
    keys = RunKeys(args.run_id, args.key_prefix)
    try:
        member = leave_node(client, keys, args.node_id)
    except LookupError:
        # Replica mode: the node joined its replica's own rendezvous, not the run's.
        from .replica_launch import replica_rdzv_id
        from .replica_slots import find_claim

        claim = find_claim(client, keys, args.node_id)
        if claim is None:
            raise
        scoped = RunKeys(replica_rdzv_id(args.run_id, claim.slot, claim.gen), args.key_prefix)
        member = leave_node(client, scoped, args.node_id)
    print(f"node {args.node_id} ({member}) left run {args.run_id}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first `--` is the training command, untouched by argparse.
    tail: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, tail = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(argv)
    args.train_cmd = tail
    if args.command is None:
        parser.print_help()
        return 0
    try:
        if args.command == "leave":
            return _leave(args)
        if args.command == "run":
            return _run(args)
        if args.command == "notify":
            return _notify(args)
        if args.command == "watch":
            return run_watch(args)
    except (RedisConfigError, RedisAuthError, RedisUnavailableError, ValueError) as exc:
        print(f"spottrain-agent {args.command}: {exc}", file=sys.stderr)
        return 2
    except LookupError as exc:
        print(f"spottrain-agent {args.command}: {exc.args[0]}", file=sys.stderr)
        return 3
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""The simulation a ``spottrain simulate`` command line (and its ``--spec``) describes: the
defaults (their sources: :mod:`spottrain.controller.sim.command`), the checks of each option,
and the offers the catalog prices."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from pathlib import Path

from spottrain.catalog import Catalog, UnknownInstanceType, UnknownRegion, bundled
from spottrain.cloud.base import Market, Offer, region_of_zone
from spottrain.controller.reconcile.pricing import HOURS_PER_MONTH
from spottrain.controller.sim.model import SimConfig
from spottrain.controller.sim.replica_params import ReplicaParams
from spottrain.controller.sim.replica_policy import POLICIES
from spottrain.spec import (
    NOTICE_WINDOW_S,
    JobSpec,
    LocalCloudSpec,
    SpecError,
    SpotPolicy,
    load_spec,
)
from spottrain.spec.heartbeat import HEARTBEAT_AUTO
from spottrain.trace import TracedPreemption, load_trace

DEFAULT_GPUS = 100_000
DEFAULT_TYPES = {"aws": "p5.48xlarge", "gcp": "a3-highgpu-8g", "local": "local-cpu"}
DEFAULT_CKPT_GB = 84.0
DEFAULT_WRITE_GBPS = 4.0
DEFAULT_CKPT_EVERY_MIN = 20.0
DEFAULT_LAUNCH_LATENCY_S = 300.0
DEFAULT_RENDEZVOUS_S = 4.4
DEFAULT_DETECT_S = 3.7
DEFAULT_PEER_GBPS = 12.5
DEFAULT_RECLAIM_SHARE = 0.05
DEFAULT_RECLAIM_OUTAGE_MIN = 30.0
MAX_NODES = 125_000  # 1,000,000 GPUs at 8 per node


class BadInput(ValueError):
    """A setting that cannot be simulated; the message names it and what is allowed."""


@dataclass
class _Picked:
    spot: Offer
    on_demand: Offer
    gpus_per_node: int


def _offers(
    cat: Catalog,
    cloud: str,
    itype: str,
    region: str | None,
    zone: str | None,
    gpus_per_node: int | None,
) -> _Picked:
    try:
        t = cat.get(cloud, itype)
        regions = cat.regions(cloud)
        reg = region or (region_of_zone(cloud, zone) if zone and cloud != "local" else None)
        reg = reg or (t.regions[0] if t.regions else regions[0])
        spot_price = cat.price(cloud, itype, reg, Market.SPOT)
        od_price = cat.price(cloud, itype, reg, Market.ON_DEMAND)
        if zone is None:
            if cloud == "gcp":
                zone = cat.gcp_zones(reg)[0]
            elif cloud == "local":
                zone = "local-a"
            else:
                zone = reg + "a"
    except (UnknownInstanceType, UnknownRegion, ValueError) as e:
        raise BadInput(str(e)) from None
    gpn = gpus_per_node if gpus_per_node is not None else t.gpus
    if gpn < 1:
        raise BadInput(
            f"{cloud} {itype} has no GPUs in the catalog: give --gpus-per-node to count GPU-hours"
        )

    def offer(market: Market, price: float, risk: float) -> Offer:
        return Offer(cloud, reg, zone, itype, gpn, t.gpu_type, market, price, risk)

    return _Picked(
        offer(Market.SPOT, spot_price, t.interruption_risk),
        offer(Market.ON_DEMAND, od_price, 0.0),
        gpn,
    )


def _from_spec(spec: JobSpec, cat: Catalog) -> tuple[str, str, str | None, str | None]:
    """(cloud, instance type, region, zone) of the cheapest spot offer a spec allows."""
    clouds: list[str] = list(spec.resources.clouds)
    best: tuple[float, str, str, str | None] | None = None
    for cloud in clouds:
        names = [n for n in spec.resources.instance_types if n in cat.types(cloud)]
        if not names:
            names = [
                n
                for n, t in cat.types(cloud).items()
                if cloud == "local" or t.gpus == spec.nodes.gpus
            ]
        regions: list[str | None] = [r for r in spec.resources.regions if r in cat.regions(cloud)]
        for name in names:
            for reg in regions or [None]:
                t = cat.get(cloud, name)
                r = reg or (t.regions[0] if t.regions else cat.regions(cloud)[0])
                try:
                    price = cat.price(cloud, name, r, Market.SPOT)
                except UnknownRegion:
                    continue
                if best is None or price < best[0]:
                    best = (price, cloud, name, r)
    if best is None:
        raise BadInput(f"{clouds}: the spec allows no instance type the catalog prices")
    _, chosen, name, region = best
    zone = None
    if region is not None:
        zone = next((z for z in spec.resources.zones if z.startswith(region)), None)
    if chosen == "local":
        zone = next(iter(spec.local.zones if spec.local else {"local-a": None}), "local-a")
        region = "local"
    return chosen, name, region, zone


def _positive(name: str, value: float | None, *, zero_ok: bool = False) -> None:
    if value is None:
        return
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        allowed = ">= 0" if zero_ok else "> 0"
        raise BadInput(f"{name} must be a number {allowed}, got {value:g}")


def _share(name: str, value: float | None) -> None:
    if value is not None and not 0 <= value <= 1:
        raise BadInput(f"{name} is a share in [0, 1], got {value:g}")


_POSITIVE = (
    "gpus_per_node",
    "days",
    "hours",
    "write_gbps",
    "load_gbps",
    "peer_gbps",
    "scaling",
    "notice_s",
    "step_s",
)

_NOT_NEGATIVE = (
    "spot_usd",
    "on_demand_usd",
    "rate_per_node_hour",
    "zone_reclaims_per_day",
    "reclaim_outage_min",
    "ckpt_gb",
    "ckpt_every_min",
    "launch_latency_s",
    "rendezvous_s",
    "detect_s",
    "pass_s",
    "heartbeat_s",
    "kill_stall_s",
    "join_start_s",
    "quorum_a_s",
    "quorum_b_s",
    "redis_quorum_a_s",
    "redis_quorum_b_s",
    "pg_base_s",
    "pg_per_replica_s",
)

# option -> ReplicaParams field
_REPLICA_OPTIONS = {
    "step_s": "step_s",
    "heartbeat_s": "heartbeat_s",
    "kill_stall_s": "kill_stall_s",
    "join_start_s": "join_start_s",
    "quorum_a_s": "quorum_a_s",
    "quorum_b_s": "quorum_b_s",
    "quorum": "quorum",
    "redis_quorum_a_s": "redis_a_s",
    "redis_quorum_b_s": "redis_b_s",
    "relay_from": "relay_from",
    "relay_redis_b_s": "relay_b_s",
    "relay_hop_s": "relay_hop_s",
    "pg_base_s": "pg_c0_s",
    "pg_per_replica_s": "pg_c1_s",
}


def replica_params(args: argparse.Namespace, spec: JobSpec | None = None) -> ReplicaParams:
    """The measured replica costs, with the options given in their place; a spec's explicit
    ``train.replica.heartbeat_timeout_s`` stands for ``--heartbeat-s`` (its ``auto`` is the
    simulator's own default: the same formula, for the simulated replicas)."""
    given = {
        field: getattr(args, opt)
        for opt, field in _REPLICA_OPTIONS.items()
        if getattr(args, opt, None) is not None
    }
    beat = spec.train.replica.heartbeat_timeout_s if spec is not None else HEARTBEAT_AUTO
    if "heartbeat_s" not in given and beat != HEARTBEAT_AUTO:
        given["heartbeat_s"] = float(beat)
    return replace(ReplicaParams(), **given)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """The simulation the options (and ``--spec``) describe.

    Raises:
        BadInput: a bad value, an unknown type or region, an invalid spec or trace.
    """
    cat = bundled()
    spec: JobSpec | None = None
    base = Path.cwd()
    if args.spec:
        try:
            loaded = load_spec(args.spec)
        except SpecError as e:
            raise BadInput(str(e)) from None
        spec, base = loaded.spec, loaded.base_dir
    _check_numbers(args)
    cloud, spot, od, gpn = _fleet_offers(args, spec, cat)
    nodes, replica_nodes = _node_count(args, spec, gpn)
    if args.hours is not None:
        hours = args.hours
    elif args.days is not None:
        hours = args.days * 24.0
    else:
        hours = 168.0
    local = spec.local if spec is not None and cloud == "local" else None
    pre = _preemptions(args, spec, local, base, cloud, spot)
    rec = _recovery(args, spec, local)
    policies = _policies(args)
    if hours * (pre.rate * nodes + 1) > 5e7:
        raise BadInput(
            f"{hours:g} h at {pre.rate:g} preemptions per node-hour on {nodes:,} nodes is "
            f"{hours * pre.rate * nodes:,.0f} preemptions; simulate at most about 50 million"
        )
    return SimConfig(
        nodes=nodes,
        spot=spot,
        on_demand=od,
        gpus_per_node=gpn,
        hours=hours,
        rate_per_node_hour=pre.rate,
        notice_fraction=pre.notice_fraction,
        notice_s=pre.notice_s,
        zone_reclaims_per_day=args.zone_reclaims_per_day or 0.0,
        reclaim_share=(
            args.reclaim_share if args.reclaim_share is not None else DEFAULT_RECLAIM_SHARE
        ),
        reclaim_outage_s=60.0
        * (
            args.reclaim_outage_min
            if args.reclaim_outage_min is not None
            else DEFAULT_RECLAIM_OUTAGE_MIN
        ),
        trace=pre.trace,
        ckpt_gb=rec.ckpt_gb if rec.ckpt_gb is not None else DEFAULT_CKPT_GB,
        write_gbps=rec.write_gbps if rec.write_gbps is not None else DEFAULT_WRITE_GBPS,
        load_gbps=args.load_gbps,
        ckpt_every_s=(
            math.inf
            if rec.every_min == 0
            else 60.0 * (rec.every_min if rec.every_min is not None else DEFAULT_CKPT_EVERY_MIN)
        ),
        launch_latency_s=(
            rec.launch_latency if rec.launch_latency is not None else DEFAULT_LAUNCH_LATENCY_S
        ),
        rendezvous_s=args.rendezvous_s if args.rendezvous_s is not None else DEFAULT_RENDEZVOUS_S,
        detect_s=args.detect_s if args.detect_s is not None else DEFAULT_DETECT_S,
        peer_gbps=args.peer_gbps if args.peer_gbps is not None else DEFAULT_PEER_GBPS,
        replica_nodes=replica_nodes,
        scaling=args.scaling if args.scaling is not None else 1.0,
        pass_s=args.pass_s if args.pass_s is not None else 1.0,
        replica=replica_params(args, spec),
        spot_policy=rec.spot_policy,
        fallback_after_s=rec.fallback_s,
        policies=policies,
        seed=args.seed,
        samples=max(24, min(336, round(hours))),
    )


def _check_numbers(args: argparse.Namespace) -> None:
    for name in _POSITIVE:
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    for name in _NOT_NEGATIVE:
        _positive("--" + name.replace("_", "-"), getattr(args, name), zero_ok=True)
    _share("--notice-fraction", args.notice_fraction)
    _share("--reclaim-share", args.reclaim_share)
    if args.gpus is not None and args.gpus < 1:
        raise BadInput(f"--gpus must be at least 1, got {args.gpus}")
    if args.replica_nodes is not None and args.replica_nodes < 1:
        raise BadInput(f"--replica-nodes must be at least 1, got {args.replica_nodes}")


def _fleet_offers(
    args: argparse.Namespace, spec: JobSpec | None, cat: Catalog
) -> tuple[str, Offer, Offer, int]:
    """(cloud, spot offer, on-demand offer, GPUs per node) of the simulated fleet."""
    if spec is not None and not (args.cloud or args.instance_type):
        cloud, itype, region, zone = _from_spec(spec, cat)
    else:
        cloud = args.cloud or (spec.resources.clouds[0] if spec else "aws")
        itype = args.instance_type or DEFAULT_TYPES[cloud]
        region, zone = None, None
    region = args.region or region
    zone = args.zone or zone
    gpn_arg = args.gpus_per_node
    if gpn_arg is None and spec is not None and spec.nodes.gpus > 0:
        gpn_arg = spec.nodes.gpus
    picked = _offers(cat, cloud, itype, region, zone, gpn_arg)
    spot, od = picked.spot, picked.on_demand
    if args.spot_usd is not None:
        spot = replace(spot, price_per_hour=args.spot_usd)
    if args.on_demand_usd is not None:
        od = replace(od, price_per_hour=args.on_demand_usd)
    return cloud, spot, od, picked.gpus_per_node


def _node_count(args: argparse.Namespace, spec: JobSpec | None, gpn: int) -> tuple[int, int]:
    """(nodes, nodes per replica)."""
    if args.gpus is not None:
        gpus = args.gpus
    elif spec is not None:
        gpus = spec.nodes.max * gpn
    else:
        gpus = DEFAULT_GPUS
    if gpus % gpn:
        raise BadInput(
            f"--gpus {gpus:,} is not a whole number of {gpn}-GPU nodes: use a multiple of {gpn}"
        )
    nodes = gpus // gpn
    if nodes > MAX_NODES:
        raise BadInput(f"--gpus {gpus:,} is {nodes:,} nodes; at most {MAX_NODES:,} are simulated")
    replica_nodes = args.replica_nodes or (
        spec.train.replica.nodes_per_replica if spec is not None else 1
    )
    if nodes % replica_nodes:
        raise BadInput(
            f"{nodes:,} nodes do not split into replicas of {replica_nodes}: make "
            "--replica-nodes divide the node count"
        )
    return nodes, replica_nodes


@dataclass
class _Preemptions:
    trace: tuple[TracedPreemption, ...]
    rate: float
    notice_fraction: float
    notice_s: float


def _preemptions(
    args: argparse.Namespace,
    spec: JobSpec | None,
    local: LocalCloudSpec | None,
    base: Path,
    cloud: str,
    spot: Offer,
) -> _Preemptions:
    trace: tuple[TracedPreemption, ...] = ()
    trace_path = args.trace
    if trace_path is None and local is not None and local.preemptions.trace:
        trace_path = str(base / local.preemptions.trace)
    if trace_path:
        try:
            trace = tuple(load_trace(trace_path))
        except ValueError as e:
            raise BadInput(str(e)) from None
    rate = args.rate_per_node_hour
    if rate is None and local is not None:
        rate = local.preemptions.rate_per_hour
    if rate is None:
        # No trace: the catalog's band as the planner reads it. A trace alone: just it.
        rate = 0.0 if args.trace else spot.interruption_risk / HOURS_PER_MONTH
    notice_fraction = args.notice_fraction
    if notice_fraction is None:
        notice_fraction = local.preemptions.notice_fraction if local is not None else 1.0
    notice_s = args.notice_s
    if notice_s is None:
        if spec is not None:
            notice_s = spec.notice_windows.get(cloud, NOTICE_WINDOW_S.get(cloud, 30.0))
        else:
            notice_s = NOTICE_WINDOW_S.get(cloud, 30.0)
    return _Preemptions(trace, rate, notice_fraction, notice_s)


@dataclass
class _Recovery:
    ckpt_gb: float | None
    write_gbps: float | None
    every_min: float | None
    spot_policy: SpotPolicy
    fallback_s: float
    launch_latency: float | None


def _recovery(
    args: argparse.Namespace, spec: JobSpec | None, local: LocalCloudSpec | None
) -> _Recovery:
    """Checkpoint, spot policy and launch settings: the options', else the spec's."""
    ckpt_gb = args.ckpt_gb
    write_gbps = args.write_gbps
    every_min = args.ckpt_every_min
    spot_policy = SpotPolicy(args.spot_policy) if args.spot_policy else SpotPolicy.SPOT
    fallback_s = 1800.0
    launch_latency = args.launch_latency_s
    if spec is not None:
        if ckpt_gb is None:
            ckpt_gb = spec.checkpoint.estimated_gb
        if write_gbps is None:
            write_gbps = spec.checkpoint.volume.write_gbps
        if every_min is None:
            every_min = spec.checkpoint.every_minutes
        if args.spot_policy is None:
            spot_policy = spec.spot.policy
        fallback_s = spec.spot.fallback_after_minutes * 60.0
        if launch_latency is None and local is not None:
            launch_latency = local.launch_latency_s
    return _Recovery(ckpt_gb, write_gbps, every_min, spot_policy, fallback_s, launch_latency)


def _policies(args: argparse.Namespace) -> tuple[str, ...]:
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise BadInput(
            f"--policies: {', '.join(unknown) or 'none given'}; choose from {', '.join(POLICIES)}"
        )
    if len(set(policies)) != len(policies):
        raise BadInput("--policies: name each policy once")
    if args.png:
        parent = Path(args.png).resolve().parent
        if not parent.is_dir():
            raise BadInput(f"--png {args.png}: the directory {parent} does not exist")
    return policies

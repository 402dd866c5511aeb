"""``spottrain simulate``: a job of up to 100,000 GPUs on spot VMs, simulated for days in
seconds, under three ways of training through preemptions, side by side on one fleet.

A discrete-event simulation (:mod:`spottrain.controller.sim_engine`): VMs are preempted (at a
per-node rate, by zone-wide reclaims, or from a trace), with or without the notice window;
the controller's **real planner** (:func:`spottrain.controller.planner.plan`) decides every
backfill, pass by pass, as ``spottrain up`` would; launches take time and can be refused for
capacity. Three training policies (:mod:`spottrain.controller.sim_policies`) watch the same
fleet, so they are compared on the same preemptions:

- ``sync``: fully synchronous, restart everything from the last periodic checkpoint once
  the fleet is whole again (what most teams run);
- ``elastic``: spottrain today: emergency checkpoints on notice, survivors re-form at the
  smaller size, a backfill joins with another re-form;
- ``replica``: replicas as the unit of fault tolerance (modelled; spottrain's later goal):
  survivors keep stepping, a rejoining replica copies its state from a live peer.

Reported per policy: effective training time (the share of wall time spent on steps that
count, at the full fleet's rate), dollars per useful GPU-hour and against on-demand, and the
work each preemption cost (rolled back, and all GPU-hours short of the full fleet).

Defaults, and where each comes from
-----------------------------------
- ``--gpus 100000``: the scale the design aims at (12,500 VMs of 8 GPUs).
- ``--cloud aws --instance-type p5.48xlarge``, ``us-east-1a``: prices from the bundled catalog
  (``cloud/data/catalog.json``: 8 H100, $55.04/h on-demand, spot at 0.45 of it).
- ``--rate-per-node-hour``: the type's Spot Instance Advisor band as the planner reads it
  (band midpoint / 730 h, ``planner.hourly_risk``): 0.25 / 730 = 0.00034 for p5's ">20%".
- ``--notice-fraction 1.0``: AWS and GCP give spot VMs their notice.
- ``--notice-s``: 120 on AWS, 30 on GCP (``spottrain.spec.NOTICE_WINDOW_S``); a notice's
  emergency save must end 10 s before the VM does (``spottrain.spec.DRAIN_OVERHEAD_S``).
- ``--zone-reclaims-per-day 0``: off unless asked; each takes ``--reclaim-share 0.05`` of the
  running VMs and leaves the zone without spot capacity for ``--reclaim-outage-min 30``
  (assumptions).
- ``--ckpt-gb 84``: a 7B model at 12 bytes per parameter (the spec's ``bytes_per_param``, the
  model of ``examples/aws_job.yaml``).
- ``--write-gbps 4``: the aggregate bandwidth of the example job's volume
  (``examples/aws_job.yaml``). ``bench/checkpoint.py`` measured the SDK's emergency save at
  1.71x one raw sequential writer on the same disk, so the volume, not the SDK, is the bound.
- ``--load-gbps``: the write bandwidth (restarts read the checkpoint back from the volume).
- ``--ckpt-every-min 20``: ``examples/aws_job.yaml``.
- ``--launch-latency-s 300``: an assumption (no bench measures it): launch, boot, image,
  the agent's health check.
- ``--rendezvous-s 4.4``: ``bench/rendezvous.py`` (d), an explicit leave to training again
  at the new size (re-form, workers restarted, state loaded).
- ``--detect-s 3.7``: ``bench/rendezvous.py`` (a) minus (d): a SIGKILLed node costs 8.1 s,
  3.7 s more than a leave (the heartbeat timeout).
- A join's save must fit in 30 s: torch's restart path kills the workers then (README,
  "Limits that remain").
- ``--peer-gbps 12.5``: an assumption, one 100 Gb/s link per node from a live peer (p4d has
  four, p5 thirty-two).
- ``--replica-nodes 1``, ``--scaling 1.0``: a node per data-parallel replica, throughput in
  proportion to the replicas (the global batch is kept by gradient accumulation).
- ``--pass-s 1``: ``spottrain up --interval``.

``--spec job.yaml`` takes the fleet size, instance type and region, checkpoint size, volume
bandwidth and cadence, the notice window, the spot policy, and (for the local cloud) the
injected preemptions from a job spec; options given on the command line win.

Not modelled: moving the job to another zone, budgets, stragglers, data loading, and the
planner's boot timeouts unless the launch latency exceeds them. Each policy's periodic
checkpoint stops training for its write.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from spottrain.cloud.base import Market, Offer, region_of_zone
from spottrain.cloud.catalog import Catalog, UnknownInstanceType, UnknownRegion, bundled
from spottrain.cloud.local import TracedPreemption, load_trace
from spottrain.controller.reconcile.pricing import HOURS_PER_MONTH
from spottrain.controller.sim_engine import SimConfig, SimResult, simulate
from spottrain.controller.sim_policies import POLICIES
from spottrain.controller.sim_report import figures, plot, table
from spottrain.spec import NOTICE_WINDOW_S, JobSpec, SpecError, SpotPolicy, load_spec

EXIT_OK = 0
EXIT_BAD_INPUT = 2

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


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``simulate`` and its options to a ``spottrain`` subcommand set."""
    p = sub.add_parser(
        "simulate",
        help="simulate a big spot job's preemptions and compare ways of training through them",
        description=(
            "Simulate a job of up to 100,000 GPUs on spot VMs: preemptions (a per-node rate, "
            "zone-wide reclaims or a trace), the controller's real planner backfilling, and "
            "three policies on the same fleet: sync (restart everything from the last "
            "periodic checkpoint), elastic (spottrain today: emergency checkpoints, re-form "
            "smaller) and replica (survivors keep stepping; modelled). Prints effective "
            "training time, $ per useful GPU-hour against on-demand, and work lost per "
            "preemption. Defaults and their sources: `pydoc spottrain.controller.simulate`."
        ),
        epilog="Exit codes: 0 done, 2 bad input.",
    )
    size = p.add_argument_group("the job")
    size.add_argument("--spec", help="take sizes, prices and checkpoint settings from a job spec")
    size.add_argument("--gpus", type=int, help=f"GPUs in the job (default {DEFAULT_GPUS:,})")
    size.add_argument("--gpus-per-node", type=int, help="GPUs per VM (default: the type's)")
    size.add_argument("--cloud", choices=sorted(DEFAULT_TYPES), help="default aws")
    size.add_argument("--instance-type", help="default p5.48xlarge (aws), a3-highgpu-8g (gcp)")
    size.add_argument("--region", help="default: the catalog's reference region")
    size.add_argument("--zone", help="default: the region's first zone")
    size.add_argument("--spot-usd", type=float, help="spot $ per VM-hour (default: catalog)")
    size.add_argument("--on-demand-usd", type=float, help="on-demand $ per VM-hour (catalog)")
    size.add_argument("--spot-policy", choices=[s.value for s in SpotPolicy], help="default spot")
    size.add_argument("--replica-nodes", type=int, help="nodes per data-parallel replica (1)")
    size.add_argument("--scaling", type=float, help="throughput ~ replicas**SCALING (1.0)")
    when = p.add_argument_group("time")
    span = when.add_mutually_exclusive_group()
    span.add_argument("--days", type=float, help="simulated days (default 7)")
    span.add_argument("--hours", type=float, help="simulated hours")
    when.add_argument("--seed", type=int, default=0, help="everything random comes from it")
    pre = p.add_argument_group("preemptions")
    pre.add_argument(
        "--rate-per-node-hour", type=float, help="preemptions per VM-hour (default: catalog band)"
    )
    pre.add_argument("--notice-fraction", type=float, help="share with a notice (1.0)")
    pre.add_argument("--notice-s", type=float, help="notice window (aws 120, gcp 30)")
    pre.add_argument("--zone-reclaims-per-day", type=float, help="zone-wide reclaims (0)")
    pre.add_argument(
        "--reclaim-share",
        type=float,
        help=f"share of VMs a reclaim takes ({DEFAULT_RECLAIM_SHARE})",
    )
    pre.add_argument(
        "--reclaim-outage-min",
        type=float,
        help=f"minutes without spot capacity after a reclaim ({DEFAULT_RECLAIM_OUTAGE_MIN:g})",
    )
    pre.add_argument("--trace", help="YAML/JSON list of {at_s, node, notice} preemptions")
    rec = p.add_argument_group("recovery")
    rec.add_argument("--ckpt-gb", type=float, help=f"checkpoint size ({DEFAULT_CKPT_GB:g} GB)")
    rec.add_argument(
        "--write-gbps", type=float, help=f"aggregate checkpoint write GB/s ({DEFAULT_WRITE_GBPS:g})"
    )
    rec.add_argument("--load-gbps", type=float, help="checkpoint load GB/s at a restart (= write)")
    rec.add_argument(
        "--ckpt-every-min",
        type=float,
        help=f"periodic checkpoint interval ({DEFAULT_CKPT_EVERY_MIN:g}; 0: none)",
    )
    rec.add_argument(
        "--launch-latency-s",
        type=float,
        help=f"launch to a healthy VM ({DEFAULT_LAUNCH_LATENCY_S:g})",
    )
    rec.add_argument(
        "--rendezvous-s", type=float, help=f"one re-form and restart ({DEFAULT_RENDEZVOUS_S:g})"
    )
    rec.add_argument(
        "--detect-s", type=float, help=f"finding a VM lost without notice ({DEFAULT_DETECT_S:g})"
    )
    rec.add_argument(
        "--peer-gbps", type=float, help=f"replica catch-up GB/s per node ({DEFAULT_PEER_GBPS:g})"
    )
    rec.add_argument("--pass-s", type=float, help="seconds between controller passes (1)")
    out = p.add_argument_group("output")
    out.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated, of {', '.join(POLICIES)} (default all)",
    )
    out.add_argument("--png", help="write a plot here")
    out.add_argument("--json", action="store_true", help="print the figures as one JSON object")


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
)


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
    gpn = picked.gpus_per_node

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
    replica_nodes = args.replica_nodes or 1
    if nodes % replica_nodes:
        raise BadInput(
            f"{nodes:,} nodes do not split into replicas of {replica_nodes}: make "
            "--replica-nodes divide the node count"
        )

    if args.hours is not None:
        hours = args.hours
    elif args.days is not None:
        hours = args.days * 24.0
    else:
        hours = 168.0

    local = spec.local if spec is not None and cloud == "local" else None
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
    if hours * (rate * nodes + 1) > 5e7:
        raise BadInput(
            f"{hours:g} h at {rate:g} preemptions per node-hour on {nodes:,} nodes is "
            f"{hours * rate * nodes:,.0f} preemptions; simulate at most about 50 million"
        )
    return SimConfig(
        nodes=nodes,
        spot=spot,
        on_demand=od,
        gpus_per_node=gpn,
        hours=hours,
        rate_per_node_hour=rate,
        notice_fraction=notice_fraction,
        notice_s=notice_s,
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
        trace=trace,
        ckpt_gb=ckpt_gb if ckpt_gb is not None else DEFAULT_CKPT_GB,
        write_gbps=write_gbps if write_gbps is not None else DEFAULT_WRITE_GBPS,
        load_gbps=args.load_gbps,
        ckpt_every_s=(
            math.inf
            if every_min == 0
            else 60.0 * (every_min if every_min is not None else DEFAULT_CKPT_EVERY_MIN)
        ),
        launch_latency_s=(
            launch_latency if launch_latency is not None else DEFAULT_LAUNCH_LATENCY_S
        ),
        rendezvous_s=args.rendezvous_s if args.rendezvous_s is not None else DEFAULT_RENDEZVOUS_S,
        detect_s=args.detect_s if args.detect_s is not None else DEFAULT_DETECT_S,
        peer_gbps=args.peer_gbps if args.peer_gbps is not None else DEFAULT_PEER_GBPS,
        replica_nodes=replica_nodes,
        scaling=args.scaling if args.scaling is not None else 1.0,
        pass_s=args.pass_s if args.pass_s is not None else 1.0,
        spot_policy=spot_policy,
        fallback_after_s=fallback_s,
        policies=policies,
        seed=args.seed,
        samples=max(24, min(336, round(hours))),
    )


def settings(cfg: SimConfig) -> dict[str, Any]:
    """The settings a run used, for its JSON."""
    costs = cfg.costs()
    return {
        "rate_per_node_hour": cfg.rate_per_node_hour,
        "notice_fraction": cfg.notice_fraction,
        "notice_s": cfg.notice_s,
        "zone_reclaims_per_day": cfg.zone_reclaims_per_day,
        "trace_rows": len(cfg.trace),
        "ckpt_gb": cfg.ckpt_gb,
        "write_gbps": cfg.write_gbps,
        "ckpt_every_min": None if math.isinf(cfg.ckpt_every_s) else cfg.ckpt_every_s / 60.0,
        "save_s": round(costs.save_s, 3),
        "load_s": round(costs.load_s, 3),
        "launch_latency_s": cfg.launch_latency_s,
        "rendezvous_s": cfg.rendezvous_s,
        "detect_s": cfg.detect_s,
        "catch_up_s": round(costs.catch_up_s, 3),
        "replica_nodes": cfg.replica_nodes,
        "scaling": cfg.scaling,
        "pass_s": cfg.pass_s,
        "spot_policy": cfg.spot_policy.value,
    }


def command(args: argparse.Namespace) -> int:
    """Run ``spottrain simulate``: 0 done, 2 bad input (one line on stderr)."""
    try:
        cfg = config_from_args(args)
    except BadInput as e:
        print(f"spottrain simulate: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    res: SimResult = simulate(cfg)
    if args.png:
        plot(res, args.png)
    if args.json:
        out = figures(res)
        out["settings"] = settings(cfg)
        if args.png:
            out["png"] = str(args.png)
        print(json.dumps(out))
    else:
        print(table(res))
        if args.png:
            print(f"plot: {args.png}")
    return EXIT_OK


__all__ = ["BadInput", "add_parser", "command", "config_from_args", "settings"]

"""``spottrain simulate``: a job of up to 100,000 GPUs on spot VMs, simulated for days in
seconds, under four ways of training through preemptions, side by side on one fleet.

A discrete-event simulation (:mod:`spottrain.controller.sim.engine`): VMs are preempted (at
a per-node rate, by zone-wide reclaims, or from a trace), with or without the notice window;
the controller's **real planner** (:func:`spottrain.controller.reconcile.planner.plan`)
decides every backfill, pass by pass, as ``spottrain up`` would; launches take time and can
be refused for capacity. Four training policies (:mod:`spottrain.controller.sim.policies`)
watch the same fleet, so they are compared on the same preemptions:

- ``sync``: fully synchronous, restart everything from the last periodic checkpoint once
  the fleet is whole again (what most teams run);
- ``elastic``: spottrain today: emergency checkpoints on notice, survivors re-form at the
  smaller size, a backfill joins with another re-form;
- ``replica``: replicas as the unit of fault tolerance on torchft 0.2.0 (``train.fault_tolerance:
  replica``), with its measured costs: survivors keep stepping, but every step waits for a
  quorum round (the Redis quorum's, linear in the replica count, or with ``--quorum
  lighthouse`` the stock lighthouse's, quadratic) and every quorum change rebuilds the
  cross-replica process group on every survivor;
- ``replica-ideal``: the same with a quorum and process group that cost nothing (the first
  model, kept as the bound a quorum that scales would approach).

Reported per policy: effective training time (the share of wall time spent on steps that
count, at the full fleet's rate), dollars per useful GPU-hour and against on-demand, and the
work each preemption cost (rolled back, and all GPU-hours short of the full fleet).

Defaults, and where each comes from
-----------------------------------
- ``--gpus 100000``: the scale the design aims at (12,500 VMs of 8 GPUs).
- ``--cloud aws --instance-type p5.48xlarge``, ``us-east-1a``: prices from the bundled catalog
  (``spottrain/data/catalog.json``: 8 H100, $55.04/h on-demand, spot at 0.45 of it).
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
- The ``replica`` policy's costs (:mod:`spottrain.controller.sim.replica_params`, where each
  source is given; the text output and ``--json`` print them beside the result, marked
  measured or modelled): ``--step-s 6`` (modelled: Llama 3 405B's 16M-token step on H100 at
  about 40% MFU); ``--heartbeat-s`` (the quorum's heartbeat timeout: with the Redis quorum
  the spec's ``auto`` for the simulated replicas, 1 s up to 2,500 and 5 s at 12,500, or a
  ``--spec``'s own number; with the lighthouse the controller's 1 s, and a noticed loss
  stalls its survivors for it plus a step, as it has no leave); ``--kill-stall-s`` (a loss
  without notice, before the step redone: 1.08 x the heartbeat timeout with the Redis
  quorum, measured by ``bench/quorum_scale.py``, 5.40 s at 5 s; the timeout + 0.1 s with
  the lighthouse, measured with torchft); ``--join-start-s 4.9`` (measured: a
  joiner's start to its first full step); ``--quorum redis`` (default: each step waits for
  the Redis quorum's round, ``--redis-quorum-a-s`` + ``--redis-quorum-b-s`` N, fitted by
  ``bench/quorum_scale.py`` up to 12,500 simulated replicas, and a noticed loss costs one
  round: the leave; from ``--relay-from 1000`` replicas on, through relays:
  ``--relay-hop-s`` + ``--relay-redis-b-s`` N) or ``--quorum lighthouse``
  (``--quorum-a-s``/``--quorum-b-s``: a round of N replicas is a N + b N^2, fitted on the
  stock lighthouse up to 1,000 replicas);
  ``--pg-base-s``/``--pg-per-replica-s`` (a process-group rebuild at every quorum change,
  c0 + c1 n, fitted on gloo at 2..16 ranks).

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
from typing import Any

from spottrain.controller.sim.config import (
    DEFAULT_CKPT_EVERY_MIN,
    DEFAULT_CKPT_GB,
    DEFAULT_DETECT_S,
    DEFAULT_GPUS,
    DEFAULT_LAUNCH_LATENCY_S,
    DEFAULT_PEER_GBPS,
    DEFAULT_RECLAIM_OUTAGE_MIN,
    DEFAULT_RECLAIM_SHARE,
    DEFAULT_RENDEZVOUS_S,
    DEFAULT_TYPES,
    DEFAULT_WRITE_GBPS,
    BadInput,
    config_from_args,
)
from spottrain.controller.sim.engine import simulate
from spottrain.controller.sim.model import SimConfig, SimResult
from spottrain.controller.sim.replica_params import (
    LIGHTHOUSE_HEARTBEAT_S,
    LIGHTHOUSE_KILL_OVERHEAD_S,
    QUORUMS,
    REDIS_KILL_STALL_PER_HEARTBEAT,
    ReplicaParams,
)
from spottrain.controller.sim.replica_policy import POLICIES
from spottrain.controller.sim.report import figures, plot, table
from spottrain.spec import SpotPolicy

EXIT_OK = 0
EXIT_BAD_INPUT = 2


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``simulate`` and its options to a ``spottrain`` subcommand set."""
    p = sub.add_parser(
        "simulate",
        help="simulate a big spot job's preemptions and compare ways of training through them",
        description=(
            "Simulate a job of up to 100,000 GPUs on spot VMs: preemptions (a per-node rate, "
            "zone-wide reclaims or a trace), the controller's real planner backfilling, and "
            "four policies on the same fleet: sync (restart everything from the last "
            "periodic checkpoint), elastic (emergency checkpoints, re-form smaller), replica "
            "(survivors keep stepping, torchft's measured costs) and replica-ideal (the same "
            "with a free quorum). Prints effective "
            "training time, $ per useful GPU-hour against on-demand, and work lost per "
            "preemption. Defaults and their sources: `pydoc spottrain.controller.sim.command`."
        ),
        epilog="Exit codes: 0 done, 2 bad input.",
    )
    _job_options(p)
    _time_options(p)
    _preemption_options(p)
    _recovery_options(p)
    _replica_options(p)
    _output_options(p)


def _job_options(p: argparse.ArgumentParser) -> None:
    """The job: its size, VM type, prices and replicas."""
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


def _time_options(p: argparse.ArgumentParser) -> None:
    """The simulated span and the seed."""
    when = p.add_argument_group("time")
    span = when.add_mutually_exclusive_group()
    span.add_argument("--days", type=float, help="simulated days (default 7)")
    span.add_argument("--hours", type=float, help="simulated hours")
    when.add_argument("--seed", type=int, default=0, help="everything random comes from it")


def _preemption_options(p: argparse.ArgumentParser) -> None:
    """How VMs are preempted: a rate, zone-wide reclaims or a trace."""
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


def _recovery_options(p: argparse.ArgumentParser) -> None:
    """What a recovery costs: checkpoint sizes and speeds, launch, re-form."""
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


def _replica_options(p: argparse.ArgumentParser) -> None:
    """The replica policy's measured costs (defaults: replica_params)."""
    d = ReplicaParams()
    rep = p.add_argument_group("the replica policy (torchft 0.2.0, measured)")
    rep.add_argument("--step-s", type=float, help=f"one training step ({d.step_s:g} s)")
    rep.add_argument(
        "--heartbeat-s",
        type=float,
        help="the quorum's heartbeat timeout (default: the Redis quorum's auto for the "
        "replicas, max(1, replicas / 2,500) s rounded up to 0.5 s, 5 s at 12,500; the "
        f"lighthouse's {LIGHTHOUSE_HEARTBEAT_S:g} s)",
    )
    rep.add_argument(
        "--kill-stall-s",
        type=float,
        help="survivors' stall at a SIGKILL, before the step redone (default: from the "
        f"heartbeat timeout: x {REDIS_KILL_STALL_PER_HEARTBEAT:g} with the Redis quorum, "
        f"+ {LIGHTHOUSE_KILL_OVERHEAD_S:g} s with the lighthouse)",
    )
    rep.add_argument(
        "--join-start-s", type=float, help=f"joiner start to first step ({d.join_start_s:g})"
    )
    rep.add_argument(
        "--quorum-a-s",
        type=float,
        help=f"lighthouse quorum round a N + b N^2: a ({d.quorum_a_s:.3g})",
    )
    rep.add_argument("--quorum-b-s", type=float, help=f"quorum round: b ({d.quorum_b_s:.3g})")
    rep.add_argument(
        "--quorum",
        choices=QUORUMS,
        help="whose quorum costs the replica policy pays: the Redis quorum (default) or "
        "torchft's stock lighthouse (--quorum-a-s/--quorum-b-s)",
    )
    rep.add_argument(
        "--redis-quorum-a-s",
        type=float,
        help=f"Redis quorum round a + b N: a ({d.redis_a_s:.3g})",
    )
    rep.add_argument(
        "--redis-quorum-b-s", type=float, help=f"Redis quorum round: b ({d.redis_b_s:.3g})"
    )
    rep.add_argument(
        "--relay-from",
        type=int,
        help=f"replicas from which the Redis quorum goes through relays ({d.relay_from}; 0: never)",
    )
    rep.add_argument(
        "--relay-redis-b-s",
        type=float,
        help=f"a relayed round: hop + b N: b ({d.relay_b_s:.3g})",
    )
    rep.add_argument(
        "--relay-hop-s", type=float, help=f"a relayed round: the hop ({d.relay_hop_s:.3g} s)"
    )
    rep.add_argument(
        "--pg-base-s", type=float, help=f"process-group rebuild c0 + c1 n: c0 ({d.pg_c0_s:.3g})"
    )
    rep.add_argument(
        "--pg-per-replica-s", type=float, help=f"process-group rebuild: c1 ({d.pg_c1_s:.3g})"
    )


def _output_options(p: argparse.ArgumentParser) -> None:
    """Which policies, and the PNG and JSON output."""
    out = p.add_argument_group("output")
    out.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated, of {', '.join(POLICIES)} (default all)",
    )
    out.add_argument("--png", help="write a plot here")
    out.add_argument("--json", action="store_true", help="print the figures as one JSON object")


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
        "step_s": cfg.replica.step_s,
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

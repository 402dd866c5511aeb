"""What one planner pass costs over a plain list of nodes (no incremental index): the
simulate benchmark's anchor."""

from __future__ import annotations

import time
from collections.abc import Sequence

from spottrain.controller.reconcile.planner import plan
from spottrain.controller.reconcile.types import NodeObs, Observed, Policy
from spottrain.controller.sim.model import SimConfig


def plain_plan_seconds(cfg: SimConfig, nodes: Sequence[NodeObs], reps: int = 5) -> float:
    """Median seconds of one :func:`plan` over ``nodes`` given as a plain list (what each
    pass would cost without the incremental index), for the benchmark's anchor."""
    policy = Policy(min_nodes=1, max_nodes=cfg.nodes, spot_policy=cfg.spot_policy)
    obs = Observed(
        now=cfg.hours * 3600.0,
        nodes=list(nodes),
        offers=[cfg.spot, cfg.on_demand],
        home=(cfg.spot.cloud, cfg.spot.zone, cfg.spot.instance_type),
        next_index=len(nodes),
        job_tag=f"sim-{cfg.seed}",
    )
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        plan(policy, obs)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]

"""What a simulation is given (:class:`SimConfig`) and what it finds (:class:`SimResult`,
one :class:`PolicyResult` per training policy)."""

from __future__ import annotations

from dataclasses import dataclass, field

from spottrain.cloud.base import Offer
from spottrain.controller.reconcile.types import NodeObs
from spottrain.controller.sim.policies import Costs
from spottrain.controller.sim.replica_params import ReplicaParams
from spottrain.spec import SpotPolicy
from spottrain.trace import TracedPreemption


@dataclass(frozen=True)
class SimConfig:
    """One simulation. See :mod:`spottrain.controller.sim.command` for what each default is
    and where it comes from.

    Attributes:
        nodes: nodes of the full-size job (its slots, and the planner's ``max_nodes``).
        gpus_per_node: GPUs per VM.
        hours: simulated hours.
        spot, on_demand: the home zone's offers.
        rate_per_node_hour: preemptions per running VM-hour.
        notice_fraction: share of preemptions that come with the notice.
        notice_s: the notice window.
        zone_reclaims_per_day: reclaims of many VMs at once (Poisson).
        reclaim_share: share of the running VMs one reclaim takes.
        reclaim_outage_s: how long the zone then has no spot capacity.
        trace: preemptions at given times (added to the rates).
        ckpt_gb: one checkpoint's size.
        write_gbps: the checkpoint volume's aggregate write bandwidth.
        load_gbps: how fast a restart loads the checkpoint (None: ``write_gbps``).
        ckpt_every_s: periodic checkpoint interval (``inf``: none).
        launch_latency_s: a launch to a booted, healthy VM ready to join.
        rendezvous_s: a re-form (membership agreed, workers restarted).
        detect_s: what finding a VM that vanished without notice adds.
        peer_gbps: a node's network bandwidth from a live peer (replica catch-up).
        replica_nodes: nodes per data-parallel replica.
        scaling: throughput at a share x of the replicas is x ** scaling.
        pass_s: seconds between controller passes (0: a pass at the instant of a change).
        replica: the ``replica`` policy's measured costs (step time, stalls, quorum,
            process-group rebuild, join).
        spot_policy, fallback_after_s: the planner's market policy.
        policies: which training policies watch the fleet.
        seed: everything random comes from it.
        samples: points of the throughput timeline.
    """

    nodes: int
    spot: Offer
    on_demand: Offer
    gpus_per_node: int = 8
    hours: float = 168.0
    rate_per_node_hour: float = 0.0
    notice_fraction: float = 1.0
    notice_s: float = 120.0
    zone_reclaims_per_day: float = 0.0
    reclaim_share: float = 0.05
    reclaim_outage_s: float = 1800.0
    trace: tuple[TracedPreemption, ...] = ()
    ckpt_gb: float = 84.0
    write_gbps: float = 4.0
    load_gbps: float | None = None
    ckpt_every_s: float = 1200.0
    launch_latency_s: float = 300.0
    rendezvous_s: float = 4.4
    detect_s: float = 3.7
    peer_gbps: float = 12.5
    replica_nodes: int = 1
    scaling: float = 1.0
    pass_s: float = 1.0
    replica: ReplicaParams = field(default_factory=ReplicaParams)
    spot_policy: SpotPolicy = SpotPolicy.SPOT
    fallback_after_s: float = 1800.0
    policies: tuple[str, ...] = ("sync", "elastic", "replica", "replica-ideal")
    seed: int = 0
    samples: int = 168

    def costs(self) -> Costs:
        load = self.load_gbps if self.load_gbps is not None else self.write_gbps
        return Costs(
            slots=self.nodes,
            replica_nodes=self.replica_nodes,
            notice_s=self.notice_s,
            save_s=self.ckpt_gb / self.write_gbps,
            load_s=self.ckpt_gb / load,
            rendezvous_s=self.rendezvous_s,
            detect_s=self.detect_s,
            catch_up_s=self.ckpt_gb / self.replica_nodes / self.peer_gbps,
            ckpt_every_s=self.ckpt_every_s,
            scaling=self.scaling,
            replica=self.replica,
        )


@dataclass
class PolicyResult:
    """What one policy made of the fleet."""

    name: str
    progress_s: float  # full-fleet seconds of training that count
    lost_s: float  # full-fleet seconds thrown away by rollbacks
    rollbacks: int
    checkpoints: int
    timeline: list[float]  # useful throughput (share of the full fleet) per sample bin


@dataclass
class SimResult:
    """The fleet's figures and each policy's."""

    config: SimConfig
    preemptions: int = 0
    with_notice: int = 0
    reclaims: int = 0
    launches: int = 0
    on_demand_launches: int = 0
    capacity_errors: int = 0
    terminated: int = 0
    passes: int = 0
    plan_s: float = 0.0
    wall_s: float = 0.0
    vm_hours: float = 0.0
    cost_usd: float = 0.0
    stop_reason: str = ""
    sample_hours: list[float] = field(default_factory=list)
    policies: list[PolicyResult] = field(default_factory=list)
    final_nodes: list[NodeObs] = field(default_factory=list)

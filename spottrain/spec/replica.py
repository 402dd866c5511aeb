"""What replica mode (``train.fault_tolerance: replica``) needs of the rest of a spec: whole
replicas of nodes, a quorum that can form at ``nodes.min``, one GPU type across replicas, and
VMs the controller boots itself (pure decisions: each returns the problem's one line, or
nothing); and the agent settings that select the mode."""

from __future__ import annotations

from typing import TYPE_CHECKING

from spottrain.catalog import Catalog
from spottrain.protocol import env as env_names

from .code import ImageCode
from .heartbeat import DEFAULT_QUORUM_HEARTBEAT_S, HEARTBEAT_AUTO, auto_heartbeat_timeout_s
from .relay import RELAY_GROUP_AUTO
from .sections import (
    JOIN_TIMEOUT_AUTO,
    JOIN_TIMEOUT_MS_RANGE,
    FaultTolerance,
    Placement,
    QuorumKind,
)

if TYPE_CHECKING:
    from .job import JobSpec

# torchft's lighthouse's join timeout in this project (spottrain.quorum.model's default),
# the floor of the automatic one.
DEFAULT_JOIN_TIMEOUT_MS = 250
# torchft's lighthouse drops a replica after its own fixed 1 s (the controller starts it with
# controller/run/lighthouse.py's HEARTBEAT_TIMEOUT_MS): a spec with the lighthouse may spell
# exactly that out, as specs written when 1 was the default do.
LIGHTHOUSE_HEARTBEAT_S = DEFAULT_QUORUM_HEARTBEAT_S
# Redis CPU per replica per round, all on Redis's one thread: 54 µs, measured by
# bench/quorum_scale.py at 12,500 replicas (INFO commandstats: the request script, its BLPOP
# and the heartbeats).
REDIS_ROUND_US_PER_REPLICA = 54


def auto_join_timeout_ms(replicas_max: int) -> int:
    """The join timeout for a fleet of up to ``replicas_max`` replicas: twice the time Redis
    takes to serve one request from each (a round whose requests arrive together is served
    one after the other, so the last is answered ``replicas x 54 µs`` after the first), never
    below the lighthouse's 250 ms nor past the spec's bound. A shorter one forms a changed
    quorum before late replicas were even served; each then joins the next round, at a
    process-group rebuild each time. Past ~2,300 replicas it grows above 250 ms."""
    served_ms = -(-2 * max(replicas_max, 0) * REDIS_ROUND_US_PER_REPLICA // 1000)  # ceil
    return min(JOIN_TIMEOUT_MS_RANGE[1], max(DEFAULT_JOIN_TIMEOUT_MS, served_ms))


def join_timeout_ms(spec: JobSpec) -> int:
    """The Redis quorum's join timeout for ``spec``: ``train.replica.join_timeout_ms``, or
    for ``auto`` :func:`auto_join_timeout_ms` of ``nodes.max / nodes_per_replica``."""
    r = spec.train.replica
    if r.join_timeout_ms != JOIN_TIMEOUT_AUTO:
        return int(r.join_timeout_ms)
    return auto_join_timeout_ms(spec.nodes.max // r.nodes_per_replica)


def heartbeat_timeout_s(spec: JobSpec) -> float:
    """The Redis quorum's heartbeat timeout for ``spec``: ``train.replica.
    heartbeat_timeout_s``, or for ``auto`` :func:`.heartbeat.auto_heartbeat_timeout_s` of
    ``nodes.max / nodes_per_replica``."""
    r = spec.train.replica
    if r.heartbeat_timeout_s != HEARTBEAT_AUTO:
        return float(r.heartbeat_timeout_s)
    return auto_heartbeat_timeout_s(spec.nodes.max // r.nodes_per_replica)


# Relays pay off from here (bench/quorum_scale.py: ~54 µs of Redis per direct request, so
# 1,000 replicas already cost a 54 ms round) and the automatic group size.
RELAY_AUTO_FROM_REPLICAS = 1000
RELAY_AUTO_GROUP = 100


def relay_group_size(spec: JobSpec) -> int:
    """Replicas per quorum relay for ``spec`` (0: no relays): ``train.replica.
    relay_group_size``, or for ``auto`` 100 from 1,000 replicas at ``nodes.max`` on."""
    r = spec.train.replica
    if r.quorum is not QuorumKind.REDIS:
        return 0
    if r.relay_group_size != RELAY_GROUP_AUTO:
        return int(r.relay_group_size)
    replicas = spec.nodes.max // r.nodes_per_replica
    return RELAY_AUTO_GROUP if replicas >= RELAY_AUTO_FROM_REPLICAS else 0


def replica_problem(spec: JobSpec) -> str | None:
    """The first thing in ``spec`` that replica mode cannot run, or None (also for an elastic
    job). The catalog's part is :func:`replica_gpu_types_problem`."""
    if spec.train.fault_tolerance is not FaultTolerance.REPLICA:
        return None
    r = spec.train.replica
    k, least = r.nodes_per_replica, r.min_replicas
    redis_only = {
        "wait_replicas": bool(r.wait_replicas),
        "heartbeat_timeout_s": r.heartbeat_timeout_s
        not in (HEARTBEAT_AUTO, LIGHTHOUSE_HEARTBEAT_S),
        "join_timeout_ms": r.join_timeout_ms != JOIN_TIMEOUT_AUTO,
        "relay_group_size": r.relay_group_size != RELAY_GROUP_AUTO,
    }
    key = next((name for name, set_ in redis_only.items() if set_), None)
    if r.quorum is QuorumKind.LIGHTHOUSE and key == "heartbeat_timeout_s":
        return (
            f"train.replica.heartbeat_timeout_s: {r.heartbeat_timeout_s:g} s, but torchft's "
            f"lighthouse drops a replica after its own fixed {LIGHTHOUSE_HEARTBEAT_S:g} s "
            "(the controller starts it with that timeout): remove it (or write "
            f"{LIGHTHOUSE_HEARTBEAT_S:g}), or use quorum: redis for a timeout of your own"
        )
    if r.quorum is QuorumKind.LIGHTHOUSE and key:
        return (
            f"train.replica.{key}: applies to the Redis quorum only (quorum: redis); "
            "torchft's lighthouse runs with its own fixed settings: remove it or use "
            "quorum: redis"
        )
    floor = least * k
    lo, hi = spec.nodes.min, spec.nodes.max
    if lo < floor:
        lower = ", or lower train.replica.min_replicas" if least > 1 else ""
        return (
            f"nodes.min: {lo} is below train.replica.min_replicas x nodes_per_replica "
            f"({least} x {k} = {floor}), so the job could run with too few nodes for a "
            f"quorum and train nothing: raise nodes.min to {floor}{lower}"
        )
    bad = [f"{key} ({n})" for key, n in (("nodes.min", lo), ("nodes.max", hi)) if n % k]
    if bad:
        # A node left over from whole replicas would be paid for and never train.
        return (
            f"{' and '.join(bad)}: not a multiple of train.replica.nodes_per_replica ({k}); "
            "a partial replica cannot train: use whole replicas, e.g. nodes.min "
            f"{_round_up(lo, k)} and nodes.max {max(_round_up(lo, k), hi - hi % k)}"
        )
    return None


def replica_agent_env(spec: JobSpec) -> dict[str, str]:
    """The agent's replica-mode settings (``SPOTTRAIN_*``, for the boot script and the local
    cloud's boot); empty for an elastic job, whose settings stay as they were. The quorum
    (``redis`` or ``lighthouse``) is among them; the lighthouse's address is not: it moves
    whenever the controller restarts the lighthouse, so the agent reads it from the run's
    Redis at each launch."""
    if spec.train.fault_tolerance is not FaultTolerance.REPLICA:
        return {}
    redis = spec.train.replica.quorum is QuorumKind.REDIS
    return {
        env_names.ENV_FAULT_TOLERANCE: spec.train.fault_tolerance.value,
        env_names.ENV_NODES_PER_REPLICA: str(spec.train.replica.nodes_per_replica),
        env_names.ENV_MIN_REPLICAS: str(spec.train.replica.min_replicas),
        env_names.ENV_QUORUM: spec.train.replica.quorum.value,
        **(
            {env_names.ENV_QUORUM_WAIT_REPLICAS: str(spec.train.replica.wait_replicas)}
            if spec.train.replica.wait_replicas
            else {}
        ),
        **(
            {env_names.ENV_QUORUM_HEARTBEAT_TIMEOUT: f"{heartbeat_timeout_s(spec):g}"}
            if redis and heartbeat_timeout_s(spec) != DEFAULT_QUORUM_HEARTBEAT_S
            else {}
        ),
        **(
            {env_names.ENV_QUORUM_JOIN_TIMEOUT: str(join_timeout_ms(spec))}
            if redis and join_timeout_ms(spec) != DEFAULT_JOIN_TIMEOUT_MS
            else {}
        ),
        **(
            {env_names.ENV_QUORUM_RELAY_GROUP: str(relay_group_size(spec))}
            if relay_group_size(spec)
            else {}
        ),
    }


def describe_replica(spec: JobSpec) -> str | None:
    """``validate``'s line for a replica-mode job (None for an elastic one): the replica's
    size, how many replicas the node range gives, the quorum's floor and where it forms (in
    Redis: with the join and heartbeat timeouts it resolved, since ``auto`` depends on the
    fleet), and where torchft comes from."""
    if spec.train.fault_tolerance is not FaultTolerance.REPLICA:
        return None
    r = spec.train.replica
    k = r.nodes_per_replica
    join = ""
    if r.quorum is QuorumKind.REDIS:
        how = " (auto)" if r.join_timeout_ms == JOIN_TIMEOUT_AUTO else ""
        join = f" with a {join_timeout_ms(spec)} ms join timeout{how}"
        how = " (auto)" if r.heartbeat_timeout_s == HEARTBEAT_AUTO else ""
        join += f" and a {heartbeat_timeout_s(spec):g} s heartbeat timeout{how}"
        group = relay_group_size(spec)
        join += f", relayed by one VM per {group} replicas" if group else ""
    if isinstance(spec.code, ImageCode):
        source = (
            "the image must hold torchft (pip install 'spottrain[agent,replica]'): nothing "
            "installs it at boot"
        )
    elif set(spec.resources.clouds) == {"local"}:
        source = "the local VMs run in this venv, which needs spottrain[replica] (torchft)"
    else:
        source = "each VM installs spottrain[replica] (torchft)"
    return (
        f"fault tolerance replica: {k} node(s) per replica, {spec.nodes.min // k}-"
        f"{spec.nodes.max // k} replicas, a step commits with at least {r.min_replicas} "
        f"replica(s), its quorum {_QUORUM_WHERE[r.quorum]}{join}; {source}"
    )


_QUORUM_WHERE = {
    QuorumKind.REDIS: "in the run's Redis",
    QuorumKind.LIGHTHOUSE: "from torchft's lighthouse, which the controller runs",
}


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def allowed_gpu_types(spec: JobSpec, catalog: Catalog) -> dict[str, list[str]]:
    """The GPU types the planner may launch for ``spec``: ``{gpu type: [cloud type names]}``
    over the allowed clouds, from ``resources.instance_types`` or, when it is empty, every
    type in the catalog with at least ``nodes.gpus`` GPUs (what the offers are filtered by).
    Names the catalog does not know are left out (:func:`check_catalog` reports them)."""
    out: dict[str, list[str]] = {}
    for cloud in spec.resources.clouds:
        known = catalog.types(cloud)
        if spec.resources.instance_types:
            types = [known[n] for n in spec.resources.instance_types if n in known]
        else:
            types = [t for t in known.values() if t.gpus >= spec.nodes.gpus]
        for t in types:
            out.setdefault(t.gpu_type, []).append(t.name)
    return out


def replica_gpu_types_problem(spec: JobSpec, catalog: Catalog) -> str | None:
    """Spread placement in replica mode with more than one GPU type allowed, or None.

    Spread placement picks each node's offer on its own (the cheapest in the emptiest
    zone), so replicas, and the nodes inside one, would land on different GPU types: every
    step waits for the slowest replica, a joiner heals from a peer that computes in other
    kernels (the replicas no longer agree bitwise), and a replica sharded over mixed
    memory sizes may not fit. Same-zone placement keeps every node on one type."""
    if spec.train.fault_tolerance is not FaultTolerance.REPLICA:
        return None
    if spec.resources.placement is not Placement.SPREAD:
        return None
    gpu_types = allowed_gpu_types(spec, catalog)
    if len(gpu_types) <= 1:
        return None
    if spec.resources.instance_types:
        listed = "; ".join(f"{g}: {', '.join(names)}" for g, names in sorted(gpu_types.items()))
    else:
        listed = f"{', '.join(sorted(gpu_types))}: resources.instance_types is empty, so all"
    return (
        f"resources.placement: spread in replica mode would mix GPU types across replicas "
        f"({listed}): list instance types of one GPU type in resources.instance_types, or "
        "use placement: same-zone"
    )

"""What the ``replica`` policy's events cost, from measurements of torchft 0.2.0 (issue 15,
``bench/quorum_scale.py``), each with its source and whether it was measured or modelled.

- A replica lost **with notice**: with the Redis quorum (the default) the leaver's explicit
  leave lands within one round (``bench/quorum_scale.py``'s leave -> quorum: 0.006-0.64 s),
  so the survivors stop for one quorum round, never a heartbeat timeout. torchft 0.2.0's
  lighthouse has no leave: its survivors wait for the leaver's heartbeats to expire
  (``heartbeat_s``) plus the step in flight.
- A replica lost **without notice** (SIGKILL): the survivors wait for its heartbeats to
  expire, then the step in flight is discarded and redone (``kill_stall_s`` + ``step_s``).
  The heartbeat timeout (``heartbeat_s``) is the quorum's own unless given: the Redis
  quorum's grows with the fleet as the spec's ``heartbeat_timeout_s: auto`` does
  (:func:`spottrain.spec.heartbeat.auto_heartbeat_timeout_s`: 1 s up to 2,500 replicas, 5 s
  at 12,500); the lighthouse's is the 1 s the controller gives it. ``kill_stall_s`` follows
  it unless given: 1.08 x the timeout with the Redis quorum (``bench/quorum_scale.py``'s
  silent loss -> quorum: 5.40 s at a 5 s timeout at 12,500 replicas, 1.01-1.11 s at 1 s),
  the timeout + 0.1 s with the lighthouse (torchft 0.2.0 measured 1.1 s at 1 s).
- **Every quorum change** (a leave or a join) makes every survivor rebuild the cross-replica
  process group: ``pg_c0_s + pg_c1_s * n`` for a group of ``n`` replicas, fitted on torchft's
  ``ProcessGroupGloo.configure`` at 2..16 ranks (``bench/quorum_scale.py``) and extrapolated
  linearly. The survivors stop for all of it (a synchronous quorum; torchft's asynchronous
  one could hide up to a forward pass of it).
- **Every step** waits for a quorum round of the live replicas. With ``quorum="redis"``
  (the default, issue 16's quorum in the run's Redis): ``redis_a_s + redis_b_s * n``,
  fitted by ``bench/quorum_scale.py`` on 100..12,500 simulated replicas (each step's bytes
  are O(1) per replica; Redis's work per round is linear in n). With
  ``quorum="lighthouse"`` (torchft's stock lighthouse, which answers every member with
  every member): ``quorum_a_s * n + quorum_b_s * n^2``, fitted on 10..1,000 fake replicas;
  beyond that it is extrapolated. A step then takes ``step_s + quorum``, so the fleet trains
  at ``step_s / (step_s + quorum)`` of its rate.
- From ``relay_from`` replicas on (the spec's ``relay_group_size: auto``: 1,000), the Redis
  quorum's requests go through relays of 100: a round is then ``relay_hop_s + relay_b_s *
  n``, the relays' hop (member -> relay -> member, in parallel on their own VMs) plus
  Redis's CPU for the batches and the steady FORM, fitted by ``bench/quorum_scale.py`` on
  100..12,500 relayed replicas.
- A **joiner** takes ``join_start_s`` from its start to its first full step (measured 3.6-4.9
  s, mostly Python and torch imports), then one process-group rebuild, then the state
  from a live peer: the checkpoint's size / nodes per replica / ``--peer-gbps``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from spottrain.controller.run.lighthouse import HEARTBEAT_TIMEOUT_MS
from spottrain.spec.heartbeat import auto_heartbeat_timeout_s

# bench/quorum_scale.py, 2 cores, torchft 0.2.0: 0.0017, 0.025, 0.16 and 1.58 s a round at
# 10, 100, 300 and 1,000 replicas (the README's quorum table). The clients shared the
# lighthouse's 2 cores (and other jobs ran), so this is the high estimate for a fleet; the
# lighthouse's own CPU seconds fit 3.6e-5 N + 7.6e-7 N^2, the low one (--quorum-b-s).
QUORUM_A_S = 8.24e-5
QUORUM_B_S = 1.494e-6
# The Redis quorum, bench/quorum_scale.py (issue 16), 2 cores, an otherwise idle machine:
# 0.0042, 0.043, 0.149 and 0.551 s a round (p50, last request sent to every answer) at 100,
# 1,000, 4,000 and 12,500 simulated replicas, fitting 4.34e-5 N; but the clients sent their
# requests over 0.36 s at 12,500, and Redis's own CPU per round fits 5.39e-5 N (0.68 s at
# 12,500, 54 us a replica): what a fleet whose requests arrive together waits at least, so
# that is the cost taken (a kept 0). Earlier runs under other load and older scripts: 0.87-
# 1.45 s at 12,500.
REDIS_MEASURED_UP_TO = 12_500
REDIS_A_S = 0.0
REDIS_B_S = 5.389e-5
# Through relays of 100 (issue 16's relays, bench/quorum_scale.py, load average 2-6): Redis's
# CPU per round 0.56, 3.6, 12.8 and 42 ms at 100, 1,000, 4,000 and 12,500 replicas (all
# Redis did in the round, heartbeats included; rounds' p50 0.66, 2.5, 7.1 and 27 ms): 3.36e-6
# N. The hop member -> relay -> member: relay_cost.py, 100 members on one machine, a
# stand-in quorum: 19-27 ms a round p50 (the relay's CPU 6.5-9.1 ms of it).
RELAY_FROM = 1000
RELAY_B_S = 3.36e-6
RELAY_HOP_S = 0.023
# The same run: 0.020, 0.041, 0.091 and 0.20 s at 2, 4, 8 and 16 ranks (one process each).
PG_C0_S = 0.0
PG_C1_S = 0.01217
# A silent loss to the quorum without it, over the heartbeat timeout. The Redis quorum
# (bench/quorum_scale.py): 5.40 s at a 5 s timeout (12,500 replicas, run on its own), 1.01,
# 1.03 and 1.11 s at 1 s (100, 1,000 and 4,000 replicas): the sweep lags the expiry by a
# share of the timeout (a waiter TICKs every timeout / 4 or more), 8 % at 5 s, 1-11 % at 1 s.
# torchft 0.2.0's lighthouse: a survivor's stall of 1.1 s at its 1 s timeout (issue 15).
REDIS_KILL_STALL_PER_HEARTBEAT = 1.08
LIGHTHOUSE_KILL_OVERHEAD_S = 0.1
# The heartbeat timeout the controller gives torchft's lighthouse (fixed: 1 s).
LIGHTHOUSE_HEARTBEAT_S = HEARTBEAT_TIMEOUT_MS / 1000


@dataclass(frozen=True)
class ReplicaParams:
    """The measured replica costs; see the module's docstring for each."""

    step_s: float = 6.0
    heartbeat_s: float | None = None  # None: the quorum's own (heartbeat_timeout_s)
    kill_stall_s: float | None = None  # None: from the heartbeat timeout (kill_stall)
    join_start_s: float = 4.9
    quorum_a_s: float = QUORUM_A_S
    quorum_b_s: float = QUORUM_B_S
    pg_c0_s: float = PG_C0_S
    pg_c1_s: float = PG_C1_S
    redis_a_s: float = REDIS_A_S
    redis_b_s: float = REDIS_B_S
    relay_from: int = RELAY_FROM  # replicas from which the Redis quorum uses relays (0: never)
    relay_b_s: float = RELAY_B_S
    relay_hop_s: float = RELAY_HOP_S
    quorum: str = "redis"  # or "lighthouse": which quorum's costs the policy pays

    def __post_init__(self) -> None:
        if self.quorum not in QUORUMS:
            raise ValueError(f"quorum {self.quorum!r}: choose one of {', '.join(QUORUMS)}")

    def quorum_s(self, replicas: int) -> float:
        """One quorum round of ``replicas`` live replicas."""
        if self.quorum == "redis":
            if self.relay_from and replicas >= self.relay_from:
                return self.relay_hop_s + self.relay_b_s * replicas
            return self.redis_a_s + self.redis_b_s * replicas
        return self.quorum_a_s * replicas + self.quorum_b_s * replicas * replicas

    def step_share(self, replicas: int) -> float:
        """The share of a step's time spent training, the rest waiting for the quorum."""
        return self.step_s / (self.step_s + self.quorum_s(replicas))

    def pg_rebuild_s(self, replicas: int) -> float:
        """One cross-replica process-group rebuild for a group of ``replicas``."""
        return self.pg_c0_s + self.pg_c1_s * replicas

    def heartbeat_timeout_s(self, fleet: int) -> float:
        """The quorum's heartbeat timeout for a fleet of ``fleet`` replicas (``nodes.max /
        nodes_per_replica``): ``heartbeat_s`` where given, else the Redis quorum's automatic
        one (the spec's ``auto``) or the lighthouse's fixed one."""
        if self.heartbeat_s is not None:
            return self.heartbeat_s
        if self.quorum == "redis":
            return auto_heartbeat_timeout_s(fleet)
        return LIGHTHOUSE_HEARTBEAT_S

    def kill_stall(self, fleet: int) -> float:
        """A silent loss to the quorum without it: ``kill_stall_s`` where given, else the
        measured overhead on the heartbeat timeout (the module's docstring)."""
        if self.kill_stall_s is not None:
            return self.kill_stall_s
        timeout = self.heartbeat_timeout_s(fleet)
        if self.quorum == "redis":
            return REDIS_KILL_STALL_PER_HEARTBEAT * timeout
        return timeout + LIGHTHOUSE_KILL_OVERHEAD_S

    def notice_stall_s(self, replicas: int) -> float:
        """The survivors' stop on a noticed loss among ``replicas`` live ones: the Redis
        quorum's explicit leave lands within one round; torchft 0.2.0's lighthouse has none
        (its fixed heartbeat timeout and the step in flight)."""
        if self.quorum == "redis":
            return self.quorum_s(replicas)
        return self.heartbeat_timeout_s(replicas) + self.step_s

    def kill_stall_total_s(self, fleet: int) -> float:
        """The survivors' stop on a silent loss in a fleet of ``fleet`` replicas, the step
        in flight redone included."""
        return self.kill_stall(fleet) + self.step_s


QUORUMS = ("redis", "lighthouse")

SOURCES: dict[str, tuple[str, str]] = {
    "step_s": (
        "modelled",
        "Llama 3 405B (Llama 3 paper, 2024): 16M-token steps on 16,384 H100 at 38-43% MFU, "
        "6 x 405e9 x 16e6 / (16,384 x 989 TFLOP/s x 0.4) = 6.0 s; the batch grows with the "
        "GPUs to keep it",
    ),
    "join_start_s": (
        "measured",
        "a restarted replica's start to its first full step: 3.6-4.9 s, the top taken "
        "(issue 15, torchft 0.2.0, mostly imports)",
    ),
    "quorum_a_s": (
        "measured",
        "bench/quorum_scale.py: stock lighthouse round = a N + b N^2, fitted on 10..1,000 "
        "fake replicas (1.58 s at 1,000; clients on the same 2 cores: the high estimate)",
    ),
    "quorum_b_s": (
        "measured",
        "bench/quorum_scale.py, the same fit (the lighthouse's own CPU fits b = 7.6e-7, "
        "the low estimate)",
    ),
    "redis_a_s": (
        "measured",
        "bench/quorum_scale.py: the Redis quorum's round = a + b N, fitted on 100..12,500 "
        "simulated replicas: Redis's own CPU per round (0.68 s at 12,500, above the round's "
        "p50 of 0.55 s, whose clients sent their requests over 0.36 s)",
    ),
    "redis_b_s": (
        "measured",
        "bench/quorum_scale.py, the same fit: 54 us of Redis CPU per replica on one core, "
        "the least a fleet's round can take when its requests arrive together",
    ),
    "relay_from": (
        "setting",
        "train.replica.relay_group_size: auto turns relays of 100 on from 1,000 replicas "
        "(nodes.max / nodes_per_replica); 0 here: never",
    ),
    "relay_b_s": (
        "measured",
        "bench/quorum_scale.py through relays of 100: Redis's CPU per round 0.56, 3.6, 12.8 "
        "and 42 ms at 100, 1,000, 4,000 and 12,500 replicas (heartbeats included), 3.36e-6 N",
    ),
    "relay_hop_s": (
        "measured",
        "spottrain.agent.quorum_shim.relay_cost: a relay's round for 100 members over its "
        "framed TCP wire, 19-27 ms p50 on one 2-core machine shared by the members (relay "
        "CPU 6.5-9.1 ms); relays run in parallel on their own VMs",
    ),
    "pg_c0_s": (
        "measured",
        "bench/quorum_scale.py: torchft ProcessGroupGloo.configure + an all-reduce = c0 + "
        "c1 n, fitted on 2..16 ranks (0.20 s at 16)",
    ),
    "pg_c1_s": (
        "measured",
        "bench/quorum_scale.py, the same fit; linear beyond 16 ranks is a model (gloo's "
        "full mesh looks up every peer in one store)",
    ),
}


# The heartbeat timeouts at which a silent loss was measured, per quorum (the docstring).
KILL_MEASURED_AT_S = {"redis": (1.0, 5.0), "lighthouse": (1.0,)}
_LIGHTHOUSE_NOTICE = (
    "a noticed loss is modelled as it plus a step (the lighthouse has no leave), the high "
    "bound: bench/replica.py measured the leave of one of three replicas at one step + "
    "0.2-0.3 s (0.43-0.59 s at 0.21-0.38 s steps, 2 cores), the lighthouse's join timeout, "
    "not its heartbeat"
)
_REDONE = "; plus the step in flight, redone (modelled)"


def _heartbeat_source(params: ReplicaParams, fleet: int) -> tuple[str, str]:
    if params.heartbeat_s is not None:
        return "setting", "given (--heartbeat-s, or --spec's train.replica.heartbeat_timeout_s)"
    if params.quorum == "redis":
        return "setting", (
            f"train.replica.heartbeat_timeout_s: auto at {fleet:,} replicas (spottrain.spec."
            "heartbeat: max(1, replicas / 2,500) s rounded up to 0.5 s, 1 s up to 2,500 "
            "replicas, 5 s at 12,500; --heartbeat-s sets one); with the Redis quorum only a "
            "loss without notice waits for it: a noticed one leaves, one round"
        )
    return "setting", (
        f"the heartbeat timeout the controller gives torchft's lighthouse "
        f"({HEARTBEAT_TIMEOUT_MS:,} ms, controller/run/lighthouse.py, issue 15); "
        + _LIGHTHOUSE_NOTICE
    )


def _kill_source(params: ReplicaParams, fleet: int) -> tuple[str, str]:
    if params.kill_stall_s is not None:
        return "setting", "given (--kill-stall-s)" + _REDONE
    timeout = params.heartbeat_timeout_s(fleet)
    kind = "measured" if timeout in KILL_MEASURED_AT_S[params.quorum] else "modelled"
    if params.quorum == "redis":
        return kind, (
            f"{REDIS_KILL_STALL_PER_HEARTBEAT:g} x the heartbeat timeout: bench/quorum_scale.py's "
            "silent loss -> quorum, 5.40 s at a 5 s timeout (12,500 replicas) and 1.01-1.11 s "
            "at 1 s (100-4,000 replicas), the sweep lagging the expiry by a share of the "
            "timeout (a waiter TICKs every timeout / 4 or more); measured at 1 and 5 s only"
            + _REDONE
        )
    return kind, (
        f"the heartbeat timeout + {LIGHTHOUSE_KILL_OVERHEAD_S:g} s: survivor's stall after a "
        "SIGKILL, 1.1 s at a 1,000 ms heartbeat timeout, torchft 0.2.0, 2 cores, two "
        "replicas (issue 15)" + _REDONE + ". bench/replica.py, three replicas: 0.58-1.37 s "
        "in all with the redone step (the majority goes on after the join timeout); "
        "SIGSTOP 1.25-1.58 s"
    )


def timeout_sources(params: ReplicaParams, fleet: int) -> dict[str, dict[str, Any]]:
    """``heartbeat_s`` and ``kill_stall_s`` for a fleet of ``fleet`` replicas, resolved,
    each with its kind and source (they depend on the quorum, the fleet and what was
    given)."""
    values = {
        "heartbeat_s": (params.heartbeat_timeout_s(fleet), _heartbeat_source(params, fleet)),
        "kill_stall_s": (params.kill_stall(fleet), _kill_source(params, fleet)),
    }
    return {
        name: {"value": round(value, 4), "kind": kind, "source": source}
        for name, (value, (kind, source)) in values.items()
    }


def describe(params: ReplicaParams, replicas: int, catch_up_s: float) -> dict[str, Any]:
    """Every parameter with its source, and what they cost at ``replicas`` replicas (which
    of those figures are extrapolated beyond what was measured is said)."""
    timeouts = timeout_sources(params, replicas)
    out: dict[str, Any] = {}
    for name, value in asdict(params).items():
        if name in timeouts:
            out[name] = timeouts[name]
        elif name in SOURCES:
            kind, source = SOURCES[name]
            out[name] = {"value": value, "kind": kind, "source": source}
    if params.quorum == "redis":
        top = REDIS_MEASURED_UP_TO
        quorum_note = "measured" if replicas <= top else f"extrapolated beyond {top:,}"
    else:
        quorum_note = "measured" if replicas <= 1000 else "extrapolated beyond 1,000"
    pg_note = "measured" if replicas <= 16 else "extrapolated beyond 16 ranks"
    out["at_replicas"] = {
        "replicas": replicas,
        "quorum": params.quorum,
        "relayed": params.quorum == "redis" and 0 < params.relay_from <= replicas,
        "quorum_s_per_step": round(params.quorum_s(replicas), 4),
        "quorum_kind": quorum_note,
        "step_share": round(params.step_share(replicas), 5),
        "pg_rebuild_s": round(params.pg_rebuild_s(replicas), 3),
        "pg_kind": pg_note,
        "notice_stall_s": round(params.notice_stall_s(replicas), 4),
        "kill_stall_s": round(params.kill_stall_total_s(replicas), 4),
        "join_s": round(params.join_start_s + catch_up_s, 3),
        "catch_up_s": round(catch_up_s, 3),
    }
    return out

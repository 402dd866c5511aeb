"""The Redis key schema of a job: every part of spottrain builds its keys here.

All keys of one run share the prefix ``{prefix}:{<run_id>}:``. The braces are a Redis Cluster
hash tag, so every key of a run lands in one slot and the multi-key Lua scripts stay legal on
a cluster.

A run id is the job's name plus its launch epoch (``train-gpt-1732270000``): a relaunch under
the same name gets fresh keys and never meets the old run's closed rendezvous or stale nodes.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

DEFAULT_PREFIX = "spottrain"

_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,46}[a-z0-9])?\Z")
_RUN_ID_RE = re.compile(r"^(?P<name>[a-z0-9]([a-z0-9-]{0,46}[a-z0-9])?)-(?P<epoch>[0-9]{9,12})\Z")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}\Z")
# torchrun hands us whatever --rdzv-id says; keep it safe for keys, logs and file names.
_ANY_RUN_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}\Z")


def validate_job_name(name: str) -> str:
    """Check a job name: lowercase letters, digits and dashes, 1-48 characters.

    The same rule as cloud labels (GCP labels are the strictest), so the name can tag VMs.

    Raises:
        ValueError: the name does not fit, with the rule in the message.
    """
    if not _NAME_RE.match(name):
        raise ValueError(
            f"job name {name!r} is not allowed: use 1-48 lowercase letters, digits and dashes, "
            "starting and ending with a letter or digit (it becomes a cloud label)"
        )
    return name


def make_run_id(name: str, epoch: int | None = None) -> str:
    """Return the run id of a launch of job ``name``: ``<name>-<unix seconds>``."""
    validate_job_name(name)
    if epoch is None:
        epoch = int(time.time())
    if not 100_000_000 <= epoch < 10**12:
        raise ValueError(f"launch epoch must be unix seconds (9-12 digits), got {epoch}")
    return f"{name}-{epoch}"


def parse_run_id(run_id: str) -> tuple[str, int]:
    """Split a run id made by :func:`make_run_id` into (job name, launch epoch).

    Raises:
        ValueError: ``run_id`` was not made by :func:`make_run_id`.
    """
    m = _RUN_ID_RE.match(run_id)
    if not m:
        raise ValueError(f"{run_id!r} is not a spottrain run id (<job-name>-<launch epoch>)")
    return m.group("name"), int(m.group("epoch"))


def validate_run_id(run_id: str) -> str:
    """Check any run id used as a key component (torchrun's ``--rdzv-id`` included)."""
    if not _ANY_RUN_ID_RE.match(run_id):
        raise ValueError(
            f"run id {run_id!r} is not allowed: use 1-128 letters, digits, '.', '_' or '-'"
        )
    return run_id


@dataclass(frozen=True)
class RunKeys:
    """The keys of one run. Build it once per run and ask it for names; never format keys
    anywhere else."""

    run_id: str
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        validate_run_id(self.run_id)
        if not _PREFIX_RE.match(self.prefix):
            raise ValueError(
                f"key prefix {self.prefix!r} is not allowed: use 1-64 letters, digits, "
                "'.', '_' or '-'"
            )

    @property
    def base(self) -> str:
        return f"{self.prefix}:{{{self.run_id}}}"

    # -- rendezvous ---------------------------------------------------------------------------
    @property
    def rdzv_state(self) -> str:
        """Hash {state, token}: torch's pickled rendezvous state and its fencing token."""
        return f"{self.base}:rdzv:state"

    @property
    def rdzv_presence(self) -> str:
        """Sorted set member -> last heartbeat (Redis server time, ms)."""
        return f"{self.base}:rdzv:presence"

    @property
    def rdzv_gone(self) -> str:
        """Hash member -> why it is gone ("left", "dead"); a gone member never beats again and
        may only rejoin under a new identity."""
        return f"{self.base}:rdzv:gone"

    @property
    def rdzv_members(self) -> str:
        """Hash node id -> rendezvous member, so an agent can make its own node leave."""
        return f"{self.base}:rdzv:members"

    @property
    def rdzv_view(self) -> str:
        """Hash: the membership view of the newest complete round (round, world size,
        participants). The round is the fencing number for checkpoint commits."""
        return f"{self.base}:rdzv:view"

    def store_key(self, key: str) -> str:
        """A key of the run's ``torch.distributed.Store``."""
        return f"{self.base}:store:{key}"

    @property
    def store_pattern(self) -> str:
        return f"{self.base}:store:*"

    # -- replica mode -------------------------------------------------------------------------
    @property
    def replica_slots(self) -> str:
        """Hash slot ("replica-<j>") -> JSON {"nodes": [node ids], "at": unix s, "gen": n},
        claimed atomically by each node's agent in replica mode (a slot holds
        nodes_per_replica nodes; a claim of an empty slot starts rendezvous generation n)."""
        return f"{self.base}:replica:slots"

    @property
    def replica_generations(self) -> str:
        """Hash slot -> the highest rendezvous generation it was given; it outlives the slot's
        record, so a generation number never repeats."""
        return f"{self.base}:replica:slots:generations"

    @property
    def replica_lighthouse(self) -> str:
        """String "host:port": where the run's lighthouse listens, written by the controller
        each time it (re)starts it; agents in replica mode read it at each launch."""
        return f"{self.base}:replica:lighthouse"

    @property
    def replica_holders(self) -> str:
        """Hash replica id -> JSON {state: "live" | "leaving", step, quorum_id, participants,
        discarded, at, longest_gap_s, longest_gap_step}, written by each replica's rank 0:
        which replicas hold the training state, so a leaver learns atomically whether it is
        the last (and the longest gap between its consecutive commits, for the summary)."""
        return f"{self.base}:replica:holders"

    # -- the replica quorum in Redis (spottrain.quorum) ----------------------------------------
    @property
    def quorum_base(self) -> str:
        """Prefix of the Redis quorum's keys (train.replica.quorum: redis); their layout and
        formats are documented in spottrain/quorum/__init__.py, the one module that writes them."""
        return f"{self.base}:quorum"

    def quorum_key(self, part: str) -> str:
        """One key of the Redis quorum, e.g. ``quorum_key("seq")``."""
        return f"{self.quorum_base}:{part}"

    def quorum_relay(self, group: int) -> str:
        """String: the address of the agent relaying relay group ``group``'s quorum requests
        (its lease, SET NX with a TTL; ``agent/quorum_shim/relay.py``)."""
        return self.quorum_key(f"relay:{group}")

    # -- checkpoints --------------------------------------------------------------------------
    @property
    def ckpt_requests(self) -> str:
        """Hash node id -> JSON checkpoint request (id, drain, deadline, at), written by the
        node's agent on a notice; rank 0 of the trainers polls it."""
        return f"{self.base}:ckpt:requests"

    @property
    def ckpt_request_seq(self) -> str:
        """Counter that numbers checkpoint requests."""
        return f"{self.base}:ckpt:request-seq"

    @property
    def ckpt_last(self) -> str:
        """Hash: the newest committed checkpoint (step, round, kind, drain, request_id, path,
        at), written by the committing rank; the agents wait on it."""
        return f"{self.base}:ckpt:last"

    @property
    def ckpt_refused(self) -> str:
        """Hash: how many checkpoint commits were refused as stale (``count``) and the newest
        refusal (node, step, kind, drain, round, epoch, reason, at), written by the refused
        rank 0; ``spottrain status`` shows it."""
        return f"{self.base}:ckpt:refused"

    @property
    def restores(self) -> str:
        """List of JSON {step, reached}: each restart of the job's workers, oldest first
        (the controller reads it every pass; the event stream is too long to scan)."""
        return f"{self.base}:restores"

    @property
    def ckpt_copied(self) -> str:
        """Hash: the newest checkpoint copied to object storage (step, url, at)."""
        return f"{self.base}:ckpt:copied"

    # -- fleet --------------------------------------------------------------------------------
    @property
    def nodes(self) -> str:
        """Set of node ids that registered with this run."""
        return f"{self.base}:nodes"

    def node(self, node_id: str) -> str:
        """Hash: a node's record (cloud, zone, instance type, GPUs, address, state)."""
        return f"{self.base}:node:{node_id}"

    def boot(self, node_id: str) -> str:
        """Hash: how a node's VM boot went (vm, stage, state, reason, at, source), written by
        the boot's loader on the VM, or by the controller from the VM's console output
        (:mod:`spottrain.protocol.boot`)."""
        return f"{self.base}:boot:{node_id}"

    def heartbeat(self, node_id: str) -> str:
        """A node's heartbeat, a key with a TTL: gone means the node stopped beating."""
        return f"{self.base}:hb:{node_id}"

    def notices(self, node_id: str) -> str:
        """List of JSON notices injected for a node (the controller's drains,
        ``spottrain-agent notify``); its agent pops them."""
        return f"{self.base}:notices:{node_id}"

    @property
    def events(self) -> str:
        """Stream of structured events (``spottrain logs`` reads it)."""
        return f"{self.base}:events"

    @property
    def progress(self) -> str:
        """Hash: step, loss, world size, tokens/s, updated by rank 0."""
        return f"{self.base}:progress"

    # -- controller -----------------------------------------------------------------------------
    @property
    def ctl(self) -> str:
        """Hash: the controller's own state (phase, home zone, next node index, the times
        the fleet went short, the last reason, the spec it runs, the streak of VMs that
        failed before training: ``failed_launches``, JSON)."""
        return f"{self.base}:ctl"

    @property
    def ctl_launches(self) -> str:
        """Hash node name -> JSON launch record (request id, offer, times, instance id,
        status): written before each launch, so a restarted controller repeats a launch
        instead of doubling it, and the ledger the job's spend is computed from."""
        return f"{self.base}:ctl:launches"

    @property
    def ctl_blocked(self) -> str:
        """Hash JSON offer key -> unix time until which the offer is blocked."""
        return f"{self.base}:ctl:blocked"

    @property
    def ctl_history(self) -> str:
        """Hash "cloud|zone|type" -> JSON {preemptions, bad_nodes}: what this job has seen."""
        return f"{self.base}:ctl:history"

    @property
    def ctl_group(self) -> str:
        """Hash member id -> JSON {drain_asked_at, removed_at, replace}: what the controller
        asked of each VM of a group-owned (Terraform) fleet, so a restarted controller keeps
        its victims instead of choosing new ones."""
        return f"{self.base}:ctl:group"

    @property
    def ctl_lease(self) -> str:
        """The controller's lease (a key with a TTL): one controller drives a run at a time."""
        return f"{self.base}:ctl:lease"

    @property
    def ctl_alive(self) -> str:
        """The controller's heartbeat (a key with a TTL, set every pass): the agents' dead
        man's switch ends a VM whose controller has been gone too long."""
        return f"{self.base}:ctl:alive"

    @property
    def pattern(self) -> str:
        """Matches every key of this run (for cleanup and ``down``)."""
        return f"{self.base}:*"

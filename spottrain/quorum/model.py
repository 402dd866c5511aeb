"""What the Redis quorum hands around: a member's fixed record, one step's answer, the full
roster (sent only when the membership changed) and the quorum's settings."""

from __future__ import annotations

from dataclasses import dataclass, field

# torchft's lighthouse defaults in this project (controller/run/lighthouse.py), kept so the
# two quorums compare like for like.
DEFAULT_HEARTBEAT_TIMEOUT_MS = 1000
DEFAULT_JOIN_TIMEOUT_MS = 250


@dataclass(frozen=True)
class QuorumConfig:
    """How the quorum decides. The same for every replica of a run (the agent passes it)."""

    heartbeat_timeout_ms: int = DEFAULT_HEARTBEAT_TIMEOUT_MS
    join_timeout_ms: int = DEFAULT_JOIN_TIMEOUT_MS
    min_replicas: int = 1


@dataclass(frozen=True)
class Member:
    """What stays fixed for one replica incarnation (torchft's ``QuorumMember`` without the
    per-step fields): written once at join, read back only in a changed roster."""

    replica_id: str  # torchft's "<name>:<uuid>": a restarted manager is a new member
    address: str = ""  # the manager's address (a healer fetches the checkpoint through it)
    store_address: str = ""  # the replica's TCPStore, "host:port"
    world_size: int = 1
    data: str = ""


@dataclass(frozen=True)
class Answer:
    """One replica's answer for one step: O(1) bytes, computed for it in Lua."""

    quorum_id: int
    replica_rank: int  # position among the members sorted by replica id
    replica_count: int
    max_step: int
    heal_from: int | None  # the replica rank to recover from, None when up to date
    roster_version: int  # the quorum id at which the membership last changed
    commit_failures: int  # the largest among the members this step
    epoch: str  # the state's generation: changes when Redis lost the quorum's state
    # Members not at max_step and their steps (usually empty): with the cached roster this
    # rebuilds torchft's full participant list exactly.
    behind: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Roster:
    """The full membership of the quorum formed at ``version``, sorted by replica id."""

    version: int
    members: tuple[Member, ...]


@dataclass(frozen=True)
class BatchItem:
    """One replica's request inside a relay's batch (``QuorumClient.request_batch``): the
    arguments ``QuorumClient.request`` takes."""

    replica_id: str
    step: int
    held_qid: int = 0  # the quorum id the replica holds (floors Redis's counter)
    commit_failures: int = 0
    shrink_only: bool = False

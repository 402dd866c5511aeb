"""What a quorum is to us: its id AND its members, not the id alone.

torchft 0.2.0's lighthouse keeps its state in memory: restarted, it hands out quorum id 1
again. The manager rebuilds the cross-replica process group only when the id changes, so
replicas already holding id 1 keep a group whose members differ from the new quorum's (one
collective timeout, one discarded step), and the new group's store keys
(``<store>/torchft/<id>/<rank>``) would meet the old group's under the same id.

Two small wrappers fix both: :class:`RecordingClient` sits between the manager and its
Rust client, remembers each quorum answer and, when an answer repeats the configured id
with other members, or with a member behind (healing) or a member whose last step was
discarded (both of which every member sees alike), makes the manager see a changed id, so
all members rebuild together; :func:`salted_store` adds the members' digest and the step
the quorum formed at to the store prefix, which every member computes the same from the
same answer.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class QuorumView:
    """One quorum answer, as far as we use it."""

    quorum_id: int
    replica_ids: tuple[str, ...]  # "<replica id>:<uuid>" of every member, the lighthouse's order
    replica_rank: int
    replica_world_size: int
    participant_rank: int | None  # None: healing (behind the max step) or a spare
    participants: int  # members at the max step: the step's data-parallel width
    heal: bool
    max_step: int
    commit_failures: int = 0

    @property
    def digest(self) -> str:
        return membership_digest(self.replica_ids)

    @property
    def salt(self) -> str:
        """Names the group built for this answer: the members and the step it formed at, so
        a restarted lighthouse's quorum 2 never meets the store keys of the old one's."""
        return f"{self.digest}-s{self.max_step}"

    @property
    def unsettled(self) -> bool:
        """Someone is behind (heals this step) or a member's last step was discarded: every
        member sees it the same, so every member rebuilds the group together."""
        return self.participants < self.replica_world_size or self.commit_failures > 0

    def names(self) -> list[str]:
        """The members' replica ids without torchft's uuid suffix."""
        return [r.split(":", 1)[0] for r in self.replica_ids]


def membership_digest(replica_ids: tuple[str, ...] | list[str]) -> str:
    """A short name for a set of members (order-free: the lighthouse's order may vary)."""
    return hashlib.sha256("\n".join(sorted(replica_ids)).encode()).hexdigest()[:12]


def salted_store(store_addr: str, digest: str) -> str:
    """The store prefix of a quorum's process group, unique to its members."""
    return f"{store_addr}/m{digest}"


class RecordingClient:
    """Wraps torchft's ``ManagerClient``: records every quorum answer and forces the manager
    to reconfigure when the same quorum id comes back with other members."""

    def __init__(self, inner: Any, manager: Any) -> None:
        self._inner = inner
        self._manager = manager
        self._lock = threading.Lock()
        self.last: QuorumView | None = None
        self.configured_digest: str | None = None
        self.id_reuses = 0  # answers that repeated the configured id and forced a rebuild

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        result = self._inner._quorum(*args, **kwargs)
        view = QuorumView(
            quorum_id=int(result.quorum_id),
            replica_ids=tuple(result.replica_ids),
            replica_rank=int(result.replica_rank),
            replica_world_size=int(result.replica_world_size),
            participant_rank=result.max_replica_rank,
            participants=int(result.max_world_size),
            heal=bool(result.heal),
            max_step=int(result.max_step),
            commit_failures=int(getattr(result, "commit_failures", 0) or 0),
        )
        with self._lock:
            same_id = view.quorum_id == self._manager._quorum_id
            if same_id and (view.digest != self.configured_digest or view.unsettled):
                # The manager compares ids only; -1 is never an id, so it reconfigures.
                self._manager._quorum_id = -1
                self.id_reuses += 1
            self.last = view
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

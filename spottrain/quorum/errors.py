"""The Redis quorum's errors: each message says what happened and what to do."""

from __future__ import annotations


class QuorumError(RuntimeError):
    """Base of the quorum's errors."""


class QuorumGone(QuorumError):
    """This replica identity left or was dropped (its heartbeats stopped): it can never rejoin
    under the same id. Restart the replica's manager, which joins under a new one."""


class QuorumTimeout(QuorumError):
    """No quorum formed in time (too few replicas, or Redis unreachable the whole time)."""


class QuorumCorrupt(QuorumError):
    """A quorum key holds something the scripts did not write; the message names the key and
    how to reset the quorum's keys."""

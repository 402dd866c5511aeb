"""The fault-tolerance mode of a session, and one step's work as a training loop sees it in
either mode (pure: no torch, no I/O).

``elastic`` (the default) is the checkpoint-and-restart path; ``replica`` trains each
replica on its own and averages gradients across them through torchft
(:mod:`spottrain.agent.replica`). A job switches in its spec (``train.fault_tolerance``),
which the agent hands to the workers as ``$SPOTTRAIN_FAULT_TOLERANCE``, so the same script
runs in both.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

from spottrain.protocol.env import ENV_FAULT_TOLERANCE

ELASTIC = "elastic"
REPLICA = "replica"
MODES = (ELASTIC, REPLICA)


def resolve_mode(given: str | None, env: dict[str, str] | None = None) -> str:
    """The mode: ``given``, else ``$SPOTTRAIN_FAULT_TOLERANCE``, else elastic.

    Raises:
        ValueError: the mode is neither ``elastic`` nor ``replica`` (one line naming where
            it came from).
    """
    environ = os.environ if env is None else env
    source = "fault_tolerance="
    value = given
    if not value:
        value, source = environ.get(ENV_FAULT_TOLERANCE, ""), f"${ENV_FAULT_TOLERANCE}="
    if not value:
        return ELASTIC
    mode = value.strip().lower()
    if mode not in MODES:
        raise ValueError(f"{source}{value!r} is not a fault-tolerance mode: use elastic or replica")
    return mode


@dataclass(frozen=True)
class StepWork:
    """This rank's part of the next step: the step's number (the optimizer steps committed
    so far) and the micro-batches (global sample indices) it computes.

    Iterate over it for the micro-batches; scale each micro-batch's mean loss by
    :meth:`weight` before ``backward``. The weights match the reduction the session does
    (elastic: gradients averaged over the ranks; replica: summed over the replicas taking
    part), so the step's gradient is the mean over the global batch either way.
    """

    step: int
    micro_ranges: tuple[range, ...]
    sample_scale: float  # the weight of one sample
    participants: int = 1  # ranks (elastic) or replicas (replica) computing the step
    participating: bool = True  # replica: False when this replica computes nothing
    healed: bool = False  # replica: it loaded a live peer's state at the start of the step
    quorum_id: int = -1  # replica: the quorum the step runs in
    participant_rank: int | None = 0  # replica: this replica's share of the step
    wait_s: float = 0.0  # replica: seconds the step's quorum (and a heal) took

    def __iter__(self) -> Iterator[range]:
        return iter(self.micro_ranges)

    def __len__(self) -> int:
        return len(self.micro_ranges)

    def weight(self, micro: range) -> float:
        """The factor for ``micro``'s mean loss: every sample of the step weighs the same."""
        return len(micro) * self.sample_scale

    @property
    def samples(self) -> list[int]:
        """The global sample indices this rank computes in the step."""
        return [i for r in self.micro_ranges for i in r]

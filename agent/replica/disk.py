"""Disk checkpoints in replica mode, through the house's checkpoint code (DCP shards,
manifest, atomic rename, fencing epochs).

Only one replica saves a periodic checkpoint: the step's lowest participant (rank 0 of the
quorum). Each save claims a fresh fencing epoch of the directory just before it writes, so
epochs follow the saves in time: a writer that froze mid-save and woke after a newer save
claimed its epoch is refused (the never-backwards fence of
:mod:`spottrain.agent.checkpoint.epochs`); quorum ids, which the stock lighthouse restarts
at 1, play no part in it.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..checkpoint import dcp_io
from ..checkpoint.directory import CheckpointDir

log = logging.getLogger("spottrain.replica")


class ReplicaCheckpoints:
    """The job's checkpoint directory as one replica uses it.

    Args:
        root: The shared checkpoint directory (it must exist).
        replica_id: Names this replica's writers in the fencing epochs.
        keep: Committed checkpoints to keep.
        group: The replica's own process group (None: one rank).
    """

    def __init__(
        self, root: str | os.PathLike[str], replica_id: str, *, keep: int = 3, group: Any = None
    ) -> None:
        self.ckdir = CheckpointDir(root)
        self.replica_id = replica_id
        self.keep = keep
        self.group = group
        self._rank = dist.get_rank(group) if group is not None else 0
        self.saves: list[dcp_io.SaveResult] = []
        if self._rank == 0:
            self.ckdir.check_writable()

    def restore(
        self,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
        manager_state: dict[str, int],
    ) -> dict[str, int] | None:
        """Load the newest checkpoint that verifies; return its manager state (step,
        batches committed), or None when there is none. ``state_dict`` gives the template
        DCP loads into (shapes and dtypes); ``load_state_dict`` applies the result."""
        choice = None
        if self._rank == 0:
            found = self.ckdir.find_restorable()
            for name, why in found.skipped if found else []:
                log.warning("restore skipped %s: %s", name, why)
            choice = str(found.path) if found is not None else None
        choice = dcp_io.broadcast_from_first(choice, self.group)
        if choice is None:
            return None
        template = {"user": state_dict(), "torchft": dict(manager_state)}
        dcp_io.load(template, Path(choice), group=self.group)
        load_state_dict(template["user"])
        restored = {k: int(v) for k, v in template["torchft"].items()}
        log.warning("replica restored step %d from %s", restored["step"], choice)
        return restored

    def save(
        self,
        step: int,
        state: dict[str, Any],
        manager_state: dict[str, int],
        *,
        kind: str,
        quorum_id: int,
    ) -> dcp_io.SaveResult | None:
        """Save and commit ``state`` as checkpoint ``step``, fenced by a fresh epoch (every
        rank of the replica calls it). None: the write failed (logged; training goes on)."""
        epoch = -1
        if self._rank == 0:
            generation = f"{self.replica_id} step {step} pid {os.getpid()} {uuid.uuid4().hex[:12]}"
            epoch = self.ckdir.claim_epoch(generation)
        epoch = dcp_io.broadcast_from_first(epoch, self.group)
        try:
            result = dcp_io.save(
                {"user": state, "torchft": dict(manager_state)},
                self.ckdir,
                step=step,
                round_=-1,
                kind=kind,
                extra={"replica": self.replica_id, "quorum_id": quorum_id},
                group=self.group,
                keep=self.keep,
                epoch=epoch,
            )
        except dcp_io.CheckpointWriteError as exc:
            log.error("%s checkpoint at step %d failed: %s", kind, step, exc)
            return None
        self.saves.append(result)
        if result.committed:
            log.warning("%s checkpoint step %d committed (%s)", kind, step, result.path)
        return result

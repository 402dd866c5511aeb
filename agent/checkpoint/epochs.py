"""Fencing epochs: which generation of writers may commit to a checkpoint directory.

**Fencing epochs.** A *generation* is one set of writers that save together: the workers of
one rendezvous round, which the trainer SDK's rank 0 represents. At its start it claims a
fencing epoch from the directory itself (:meth:`Epochs.claim`): the next free
number in ``.epochs/``, taken by hard-linking a fully written file to ``epoch-<n>``, which
fails if that name exists. ``link`` is atomic and exclusive on local file systems and on NFS
(where an answer lost and retried is recognised by the link count), so two generations never
hold the same epoch, and epochs only go up. A commit carries its writer's epoch in the
manifest and is refused when a higher epoch has been claimed in the directory: a node frozen
mid-save, woken after a newer generation started, cannot overwrite its work. Nothing here
depends on the rendezvous round, which restarts at 0 whenever the rendezvous state is new (Redis
lost its data, its keys expired, a relaunch under a new ``--rdzv-id``): such a restart claims
a higher epoch like any other and commits. The round is still checked against Redis by the
SDK's fence callback, which only refuses while the same Redis says a newer round trains (it
fences a round that has formed but whose workers have not claimed their epoch yet).

A generation claiming under the same ``generation`` string gets the same epoch (each member
of a generation may claim on its own); the newest claims are kept (``KEEP_EPOCHS``).
The check of the newest epoch happens just before the commit's rename, not atomically with it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import time
import uuid
from pathlib import Path

from spottrain.fileio import fsync_dir

from .files import CheckpointDirError, describe_os_error, write_file_durably

log = logging.getLogger("spottrain.agent.checkpoint.directory")

EPOCHS = ".epochs"
_EPOCH_RE = re.compile(r"^epoch-(\d{12})\Z")
# Epoch files kept below the newest: far more than generations that can still be alive.
KEEP_EPOCHS = 64


class Epochs:
    """The epochs claimed in ``<root>/.epochs``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, epoch: int) -> Path:
        return self.root / EPOCHS / f"epoch-{epoch:012d}"

    def claim(self, generation: str) -> int:
        """The fencing epoch of ``generation``: the one it already holds here, or a new one
        above every epoch claimed so far (see the module docstring).

        Args:
            generation: Names one generation of writers, the same string for all of them
                (e.g. ``"<run id> round 3 <nonce>"``); any other string is another generation.

        Raises:
            ValueError: ``generation`` is empty or spans lines.
            CheckpointDirError: the directory refused the claim (full, read-only).
        """
        if not generation or "\n" in generation:
            raise ValueError(f"generation {generation!r} must be one non-empty line")
        epochs = self.root / EPOCHS
        claim = epochs / f".claim-{uuid.uuid4().hex}"
        body = {"generation": generation, "host": socket.gethostname(), "pid": os.getpid()}
        try:
            epochs.mkdir(exist_ok=True)
            write_file_durably(claim, json.dumps({**body, "at": time.time()}).encode())
            try:
                epoch = self._link(claim, generation)
            finally:
                with contextlib.suppress(OSError):
                    claim.unlink()
            fsync_dir(epochs)
        except OSError as exc:
            raise CheckpointDirError(
                exc.errno or 0, describe_os_error(exc, self.root, "claiming a fencing epoch")
            ) from exc
        log.info("generation %s holds fencing epoch %d of %s", generation, epoch, self.root)
        return epoch

    def _link(self, claim: Path, generation: str) -> int:
        claimed = self.claimed()
        for epoch in reversed(claimed):
            if self.generation(epoch) == generation:
                return epoch
        # Epochs are dense (each new one is the successor of one that exists), so walking up
        # from the newest seen meets any epoch this generation got meanwhile before passing it.
        epoch = claimed[-1] + 1 if claimed else 0
        while True:
            try:
                os.link(claim, self.path(epoch))
                return epoch
            except FileExistsError:
                if os.stat(claim).st_nlink > 1:
                    return epoch  # NFS: our link was made, and its answer lost and retried
                if self.generation(epoch) == generation:
                    return epoch  # another member of this generation claimed it first
                epoch += 1

    def claimed(self) -> list[int]:
        try:
            names = os.listdir(self.root / EPOCHS)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := _EPOCH_RE.match(n)))

    def generation(self, epoch: int) -> str | None:
        """The generation that claimed ``epoch``, or None if it is not (or no longer) here."""
        try:
            body = json.loads(self.path(epoch).read_bytes())
        except (OSError, ValueError):
            return None
        value = body.get("generation") if isinstance(body, dict) else None
        return value if isinstance(value, str) else None

    def newest(self, at_least: int = -1) -> int:
        """The highest epoch claimed in this directory (-1: none).

        The listing may be cached by an NFS client; the successors of the newest one seen
        are therefore also looked up by name, which the server answers.
        """
        claimed = self.claimed()
        newest = max(claimed[-1] if claimed else -1, at_least)
        while self.path(newest + 1).exists():
            newest += 1
        return newest

    def prune(self) -> None:
        """Drop the claims far below the newest (all but the newest ``KEEP_EPOCHS``)."""
        for old in self.claimed()[:-KEEP_EPOCHS]:
            with contextlib.suppress(OSError):
                self.path(old).unlink()

"""The checkpoint directory: where checkpoints are committed, found and pruned.

Layout of a directory (a mount every node of the job sees)::

    step-000000120/     committed: DCP shard files, .metadata, MANIFEST.json
    step-000000140/
    .tmp-step-000000160-r7/   being written (round 7); never read by restore
    .old-step-000000140-r8-<ns>/   set aside while round 8 saves step 140 again; read only
                        if that save died between its two renames (no step-000000140)
    .tmp-step-000000160-e12/  the same, written by the generation holding fencing epoch 12
    .epochs/epoch-000000000012   fencing epoch 12, claimed by one generation of writers
    latest              "step-000000140": a pointer for people and tools

The rename of a temporary directory to ``step-N`` is the commit point. ``latest`` is written
after it, so a crash between the two leaves ``latest`` one behind; restore therefore scans the
committed directories itself and never trusts ``latest`` alone.

**Fencing epochs** (see :mod:`.epochs`): a commit carries its writer's epoch in the
manifest and is refused when a higher epoch has been claimed in the directory, or when the
SDK's fence callback says a newer round trains.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from spottrain.fileio import fsync_dir

from .epochs import Epochs
from .failpoints import failpoint
from .files import (
    CheckpointDirError,
    StaleCommitError,
    describe_os_error,
    step_name,
    write_file_durably,
    writer_tag,
)
from .manifest import MANIFEST_NAME, Manifest, ManifestError, verify_files

log = logging.getLogger(__name__)

LATEST = "latest"
_STEP_RE = re.compile(r"^step-(\d{9,})\Z")
_TMP_RE = re.compile(r"^\.(?:tmp|old)-step-(\d{9,})-([re])(-?\d+)(?:-.*)?\Z")
_OLD_RE = re.compile(r"^\.old-step-(\d{9,})-[re]-?\d+-(\d+)\Z")


@dataclass(frozen=True)
class Restorable:
    path: Path
    manifest: Manifest
    skipped: list[tuple[str, str]] = field(default_factory=list)


class CheckpointDir:
    """One job's checkpoint directory.

    Raises:
        CheckpointDirError: the directory is missing or not a directory.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.epochs = Epochs(self.root)
        # Checkpoints this process saw verify, by name, with the (name, size, mtime, inode)
        # of their files then: pruning re-reads only what changed since.
        self._verified: dict[str, tuple[tuple[str, int, int, int], ...]] = {}
        if not self.root.exists():
            raise CheckpointDirError(
                errno.ENOENT,
                f"checkpoint directory {self.root} does not exist: mount the checkpoint "
                "volume there or create the directory, then start again",
            )
        if not self.root.is_dir():
            raise CheckpointDirError(
                errno.ENOTDIR,
                f"checkpoint directory {self.root} is not a directory: point "
                "--ckpt-dir at a directory",
            )

    def check_writable(self) -> None:
        """Prove that a file can be created, synced and removed here, before training."""
        probe = self.root / f".probe-{os.getpid()}"
        try:
            write_file_durably(probe, b"spottrain\n")
            probe.unlink()
        except OSError as exc:
            with contextlib.suppress(OSError):
                probe.unlink()
            raise CheckpointDirError(
                exc.errno or 0, describe_os_error(exc, self.root, "a test write")
            ) from exc

    # -- naming -------------------------------------------------------------------------------
    def step_path(self, step: int) -> Path:
        return self.root / step_name(step)

    def tmp_path(self, step: int, round_: int, epoch: int = -1) -> Path:
        # By epoch when there is one: rounds repeat across launches, and a frozen writer of
        # an older launch must not share (and delete) a live writer's temporary directory.
        return self.root / f".tmp-{step_name(step)}-{writer_tag(round_, epoch)}"

    # -- fencing epochs -----------------------------------------------------------------------
    def claim_epoch(self, generation: str) -> int:
        """The fencing epoch of ``generation`` (see :meth:`.epochs.Epochs.claim`)."""
        return self.epochs.claim(generation)

    def epoch_generation(self, epoch: int) -> str | None:
        """The generation that claimed ``epoch``, or None if it is not (or no longer) here."""
        return self.epochs.generation(epoch)

    def newest_epoch(self, at_least: int = -1) -> int:
        """The highest epoch claimed in this directory (-1: none)."""
        return self.epochs.newest(at_least)

    def committed(self) -> list[tuple[int, Path]]:
        """Committed checkpoint directories, oldest first (not verified).

        A step saved again is replaced by two renames (the committed one aside to
        ``.old-step-N-...``, the new one in); a crash between them leaves no ``step-N``, and
        the one set aside stands for step N until a later save prunes it.
        """
        steps: dict[int, Path] = {}
        set_aside: dict[int, tuple[int, Path]] = {}
        try:
            entries = list(os.scandir(self.root))
        except OSError as exc:
            raise CheckpointDirError(
                exc.errno or 0, describe_os_error(exc, self.root, "listing")
            ) from exc
        for entry in entries:
            if (m := _STEP_RE.match(entry.name)) and entry.is_dir():
                steps[int(m.group(1))] = Path(entry.path)
            elif (m := _OLD_RE.match(entry.name)) and entry.is_dir():
                step, stamp = int(m.group(1)), int(m.group(2))
                if step not in set_aside or set_aside[step][0] < stamp:
                    set_aside[step] = (stamp, Path(entry.path))
        for step, (_, path) in set_aside.items():
            steps.setdefault(step, path)
        return sorted(steps.items())

    def read_latest(self) -> str | None:
        try:
            return (self.root / LATEST).read_text().strip() or None
        except OSError:
            return None

    # -- restore ------------------------------------------------------------------------------
    def find_restorable(self, *, checksums: bool = True) -> Restorable | None:
        """The newest committed checkpoint whose manifest and files verify.

        Each newer one that fails is logged with the reason and skipped.
        """
        skipped: list[tuple[str, str]] = []
        for step, path in reversed(self.committed()):
            try:
                manifest = Manifest.read(path)
            except ManifestError as exc:
                skipped.append((path.name, str(exc)))
                log.warning("skipping checkpoint %s: %s", path.name, exc)
                continue
            problems = []
            if manifest.step != step:
                problems.append(f"its manifest is for step {manifest.step}")
            problems += verify_files(path, manifest, checksums=checksums)
            if problems:
                reason = "; ".join(problems)
                skipped.append((path.name, reason))
                log.warning("skipping checkpoint %s: %s", path.name, reason)
                continue
            if checksums:
                self._remember_verified(path)
            return Restorable(path, manifest, skipped)
        return None

    def newest_manifest(self) -> Manifest | None:
        """The manifest of the newest committed checkpoint that has a readable one."""
        for _, path in reversed(self.committed()):
            with contextlib.suppress(ManifestError):
                return Manifest.read(path)
        return None

    # -- commit -------------------------------------------------------------------------------
    def commit(
        self,
        tmp: Path,
        manifest: Manifest,
        fence: Callable[[int], str | None] | None = None,
    ) -> Path:
        """Turn a fully written temporary directory into checkpoint ``manifest.step``.

        Args:
            tmp: The directory holding every shard file, synced.
            manifest: What it holds.
            fence: Given the writer's round, returns why the commit must be refused (a newer
                round is training) or None. Asked only for a round >= 0. Before it, a writer
                with an epoch (``manifest.epoch >= 0``) is refused if a newer epoch has been
                claimed in this directory.

        Raises:
            StaleCommitError: the writer's generation is older than the one training now; the
                temporary directory is removed and nothing else changes.
            CheckpointDirError: the disk refused (full, read-only); the previous checkpoints
                are untouched.
        """
        try:
            reason = self.stale_reason(manifest, fence)
            if reason is not None:
                shutil.rmtree(tmp, ignore_errors=True)
                epoch = f" (fencing epoch {manifest.epoch})" if manifest.epoch >= 0 else ""
                raise StaleCommitError(
                    f"refused to commit step {manifest.step} from rendezvous round "
                    f"{manifest.round}{epoch}: {reason}"
                )
            write_file_durably(tmp / MANIFEST_NAME, manifest.to_bytes(), failpoint_name="manifest")
            fsync_dir(tmp)
            failpoint("before-rename")
            target = self.step_path(manifest.step)
            old = None
            if target.exists():
                # Same step saved again (a newer round redoing it): the new one wins.
                tag = writer_tag(manifest.round, manifest.epoch)
                old = self.root / f".old-{target.name}-{tag}-{time.time_ns()}"
                os.rename(target, old)
                failpoint("replace")
            try:
                os.rename(tmp, target)
            except OSError:
                if old is not None:
                    with contextlib.suppress(OSError):
                        os.rename(old, target)  # put the committed one back
                raise
            failpoint("after-rename")
            fsync_dir(self.root)
            # Its checksums were taken from the bytes as they were written and synced.
            self._remember_verified(target)
        except StaleCommitError:
            raise
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointDirError(
                exc.errno or 0,
                describe_os_error(exc, self.root, f"committing step {manifest.step}"),
            ) from exc
        # Committed: what follows is housekeeping, and its failure must not report the
        # checkpoint as lost (restore never trusts ``latest``).
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        try:
            self._point_latest(target.name)
        except OSError as exc:
            log.warning(
                "checkpoint %s is committed but %s",
                target.name,
                describe_os_error(exc, self.root, f"pointing {LATEST} at it"),
            )
        return target

    def commit_in_place(
        self,
        path: Path,
        manifest: Manifest,
        fence: Callable[[int], str | None] | None = None,
    ) -> Path:
        """Make ``path``, a checkpoint directory a framework wrote under its own name (the
        Hugging Face Trainer's ``checkpoint-N``), complete: its manifest, written durably
        last, is the commit point (there is no rename). Fenced as :meth:`commit`.

        Raises:
            StaleCommitError: the writer's generation is stale; ``path`` is left as it is
                (without a manifest it never restores).
            CheckpointDirError: the disk refused.
        """
        reason = self.stale_reason(manifest, fence)
        if reason is not None:
            epoch = f" (fencing epoch {manifest.epoch})" if manifest.epoch >= 0 else ""
            raise StaleCommitError(
                f"refused to commit {path.name} from rendezvous round {manifest.round}{epoch}: "
                f"{reason}"
            )
        try:
            write_file_durably(path / MANIFEST_NAME, manifest.to_bytes(), failpoint_name="manifest")
            fsync_dir(path)
            fsync_dir(path.parent)
        except OSError as exc:
            with contextlib.suppress(OSError):
                (path / MANIFEST_NAME).unlink()
            raise CheckpointDirError(
                exc.errno or 0, describe_os_error(exc, self.root, f"committing {path.name}")
            ) from exc
        return path

    def stale_reason(
        self, manifest: Manifest, fence: Callable[[int], str | None] | None
    ) -> str | None:
        """Why a commit of ``manifest`` must be refused (see :meth:`commit`), or None."""
        # Never the rounds of the committed manifests: rounds restart at 0 with a new
        # rendezvous state, and comparing them refused every commit after such a restart.
        if manifest.epoch >= 0:
            newest = self.newest_epoch(manifest.epoch)
            if newest > manifest.epoch:
                newer = self.epoch_generation(newest) or "its claim is gone"
                return (
                    f"a newer generation holds fencing epoch {newest} of {self.root} "
                    f"({newer}); this writer's generation is stale"
                )
        if manifest.round < 0 or fence is None:
            return None  # not under the spottrain rendezvous: no round to ask Redis about
        return fence(manifest.round)

    def _point_latest(self, name: str) -> None:
        tmp = self.root / f".{LATEST}.tmp"
        write_file_durably(tmp, (name + "\n").encode(), failpoint_name="latest")
        os.replace(tmp, self.root / LATEST)
        fsync_dir(self.root)
        failpoint("after-latest")

    # -- verification -------------------------------------------------------------------------
    @staticmethod
    def _signature(path: Path) -> tuple[tuple[str, int, int, int], ...]:
        out = []
        with os.scandir(path) as entries:
            for e in entries:
                st = e.stat(follow_symlinks=False)
                out.append((e.name, st.st_size, st.st_mtime_ns, st.st_ino))
        return tuple(sorted(out))

    def _remember_verified(self, path: Path) -> None:
        with contextlib.suppress(OSError):
            self._verified[path.name] = self._signature(path)

    def verifies(self, step: int, path: Path) -> bool:
        """Whether checkpoint ``path`` of ``step`` verifies (see :meth:`check`)."""
        return self.check(step, path) is None

    def check(self, step: int, path: Path) -> str | None:
        """What is wrong with checkpoint ``path`` of ``step`` (None: its manifest and files
        verify, checksums included). A checkpoint this process saw verify (or wrote) is read
        again only if one of its files changed since."""
        try:
            signature = self._signature(path)
        except OSError as exc:
            return f"cannot list it: {exc.strerror or exc}"
        if self._verified.get(path.name) == signature:
            return None
        try:
            manifest = Manifest.read(path)
        except ManifestError as exc:
            return str(exc)
        problems = [f"its manifest is for step {manifest.step}"] if manifest.step != step else []
        problems += verify_files(path, manifest)
        if problems:
            return "; ".join(problems)
        self._verified[path.name] = signature
        return None

    def _beyond_keep(self, committed: list[tuple[int, Path]], keep: int) -> list[Path]:
        """The committed checkpoints older than the ``keep``-th newest one that verifies.

        Checkpoints that fail verification do not count towards ``keep``, and are not
        deleted for failing it (a read error is not proof that a checkpoint is bad); they
        go once ``keep`` newer ones verify, like any other.
        """
        good = 0
        for i in range(len(committed) - 1, -1, -1):
            if good >= keep:
                return [path for _, path in committed[: i + 1]]
            step, path = committed[i]
            if self.verifies(step, path):
                good += 1
        return []

    # -- housekeeping -------------------------------------------------------------------------
    def prune(self, keep: int, round_: int, epoch: int = -1) -> list[str]:
        """Keep the newest ``keep`` committed checkpoints that verify (and any newer ones
        that do not); drop the temporary directories that no live writer can commit any
        more, and epoch claims far below the newest.

        Verifying reads each checkpoint once per process (see :meth:`verifies`), and only
        when there are more than ``keep`` to choose from.

        A temporary directory is dead when its epoch is below the directory's newest (it
        can never commit), or, for the writer's own epoch or round, when its step is below
        the newest committed one (a generation saves one step at a time; without the
        rendezvous every run is round -1, and only this rule frees them). Of round-tagged
        ones, a writer with a round drops those of older rounds too.
        """
        removed = []
        committed = self.committed()
        newest = committed[-1][0] if committed else -1
        for path in self._beyond_keep(committed, keep) if len(committed) > keep else []:
            shutil.rmtree(path, ignore_errors=True)
            self._verified.pop(path.name, None)
            removed.append(path.name)
        newest_epoch = self.newest_epoch(epoch)
        standing = {path.name for _, path in committed}  # an .old-* standing in for its step
        for entry in os.scandir(self.root):
            m = _TMP_RE.match(entry.name)
            if m is None or entry.name in standing:
                continue
            step, by, number = int(m.group(1)), m.group(2), int(m.group(3))
            if by == "e":
                dead = number < newest_epoch or (number == newest_epoch and step < newest)
            elif epoch >= 0:
                dead = step < newest  # a round writer's leftover beside an epoch writer
            else:
                dead = number < round_ or (number == round_ and step < newest)
            if dead:
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.name)
        self.epochs.prune()
        return removed

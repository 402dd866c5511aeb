"""The checkpoint directory: where checkpoints are committed, found and pruned.

Layout of a directory (a mount every node of the job sees)::

    step-000000120/     committed: DCP shard files, .metadata, MANIFEST.json
    step-000000140/
    .tmp-step-000000160-r7/   being written (round 7); never read by restore
    .old-step-000000140-r8-<ns>/   set aside while round 8 saves step 140 again; read only
                        if that save died between its two renames (no step-000000140)
    latest              "step-000000140": a pointer for people and tools

The rename of a temporary directory to ``step-N`` is the commit point. ``latest`` is written
after it, so a crash between the two leaves ``latest`` one behind; restore therefore scans the
committed directories itself and never trusts ``latest`` alone.
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

from .failpoints import failpoint
from .manifest import MANIFEST_NAME, Manifest, ManifestError, verify_files

log = logging.getLogger(__name__)

LATEST = "latest"
_STEP_RE = re.compile(r"^step-(\d{9,})\Z")
_TMP_RE = re.compile(r"^\.(?:tmp|old)-step-(\d{9,})-r(-?\d+)(?:-.*)?\Z")
_OLD_RE = re.compile(r"^\.old-step-(\d{9,})-r-?\d+-(\d+)\Z")


class CheckpointDirError(OSError):
    """The checkpoint directory cannot be used; the message says why and what to do."""


class StaleCommitError(RuntimeError):
    """A commit from an older rendezvous round than the one now training was refused."""


def describe_os_error(exc: OSError, root: Path, doing: str) -> str:
    """One plain sentence for an I/O failure on the checkpoint directory."""
    if exc.errno == errno.ENOSPC or exc.errno == errno.EDQUOT:
        why = "it is full (no space left on the device)"
        fix = "free space or point the checkpoint directory at a larger volume"
    elif exc.errno == errno.EROFS:
        why = "it is on a read-only file system"
        fix = "remount it read-write or point the checkpoint directory elsewhere"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        why = "this user may not write there (permission denied)"
        fix = "fix its owner or mode, or point the checkpoint directory elsewhere"
    elif exc.errno == errno.ENOENT:
        why = "it does not exist"
        fix = "mount the checkpoint volume there or create the directory"
    else:
        why = exc.strerror or str(exc)
        fix = "check the volume"
    return f"checkpoint directory {root}: {doing} failed because {why}; {fix}"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: Path, data: bytes, *, failpoint_name: str | None = None) -> None:
    """Write ``data`` to ``path`` and fsync it (the directory entry is the caller's job)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        half = len(view) // 2
        if failpoint_name is not None:
            # Half of it on disk, then the failpoint: a torn write, as a crash leaves it.
            _write_all(fd, view[:half])
            os.fsync(fd)
            failpoint(failpoint_name)
            view = view[half:]
        _write_all(fd, view)
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        n = os.write(fd, view)
        view = view[n:]


def step_name(step: int) -> str:
    return f"step-{step:09d}"


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

    def tmp_path(self, step: int, round_: int) -> Path:
        return self.root / f".tmp-{step_name(step)}-r{round_}"

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
                round is training) or None. The directory's own newest round is checked too.

        Raises:
            StaleCommitError: the writer's round is older than the one training now; the
                temporary directory is removed and nothing else changes.
            CheckpointDirError: the disk refused (full, read-only); the previous checkpoints
                are untouched.
        """
        try:
            reason = self._stale_reason(manifest.round, fence)
            if reason is not None:
                shutil.rmtree(tmp, ignore_errors=True)
                raise StaleCommitError(
                    f"refused to commit step {manifest.step} from rendezvous round "
                    f"{manifest.round}: {reason}"
                )
            write_file_durably(tmp / MANIFEST_NAME, manifest.to_bytes(), failpoint_name="manifest")
            fsync_dir(tmp)
            failpoint("before-rename")
            target = self.step_path(manifest.step)
            old = None
            if target.exists():
                # Same step saved again (a newer round redoing it): the new one wins.
                old = self.root / f".old-{target.name}-r{manifest.round}-{time.time_ns()}"
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

    def _stale_reason(self, round_: int, fence: Callable[[int], str | None] | None) -> str | None:
        if round_ < 0:
            return None  # not under the spottrain rendezvous: nothing to fence with
        newest = self.newest_manifest()
        if newest is not None and newest.round > round_:
            return f"checkpoint step {newest.step} was committed by the newer round {newest.round}"
        return fence(round_) if fence is not None else None

    def _point_latest(self, name: str) -> None:
        tmp = self.root / f".{LATEST}.tmp"
        write_file_durably(tmp, (name + "\n").encode(), failpoint_name="latest")
        os.replace(tmp, self.root / LATEST)
        fsync_dir(self.root)
        failpoint("after-latest")

    # -- housekeeping -------------------------------------------------------------------------
    def prune(self, keep: int, round_: int) -> list[str]:
        """Keep the newest ``keep`` committed checkpoints; drop the temporary directories
        that no live writer can commit any more: those of an older round, and those of this
        round for a step below the newest committed one (a round saves one step at a time;
        without the rendezvous every run is round -1, and only this rule frees them)."""
        removed = []
        committed = self.committed()
        newest = committed[-1][0] if committed else -1
        for _, path in committed[: max(0, len(committed) - keep)]:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
        standing = {path.name for _, path in committed}  # an .old-* standing in for its step
        for entry in os.scandir(self.root):
            m = _TMP_RE.match(entry.name)
            if m is None or entry.name in standing:
                continue
            step, tmp_round = int(m.group(1)), int(m.group(2))
            if tmp_round < round_ or (tmp_round == round_ and step < newest):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.name)
        return removed

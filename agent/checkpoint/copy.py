"""Checkpoint copies in object storage: what lets a job move to another zone or cloud.

A checkpoint volume is zonal (FSx, Filestore, a local disk), so a job that moves leaves it
behind. The agent of the node that committed a checkpoint copies it in the background to
``<copy_to>/<run id>/`` under its path in the volume: ``step-N/`` for spottrain's own
commits, ``hf/checkpoint-N/`` for a Trainer whose ``output_dir`` is ``<volume>/hf`` (its
manifest last, so a partial copy is never taken for a whole one). A checkpoint outside the
volume has no such path and is not copied (a ``checkpoint-copy-failed`` event says so and
how to fix it). Before starting torchrun, an agent whose volume holds nothing as new as the
newest complete copy brings that copy in, to the same place in the volume, where the
framework looks for it. A copy that cannot be used (an object corrupt or missing, a
checkpoint that does not verify once downloaded, a name that would leave the volume) is
skipped for the next older one, and each one skipped is reported with why. Both directions
report to the run's event stream; the newest copy is also recorded in ``ckpt:copied``, which
the controller waits on before it restarts a moved job elsewhere.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import redis

from spottrain.fileio import fsync_dir
from spottrain.protocol.keys import RunKeys

from ..node_record import NodeRecord
from .copy_names import CopyName, copy_name_problem, parse_copy_name, place_problem, volume_name
from .directory import CheckpointDir
from .in_place import TORN_PREFIX, scan_complete

if TYPE_CHECKING:
    from spottrain.cloud.storage import ObjectStore

log = logging.getLogger("spottrain.agent.ckpt_copy")

# A pull in progress says how far it got into the agent's output at each tenth of the copy,
# or this often when its size is unknown or it moves slowly.
PULL_EVERY_S = 5.0


@dataclass(frozen=True)
class PullResult:
    """What :meth:`CheckpointCopier.pull_newest` did.

    Attributes:
        step: the step brought in, or None (the volume was as new, or no copy was usable).
        skipped: (copy name, why) of each newer copy passed over, newest first.
        name: the copy brought in (its place in the volume), or None.
    """

    step: int | None
    skipped: tuple[tuple[str, str], ...] = ()
    name: str | None = None


class CheckpointCopier:
    """Copies this node's commits out, and the newest copy in.

    Args:
        store_url: where copies go (``s3://``, ``gs://``, ``file://``).
        ckpt_dir: the node's checkpoint directory.
        client, keys, node_id, record: the run's Redis, this node, its event recorder.
        poll_s: how often to look for a new commit.
        store: the store itself, when it is not opened from ``store_url`` alone (an
            endpoint or credentials of its own); ``store_url`` then only names it.
    """

    def __init__(
        self,
        store_url: str,
        ckpt_dir: str,
        client: redis.Redis,
        keys: RunKeys,
        node_id: str,
        record: NodeRecord,
        poll_s: float = 1.0,
        store: ObjectStore | None = None,
    ) -> None:
        from spottrain.cloud.stores import open_store

        self.store = store if store is not None else open_store(store_url)
        self.url = store_url
        self.ckpt_dir = Path(ckpt_dir)
        self.client = client
        self.keys = keys
        self.node_id = node_id
        self.record = record
        self.poll_s = poll_s
        self.copied_step = -1
        # The newest commit that is never copied (outside the volume): said once, not waited on.
        self.refused_step = -1
        self._stop = threading.Event()
        self._copied = threading.Condition()
        self._upload_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def prefix(self) -> str:
        return self.keys.run_id

    # --- in, at boot ---------------------------------------------------------------------
    def pull_newest(self) -> PullResult:
        """Bring in the newest usable copy if the volume has nothing as new.

        The volume's checkpoints are its committed ``step-N`` and, in each directory the
        copies go to, the newest in-place one (``hf/checkpoint-N``) whose manifest and file
        sizes verify (not checksums: every node of a zone boots through here, and reading a
        whole checkpoint each time would hold them all up; resume checks them). Copies are
        tried newest first. One whose objects are corrupt or missing, whose checkpoint does
        not verify once downloaded, or whose name would put it outside the volume, is
        skipped for the next older one, with a ``checkpoint-copy-skipped`` event saying why;
        one left at ``.tmp-<name>-r-1-pull`` never counts as committed until it verified.

        Raises:
            StorageError: the store failed (unreachable, credentials), or every copy newer
                than the volume's checkpoints was unusable and the volume has none: starting
                from nothing would lose the run's progress unseen.
        """
        copies = self._list_copies()
        if not copies:
            return PullResult(None)
        # Every node of a zone shares its volume and boots at about the same time: one
        # brings the copy in, the others wait for it and find it there.
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(self.ckpt_dir / ".pull.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                ckdir = CheckpointDir(str(self.ckpt_dir))
                local_newest = self._volume_newest(ckdir, copies)
                pulled, skipped = self._pull_first_usable(ckdir, copies, local_newest)
                if pulled is not None:
                    (self.ckpt_dir / "latest").write_text(pulled.name)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        if pulled is None:
            if skipped and local_newest < 0:
                from spottrain.cloud.storage import StorageError

                raise StorageError(
                    f"no usable checkpoint copy in {self.url}/{self.prefix} and none on the "
                    f"volume {self.ckpt_dir}: "
                    + "; ".join(f"{name}: {why}" for name, why in skipped)
                )
            return PullResult(None, tuple(skipped))
        self.record.event(
            "checkpoint-pulled",
            step=pulled.step,
            source=f"{self.url}/{self.prefix}/{pulled.name}",
            dest=str(self.ckpt_dir / pulled.name),
            seconds=round(time.monotonic() - t0, 3),
            skipped=[name for name, _ in skipped],
        )
        log.info(
            "brought in checkpoint step %d from %s to %s",
            pulled.step,
            self.url,
            self.ckpt_dir / pulled.name,
        )
        return PullResult(pulled.step, tuple(skipped), pulled.name)

    def _list_copies(self) -> list[CopyName]:
        """The run's complete copies, newest first (names without a step are no copies
        spottrain made: left alone, with a warning)."""
        from spottrain.cloud.storage import list_dirs

        copies = []
        for name in list_dirs(self.store, self.prefix, nested=True):
            parsed = parse_copy_name(name)
            if parsed is None:
                log.warning(
                    "ignoring %s/%s/%s: its name ends in no step", self.url, self.prefix, name
                )
                continue
            copies.append(parsed)
        return sorted(copies, key=lambda c: c.step, reverse=True)

    def _volume_newest(self, ckdir: CheckpointDir, copies: list[CopyName]) -> int:
        """The newest step the volume holds where ``copies`` would go (-1: none): its
        committed ``step-N`` and, in each directory of a copy's name, the newest complete
        checkpoint named as that copy is (see :meth:`pull_newest`)."""
        committed = ckdir.committed()
        newest = committed[-1][0] if committed else -1
        places = {(c.parent, c.prefix) for c in copies if copy_name_problem(c.name) is None}
        places.discard(("", "step-"))  # the committed ones above
        for parent, prefix in sorted(places):
            if parent and place_problem(self.ckpt_dir, parent) is not None:
                continue  # no copy is brought in there: nothing there counts
            found = scan_complete(self.ckpt_dir / parent, prefix, set_aside=False, checksums=False)
            if found is not None:
                newest = max(newest, found.step)
        return newest

    def _pull_first_usable(
        self, ckdir: CheckpointDir, copies: list[CopyName], local_newest: int
    ) -> tuple[CopyName | None, list[tuple[str, str]]]:
        """Bring in the newest copy newer than ``local_newest`` that is usable; the one
        brought in (None: none) and the newer ones skipped, with why, each reported."""
        skipped: list[tuple[str, str]] = []
        for copy in copies:
            if copy.step <= local_newest:
                break
            why = copy_name_problem(copy.name) or place_problem(self.ckpt_dir, copy.name)
            if why is None:
                why = self._pull_one(ckdir, copy)
            if why is None:
                return copy, skipped
            skipped.append((copy.name, why))
            log.error("skipping checkpoint copy %s/%s: %s", self.url, copy.name, why)
            self.record.event(
                "checkpoint-copy-skipped",
                step=copy.step,
                source=f"{self.url}/{self.prefix}/{copy.name}",
                reason=why,
            )
        return None, skipped

    def _pull_one(self, ckdir: CheckpointDir, copy: CopyName) -> str | None:
        """Download ``copy`` and commit it to its place in the volume if it verifies; return
        why it cannot be used, or None. Transient store errors are raised, not skipped."""
        from spottrain.cloud.storage import CorruptObject, IncompleteCopy, download_dir

        dest = self.ckpt_dir / copy.name
        if dest.is_dir():
            # Not complete, or it would have counted as the volume's (a save that died
            # there): kept aside for a person to look at, as resume does.
            os.rename(dest, dest.parent / f"{TORN_PREFIX}{dest.name}-{time.time_ns()}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        # A name that no writer uses, and that pruning clears as a dead temporary directory.
        tmp = dest.parent / f".tmp-{dest.name}-r-1-pull"
        shutil.rmtree(tmp, ignore_errors=True)  # a pull that died here before
        try:
            with _PullProgress(copy.name, self._copy_bytes(copy.name), dest.parent, tmp.name):
                download_dir(self.store, f"{self.prefix}/{copy.name}", tmp)
        except (CorruptObject, IncompleteCopy, ValueError) as exc:
            return str(exc)
        problem = ckdir.check(copy.step, tmp)
        if problem is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            return f"its checkpoint does not verify once downloaded ({problem})"
        tmp.rename(dest)
        fsync_dir(dest.parent)
        return None

    def _copy_bytes(self, name: str) -> int | None:
        """The size of copy ``name`` from its manifest (one small read), for the pull's
        progress; None when it cannot be read (the pull itself then says why)."""
        from spottrain.cloud.storage import StorageError

        from .manifest import MANIFEST_NAME, Manifest, ManifestError

        try:
            raw = self.store.get_bytes(f"{self.prefix}/{name}/{MANIFEST_NAME}")
            return Manifest.from_bytes(raw).total_bytes
        except (StorageError, ManifestError, KeyError, TypeError, ValueError):
            return None

    # --- out, in the background ----------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="spottrain-ckpt-copy", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _newest_commit(self) -> dict[str, str] | None:
        try:
            raw = self.client.hgetall(self.keys.ckpt_last)
        except redis.RedisError:
            return None
        last = {k.decode(): v.decode() for k, v in raw.items()}
        if last.get("node") != self.node_id or "path" not in last:
            return None
        return last

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.copy_newest()

    def copy_newest(self) -> bool:
        """Copy the newest checkpoint this node committed, if not copied yet."""
        with self._upload_lock:
            return self._copy_newest()

    def _copy_newest(self) -> bool:
        last = self._newest_commit()
        if last is None:
            return False
        step = int(last["step"])
        if step <= max(self.copied_step, self.refused_step):
            return False
        path = Path(last["path"])
        if not path.is_dir():
            return False
        from spottrain.cloud.storage import StorageError, upload_dir

        try:
            name = volume_name(path, self.ckpt_dir)
        except ValueError as exc:
            self.refused_step = step
            log.error("%s", exc)
            self.record.event("checkpoint-copy-failed", step=step, error=str(exc))
            return False
        t0 = time.monotonic()
        try:
            report = upload_dir(self.store, path, f"{self.prefix}/{name}")
        except (StorageError, OSError) as exc:
            self.record.event("checkpoint-copy-failed", step=step, error=str(exc))
            return False
        seconds = round(time.monotonic() - t0, 3)
        with contextlib.suppress(redis.RedisError):
            self.client.hset(
                self.keys.ckpt_copied,
                mapping={
                    "step": str(step),
                    "name": name,
                    "url": report.url,
                    "at": str(time.time()),
                },
            )
        self.record.event("checkpoint-copied", step=step, url=report.url, seconds=seconds)
        with self._copied:
            self.copied_step = step
            self._copied.notify_all()
        return True

    def wait_copied(self, step: int, timeout: float) -> bool:
        """Copy (now, on this thread) and wait until ``step`` or newer is copied (False at
        once when it is never copied: outside the volume)."""
        deadline = time.monotonic() + timeout
        while max(self.copied_step, self.refused_step) < step and time.monotonic() < deadline:
            if not self.copy_newest():
                with self._copied:
                    self._copied.wait(min(0.5, max(0.0, deadline - time.monotonic())))
        return self.copied_step >= step


def _size(n: int) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB" if n >= 1e6 else f"{n} B"


class _PullProgress:
    """Lines of a pull's progress in the agent's output: bytes done (of the total when
    known), at each tenth of the copy or every ``PULL_EVERY_S``, read from the download's
    temporary directory (``download_dir`` writes it beside the destination)."""

    def __init__(self, name: str, total: int | None, parent: Path, dest_name: str) -> None:
        self.name, self.total, self.parent, self.glob = name, total, parent, f".{dest_name}.*"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spottrain-pull", daemon=True)

    def done_bytes(self) -> int:
        done = 0
        for d in self.parent.glob(self.glob):
            for p in d.rglob("*"):
                with contextlib.suppress(OSError):
                    done += p.stat().st_size if p.is_file() else 0
        return done

    def line(self, done: int) -> str:
        if not self.total:
            return f"pulling checkpoint copy {self.name}: {_size(done)}"
        pct = min(100, 100 * done // self.total)
        return f"pulling checkpoint copy {self.name}: {_size(done)} of {_size(self.total)} ({pct}%)"

    def _run(self) -> None:
        tenth, last = 0, time.monotonic()
        while not self._stop.wait(0.5):
            done = self.done_bytes()
            now_tenth = 10 * done // self.total if self.total else 0
            if now_tenth > tenth or time.monotonic() - last >= PULL_EVERY_S:
                log.info("%s", self.line(done))
                tenth, last = now_tenth, time.monotonic()

    def __enter__(self) -> _PullProgress:
        log.info("%s", self.line(0))
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

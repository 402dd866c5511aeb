"""Checkpoint copies in object storage: what lets a job move to another zone or cloud.

A checkpoint volume is zonal (FSx, Filestore, a local disk), so a job that moves leaves it
behind. The agent of the node that committed a checkpoint copies it to
``<copy_to>/<run id>/step-N/`` in the background (its manifest last, so a partial copy is
never taken for a whole one); before starting torchrun, an agent whose volume holds nothing
newer than the newest complete copy brings that copy in. A copy that cannot be used (an
object corrupt or missing, a checkpoint that does not verify once downloaded) is skipped for
the next older one, and each one skipped is reported with why. Both directions report to the
run's event stream; the newest copy is also recorded in ``ckpt:copied``, which the
controller waits on before it restarts a moved job elsewhere.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
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
from .directory import CheckpointDir

if TYPE_CHECKING:
    from spottrain.cloud.storage import ObjectStore

log = logging.getLogger("spottrain.agent.ckpt_copy")

# A pull in progress says how far it got into the agent's output at each tenth of the copy,
# or this often when its size is unknown or it moves slowly.
PULL_EVERY_S = 5.0


def _step_of(name: str) -> int:
    return int(name.rsplit("-", 1)[1])


@dataclass(frozen=True)
class PullResult:
    """What :meth:`CheckpointCopier.pull_newest` did.

    Attributes:
        step: the step brought in, or None (the volume was as new, or no copy was usable).
        skipped: (copy name, why) of each newer copy passed over, newest first.
    """

    step: int | None
    skipped: tuple[tuple[str, str], ...] = ()


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

        Copies are tried newest first. One whose objects are corrupt or missing, or whose
        checkpoint does not verify once downloaded, is skipped for the next older one, with
        a ``checkpoint-copy-skipped`` event saying why; one left at ``.tmp-step-N-r-1-pull``
        never counts as committed until it verified.

        Raises:
            StorageError: the store failed (unreachable, credentials), or every copy newer
                than the volume's checkpoints was unusable and the volume has none: starting
                from nothing would lose the run's progress unseen.
        """
        from spottrain.cloud.storage import list_dirs

        copies = sorted(list_dirs(self.store, self.prefix), key=_step_of, reverse=True)
        if not copies:
            return PullResult(None)
        # Every node of a zone shares its volume and boots at about the same time: one
        # brings the copy in, the others wait for it and find it there.
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        skipped: list[tuple[str, str]] = []
        t0 = time.monotonic()
        with open(self.ckpt_dir / ".pull.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                ckdir = CheckpointDir(str(self.ckpt_dir))
                local = ckdir.committed()
                local_newest = local[-1][0] if local else -1
                pulled = None
                for name in copies:
                    if _step_of(name) <= local_newest:
                        break
                    why = self._pull_one(ckdir, name)
                    if why is None:
                        pulled = name
                        break
                    skipped.append((name, why))
                    log.error("skipping checkpoint copy %s/%s: %s", self.url, name, why)
                    self.record.event(
                        "checkpoint-copy-skipped",
                        step=_step_of(name),
                        source=f"{self.url}/{self.prefix}/{name}",
                        reason=why,
                    )
                if pulled is not None:
                    (self.ckpt_dir / "latest").write_text(pulled)
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
        step = _step_of(pulled)
        self.record.event(
            "checkpoint-pulled",
            step=step,
            source=f"{self.url}/{self.prefix}/{pulled}",
            seconds=round(time.monotonic() - t0, 3),
            skipped=[name for name, _ in skipped],
        )
        log.info("brought in checkpoint step %d from %s", step, self.url)
        return PullResult(step, tuple(skipped))

    def _pull_one(self, ckdir: CheckpointDir, name: str) -> str | None:
        """Download copy ``name`` and commit it to the volume if it verifies; return why it
        cannot be used, or None. Transient store errors are raised, not skipped."""
        from spottrain.cloud.storage import CorruptObject, IncompleteCopy, download_dir

        step = _step_of(name)
        # A framework's copy (checkpoint-N) is not a step-N that committed() sees: an earlier
        # boot on this shared volume may have brought it in already.
        if (self.ckpt_dir / name).is_dir() and ckdir.check(step, self.ckpt_dir / name) is None:
            return None
        # A name that no writer uses, and that pruning clears as a dead temporary directory.
        tmp = self.ckpt_dir / f".tmp-{name}-r-1-pull"
        shutil.rmtree(tmp, ignore_errors=True)  # a pull that died here before
        try:
            with _PullProgress(name, self._copy_bytes(name), self.ckpt_dir, tmp.name):
                download_dir(self.store, f"{self.prefix}/{name}", tmp)
        except (CorruptObject, IncompleteCopy, ValueError) as exc:
            return str(exc)
        problem = ckdir.check(step, tmp)
        if problem is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            return f"its checkpoint does not verify once downloaded ({problem})"
        tmp.rename(self.ckpt_dir / name)
        fsync_dir(self.ckpt_dir)
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
        if step <= self.copied_step:
            return False
        path = Path(last["path"])
        if not path.is_dir():
            return False
        from spottrain.cloud.storage import StorageError, upload_dir

        t0 = time.monotonic()
        try:
            report = upload_dir(self.store, path, f"{self.prefix}/{path.name}")
        except (StorageError, OSError) as exc:
            self.record.event("checkpoint-copy-failed", step=step, error=str(exc))
            return False
        seconds = round(time.monotonic() - t0, 3)
        with contextlib.suppress(redis.RedisError):
            self.client.hset(
                self.keys.ckpt_copied,
                mapping={"step": str(step), "url": report.url, "at": str(time.time())},
            )
        self.record.event("checkpoint-copied", step=step, url=report.url, seconds=seconds)
        with self._copied:
            self.copied_step = step
            self._copied.notify_all()
        return True

    def wait_copied(self, step: int, timeout: float) -> bool:
        """Copy (now, on this thread) and wait until ``step`` or newer is copied."""
        deadline = time.monotonic() + timeout
        while self.copied_step < step and time.monotonic() < deadline:
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

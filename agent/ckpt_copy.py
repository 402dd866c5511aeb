"""Checkpoint copies in object storage: what lets a job move to another zone or cloud.

A checkpoint volume is zonal (FSx, Filestore, a local disk), so a job that moves leaves it
behind. The agent of the node that committed a checkpoint copies it to
``<copy_to>/<run id>/step-N/`` in the background (its manifest last, so a partial copy is
never taken for a whole one); before starting torchrun, an agent whose volume holds nothing
newer than the newest complete copy brings that copy in. Both report to the run's event
stream; the newest copy is also recorded in ``ckpt:copied``, which the controller waits on
before it restarts a moved job elsewhere.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import threading
import time
from pathlib import Path

import redis

from spottrain.keys import RunKeys

from .checkpoint.directory import CheckpointDir
from .node_record import NodeRecord

log = logging.getLogger("spottrain.agent.ckpt_copy")


def _step_of(name: str) -> int:
    return int(name.rsplit("-", 1)[1])


class CheckpointCopier:
    """Copies this node's commits out, and the newest copy in.

    Args:
        store_url: where copies go (``s3://``, ``gs://``, ``file://``).
        ckpt_dir: the node's checkpoint directory.
        client, keys, node_id, record: the run's Redis, this node, its event recorder.
        poll_s: how often to look for a new commit.
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
    ) -> None:
        from spottrain.cloud.storage import open_store

        self.store = open_store(store_url)
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
    def pull_newest(self) -> int | None:
        """Bring in the newest complete copy if the volume has nothing as new; return its
        step, or None when the volume is already as new (or there is no copy)."""
        from spottrain.cloud.storage import download_dir, list_dirs

        copies = list_dirs(self.store, self.prefix)
        if not copies:
            return None
        newest = max(copies, key=_step_of)
        step = _step_of(newest)
        # Every node of a zone shares its volume and boots at about the same time: one
        # brings the copy in, the others wait for it and find it there.
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        with open(self.ckpt_dir / ".pull.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                local = CheckpointDir(str(self.ckpt_dir)).committed()
                if local and local[-1][0] >= step:
                    return None
                t0 = time.monotonic()
                download_dir(self.store, f"{self.prefix}/{newest}", self.ckpt_dir / newest)
                (self.ckpt_dir / "latest").write_text(newest)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        self.record.event(
            "checkpoint-pulled",
            step=step,
            source=f"{self.url}/{self.prefix}/{newest}",
            seconds=round(time.monotonic() - t0, 3),
        )
        log.info("brought in checkpoint step %d from %s", step, self.url)
        return step

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

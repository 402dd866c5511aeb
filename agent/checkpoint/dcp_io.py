"""Writing and reading checkpoints with torch.distributed.checkpoint (DCP).

DCP plans who writes what: replicated tensors are written once, and the writing is spread
over the ranks. Its file system layer is where this module hooks in: every file is
checksummed (CRC32) as its bytes go out, on a helper thread while the same bytes are being
written, so the manifest never needs a second read of the data. torch's own per-record CRC
inside each file is then redundant and costs almost half the write speed, so it is off while
spottrain saves.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch.distributed as dist
import torch.utils.serialization.config as _serialization_config
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future as TorchFuture

from .directory import CheckpointDir
from .failpoints import armed, failpoint
from .files import CheckpointDirError, StaleCommitError, describe_os_error
from .manifest import FileSum, Manifest, crc32

log = logging.getLogger(__name__)

# A single process saving without a process group is a case this module means (tests, a
# one-worker job), not a mistake worth a warning on every save.
warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized",
    category=UserWarning,
)

# Checksumming a buffer on a second thread overlaps it with the write of the same buffer;
# both release the GIL. Small writes are checksummed inline (a thread hop costs more).
_OVERLAP_MIN = 1 << 20
_crc_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="spottrain-crc")


class CheckpointWriteError(RuntimeError):
    """A save failed on some rank; the previous checkpoint is intact."""


class _ChecksumFile(io.RawIOBase):
    """A write-only file that keeps the CRC32 and size of everything written to it."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.crc = 0
        self.size = 0
        self._tear = armed().startswith("shard") and path.suffix == ".distcp"

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def tell(self) -> int:
        return self.size

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = len(view)
        if self._tear and n > 1:
            # Half of this write on disk, then the failpoint; if it is not this write's turn
            # to die, the other half follows (never the whole buffer again).
            self.crc = crc32(view, self.crc)
            self._write_all(view[: n // 2])
            failpoint("shard")
            self._write_all(view[n // 2 :])
        elif n >= _OVERLAP_MIN:
            fut: Future[int] = _crc_pool.submit(crc32, view, self.crc)
            self._write_all(view)
            self.crc = fut.result()
        else:
            self.crc = crc32(view, self.crc)
            self._write_all(view)
        self.size += n
        return n

    def _write_all(self, view: memoryview) -> None:
        while view:
            written = os.write(self._fd, view)
            view = view[written:]

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


class ChecksumFileSystem(FileSystem):
    """DCP's local file system, recording the size and CRC32 of every file it writes, and
    every exception raised while a file was being written (see :class:`ChecksumWriter`)."""

    def __init__(self) -> None:
        super().__init__()
        self.sums: dict[str, FileSum] = {}
        self.failures: list[BaseException] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(
        self, path: str | os.PathLike[str], mode: str
    ) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        try:
            f = _ChecksumFile(Path(path))
        except BaseException as exc:
            with self._lock:
                self.failures.append(exc)
            raise
        try:
            yield cast(io.IOBase, f)
        except BaseException as exc:
            with self._lock:
                self.failures.append(exc)
            raise
        finally:
            f.close()
            with self._lock:
                self.sums[f.path.name] = FileSum(f.size, f.crc)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        with self._lock:
            if (s := self.sums.pop(Path(path).name, None)) is not None:
                self.sums[Path(new_path).name] = s


class ChecksumWriter(FileSystemWriter):
    """DCP's file system writer over :class:`ChecksumFileSystem` that fails the save when a
    writer thread failed.

    torch's writer runs ``thread_count - 1`` helper threads whose exceptions are only printed:
    the items they held are silently missing from the results, and the checkpoint would
    commit (its manifest verifying) without them, to fail only when loaded.
    """

    def __init__(self, path: Path, thread_count: int) -> None:
        super().__init__(
            path, single_file_per_rank=True, sync_files=True, thread_count=thread_count
        )
        self.fs: ChecksumFileSystem = ChecksumFileSystem()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        fut = super().write_data(plan, planner)
        results = fut.wait()  # torch's writer has finished every thread before returning
        if self.fs.failures:
            raise self.fs.failures[0]
        if len(results) != len(plan.items):
            raise RuntimeError(
                f"a checkpoint writer thread wrote {len(results)} of {len(plan.items)} items "
                "and stopped without an error"
            )
        return fut


@contextlib.contextmanager
def _without_torch_crc() -> Iterator[None]:
    cfg = _serialization_config.save
    before = cfg.compute_crc32
    cfg.compute_crc32 = False
    try:
        yield
    finally:
        cfg.compute_crc32 = before


@dataclass(frozen=True)
class SaveResult:
    step: int
    path: Path | None  # None when the commit was refused
    manifest: Manifest | None
    refused: str | None
    write_s: float
    commit_s: float

    @property
    def committed(self) -> bool:
        return self.path is not None


def _dist_on(group: Any) -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank(group: Any) -> int:
    return dist.get_rank(group) if _dist_on(group) else 0


def broadcast_from_first(obj: Any, group: Any) -> Any:
    """``obj`` as rank 0 of ``group`` has it, on every rank (itself without a process
    group)."""
    if not _dist_on(group):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    return box[0]


def save(
    state: dict[str, Any],
    ckdir: CheckpointDir,
    *,
    step: int,
    round_: int,
    kind: str,
    request_id: int = 0,
    extra: dict[str, Any] | None = None,
    group: Any = None,
    fence: Callable[[int], str | None] | None = None,
    thread_count: int = 4,
    keep: int = 3,
    epoch: int = -1,
) -> SaveResult:
    """Save ``state`` as checkpoint ``step`` on every rank of ``group`` and commit it.

    Every rank calls this at the same step. Rank 0 of the group commits (manifest, rename,
    ``latest``) and prunes; every rank returns the same result. ``epoch`` is the writers'
    fencing epoch (:meth:`CheckpointDir.claim_epoch`; -1: not fenced by epoch): the commit
    is refused, with ``SaveResult.refused`` saying why, once a newer one has been claimed.

    Raises:
        CheckpointWriteError: a rank could not write (disk full, read-only, ...). The
            temporary directory is removed and the previous checkpoint stays as it was.
    """
    on = _dist_on(group)
    rank = _rank(group)
    world = dist.get_world_size(group) if on else 1
    tmp = ckdir.tmp_path(step, round_, epoch)
    t0 = time.monotonic()
    _make_tmp(ckdir, tmp, rank, group)

    writer = ChecksumWriter(tmp, thread_count)
    try:
        with _without_torch_crc():
            dcp_save(state, storage_writer=writer, process_group=group, no_dist=not on)
    except (Exception, CheckpointException) as exc:
        # CheckpointException (every rank's failures, raised on every rank) derives from
        # BaseException, not Exception.
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(_describe_save_failure(exc, ckdir, step)) from exc
    failpoint("before-manifest")
    write_s = time.monotonic() - t0

    sums = _gather_sums(writer, group, rank, world)

    outcome: tuple[str, str | None, Manifest | None]
    if rank == 0:
        manifest = Manifest(
            step=step,
            world_size=world,
            round=round_,
            kind=kind,
            created_at=time.time(),
            files=sums,
            request_id=request_id,
            extra=dict(extra or {}),
            epoch=epoch,
        )
        outcome = _commit(ckdir, tmp, manifest, fence, keep=keep, epoch=epoch)
    else:
        outcome = ("", None, None)
    status, text, manifest_out = broadcast_from_first(outcome, group)
    commit_s = time.monotonic() - t0 - write_s
    if status == "failed":
        raise CheckpointWriteError(str(text))
    if status == "refused":
        log.error("%s", text)
        return SaveResult(step, None, None, text, write_s, commit_s)
    assert text is not None
    return SaveResult(step, Path(text), manifest_out, None, write_s, commit_s)


def _make_tmp(ckdir: CheckpointDir, tmp: Path, rank: int, group: Any) -> None:
    """Rank 0 makes the empty temporary directory; every rank raises if it could not."""
    error = None
    if rank == 0:
        try:
            if tmp.exists():
                shutil.rmtree(tmp)  # a crashed attempt of this round at this step
            tmp.mkdir()
        except OSError as exc:
            error = describe_os_error(exc, ckdir.root, f"creating {tmp.name}")
    error = broadcast_from_first(error, group)
    if error is not None:
        raise CheckpointWriteError(error)


def _gather_sums(writer: ChecksumWriter, group: Any, rank: int, world: int) -> dict[str, FileSum]:
    """Every rank's file checksums, on rank 0 (this rank's own elsewhere)."""
    sums: dict[str, FileSum] = dict(writer.fs.sums)
    if _dist_on(group):
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dst = dist.get_global_rank(group, 0) if group else 0
        dist.gather_object(sums, gathered, dst=dst, group=group)
        if gathered is not None:
            for part in gathered:
                sums.update(part)
    return sums


def _commit(
    ckdir: CheckpointDir,
    tmp: Path,
    manifest: Manifest,
    fence: Callable[[int], str | None] | None,
    *,
    keep: int,
    epoch: int,
) -> tuple[str, str | None, Manifest | None]:
    """Rank 0's commit and prune: (status, path or why, manifest) for every rank."""
    step, kind, round_ = manifest.step, manifest.kind, manifest.round
    outcome: tuple[str, str | None, Manifest | None]
    try:
        path = ckdir.commit(tmp, manifest, fence)
        outcome = ("committed", str(path), manifest)
        if kind != "emergency":  # seconds count there; the next save prunes
            with contextlib.suppress(OSError):
                ckdir.prune(keep, round_, epoch)
    except StaleCommitError as exc:
        outcome = ("refused", str(exc), None)
    except CheckpointDirError as exc:
        outcome = ("failed", exc.strerror, None)
    except Exception as exc:
        # Anything else must still reach the other ranks, waiting in the broadcast below.
        log.exception("committing step %d failed", step)
        shutil.rmtree(tmp, ignore_errors=True)
        outcome = ("failed", f"committing step {step} failed: {exc}", None)
    return outcome


def _describe_save_failure(exc: BaseException, ckdir: CheckpointDir, step: int) -> str:
    # DCP wraps each rank's failure as (exception, stack summary); find an OSError to name
    # the cause plainly, or else name the first rank's exception.
    seen: list[BaseException] = [exc]
    failures = getattr(exc, "failures", None)
    first = None
    if isinstance(failures, dict):
        for rank, f in sorted(failures.items()):
            inner = f[0] if isinstance(f, tuple) and f else f
            if isinstance(inner, BaseException):
                seen.append(inner)
                if first is None:
                    first = f"rank {rank}: {type(inner).__name__}: {inner}"
    for e in list(seen):
        cause = e.__cause__ or e.__context__
        while cause is not None:
            seen.append(cause)
            cause = cause.__cause__ or cause.__context__
    for e in seen:
        if isinstance(e, OSError) and e.errno:
            return describe_os_error(e, ckdir.root, f"writing step {step}") + (
                "; the previous checkpoint is intact"
            )
    why = first if first is not None else f"{type(exc).__name__}: {exc}"
    return f"saving step {step} to {ckdir.root} failed ({why}); the previous checkpoint is intact"


class CheckpointLoadError(RuntimeError):
    """A checkpoint that verifies did not load into the given state."""


def load(state: dict[str, Any], path: Path, *, group: Any = None) -> None:
    """Load checkpoint ``path`` into ``state`` in place (any world size; DCP reshards).

    Raises:
        CheckpointLoadError: the checkpoint does not fit ``state`` (on every rank).
    """
    try:
        dcp_load(
            state,
            storage_reader=FileSystemReader(path),
            process_group=group,
            no_dist=not _dist_on(group),
        )
    except (Exception, CheckpointException) as exc:
        # Its files verified, so this is not a torn write: the state it holds does not fit
        # the one given (a changed model or optimizer). Starting over here would let the
        # new run's saves prune the old checkpoints, so stop and say so.
        raise CheckpointLoadError(
            f"checkpoint {path} verifies but does not load into this training state "
            f"({_first_line(exc)}). If the model, optimizer or state keys changed, point the "
            "checkpoint directory at a new one (the old checkpoints are left as they are)"
        ) from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__

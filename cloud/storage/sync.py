"""Copying a directory to a store and back (checkpoint copies): :func:`upload_dir`,
:func:`download_dir`, and :func:`list_dirs` for the complete copies under a prefix."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat as stat_mod
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from spottrain.cloud.storage.errors import (
    CorruptObject,
    IncompleteCopy,
    ObjectNotFound,
    SourceChanged,
)
from spottrain.cloud.storage.interface import (
    DEFAULT_COMMIT_MARKER,
    ObjectStore,
    _key_problem,
    validate_key,
)
from spottrain.cloud.storage.store_base import _stream_sha256
from spottrain.fileio import fsync_dir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UploadReport:
    """What :func:`upload_dir` did, by path relative to the directory.

    Attributes:
        url: the copy's URL.
        uploaded: files sent (the marker last).
        skipped: files already stored with the same size and sha256.
        deleted: stale objects under the prefix that the directory no longer has.
        bytes_uploaded: the bytes sent.
    """

    url: str
    uploaded: tuple[str, ...]
    skipped: tuple[str, ...]
    deleted: tuple[str, ...]
    bytes_uploaded: int


def _dir_prefix(prefix: str) -> str:
    prefix = prefix.strip("/")
    if not prefix:
        raise ValueError(
            "a directory copy needs a non-empty prefix (a copy at the store's root would "
            "mirror over everything else in it)"
        )
    validate_key(prefix)
    return prefix


def _local_files(local_dir: Path, dir_fd: int) -> list[str]:
    """The regular files under the directory open as ``dir_fd``, as relative paths."""
    rels: list[str] = []
    for dirpath, dirnames, filenames, fd in os.fwalk(".", dir_fd=dir_fd):
        dirnames.sort()
        for name in [*dirnames, *filenames]:
            if stat_mod.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                raise ValueError(
                    f"{local_dir / dirpath / name} is a symbolic link; upload_dir copies "
                    "regular files only (replace the link with the file it points to)"
                )
        for name in filenames:
            rel = (Path(dirpath) / name).as_posix()
            problem = _key_problem(rel)
            if problem:
                raise ValueError(f"{local_dir / rel} cannot be stored as an object: {problem}")
            rels.append(rel)
    return rels


def upload_dir(
    store: ObjectStore,
    local_dir: str | os.PathLike[str],
    prefix: str,
    *,
    commit_marker: str = DEFAULT_COMMIT_MARKER,
) -> UploadReport:
    """Copy a directory to ``prefix/`` so that readers see all of it or none of it.

    A copy is complete if and only if its commit marker (a file of the directory, such as a
    checkpoint's ``MANIFEST.json``) exists in the store, so the marker goes up last. Before
    anything of an existing complete copy changes, its marker is deleted first. Files
    already stored with the same size and sha256 are skipped, which makes a repeated or
    interrupted upload cheap to resume. The prefix ends up mirroring the directory: objects
    under it that the directory does not have are deleted.

    Every file is read through one descriptor of the directory, opened at the start, and
    each is hashed and sent through one descriptor of its own (see
    :meth:`ObjectStore.put_fileobj`). A directory renamed away and replaced meanwhile (a
    checkpoint step committed again by a newer round) is therefore still copied whole, from
    the directory as it was at the start, or, if it was deleted before all its files were
    opened, the upload stops with :class:`SourceChanged`, leaving no marker: upload again.

    Args:
        store: where to copy to.
        local_dir: the directory; regular files only, no symbolic links.
        prefix: the copy's key prefix, e.g. ``"ckpt/step-000000120"``.
        commit_marker: the path of the marker file, relative to ``local_dir``.

    Returns:
        What was uploaded, skipped and deleted.

    Raises:
        ValueError: an empty prefix, a directory without the marker, a symbolic link, or a
            file name that cannot be a key.
        FileNotFoundError: ``local_dir`` does not exist.
        SourceChanged: the directory changed or vanished while it was uploaded.
        StorageError: another subclass, from the store.
    """
    root = Path(local_dir)
    if not root.is_dir():
        raise FileNotFoundError(errno.ENOENT, "no directory to upload", str(root))
    prefix = _dir_prefix(prefix)
    validate_key(commit_marker)
    dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return _upload_dir_at(store, root, dir_fd, prefix, commit_marker)
    except FileNotFoundError as exc:
        raise SourceChanged(
            f"{root} was replaced or removed while it was uploaded ({exc.filename or exc} is "
            "gone; a newer commit of the same checkpoint?); the copy has no "
            f"{commit_marker}, so it is not taken for a complete one: upload it again"
        ) from exc
    finally:
        os.close(dir_fd)


def _upload_dir_at(
    store: ObjectStore, root: Path, dir_fd: int, prefix: str, commit_marker: str
) -> UploadReport:
    rels = _local_files(root, dir_fd)
    if commit_marker not in rels:
        raise ValueError(
            f"{root} has no {commit_marker}: upload_dir needs the directory's commit marker "
            "(a copy counts as complete only once its marker is stored); pass "
            "commit_marker= naming a file the directory has"
        )

    def open_rel(rel: str) -> BinaryIO:
        def opener(_: str, flags: int) -> int:
            return os.open(rel, flags | os.O_NOFOLLOW, dir_fd=dir_fd)

        return open(root / rel, "rb", opener=opener)

    remote = {key[len(prefix) + 1 :] for key in store.list(prefix + "/")}
    to_upload: list[str] = []
    skipped: list[str] = []
    for rel in sorted(rels):
        if rel in remote:
            try:
                info = store.stat(f"{prefix}/{rel}")
            except ObjectNotFound:
                info = None
            if info is not None and info.sha256 is not None:
                with open_rel(rel) as f:
                    size = os.fstat(f.fileno()).st_size
                    if info.size == size and _stream_sha256(f)[0] == info.sha256:
                        skipped.append(rel)
                        continue
        to_upload.append(rel)
    stale = sorted(remote - set(rels))

    marker_key = f"{prefix}/{commit_marker}"
    if (to_upload or stale) and commit_marker in remote:
        # Un-commit first: from here until the marker is back, readers see no copy at all.
        store.delete(marker_key)
        if commit_marker in skipped:
            skipped.remove(commit_marker)
            to_upload.append(commit_marker)
    sent = 0

    def send(rel: str) -> int:
        with open_rel(rel) as f:
            store.put_fileobj(f"{prefix}/{rel}", f)
            return os.fstat(f.fileno()).st_size

    ordered = [rel for rel in to_upload if rel != commit_marker]
    for rel in ordered:
        sent += send(rel)
    for rel in stale:
        store.delete(f"{prefix}/{rel}")
    if commit_marker in to_upload:
        sent += send(commit_marker)
        ordered.append(commit_marker)
    report = UploadReport(
        url=store.url(prefix),
        uploaded=tuple(ordered),
        skipped=tuple(skipped),
        deleted=tuple(stale),
        bytes_uploaded=sent,
    )
    log.info(
        "event=storage.upload_dir url=%s uploaded=%d skipped=%d deleted=%d bytes=%d",
        report.url,
        len(report.uploaded),
        len(report.skipped),
        len(report.deleted),
        report.bytes_uploaded,
    )
    return report


def download_dir(
    store: ObjectStore,
    prefix: str,
    local_dir: str | os.PathLike[str],
    *,
    commit_marker: str = DEFAULT_COMMIT_MARKER,
) -> Path:
    """Fetch a complete copy made by :func:`upload_dir` into a new directory, atomically.

    Every object under ``prefix/`` is downloaded into a temporary directory beside
    ``local_dir``, checked against the sha256 recorded at upload, and the directory is
    renamed to ``local_dir`` only when all are good: on any failure nothing is left at
    ``local_dir``. If the copy's marker is replaced or deleted while downloading (another
    upload began), the download is refused rather than mixing two copies.

    Args:
        store: where the copy is.
        prefix: the copy's key prefix.
        local_dir: the directory to create; it must not exist yet.
        commit_marker: the marker's path relative to the copy.

    Returns:
        ``local_dir``.

    Raises:
        IncompleteCopy: the copy has no marker, or lost it while downloading.
        CorruptObject: an object does not match its recorded sha256, or has none.
        FileExistsError: ``local_dir`` already exists.
        ValueError: an empty prefix, or an object whose key cannot be a local path.
        StorageError: another subclass, from the store.
    """
    dest = Path(local_dir)
    prefix = _dir_prefix(prefix)
    validate_key(commit_marker)
    if dest.exists() or dest.is_symlink():
        raise FileExistsError(
            errno.EEXIST, "download_dir will not overwrite an existing directory", str(dest)
        )
    marker_key = f"{prefix}/{commit_marker}"
    try:
        marker = store.stat(marker_key)
    except ObjectNotFound:
        raise IncompleteCopy(
            prefix,
            f"{store.url(prefix)} is not a complete copy: it has no {commit_marker} (its "
            "upload died or is still running); use an older copy",
        ) from None
    keys = store.list(prefix + "/")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.download-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        _download_keys(store, prefix, keys, tmp)
        try:
            now = store.stat(marker_key)
        except ObjectNotFound:
            now = None
        if now is None or now.version != marker.version:
            raise IncompleteCopy(
                prefix,
                f"{store.url(prefix)} changed while it was downloaded (a new upload began); "
                "try again",
            )
        fsync_dir(tmp)
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(dest.parent)
    log.info(
        "event=storage.download_dir url=%s dest=%s files=%d", store.url(prefix), dest, len(keys)
    )
    return dest


def _download_keys(store: ObjectStore, prefix: str, keys: list[str], tmp: Path) -> None:
    """Download each object of ``keys`` (under ``prefix/``) to its path under ``tmp``,
    refusing keys that cannot be a local path and objects without a recorded sha256."""
    for key in keys:
        rel = key[len(prefix) + 1 :]
        problem = _key_problem(rel)
        if problem:
            raise ValueError(f"refusing object {store.url(key)}: {problem}")
        info = store.get_file(key, tmp / rel)
        if info.sha256 is None:
            raise CorruptObject(
                key,
                f"{store.url(key)} has no recorded sha256, so it cannot be verified; "
                "it was not written by upload_dir",
            )


def list_dirs(
    store: ObjectStore,
    prefix: str = "",
    *,
    commit_marker: str = DEFAULT_COMMIT_MARKER,
    nested: bool = False,
) -> list[str]:
    """The complete copies under ``prefix/``: names whose marker exists, sorted.

    ``list_dirs(store, "ckpt")`` gives ``["step-000000120", "step-000000140"]`` when those
    two copies are complete; ``store`` then holds them at ``"ckpt/step-000000120/..."``.
    With ``nested``, copies at any depth are listed by their path under ``prefix``
    (``"hf/checkpoint-40"``), except one inside another complete copy (a directory of that
    copy's files that happens to hold a file named like the marker).

    Raises:
        ValueError: a bad prefix or marker.
        StorageError: a subclass, from the store.
    """
    prefix = prefix.strip("/")
    if prefix:
        validate_key(prefix)
    validate_key(commit_marker)
    base = f"{prefix}/" if prefix else ""
    names = set()
    for key in store.list(base):
        rest = key[len(base) :]
        if nested:
            if rest.endswith("/" + commit_marker):
                names.add(rest[: -len(commit_marker) - 1])
            continue
        name, sep, tail = rest.partition("/")
        if sep and tail == commit_marker:
            names.add(name)
    if nested:
        names = {n for n in names if not _inside_any(n, names)}
    return sorted(names)


def _inside_any(name: str, names: set[str]) -> bool:
    parts = name.split("/")
    return any("/".join(parts[:i]) in names for i in range(1, len(parts)))

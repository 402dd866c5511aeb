"""A content-addressed archive of the working directory that ``spottrain up`` uploads to
object storage, so a backfilled node runs exactly what the others run.

``build_archive`` packs a directory into a deterministic ``.tar.gz``: the same tree gives the
same bytes, hence the same sha256, whatever the files' mtimes, owners or the machine's umask.
``upload_archive`` stores it under ``code/<sha256>.tar.gz``; the job spec pins that URL and
sha256, and every VM's boot script runs::

    python -m spottrain.cloud.code_archive fetch URL SHA256 DEST

which downloads the archive, refuses it unless its sha256 matches, and extracts it safely.

The deterministic part holds for one Python and zlib build; nodes never rebuild an archive,
they fetch the bytes that were hashed, so a different zlib elsewhere changes nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import gzip
import os
import posixpath
import re
import shutil
import stat
import sys
import tarfile
import uuid
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .storage import (
    ObjectNotFound,
    ObjectStore,
    StorageError,
    file_sha256,
    parse_store_url,
    validate_key,
)
from .stores import open_store

DEFAULT_EXCLUDES = (
    ".git",
    ".venv",
    "__pycache__",
    "*.pyc",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
)
IGNORE_FILE = ".spottrainignore"
# Written into an extracted tree; it lets a rerun of the same fetch (a rebooted VM) succeed
# without downloading again. Never archived, so it cannot come from the tree itself.
FETCHED_MARKER = ".spottrain-archive-sha256"
DEFAULT_MAX_BYTES = 1 << 30
KEY_PREFIX = "code"

_SHA256_RE = re.compile(r"^[0-9a-f]{64}\Z")
_GZIP_LEVEL = 6


class ArchiveError(Exception):
    """An archive cannot be built, fetched or extracted; the message says why and the fix."""


class ArchiveTooLarge(ArchiveError):
    """The tree is above the size limit (usually data or checkpoints in the work directory)."""


class ArchiveChecksumError(ArchiveError):
    """A fetched archive's sha256 is not the one the job pinned."""


class UnsafeArchiveError(ArchiveError):
    """A tree or archive member that would reach outside its directory."""


@dataclass(frozen=True)
class Archive:
    """A built archive.

    Attributes:
        path: the ``.tar.gz`` file, named ``code-<sha256[:16]>.tar.gz``.
        sha256: hex sha256 of its bytes.
        size: its size in bytes.
        files: the archived files and symbolic links, relative, sorted.
    """

    path: Path
    sha256: str
    size: int
    files: tuple[str, ...]

    @property
    def key(self) -> str:
        """Its content-addressed object key, ``code/<sha256>.tar.gz``."""
        return archive_key(self.sha256)


def archive_key(sha256: str) -> str:
    """The object key of the archive with this sha256.

    Raises:
        ValueError: not a lowercase hex sha256.
    """
    _check_sha256(sha256)
    return f"{KEY_PREFIX}/{sha256}.tar.gz"


def _check_sha256(sha256: str) -> str:
    if not isinstance(sha256, str) or not _SHA256_RE.match(sha256):
        raise ValueError(f"{sha256!r} is not a sha256 (64 lowercase hex digits)")
    return sha256


# --- excludes -------------------------------------------------------------------------------


def read_ignore_file(path: Path) -> list[str]:
    """The patterns of a ``.spottrainignore``: one per line, '#' comments and blanks skipped.

    Raises:
        ArchiveError: a '!' (negated) pattern, which is not supported.
    """
    patterns: list[str] = []
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("!"):
            raise ArchiveError(
                f"{path}:{number}: negated patterns ({line!r}) are not supported; list only "
                "what to leave out"
            )
        patterns.append(line)
    return patterns


def _excluded(rel: str, is_dir: bool, patterns: Sequence[str]) -> bool:
    """Whether a relative path matches: like .gitignore without negation.

    A pattern without '/' matches a file or directory name at any depth; one with '/'
    matches the whole relative path (a leading '/' anchors nothing more); a trailing '/'
    matches directories only. Everything under an excluded directory is excluded with it.
    """
    name = rel.rsplit("/", 1)[-1]
    for pattern in patterns:
        dir_only = pattern.endswith("/")
        pat = pattern.rstrip("/")
        if dir_only and not is_dir:
            continue
        if "/" in pat:
            if fnmatch.fnmatchcase(rel, pat.lstrip("/")):
                return True
        elif fnmatch.fnmatchcase(name, pat):
            return True
    return False


# --- building -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    rel: str
    kind: str  # "dir", "file" or "link"
    path: Path
    link_target: str = ""


def _collect(
    root: Path, patterns: Sequence[str], skip: Path | None, max_bytes: int
) -> list[_Entry]:
    entries: list[_Entry] = []
    total = 0
    sizes: list[tuple[int, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        rel_dir = here.relative_to(root).as_posix()
        prefix = "" if rel_dir == "." else f"{rel_dir}/"
        kept_dirs = []
        for name in sorted(dirnames):
            path = here / name
            rel = prefix + name
            if (skip is not None and path == skip) or _excluded(rel, True, patterns):
                continue
            if path.is_symlink():
                entries.append(_link_entry(root, path, rel))
                continue
            kept_dirs.append(name)
            entries.append(_Entry(rel, "dir", path))
        dirnames[:] = kept_dirs
        for name in sorted(filenames):
            path = here / name
            rel = prefix + name
            if name == FETCHED_MARKER or _excluded(rel, False, patterns):
                continue
            if path.is_symlink():
                entries.append(_link_entry(root, path, rel))
                continue
            st = path.stat()
            if not stat.S_ISREG(st.st_mode):
                raise ArchiveError(
                    f"{path} is not a regular file (a pipe, socket or device); exclude "
                    f"{rel!r} in {IGNORE_FILE}"
                )
            total += st.st_size
            sizes.append((st.st_size, rel))
            entries.append(_Entry(rel, "file", path))
        if total > max_bytes:
            biggest = ", ".join(f"{r} ({s >> 20} MiB)" for s, r in sorted(sizes)[-5:][::-1])
            raise ArchiveTooLarge(
                f"{root} holds more than {max_bytes >> 20} MiB of files to archive (largest so "
                f"far: {biggest}); code archives are for code: exclude data, checkpoints and "
                f"outputs with patterns in {root / IGNORE_FILE} (one per line, e.g. 'data/' "
                "or '*.safetensors') or exclude=..., or raise max_bytes"
            )
    entries.sort(key=lambda e: e.rel)
    return entries


def _link_entry(root: Path, path: Path, rel: str) -> _Entry:
    target = os.readlink(path)
    resolved = Path(os.path.realpath(path))
    real_root = Path(os.path.realpath(root))
    if resolved != real_root and real_root not in resolved.parents:
        raise UnsafeArchiveError(
            f"{path} is a symbolic link to {target}, outside {root}; a node that fetches the "
            f"archive would not have it: copy what it points to into the tree, or exclude "
            f"{rel!r} in {IGNORE_FILE}"
        )
    # Relative, so the link still points inside the tree wherever it is extracted.
    relative = os.path.relpath(resolved, Path(os.path.realpath(path.parent)))
    return _Entry(rel, "link", path, relative)


def _tarinfo(entry: _Entry) -> tarfile.TarInfo:
    info = tarfile.TarInfo(entry.rel)
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if entry.kind == "dir":
        info.type = tarfile.DIRTYPE
        info.mode = 0o755
    elif entry.kind == "link":
        info.type = tarfile.SYMTYPE
        info.linkname = entry.link_target
        info.mode = 0o777
    else:
        st = entry.path.stat()
        info.type = tarfile.REGTYPE
        info.size = st.st_size
        info.mode = 0o755 if st.st_mode & 0o111 else 0o644
    return info


def build_archive(
    workdir: str | os.PathLike[str],
    dest_dir: str | os.PathLike[str],
    *,
    exclude: Iterable[str] = (),
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Archive:
    """Pack ``workdir`` into a deterministic ``code-<sha256[:16]>.tar.gz`` in ``dest_dir``.

    Entries are sorted, with mtime 0, owner 0:0 and no owner names, modes 0644 or 0755
    (the owner's exec bit kept) and a gzip header with mtime 0 and no file name, so the
    same tree always gives the same bytes. Left out: :data:`DEFAULT_EXCLUDES`, the
    ``exclude`` patterns and those in ``workdir/.spottrainignore`` (see ``_excluded`` for
    the matching rules), and ``dest_dir`` itself when it lies inside ``workdir``.
    Symbolic links that stay inside the tree are kept (made relative); others are refused.

    Args:
        workdir: the tree to pack.
        dest_dir: where to write the archive (created if missing).
        exclude: more patterns to leave out.
        max_bytes: the most file bytes to pack before refusing.

    Returns:
        The archive.

    Raises:
        FileNotFoundError: ``workdir`` is not a directory.
        ArchiveTooLarge: more than ``max_bytes`` of files remain after the excludes.
        UnsafeArchiveError: a symbolic link points outside ``workdir``.
        ArchiveError: a bad ``.spottrainignore``.
    """
    root = Path(workdir).absolute()
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory to archive")
    out_dir = Path(dest_dir).absolute()
    patterns = [*DEFAULT_EXCLUDES, *exclude]
    if (root / IGNORE_FILE).is_file():
        patterns += read_ignore_file(root / IGNORE_FILE)
    entries = _collect(root, patterns, out_dir, max_bytes)

    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".code-{uuid.uuid4().hex[:12]}.tar.gz.part"
    try:
        with open(tmp, "wb") as raw:
            # filename="" keeps the temporary name out of the gzip header; mtime=0 the clock.
            with (
                gzip.GzipFile(
                    filename="", mode="wb", fileobj=raw, compresslevel=_GZIP_LEVEL, mtime=0
                ) as gz,
                tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
            ):
                for entry in entries:
                    info = _tarinfo(entry)
                    if entry.kind == "file":
                        with open(entry.path, "rb") as f:
                            tar.addfile(info, f)
                    else:
                        tar.addfile(info)
            raw.flush()
            os.fsync(raw.fileno())
        sha256 = file_sha256(tmp)
        final = out_dir / f"code-{sha256[:16]}.tar.gz"
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    files = tuple(e.rel for e in entries if e.kind != "dir")
    return Archive(final, sha256, final.stat().st_size, files)


# --- storing and fetching -------------------------------------------------------------------


def upload_archive(store: ObjectStore, archive: Archive) -> str:
    """Store an archive under ``code/<sha256>.tar.gz``, unless it is there already.

    Returns:
        The archive's URL, for the job spec and :func:`fetch_archive`.

    Raises:
        StorageError: a subclass, from the store.
    """
    key = archive.key
    try:
        present = store.stat(key).size == archive.size
    except ObjectNotFound:
        present = False
    if not present:
        store.put_file(key, archive.path, sha256=archive.sha256)
    return store.url(key)


def split_archive_url(url: str) -> tuple[str, str]:
    """Split an archive URL into its store's URL and the key, checking both.

    Raises:
        ValueError: the URL does not name an object in a store.
    """
    parent, sep, name = url.rstrip("/").rpartition("/")
    if not sep or not name or parent.endswith(":/") or parent.endswith(":"):
        raise ValueError(
            f"{url!r} does not name an archive object (expected e.g. "
            "s3://bucket/prefix/code/<sha256>.tar.gz)"
        )
    parse_store_url(parent)
    validate_key(name)
    return parent, name


def fetch_archive(
    source: str,
    sha256: str,
    dest_dir: str | os.PathLike[str],
    *,
    store: ObjectStore | None = None,
) -> Path:
    """Download an archive, check its sha256, and extract it into ``dest_dir`` atomically.

    The archive is extracted into a temporary directory beside ``dest_dir`` with tarfile's
    ``data`` filter (no absolute paths, no '..', no links leaving the tree, no devices) and
    renamed into place. If ``dest_dir`` already holds this very archive (a rebooted VM running
    its boot script again) nothing is downloaded.

    Args:
        source: the archive's URL, or its key in ``store``.
        sha256: the sha256 the job pinned.
        dest_dir: the directory to create.
        store: the store ``source`` is a key of; ``source`` is a URL when omitted.

    Returns:
        ``dest_dir``.

    Raises:
        ValueError: a malformed sha256 or URL.
        ArchiveChecksumError: the archive's sha256 is not ``sha256``.
        UnsafeArchiveError: a member would land outside ``dest_dir``.
        ArchiveError: ``dest_dir`` exists with other content, or the archive is unreadable.
        StorageError: a subclass, from the store.
    """
    _check_sha256(sha256)
    dest = Path(dest_dir).absolute()
    marker = dest / FETCHED_MARKER
    if dest.exists() or dest.is_symlink():
        if marker.is_file() and marker.read_text(encoding="utf-8").strip() == sha256:
            return dest
        raise ArchiveError(
            f"{dest} already exists and does not hold archive {sha256[:16]}; remove it or "
            "fetch into another directory"
        )
    if store is None:
        store_url, key = split_archive_url(source)
        store = open_store(store_url)
    else:
        key = source
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = dest.parent / f".{dest.name}.fetch-{uuid.uuid4().hex[:12]}"
    work.mkdir()
    try:
        tarball = work / "archive.tar.gz"
        store.get_file(key, tarball)
        actual = file_sha256(tarball)
        if actual != sha256:
            raise ArchiveChecksumError(
                f"{store.url(key)} has sha256 {actual}, not the pinned {sha256}: it was "
                "replaced or corrupted; rebuild and upload the archive, or pin the new sha256"
            )
        tree = work / "tree"
        tree.mkdir()
        _extract(tarball, tree)
        (tree / FETCHED_MARKER).write_text(sha256 + "\n", encoding="utf-8")
        os.rename(tree, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


def _extract(tarball: Path, tree: Path) -> None:
    try:
        with tarfile.open(tarball, mode="r:gz") as tar:
            for member in tar.getmembers():
                # The data filter would quietly strip a leading '/'; an archive we built never
                # has one, so its presence means the archive is not ours.
                name = member.name
                if name.startswith("/") or ".." in name.split("/"):
                    raise UnsafeArchiveError(
                        f"refusing archive {tarball.name}: member {name!r} is an absolute "
                        "path or climbs out with '..'"
                    )
            if hasattr(tarfile, "data_filter"):
                # errorlevel=1 (the default) makes the data filter's refusals raise.
                tar.extractall(tree, filter="data")
            else:
                # Python 3.11.0-3.11.3 (Debian 12's python3 is 3.11.2) have no extraction
                # filters: the same checks, made here.
                tar.extractall(tree, members=data_members(tar, tarball.name))
    except UnsafeArchiveError:
        raise
    except (tarfile.TarError, EOFError, gzip.BadGzipFile, zlib.error) as exc:
        if type(exc).__name__.endswith("FilterError") or isinstance(
            exc, getattr(tarfile, "FilterError", ())
        ):
            raise UnsafeArchiveError(f"refusing archive {tarball.name}: {exc}") from exc
        raise ArchiveError(f"archive {tarball.name} is not a readable tar.gz: {exc}") from exc


def data_members(tar: tarfile.TarFile, name: str) -> list[tarfile.TarInfo]:
    """What the ``data`` filter lets through, for a Python without it: files, folders and
    links that stay inside the tree, with no owner and no special mode bits.

    Raises:
        UnsafeArchiveError: a device, a fifo, or a link that leaves the tree.
    """
    out = []
    for m in tar.getmembers():
        if not (m.isfile() or m.isdir() or m.issym() or m.islnk()):
            raise UnsafeArchiveError(f"refusing archive {name}: {m.name!r} is a special file")
        if m.issym() or m.islnk():
            base = posixpath.dirname(m.name) if m.issym() else ""
            target = posixpath.normpath(posixpath.join(base, m.linkname))
            if m.linkname.startswith("/") or target == ".." or target.startswith("../"):
                raise UnsafeArchiveError(
                    f"refusing archive {name}: {m.name!r} links out of the tree ({m.linkname!r})"
                )
        m.uid = m.gid = 0
        m.uname = m.gname = ""
        m.mode &= 0o755 if (m.isdir() or m.mode & 0o100) else 0o644
        out.append(m)
    return out


# --- command line ---------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m spottrain.cloud.code_archive fetch URL SHA256 DEST``.

    Returns:
        0 on success, 2 on bad arguments, 1 on any failure (with one line on stderr).
    """
    parser = argparse.ArgumentParser(
        prog="python -m spottrain.cloud.code_archive",
        description="Fetch and verify a spottrain code archive (for VM boot scripts).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch", help="download, verify and extract an archive")
    fetch.add_argument("url", help="the archive's URL, e.g. s3://bucket/code/<sha256>.tar.gz")
    fetch.add_argument("sha256", help="the sha256 the job pinned")
    fetch.add_argument("dest", help="the directory to create")
    args = parser.parse_args(argv)
    try:
        _check_sha256(args.sha256)
        split_archive_url(args.url)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        fetch_archive(args.url, args.sha256, args.dest)
    except (ArchiveError, StorageError, ValueError, OSError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    except Exception as exc:  # a boot script reads one line, never a traceback
        print(f"error: {type(exc).__name__}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    print(args.dest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

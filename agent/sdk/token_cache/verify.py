"""Reading and checking a committed cache; removing a corrupt one."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np
import numpy.typing as npt

from spottrain.fileio import fsync_dir

from .format import DTYPES, FORMAT_VERSION, READ_BYTES, Paths, Verify, log, unlink


class Corrupt(Exception):
    pass


def _read_manifest(paths: Paths) -> dict[str, Any] | None:
    """The committed manifest, None when there is none; Corrupt when it is unusable."""
    try:
        raw = paths.manifest.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise Corrupt(f"manifest unreadable: {exc.strerror or exc}") from exc
    try:
        manifest = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise Corrupt(f"manifest is not valid JSON: {exc}") from exc
    if not isinstance(manifest, dict):
        raise Corrupt("manifest is not a JSON object")
    problems = []
    if manifest.get("format") != FORMAT_VERSION:
        problems.append(f"format {manifest.get('format')!r} != {FORMAT_VERSION}")
    if manifest.get("key") != paths.key:
        problems.append(f"key {manifest.get('key')!r} != {paths.key}")
    if manifest.get("dtype") not in DTYPES:
        problems.append(f"dtype {manifest.get('dtype')!r} not one of {DTYPES}")
    count = manifest.get("count")
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        problems.append(f"count {count!r} is not a non-negative integer")
    if not isinstance(manifest.get("sha256"), str):
        problems.append("sha256 missing")
    if problems:
        raise Corrupt("manifest fields are wrong: " + "; ".join(problems))
    return manifest


def open_committed(paths: Paths, verify: Verify) -> tuple[dict[str, Any], npt.NDArray[Any]] | None:
    """The committed cache, checked; None when nothing is committed; Corrupt when it fails."""
    manifest = _read_manifest(paths)
    if manifest is None:
        return None
    dtype = np.dtype(manifest["dtype"])
    count: int = manifest["count"]
    try:
        # One descriptor for the checks and the mapping: they see the same file even if a
        # rebuild renames another one over the name in between.
        f = open(paths.tokens, "rb")  # noqa: SIM115 - closed below; the mapping outlives it
    except OSError as exc:
        raise Corrupt(f"token file unreadable: {exc.strerror or exc}") from exc
    with f:
        size = os.fstat(f.fileno()).st_size
        want = count * dtype.itemsize
        if size != want:
            raise Corrupt(f"token file has {size} bytes, the manifest says {want}")
        if verify == "full":
            h = hashlib.sha256()
            try:
                while block := f.read(READ_BYTES):
                    h.update(block)
            except OSError as exc:
                raise Corrupt(f"token file unreadable: {exc.strerror or exc}") from exc
            if h.hexdigest() != manifest["sha256"]:
                raise Corrupt(
                    f"sha256 of the token bytes is {h.hexdigest()}, "
                    f"the manifest says {manifest['sha256']}"
                )
        if count == 0:
            empty = np.empty(0, dtype=dtype)
            empty.flags.writeable = False
            return manifest, empty
        tokens: npt.NDArray[Any] = np.memmap(f, dtype=dtype, mode="r", shape=(count,))
    return manifest, tokens


def remove_corrupt(paths: Paths, reason: str) -> None:
    log.warning(
        "token cache %s in %s is corrupt (%s); rebuilding it", paths.key, paths.root, reason
    )
    # The manifest goes first: from then on no reader takes the token file for committed.
    unlink(paths.manifest)
    unlink(paths.tokens)
    fsync_dir(paths.root)

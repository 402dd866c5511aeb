"""Checkpoints a framework commits in place: a directory under the framework's own name
(the Hugging Face Trainer's ``checkpoint-N``) whose ``MANIFEST.json``, written durably last,
is the commit point (:meth:`.directory.CheckpointDir.commit_in_place`); and finding the
newest complete one, which the SDK's integrations resume from and the agent's copier
compares its copies with.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from .manifest import Manifest, ManifestError, verify_files

log = logging.getLogger(__name__)

# Where torn checkpoints of the in-place layout go: a name no framework's "last checkpoint"
# logic matches (``.torn-checkpoint-40-<ns>``), kept for a person to look at.
TORN_PREFIX = ".torn-"


@dataclass(frozen=True)
class Complete:
    """The newest complete checkpoint: its directory, step and manifest, and the newer ones
    that were skipped, by name, with why (torn ones are set aside under ``.torn-<name>-*``
    when the layout is in place)."""

    path: Path
    step: int
    manifest: Manifest
    skipped: list[tuple[str, str]] = field(default_factory=list)


def step_of(name: str, prefix: str) -> int | None:
    """N of a directory named ``<prefix>N`` (None: another name)."""
    m = re.fullmatch(re.escape(prefix) + r"(\d+)", name)
    return int(m.group(1)) if m else None


def scan_complete(
    directory: Path, prefix: str, *, set_aside: bool, checksums: bool = True
) -> Complete | None:
    """The newest ``<prefix>N`` directory in ``directory`` whose manifest and files verify
    (checksums included unless ``checksums`` is False: then the manifest, its step and every
    file's size); each newer one is skipped and, with ``set_aside``, renamed to
    ``.torn-<name>-<ns>`` so that the framework's own choice of its newest cannot pick it."""
    try:
        entries = [(step_of(e.name, prefix), e) for e in os.scandir(directory) if e.is_dir()]
    except (FileNotFoundError, NotADirectoryError):
        return None
    skipped: list[tuple[str, str]] = []
    for step, entry in sorted((x for x in entries if x[0] is not None), reverse=True):
        assert step is not None
        path = Path(entry.path)
        try:
            manifest = Manifest.read(path)
            problems = (
                [f"its manifest is for step {manifest.step}"] if manifest.step != step else []
            )
            problems += verify_files(path, manifest, checksums=checksums)
        except ManifestError as exc:
            problems = [str(exc)]
        if not problems:
            return Complete(path, step, manifest, skipped)
        why = "; ".join(problems)
        skipped.append((path.name, why))
        if set_aside:
            aside = directory / f"{TORN_PREFIX}{path.name}-{time.time_ns()}"
            with contextlib.suppress(OSError):
                os.rename(path, aside)
            log.warning("checkpoint %s is incomplete (%s): set aside as %s", path, why, aside.name)
        else:
            log.warning("checkpoint %s is incomplete (%s): skipped", path, why)
    return None

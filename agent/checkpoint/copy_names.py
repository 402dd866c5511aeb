"""Where a checkpoint's copy in object storage goes, and where it comes back to: its path in
the checkpoint volume (``step-000000120``, ``hf/checkpoint-40``), so that a framework finds
the copy brought in where it wrote the checkpoint. A name read back from the store is
untrusted: these checks keep it inside the volume."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from spottrain.protocol.env import ENV_CKPT_DIR

# The last part of a checkpoint's name: a framework's prefix, then its step (``step-N``,
# ``checkpoint-N``).
_LEAF_RE = re.compile(r"(.*\D)(\d+)\Z", re.DOTALL)


@dataclass(frozen=True)
class CopyName:
    """A checkpoint's name as its copy has it: its path in the volume, relative and with
    ``/`` (``"step-000000120"``, ``"hf/checkpoint-40"``).

    Attributes:
        name: the path.
        parent: the directory it is in (``""``: the volume's top).
        prefix: its directory's name before the step (``"checkpoint-"``).
        step: the step of its name.
    """

    name: str
    parent: str
    prefix: str
    step: int


def parse_copy_name(name: str) -> CopyName | None:
    """``name``'s parts, or None when its last part ends in no step (not a checkpoint's
    name). Says nothing of whether it is safe to use: see :func:`copy_name_problem`."""
    parent, _, leaf = name.rpartition("/")
    m = _LEAF_RE.fullmatch(leaf)
    if m is None:
        return None
    return CopyName(name, parent, m.group(1), int(m.group(2)))


def copy_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a checkpoint's place in the volume, or None. A name read back
    from the store is untrusted: it must stay inside the volume and never be one of the
    names spottrain keeps its own temporaries and bookkeeping under (they start with ``.``)."""
    if not name:
        return "its name is empty"
    if "\x00" in name or "\\" in name:
        return "its name has a NUL or a backslash"
    if name.startswith("/"):
        return "its name is an absolute path, outside the volume"
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "its name has an empty, '.' or '..' part, which could lead outside the volume"
    if any(p.startswith(".") for p in parts):
        return "its name has a part starting with '.', as spottrain's own temporaries do"
    if parse_copy_name(name) is None:
        return "its name ends in no step"
    return None


def volume_name(path: Path, volume: Path) -> str:
    """The copy's name of checkpoint ``path``: its path relative to ``volume``, links
    resolved.

    Raises:
        ValueError: ``path`` is not inside ``volume``, or its path there is no name a copy
            can have; the message says why and how to fix it.
    """
    real, base = os.path.realpath(path), os.path.realpath(volume)
    rel = os.path.relpath(real, base)
    if rel == "." or rel == ".." or rel.startswith("../"):
        raise ValueError(
            f"checkpoint {path} is outside the checkpoint volume {volume}: a copy brings a "
            "checkpoint back to its place in the volume, and this one has none, so it is not "
            f"copied; save checkpoints under ${ENV_CKPT_DIR} (for the Trainer: "
            "TrainingArguments(output_dir=...) under it)"
        )
    problem = copy_name_problem(Path(rel).as_posix())
    if problem is not None:
        raise ValueError(
            f"checkpoint {path} is not copied: its path in the checkpoint volume, {rel}, "
            f"cannot name a copy ({problem}); save checkpoints under ${ENV_CKPT_DIR} in a "
            "directory named <name>-N (step-N, checkpoint-N) with no part starting with '.'"
        )
    return Path(rel).as_posix()


def place_problem(volume: Path, name: str) -> str | None:
    """Why copy ``name`` (a safe name, see :func:`copy_name_problem`) cannot be brought in
    to its place in ``volume``: a part of its path there is a symbolic link (which could
    lead anywhere) or a file. None: it can."""
    here = volume
    for part in name.split("/"):
        here = here / part
        if here.is_symlink():
            return (
                f"{here} is a symbolic link: a copy is brought in only to a directory of the "
                "volume itself; replace the link with a directory"
            )
        if here.exists() and not here.is_dir():
            return f"{here} is not a directory: move it away to bring the copy in"
    return None

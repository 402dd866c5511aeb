"""The house's one atomic write: readers see the old file or the new, never a torn one, and a
writer that fails leaves the old file and no temporary behind."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import IO

import pytest

from spottrain.fileio import atomic_write, fsync_dir, fsync_file
from spottrain.ports import free_port


@pytest.mark.parametrize("durable", [True, False])
def test_atomic_write_takes_bytes_text_or_a_writer(tmp_path: Path, durable: bool) -> None:
    path = tmp_path / "f.json"
    atomic_write(path, b"one", durable=durable)
    assert path.read_bytes() == b"one"
    atomic_write(path, "two", durable=durable)
    assert path.read_text() == "two"

    def writer(f: IO[bytes]) -> None:
        f.write(b"thr")
        f.write(b"ee")

    atomic_write(path, writer, durable=durable)
    assert path.read_bytes() == b"three"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


def test_a_failing_writer_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"old")

    def writer(f: IO[bytes]) -> None:
        f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, writer)
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


def test_fsync_helpers_accept_files_and_directories(tmp_path: Path) -> None:
    (tmp_path / "x").write_text("x")
    fsync_file(tmp_path / "x")
    fsync_dir(tmp_path)
    with pytest.raises(NotADirectoryError):
        fsync_dir(tmp_path / "x")


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))

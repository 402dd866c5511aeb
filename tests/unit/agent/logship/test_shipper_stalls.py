"""The shipper's two threads against a store that hangs, crawls or fails: the last flush
returns within its bound and never calls a hung upload shipped, and a stalled upload costs
the oldest output (with a marker the reader prints), never memory past the backlog."""

from __future__ import annotations

import gzip
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from spottrain.agent.logship.chunker import DROP_MARKER, Chunker
from spottrain.agent.logship.settings import ShipSettings
from spottrain.agent.logship.shipper import LogShipper
from spottrain.cloud.storage import LocalStore, StorageUnavailable
from spottrain.controller.cli.node_log_reader import Reader
from spottrain.protocol.node_logs import parse_chunk_key

BOUND_S = 1.0  # the close's timeout in these tests
SLACK_S = 5.0  # what a loaded machine may add to it
LINE = 100  # bytes a line


class StalledStore(LocalStore):
    """A store whose puts wait at a gate (``each_s``: that long, else until it is opened),
    or fail while ``failing``: a hung connection, a crawling one, a bucket that is down."""

    def __init__(self, root: Path, each_s: float | None = None, failing: bool = False) -> None:
        root.mkdir(exist_ok=True)
        super().__init__(str(root))
        self.each_s = each_s
        self.failing = failing
        self.gate = threading.Event()
        self.entered = threading.Event()

    def put_bytes(self, key: str, data: bytes) -> None:
        self.entered.set()
        if self.failing:
            raise StorageUnavailable("the bucket is down")
        self.gate.wait(self.each_s)
        super().put_bytes(key, data)


def _settings(tmp_path: Path, **kw: object) -> ShipSettings:
    base: dict[str, object] = dict(
        url=str(tmp_path / "store"),
        file=str(tmp_path / "node.log"),
        run_id="run-1",
        node="node-0",
        vm="vm-a",
        chunk_s=3600.0,  # cut by size (and at the close) only, unless a test says
        chunk_bytes=10 * LINE,
        backlog_bytes=100 * LINE,
    )
    base.update(kw)
    return ShipSettings(**base)


def _lines(first: int, last: int) -> bytes:
    return b"".join(
        f"{i:06d} step {i} ".ljust(LINE - 1, "x").encode() + b"\n" for i in range(first, last)
    )


def _append(path: Path, data: bytes) -> None:
    with path.open("ab") as f:
        f.write(data)


def _wait(what: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _shipped(store: LocalStore) -> list[bytes]:
    names = sorted(n for n in map(parse_chunk_key, store.list("run-1/node-0/")) if n)
    assert [n.seq for n in names] == list(range(len(names))), "a gap in the chunks"
    return [gzip.decompress(store.get_bytes(n.key())) for n in names]


@pytest.fixture
def stores() -> Iterator[list[StalledStore]]:
    made: list[StalledStore] = []
    yield made
    for s in made:  # let a thread still in its put finish, so nothing outlives the test
        s.gate.set()


@pytest.mark.parametrize("store_is", ["hung", "slow", "failing"])
def test_the_last_flush_returns_within_its_bound_whatever_the_store_does(
    store_is: str, tmp_path: Path, stores: list[StalledStore], caplog: pytest.LogCaptureFixture
) -> None:
    store = StalledStore(
        tmp_path / "store",
        each_s=0.5 if store_is == "slow" else None,
        failing=store_is == "failing",
    )
    stores.append(store)
    shipper = LogShipper(_settings(tmp_path), store=store).start()
    _append(tmp_path / "node.log", _lines(0, 55))  # five chunks cut, half of one held
    _wait(store.entered.is_set)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="spottrain.agent.logship"):
        shipped_all = shipper.close(BOUND_S)
    took = time.monotonic() - t0
    assert took < BOUND_S + SLACK_S, f"close took {took:.1f}s against a {store_is} store"
    assert not shipped_all
    assert "were not shipped" in caplog.text
    # Not marked shipped: an agent restarted on this VM ships the file again.
    assert not Path(shipper.tail.mark_path).exists()


def test_a_chunk_whose_upload_hangs_is_not_called_shipped(
    tmp_path: Path, stores: list[StalledStore], caplog: pytest.LogCaptureFixture
) -> None:
    # Everything written is in the one chunk the upload thread holds: the chunker is empty,
    # and only the thread knows its bytes are not in the store.
    store = StalledStore(tmp_path / "store")
    stores.append(store)
    shipper = LogShipper(_settings(tmp_path, chunk_s=0.1), store=store).start()
    _append(tmp_path / "node.log", _lines(0, 3))
    _wait(store.entered.is_set)
    assert shipper.chunker.held == 0
    with caplog.at_level(logging.WARNING, logger="spottrain.agent.logship"):
        assert not shipper.close(BOUND_S)
    assert f"{3 * LINE} bytes of this node's output were not shipped" in caplog.text
    assert not Path(shipper.tail.mark_path).exists()
    assert store.list("run-1/") == []


def test_a_stalled_upload_drops_the_oldest_output_and_the_reader_says_so(
    tmp_path: Path, stores: list[StalledStore], capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    settings = _settings(tmp_path, backlog_bytes=30 * LINE)
    store = StalledStore(tmp_path / "store")
    stores.append(store)
    shipper = LogShipper(settings, store=store).start()
    log = tmp_path / "node.log"
    first = _lines(0, 10)  # one whole chunk: the upload thread takes it and hangs
    _append(log, first)
    _wait(store.entered.is_set)
    flood = _lines(10, 210)  # twenty chunks, behind a backlog of three
    _append(log, flood)
    chunker = shipper.chunker
    _wait(lambda: chunker.dropped_total + chunker.held == len(flood))
    assert chunker.held <= settings.backlog_bytes  # the stall costs output, not memory
    store.gate.set()
    assert shipper.close(10.0)

    bodies = _shipped(store)
    dropped = chunker.dropped_total
    marker = DROP_MARKER.format(n=dropped).encode()
    # The chunk in flight when the store hung lands first, then the marker, then the newest.
    assert bodies[0] == first
    assert bodies[1].startswith(marker)
    kept = b"".join(bodies[1:])[len(marker) :]
    assert kept == flood[dropped:] and 0 < len(kept) <= settings.backlog_bytes
    assert dropped == len(flood) - len(kept) and dropped % (10 * LINE) == 0  # whole chunks

    reader = Reader(store, "node-0")
    reader.add(n for n in map(parse_chunk_key, store.list("run-1/node-0/")) if n)
    reader.drain(final=True)
    out, err = capsysbinary.readouterr()
    assert out == first + marker + kept
    # The seqs count uploads, not cuts: dropped chunks leave no gap for the reader to report.
    assert b"missing" not in err and f"{len(bodies)} chunks".encode() in err
    assert reader.unreadable == 0


class PausedTake(Chunker):
    """A chunker whose take() pauses once it has removed a chunk: the moment the chunk is
    neither held here nor yet the upload's in-flight chunk, unless the shipper makes the two
    one step."""

    def __init__(self, s: ShipSettings) -> None:
        super().__init__(s.chunk_s, s.chunk_bytes, s.backlog_bytes)
        self.taken = threading.Event()
        self.go = threading.Event()

    def take(self) -> bytes | None:
        data = super().take()
        if data is not None:
            self.taken.set()
            self.go.wait(30)
        return data


def test_the_close_counts_a_chunk_being_taken_for_upload_once(
    tmp_path: Path, stores: list[StalledStore]
) -> None:
    store = StalledStore(tmp_path / "store")  # the put hangs: the chunk stays in flight
    stores.append(store)
    settings = _settings(tmp_path)
    shipper = LogShipper(settings, store=store)
    shipper.chunker = chunker = PausedTake(settings)
    chunker.feed(_lines(0, 3), 0.0)
    chunker.flush()
    assert shipper.unshipped_bytes() == 3 * LINE
    upload = threading.Thread(target=shipper.ship_one, daemon=True)
    upload.start()
    assert chunker.taken.wait(30)
    counted: list[int] = []
    count = threading.Thread(target=lambda: counted.append(shipper.unshipped_bytes()))
    count.start()
    count.join(0.2)
    # The count waits for the chunk to land in flight (without the lock it read 0 here).
    assert count.is_alive() and counted == []
    chunker.go.set()
    count.join(30)
    assert counted == [3 * LINE]
    assert store.entered.wait(30) and shipper.unshipped_bytes() == 3 * LINE
    store.gate.set()
    upload.join(30)
    assert shipper.unshipped_bytes() == 0 and len(_shipped(store)) == 1

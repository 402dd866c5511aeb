"""Reading a node's shipped chunks back (``spottrain logs --node``): grouped by shipping
session (one VM's agent from its start), printed in ``seq`` order with gaps and corrupt
chunks reported on stderr, fetched a window at a time and eight chunks at once; ``--tail``
starts from the last lines instead of the first."""

from __future__ import annotations

import gzip
import sys
import tempfile
import time
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from spottrain.cloud.storage.errors import CorruptObject, ObjectNotFound, StorageError
from spottrain.cloud.storage.interface import ObjectStore
from spottrain.protocol.node_logs import ChunkName
from spottrain.safetext import escape_lines, escape_output

# Chunks fetched at once: a day of a VM is thousands of chunks, each GET a round trip.
FETCHERS = 8
# Chunks fetched before printing them: the header's byte count covers this many.
WINDOW = 256


@dataclass
class Session:
    """One VM's shipping, from its agent's start: its chunks by seq and what was printed."""

    vm: str
    started_ms: int
    keys: dict[int, str] = field(default_factory=dict)
    next_seq: int = 0
    held_gap: int | None = None  # the next_seq at which a gap was first seen, following
    skipped: set[int] = field(default_factory=set)  # called missing; late if they arrive
    headed: bool = False

    def started(self) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started_ms / 1000))


@dataclass(frozen=True)
class _Item:
    """A line of the plan for one session: a chunk to print (late or not) or a gap."""

    seq: int
    key: str = ""
    late: bool = False
    gap_end: int = 0  # for a gap: one past its last missing seq


class Reader:
    """A node's chunks as listings bring them, printed in order (``drain``)."""

    def __init__(self, store: ObjectStore, node: str, only_vm: str | None = None) -> None:
        self.store = store
        self.node = node
        self.only_vm = only_vm
        self.sessions: dict[tuple[str, int], Session] = {}
        self.unreadable = 0
        self._last: tuple[str, int] | None = None
        self._trim: dict[str, int] = {}  # chunk key -> its leading lines not to print
        self._tail_said = ""  # for the next header: where --tail started

    def vm_ids(self) -> set[str]:
        return {s.vm for s in self.sessions.values()}

    def listing(self) -> str:
        return ", ".join(
            f"{s.vm} (started {s.started()}, {len(s.keys)} chunks)" for s in self._ordered()
        )

    def newest(self) -> Session | None:
        """The VM being followed: the newest one (of ``only_vm``'s, when given)."""
        mine = [s for s in self._ordered() if self.only_vm is None or s.vm == self.only_vm]
        return mine[-1] if mine else None

    def add(self, names: Iterable[ChunkName]) -> bool:
        """Take in a listing; returns whether it named a chunk not seen before."""
        fresh = False
        for n in names:
            s = self.sessions.setdefault((n.vm, n.started_ms), Session(n.vm, n.started_ms))
            if n.seq not in s.keys:
                s.keys[n.seq] = n.key()
                fresh = True
        return fresh

    def _ordered(self) -> list[Session]:
        return [self.sessions[k] for k in sorted(self.sessions, key=lambda k: (k[1], k[0]))]

    def start_at_tail(self, lines: int) -> None:
        """Print only the last ``lines`` lines of what is listed now (and everything that
        comes after): chunks are read newest first, eight at a time, until they hold that
        many lines; the chunks before are marked printed without being fetched, and the
        first one printed loses its leading lines. Those chunks are fetched again to print
        them, which keeps memory to a batch."""
        mine = [s for s in self._ordered() if self.only_vm is None or s.vm == self.only_vm]
        newest_first = [(s, q) for s in reversed(mine) for q in sorted(s.keys, reverse=True)]
        need, at = lines, 0
        start: tuple[Session, int] | None = None
        with tempfile.TemporaryDirectory(prefix="spottrain-logs-") as tmp:
            while need > 0 and at < len(newest_first):
                batch = newest_first[at : at + FETCHERS]
                at += len(batch)
                items = [_Item(q, s.keys[q]) for s, q in batch]
                got = self._fetch_all(items, Path(tmp))
                for (s, q), item in zip(batch, items, strict=True):
                    fetched = got[item]
                    data = _unzip(fetched) if isinstance(fetched, Path) else fetched
                    count = _lines_in(data) if isinstance(data, bytes) else 0
                    start = (s, q)
                    if count >= need:
                        self._trim[item.key] = count - need
                        need = 0
                        break
                    need -= count
        if need > 0 and lines > 0:
            return  # fewer lines than asked for: everything prints
        self._tail_said = f"; its last {lines} line{'s' * (lines != 1)} follow" if lines else ""
        for s in mine:
            if start is not None and s is start[0]:
                s.next_seq = start[1]
                s.skipped.clear()
                return
            s.next_seq, s.held_gap = max(s.keys, default=-1) + 1, None
            s.skipped.clear()

    def drain(self, *, final: bool) -> None:
        """Print every session's chunks not printed yet, in order; ``final``: a gap is called
        missing now rather than held for the next poll."""
        for s in self._ordered():
            if self.only_vm is None or s.vm == self.only_vm:
                plan = _plan(s, final)
                if plan:
                    self._print(s, plan)

    def _print(self, s: Session, plan: list[_Item]) -> None:
        """Fetch a window of chunks at a time (in parallel), then print it: output starts
        after one window however long the VM ran, and the spool on disk stays bounded."""
        total = sum(1 for i in plan if i.key)
        start = 0
        while start < len(plan):
            end, n = start, 0
            while end < len(plan) and (n < WINDOW or not plan[end].key):
                n += bool(plan[end].key)
                end += 1
            with tempfile.TemporaryDirectory(prefix="spottrain-logs-") as tmp:
                got = self._fetch_all([i for i in plan[start:end] if i.key], Path(tmp))
                if start == 0:
                    stored = sum(p.stat().st_size for p in got.values() if isinstance(p, Path))
                    self._header(s, total, stored, complete=end == len(plan))
                for item in plan[start:end]:
                    self._emit(s, item, got.get(item))
            start = end

    def _fetch_all(self, chunks: list[_Item], tmp: Path) -> dict[_Item, Path | str]:
        with ThreadPoolExecutor(min(FETCHERS, max(1, len(chunks)))) as pool:
            fetched = pool.map(lambda i: self._fetch(i, tmp), chunks)
            return dict(zip(chunks, fetched, strict=True))

    def _emit(self, s: Session, item: _Item, got: Path | str | None) -> None:
        if got is None:
            self._gap(s, item)
            return
        data = _unzip(got) if isinstance(got, Path) else got
        if isinstance(data, str):
            self.unreadable += 1
            self.note(f"chunk {item.seq} of vm {s.vm} ({self.store.url(item.key)}) {data}")
            return
        if item.late:
            self.note(f"chunk {item.seq} of vm {s.vm} arrived late, out of order:")
        if trim := self._trim.pop(item.key, 0):
            data = data.split(b"\n", trim)[-1]
        write_out(data)

    def _fetch(self, item: _Item, tmp: Path) -> Path | str:
        """The chunk downloaded (checked against its recorded sha256), or why not."""
        # Named by the whole key: a batch read for --tail spans VMs, whose seqs repeat.
        dest = tmp / item.key.replace("/", "_")
        try:
            # get_bytes is one GET (get_file adds a HEAD and fsyncs): a read-back is mostly
            # round trips. The spool keeps memory to the chunks in flight.
            dest.write_bytes(self.store.get_bytes(item.key))
        except CorruptObject as e:
            return f"is corrupt ({e}); skipped"
        except ObjectNotFound:
            return "was listed but is gone (deleted since?); skipped"
        except StorageError as e:
            return f"could not be read ({e}); skipped"
        return dest

    def _header(self, s: Session, chunks: int, stored: int, *, complete: bool) -> None:
        again = " (continued)" if s.headed and self._last != (s.vm, s.started_ms) else ""
        if s.headed and not again:
            return
        s.headed = True
        self._last = (s.vm, s.started_ms)
        size = f"{stored:,} bytes gzip" + ("" if complete else f" in the first {WINDOW}")
        tail, self._tail_said = self._tail_said, ""
        self.note(
            f"node {self.node}, vm {s.vm}{again}: started {s.started()}, "
            f"{chunks} chunk{'s' * (chunks != 1)}, {size}{tail}"
        )

    def _gap(self, s: Session, item: _Item) -> None:
        if item.gap_end - item.seq == 1:
            what = f"chunk {item.seq} of vm {s.vm} is missing"
        else:
            what = f"chunks {item.seq}-{item.gap_end - 1} of vm {s.vm} are missing"
        self.note(f"{what} (lost or not yet shipped)")

    def note(self, line: str) -> None:
        sys.stdout.flush()  # a terminal shows the note where it falls in the output
        print(f"[spottrain] {escape_lines(line)}", file=sys.stderr, flush=True)


def _plan(s: Session, final: bool) -> list[_Item]:
    """What to print next for a session, updating what it has printed."""
    plan = [_Item(q, s.keys[q], late=True) for q in sorted(s.skipped & s.keys.keys())]
    s.skipped.difference_update(s.keys)
    while True:
        while s.next_seq in s.keys:
            plan.append(_Item(s.next_seq, s.keys[s.next_seq]))
            s.next_seq += 1
        after = [q for q in s.keys if q > s.next_seq]
        if not after:
            s.held_gap = None
            return plan
        if not final and s.held_gap != s.next_seq:
            s.held_gap = s.next_seq  # give an out-of-order upload one more poll
            return plan
        end = min(after)
        plan.append(_Item(s.next_seq, gap_end=end))
        s.skipped.update(range(s.next_seq, end))
        s.next_seq, s.held_gap = end, None


def write_out(data: bytes) -> None:
    """The node's bytes: as they are to a file or a pipe (``> node.log`` keeps them raw);
    to a terminal decoded, with every control character but its colours escaped
    (:func:`~spottrain.safetext.escape_output`: a worker must not be able to drive the
    operator's terminal). A stdout without bytes (redirected to a StringIO) gets them
    decoded."""
    out: BinaryIO | None = getattr(sys.stdout, "buffer", None)
    if out is None:
        sys.stdout.write(data.decode(errors="replace"))
        sys.stdout.flush()
        return
    if _is_tty(sys.stdout):
        # Chunks hold whole lines, so no character is cut in two; bytes that are not UTF-8
        # (a lone 0x9b is CSI to some terminals) become U+FFFD.
        text = escape_output(data.decode(errors="replace"))
        data = text.encode(sys.stdout.encoding or "utf-8", errors="replace")
    out.write(data)
    out.flush()


def _is_tty(stream: object) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (OSError, ValueError):
        return False


def _lines_in(data: bytes) -> int:
    """Lines in a chunk; a last line without its newline (a final flush) counts."""
    return data.count(b"\n") + (bool(data) and not data.endswith(b"\n"))


def _unzip(path: Path) -> bytes | str:
    try:
        return gzip.decompress(path.read_bytes())
    except (OSError, EOFError, zlib.error) as e:
        return f"is corrupt (not a whole gzip member: {e}); skipped"

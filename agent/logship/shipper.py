"""The agent's log shipper: a tail thread that cuts the node's output file into chunks, and
an upload thread that puts them, gzipped, in the run's object store with retries.

Neither thread is on the agent's main loop, and neither holds a lock the drain needs: a
store that is slow or down costs the oldest unshipped output (the chunker's backlog), never
a step of training nor a second of the emergency checkpoint. The agent's last call,
:meth:`LogShipper.close`, comes after the drain and is bounded by its timeout."""

from __future__ import annotations

import contextlib
import gzip
import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from spottrain.protocol.keys import RunKeys
from spottrain.protocol.node_logs import ChunkName, node_prefix

from ..known_secrets import KnownSecrets
from .chunker import Chunker
from .settings import MB, ShipSettings, vm_name
from .tail import FileTail

if TYPE_CHECKING:
    from spottrain.cloud.storage import ObjectStore

log = logging.getLogger("spottrain.agent.logship")

# The agent's last flush, after its drain: a VM past its notice has seconds, not minutes.
FINAL_FLUSH_S = 5.0
POLL_S = 0.25  # how often the file is looked at when it has nothing new
RETRY_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)  # waits between tries of one upload
READ_PER_POLL = 16 << 20  # a flood is read in slices so the chunker cuts (and drops) as it goes
# Room kept under the cap for the marker that says shipping stopped.
CAP_RESERVE = 1024
CAP_MARKER = (
    "[spottrain] shipping stopped: this VM shipped its cap of {mb:g} MB of compressed output "
    "(logs.max_mb); its newest output stays in {file} on the VM\n"
)


class LogShipper:
    """Ships one VM's output file. :meth:`start` runs it; :meth:`close` ends it.

    The tests call :meth:`poll` and :meth:`ship_one` themselves, with a clock of their own.
    """

    def __init__(
        self,
        settings: ShipSettings,
        *,
        store: ObjectStore | None = None,
        clock: Callable[[], float] = time.time,
        secrets: KnownSecrets | None = None,
    ) -> None:
        self.s = settings
        self.clock = clock
        # A worker may print the Redis password or a job secret (an env dump, a crash
        # reporter): no chunk carries one to the store.
        self.secrets = secrets or KnownSecrets(
            password_file=settings.password_file,
            redact_file=settings.redact_file,
            run_keys=RunKeys(settings.run_id, settings.key_prefix),
        )
        self.chunker = Chunker(settings.chunk_s, settings.chunk_bytes, settings.backlog_bytes)
        self.tail = FileTail(settings.file, settings.file_max_bytes)
        self.started_ms = int(clock() * 1000)
        self.vm = settings.vm
        # A run id or node no chunk can be named by is refused now, not at the first upload.
        ChunkName(self.started_ms, self.vm or "vm", 0, settings.run_id, settings.node).key()
        self.seq = 0
        self.shipped_bytes = 0  # compressed, this VM's total (the cap)
        self._in_flight = 0  # bytes of the chunk being put, for the close's count
        # Held while a chunk moves between the chunker and _in_flight (taken, put back), so
        # the close's count sees it in exactly one of them: never 0, never twice.
        self._flight_lock = threading.Lock()
        self.capped = False
        self._store = store
        self._reported: set[str] = set()
        self._stop_reading = threading.Event()
        self._give_up = threading.Event()  # the close's deadline passed: stop retrying
        self._ready = threading.Event()
        self._closing = False
        self._threads: list[threading.Thread] = []
        self.retry_s = RETRY_S

    # -- running ----------------------------------------------------------------------------
    def start(self) -> LogShipper:
        log.info(
            "log shipping: %s to %s/%s (a chunk each %gs or %g MB)",
            self.s.file,
            self.s.url.rstrip("/"),
            node_prefix(self.s.run_id, self.s.node),
            self.s.chunk_s,
            self.s.chunk_bytes / MB,
        )
        for name, target in (("tail", self._read_loop), ("upload", self._upload_loop)):
            t = threading.Thread(target=target, name=f"spottrain-logs-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def close(self, timeout: float) -> bool:
        """Read the file to its end, cut what is held, and upload it within ``timeout``
        seconds, however long the store takes. Returns whether everything was shipped (a
        put that has not returned by then counts as not shipped)."""
        deadline = time.monotonic() + timeout
        self._stop_reading.set()
        if self._threads:
            self._threads[0].join(max(0.0, deadline - time.monotonic()))
        if not (self._threads and self._threads[0].is_alive()):
            with contextlib.suppress(Exception):
                self.poll()
        self.chunker.flush()
        self._closing = True
        self._ready.set()
        if len(self._threads) > 1:
            self._threads[1].join(max(0.0, deadline - time.monotonic()))
        else:
            while self.ship_one() and time.monotonic() < deadline:
                pass
        self._give_up.set()
        # An upload thread still alive past the deadline is inside a put that has not
        # returned: its chunk is in neither the chunker nor (as far as we know) the store.
        uploading = len(self._threads) > 1 and self._threads[1].is_alive()
        left = self.unshipped_bytes()
        shipped = left == 0 and not uploading
        if shipped:
            self.tail.mark_shipped()
        self.tail.close()
        if not shipped and not self.capped:
            log.warning("log shipping: %d bytes of this node's output were not shipped", left)
        return shipped or self.capped

    def _read_loop(self) -> None:
        while not self._stop_reading.is_set():
            try:
                got = self.poll()
            except Exception as exc:  # never let the tail thread die quietly
                self._report("read", f"cannot read {self.s.file}: {exc}")
                got = False
            due = self.chunker.due_in(self.clock())
            wait = 0.0 if got else POLL_S if due is None else min(POLL_S, due)
            self._stop_reading.wait(wait)

    def _upload_loop(self) -> None:
        while not self._give_up.is_set():
            if self.ship_one():
                continue
            if self._closing and not self.chunker.pending:
                return
            self._ready.wait(POLL_S)
            self._ready.clear()

    def unshipped_bytes(self) -> int:
        """Bytes not shipped yet: held by the chunker, or in the chunk being put."""
        with self._flight_lock:
            return self.chunker.held + self._in_flight

    # -- one step of each -------------------------------------------------------------------
    def poll(self, now: float | None = None) -> bool:
        """Read what the file has new (up to a slice) and cut what is due. Returns whether
        anything was read."""
        read = 0
        while read < READ_PER_POLL:
            data = self.tail.read()
            if not data:
                break
            read += len(data)
            self.chunker.feed(data, self.clock() if now is None else now)
        self.chunker.tick(self.clock() if now is None else now)
        if self.chunker.pending:
            self._ready.set()
        return read > 0

    def ship_one(self) -> bool:
        """Upload the oldest cut chunk, retrying until it is stored or shipping is given up.
        Returns whether a chunk was stored (or dropped for the cap)."""
        with self._flight_lock:
            data = self.chunker.take()
            if data is None:
                return False
            if self.capped:
                return True  # past the cap: what follows stays in the VM's file only
            data = self.secrets.redact_bytes(data)
            self._in_flight = len(data)
        body = gzip.compress(data, compresslevel=6, mtime=0)
        if self.shipped_bytes + len(body) > self.s.max_bytes - CAP_RESERVE:
            self.capped = True
            marker = CAP_MARKER.format(mb=self.s.max_bytes / MB, file=self.s.file)
            body = gzip.compress(marker.encode(), mtime=0)
            log.warning("log shipping: this VM reached its cap; nothing more is shipped")
        stored = self._put(body)
        with self._flight_lock:
            if not stored:
                self.chunker.put_back(data)
                self.capped = False
            self._in_flight = 0
        return stored

    def _put(self, body: bytes) -> bool:
        attempt = 0
        while True:
            try:
                store = self._open_store()
                key = ChunkName(
                    self.started_ms, self._vm_id(), self.seq, self.s.run_id, self.s.node
                ).key()
                store.put_bytes(key, body)
            except Exception as exc:  # a store error, a missing SDK, no credentials
                self._report(type(exc).__name__, f"cannot upload to {self.s.url}: {exc}")
                if self._give_up.wait(self.retry_s[min(attempt, len(self.retry_s) - 1)]):
                    return False
                attempt += 1
                continue
            self.seq += 1
            self.shipped_bytes += len(body)
            return True

    # -- helpers ----------------------------------------------------------------------------
    def _open_store(self) -> ObjectStore:
        if self._store is None:
            from spottrain.cloud.storage import LocalStore, parse_store_url
            from spottrain.cloud.stores import open_store

            url = parse_store_url(self.s.url)
            if url.scheme == "file":
                # The default, <copy_to>/logs, is made beside the copies; a store whose own
                # parent is missing (a volume not mounted) is not made on the VM's disk.
                root = Path(url.path)
                self._store = LocalStore(root, create=root.parent.is_dir())
            else:
                self._store = open_store(self.s.url)
        return self._store

    def _vm_id(self) -> str:
        if not self.vm:
            self.vm = vm_name(this_vm_id(self.s.cloud, self.s.metadata_endpoint))
        return self.vm

    def _report(self, kind: str, message: str) -> None:
        # Once per kind: the report itself goes to the file being shipped, and a store that
        # is down for an hour must not fill it with the same line.
        if kind not in self._reported:
            self._reported.add(kind)
            log.warning("log shipping: %s (retrying; reported once)", message)


def this_vm_id(cloud: str, endpoint: str | None = None) -> str:
    """This VM's id as its cloud names it (EC2 instance id, GCE instance name), else the
    host name."""
    with contextlib.suppress(Exception):
        if cloud == "aws":
            from ..notices.aws_imds import ImdsSession

            resp = ImdsSession(endpoint, timeout=2.0).get("/latest/meta-data/instance-id")
            if resp.status == 200 and resp.text():
                return resp.text()
        elif cloud == "gcp":
            from ..notices.gce_metadata import GceMetadata

            path = "/computeMetadata/v1/instance/name"
            return GceMetadata(endpoint, timeout=2.0).get(path).text()
    return socket.gethostname()


def start_shipper(settings: ShipSettings | None) -> LogShipper | None:
    """Start shipping, or ``None`` (nothing to ship, or it cannot start: logged, and the
    agent runs on; a node's training never depends on its logs)."""
    if settings is None:
        return None
    try:
        return LogShipper(settings).start()
    except Exception as exc:
        log.error("log shipping is off for this VM: %s", exc)
        return None

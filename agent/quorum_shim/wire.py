"""The relay's wire: a small framed protocol over one plain TCP connection per member VM.

Python gRPC costs the relay VM ~0.4 ms of CPU per member per round (one unary call in and
its answer out), which alone would fill a 50 ms round at 100 members; the same exchange
over this wire costs a fifth of it (relay_cost).

- **Frames**: a 4-byte big-endian length, then that many bytes. Lengths of 0 or above the
  reader's limit (:data:`MAX_REQUEST` at the relay, :data:`MAX_ANSWER` at the member) close
  the connection before anything is allocated for them.
- **Hello**: each side's first frame is :data:`HELLO` (magic + version). The relay answers
  with its own and closes the connection when the member's differs, so a member of another
  spottrain version gets a clear error and asks the quorum directly.
- **Messages**: ``<request id: 4 bytes BE><kind: 1 byte><payload>``. Members send ``Q``
  (payload: :func:`.relay.encode_request`); the relay answers under the same id with ``A``
  (:func:`.relay.answer_line`), ``G`` (refused: the replica was dropped or left; final),
  ``R`` (the run's Redis refused the batch's writes or could not replicate them until the
  deadline, a :class:`~spottrain.quorum.errors.QuorumRedisRefused`; payload ``<cause>
  <message>``: the relay is fine, and the member keeps it), ``T`` (the request's round did
  not form by the deadline: too few replicas asked, a
  :class:`~spottrain.quorum.errors.QuorumNotFormed`; payload its message: the relay is fine
  too) or ``E`` (any other failure: ask directly). A member that predates ``R`` or ``T``
  takes it for an ``E`` (its old fallback), so the kinds need no new version. One
  connection carries several replicas' requests at once; answers come back in any order.
- Anything else (a bad kind, a request that does not decode, a truncated frame) closes the
  connection: the member falls back to Redis directly, and the relay serves the others. A
  member checks its request first (:func:`.relay.check_item`), so one replica's bad id or
  step fails alone, never the connection its VM's other replicas share.
- **Limits**: a member's hello has one deadline for the whole exchange (the hop's); the
  relay closes a connection idle for :data:`IDLE_TIMEOUT_S` and holds at most
  :data:`MAX_CONNECTIONS` (past it the oldest idle one goes, or the new one is refused),
  each with a log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from spottrain.quorum import errors
from spottrain.quorum.errors import (
    QuorumError,
    QuorumGone,
    QuorumNotFormed,
    QuorumRedisRefused,
)
from spottrain.quorum.model import Answer, BatchItem
from spottrain.quorum.scripts import parse_answer
from spottrain.spec.relay import RELAY_GROUP_RANGE

from . import relay as r

log = logging.getLogger("spottrain.agent.quorum_shim.relay")

VERSION = 1
HELLO = b"STQR" + bytes([VERSION])
_HEAD = struct.Struct(">I")
_MSG = struct.Struct(">IB")
# A request: its header, then the widest replica id (counted in bytes, as the quorum checks
# it) and the widest numbers: whatever a member may send fits.
MAX_REQUEST = _MSG.size + r.MAX_REQUEST_BYTES
# An answer lists every member behind (``<id>=<step>``): 12,500 of them fit many times.
MAX_ANSWER = 16 << 20
# A connection that has not said hello by then is not a member.
HELLO_TIMEOUT_S = 10.0
# The relay's deadline for a request ends this long before the member's own, so the relay
# answers (or gives up) before the member stops waiting.
ASK_MARGIN_S = 0.05
# A member's connection with no request in flight and no frame for this long is closed (the
# member makes a new one when it next asks; it drops its own after half of it, so the two
# never cross: see RelayClient.idle).
IDLE_TIMEOUT_S = 300.0
# Connections one relay holds: one per member VM of a group of at most 1,000 replicas, twice
# over for reconnects. Past it the oldest idle connection is closed, or the new one refused.
MAX_CONNECTIONS = 2 * RELAY_GROUP_RANGE[1]
REQUEST, ANSWER, GONE, ERROR, REFUSED, NOT_FORMED = b"QAGERT"


class FrameError(ValueError):
    """A frame that breaks the protocol: the connection is closed."""


def frame(body: bytes) -> bytes:
    return _HEAD.pack(len(body)) + body


def message(request_id: int, kind: int, payload: bytes) -> bytes:
    return frame(_MSG.pack(request_id, kind) + payload)


def split_message(body: bytes) -> tuple[int, int, bytes]:
    if len(body) < _MSG.size:
        raise FrameError(f"a relay message of {len(body)} bytes is shorter than its header")
    request_id, kind = _MSG.unpack_from(body)
    return request_id, kind, body[_MSG.size :]


def check_length(length: int, limit: int) -> int:
    if not 0 < length <= limit:
        raise FrameError(f"a relay frame of {length} bytes (limit {limit}): not this protocol")
    return length


def parse_bind(bind: str) -> tuple[str, int]:
    host, _, port = bind.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"relay address {bind!r} is not host:port")
    return host.strip("[]") or "0.0.0.0", int(port)


@dataclass
class _Conn:
    """A member's connection as the relay's loop sees it."""

    peer: object
    last: float  # loop time of its last whole frame, or of its last answer
    in_flight: int = 0  # its requests not answered yet: while any, it is not idle


class RelayServer:
    """The relay method, served on ``bind`` by one asyncio loop in one thread.

    ``submit`` (:meth:`.relay.Batcher.submit`) takes each request and returns a future of
    its answer; the loop writes the answer frame when it resolves. The socket is bound at
    construction, so a taken port fails there (``OSError``), not in the loop. A connection
    idle (no request in flight) for ``idle_timeout_s`` is closed; past ``max_connections``
    the oldest idle one is closed for a new one, or the new one refused when none is idle.
    """

    def __init__(
        self,
        bind: str,
        submit: Callable[[BatchItem, float], Future[Answer]],
        *,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        if not idle_timeout_s > 0 or max_connections < 1:
            raise ValueError(
                f"a quorum relay needs idle_timeout_s > 0 and max_connections >= 1 (got "
                f"{idle_timeout_s} and {max_connections})"
            )
        self.submit = submit
        self.idle_timeout_s, self.max_connections = idle_timeout_s, max_connections
        host, port = parse_bind(bind)
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        self._sock = socket.socket(info[0], socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind(info[4])
            self._sock.listen(1024)
        except OSError as exc:
            self._sock.close()
            raise OSError(
                f"the quorum relay cannot listen on {bind}: is the port taken? {exc}"
            ) from exc
        self._loop = asyncio.new_event_loop()
        self._conns: dict[asyncio.StreamWriter, _Conn] = {}
        self._answered: list[tuple[asyncio.StreamWriter, int, Future[Answer]]] = []
        self._answered_lock = threading.Lock()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._run, name="spottrain-relay-wire", daemon=True)
        self.bad_frames = 0  # connections closed for breaking the protocol (tests, logs)

    def start(self) -> RelayServer:
        self._thread.start()
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def serve() -> None:
            self._server = await asyncio.start_server(self._connection, sock=self._sock)

        self._loop.run_until_complete(serve())
        self._loop.call_soon(self._close_idle)
        self._loop.run_forever()
        self._loop.close()

    def stop(self) -> None:
        """Close the listener and every member's connection (they fall back directly)."""
        if not self._thread.is_alive():
            self._sock.close()
            if not self._thread.ident:  # never started
                self._loop.close()
            return

        def close() -> None:
            if self._server is not None:
                self._server.close()
            for w in list(self._conns):
                w.close()
            self._loop.call_later(0.05, self._loop.stop)

        self._loop.call_soon_threadsafe(close)
        self._thread.join(2)

    def _close_idle(self) -> None:
        """Close the connections idle past the timeout (a member that went silently, or one
        that sent half a frame and stopped); runs again a quarter of the timeout later."""
        now = self._loop.time()
        for writer, c in list(self._conns.items()):
            if c.in_flight == 0 and now - c.last > self.idle_timeout_s:
                log.warning(
                    "quorum relay: closing the connection from %s: idle for %.1f s (the "
                    "member reconnects when it next asks)",
                    c.peer,
                    now - c.last,
                )
                del self._conns[writer]
                writer.close()
        self._loop.call_later(min(self.idle_timeout_s / 4, 5.0), self._close_idle)

    def _admit(self, writer: asyncio.StreamWriter, peer: object) -> bool:
        """Whether a new connection may stay (at the cap, the oldest idle one goes for it)."""
        if len(self._conns) >= self.max_connections:
            idle = [
                (c.last, n, w) for n, (w, c) in enumerate(self._conns.items()) if not c.in_flight
            ]
            if not idle:
                log.warning(
                    "quorum relay: refusing the connection from %s: %d connections held (the "
                    "cap), every one with a request in flight; it asks the quorum directly",
                    peer,
                    len(self._conns),
                )
                return False
            oldest = min(idle)[2]
            log.warning(
                "quorum relay: %d connections held (the cap): closing the oldest idle one, "
                "from %s, for one from %s",
                len(self._conns),
                self._conns[oldest].peer,
                peer,
            )
            del self._conns[oldest]
            oldest.close()
        self._conns[writer] = _Conn(peer, self._loop.time())
        return True

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not self._admit(writer, peer):
            writer.close()
            return
        conn = self._conns[writer]
        try:
            hello = await asyncio.wait_for(self._read(reader), HELLO_TIMEOUT_S)
            writer.write(frame(HELLO))
            if hello != HELLO:
                raise FrameError(f"hello {hello[:16]!r}, this relay speaks {HELLO!r}")
            while True:
                request_id, kind, payload = split_message(await self._read(reader))
                conn.last = self._loop.time()
                if kind != REQUEST:
                    raise FrameError(f"message kind {kind} from a member (requests are Q)")
                try:
                    item, timeout = r.decode_request(payload)
                except ValueError as exc:  # UnicodeDecodeError too
                    raise FrameError(str(exc)) from exc
                try:
                    future = self.submit(item, timeout)
                except Exception as exc:  # a stopped relay: the member asks directly
                    future = Future()
                    future.set_exception(exc)
                conn.in_flight += 1
                future.add_done_callback(functools.partial(self._done, writer, request_id))
        except FrameError as exc:
            self.bad_frames += 1
            log.warning("quorum relay: closing the connection from %s: %s", peer, exc)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass  # the member went (or cut a frame short): its requests fall back directly
        finally:
            if self._conns.get(writer) is conn:
                del self._conns[writer]
            writer.close()

    @staticmethod
    async def _read(reader: asyncio.StreamReader) -> bytes:
        length = check_length(_HEAD.unpack(await reader.readexactly(_HEAD.size))[0], MAX_REQUEST)
        return await reader.readexactly(length)

    def _done(self, writer: asyncio.StreamWriter, request_id: int, future: Future[Answer]) -> None:
        """A batch answered (in its thread): queue the answer; one loop wake-up per batch,
        not per member (each wake-up is a write to the loop's self-pipe)."""
        with self._answered_lock:
            first = not self._answered
            self._answered.append((writer, request_id, future))
        if first:
            with contextlib.suppress(RuntimeError):  # the relay stopped: nobody to answer
                self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._answered_lock:
            answered, self._answered = self._answered, []
        now = self._loop.time()
        for writer, request_id, future in answered:
            conn = self._conns.get(writer)
            if conn is not None:
                conn.in_flight -= 1
                conn.last = now
            if writer.is_closing():
                continue  # the member went: it asked directly
            if writer.transport.get_write_buffer_size() > MAX_ANSWER:
                log.warning("quorum relay: a member reads no answers; closing its connection")
                writer.close()
                continue
            writer.write(self._answer_frame(request_id, future))

    @staticmethod
    def _answer_frame(request_id: int, future: Future[Answer]) -> bytes:
        try:
            return message(request_id, ANSWER, r.answer_line(future.result()))
        except QuorumGone as exc:
            return message(request_id, GONE, str(exc).encode())
        except QuorumRedisRefused as exc:  # Redis's, not the relay's: the member keeps it
            return message(request_id, REFUSED, f"{exc.cause} {exc}".encode())
        except QuorumNotFormed as exc:  # the replicas', not the relay's: the member keeps it
            return message(request_id, NOT_FORMED, str(exc).encode())
        except BaseException as exc:  # the member asks directly
            return message(request_id, ERROR, f"{type(exc).__name__}: {exc}".encode())


class RelayClient:
    """A member VM's one connection to its relay, shared by its replicas' requests.

    Blocking: :meth:`ask` sends a request and waits for its answer up to a deadline; a
    reader thread matches answers to requests by id. Any failure closes the connection
    (every request on it fails: they fall back directly); the next ask makes a new one.

    Raises (constructor): ``OSError`` when the relay cannot be reached (``TimeoutError``
    when it did not complete the hello within ``timeout``), ``QuorumError`` when it speaks
    another protocol version.
    """

    def __init__(self, address: str, timeout: float) -> None:
        self.address = address
        host, port = parse_bind(address)
        # One deadline for the connect and the whole hello: a relay that trickles its hello
        # a byte at a time would otherwise keep this member (and every replica of its VM,
        # waiting on the connection lock) one socket timeout per byte.
        deadline = time.monotonic() + timeout
        self._sock = socket.create_connection((host, port), timeout=timeout)
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock.sendall(frame(HELLO))
            self._buf = bytearray()
            try:
                theirs = self._next_frame(deadline)
            except TimeoutError as exc:
                raise TimeoutError(
                    f"the quorum relay at {address} did not complete its hello within "
                    f"{timeout} s: asking the quorum directly"
                ) from exc
            self._sock.settimeout(timeout)
            if theirs is None or theirs != HELLO:
                raise QuorumError(
                    f"the quorum relay at {address} answered hello {theirs!r}, this agent "
                    f"speaks {HELLO!r}: every VM of a run must run the same spottrain"
                )
        except BaseException:
            self._sock.close()
            raise
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._waiting: dict[int, Future[Answer]] = {}
        self._used = time.monotonic()  # the last ask
        self.closed = False
        threading.Thread(target=self._reader, name="spottrain-relay-client", daemon=True).start()

    def idle(self, longer_than_s: float) -> bool:
        """Whether nothing was asked on this connection for ``longer_than_s`` and nothing
        waits: a member drops such a connection before the relay closes it as idle
        (:data:`IDLE_TIMEOUT_S`), so its next ask never meets that close."""
        with self._lock:
            return not self._waiting and time.monotonic() - self._used > longer_than_s

    def ask(self, item: BatchItem, timeout: float) -> Answer:
        """Raises ValueError for a request the relay would refuse (:func:`.relay.check_item`):
        it fails alone, before the connection its VM's replicas share carries it."""
        # The relay's own deadline ends first, so it answers (or gives up) in time.
        body = r.encode_request(item, max(0.01, timeout - ASK_MARGIN_S))
        future: Future[Answer] = Future()
        with self._lock:
            if self.closed:
                raise QuorumError(f"the connection to the quorum relay {self.address} closed")
            request_id = next(self._ids) & 0xFFFFFFFF
            self._waiting[request_id] = future
            self._used = time.monotonic()
            try:
                self._sock.sendall(message(request_id, REQUEST, body))
            except OSError as exc:
                self._close_locked(exc)
        try:
            return future.result(timeout)
        except TimeoutError as exc:
            self.close(QuorumError(f"the quorum relay {self.address} missed its deadline"))
            raise QuorumError(
                f"the quorum relay {self.address} did not answer in {timeout} s"
            ) from exc

    def close(self, why: BaseException | None = None) -> None:
        with self._lock:
            self._close_locked(why or QuorumError("the relay connection was closed"))

    def _close_locked(self, why: BaseException) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        waiting, self._waiting = self._waiting, {}
        for f in waiting.values():
            if not f.done():
                f.set_exception(QuorumError(f"the quorum relay {self.address} failed: {why}"))

    def _next_frame(self, deadline: float | None = None) -> bytes | None:
        """The next frame off the socket (None: the relay closed it). A socket timeout
        while a frame is half read keeps what arrived (the next call goes on from it). With
        a ``deadline`` (monotonic), the whole frame must arrive by it (else TimeoutError)."""
        while True:
            if len(self._buf) >= _HEAD.size:
                length = check_length(_HEAD.unpack_from(self._buf)[0], MAX_ANSWER)
                if len(self._buf) >= _HEAD.size + length:
                    body = bytes(self._buf[_HEAD.size : _HEAD.size + length])
                    del self._buf[: _HEAD.size + length]
                    return body
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the frame did not arrive by its deadline")
                self._sock.settimeout(left)
            chunk = self._sock.recv(65536)
            if not chunk:
                return None
            self._buf += chunk

    def _reader(self) -> None:
        why: BaseException = QuorumError("the relay closed the connection")
        try:
            while not self.closed:
                try:
                    body = self._next_frame()
                except TimeoutError:
                    continue  # idle between rounds; deadlines are the askers'
                if body is None:
                    break
                request_id, kind, payload = split_message(body)
                with self._lock:
                    future = self._waiting.pop(request_id, None)
                if future is None or future.done():
                    continue  # its asker gave up (deadline)
                self._resolve(future, kind, payload)
        except (OSError, ValueError) as exc:
            why = exc
        self.close(why)

    @staticmethod
    def _resolve(future: Future[Answer], kind: int, payload: bytes) -> None:
        text = payload.decode(errors="replace")
        if kind == ANSWER:
            try:
                future.set_result(parse_answer(payload))
            except Exception as exc:
                future.set_exception(QuorumError(f"the relay sent a bad answer: {exc}"))
        elif kind == GONE:
            future.set_exception(QuorumGone(text))
        elif kind == REFUSED:
            cause, _, why = text.partition(" ")
            future.set_exception(errors.from_wire(cause, why))
        elif kind == NOT_FORMED:
            future.set_exception(QuorumNotFormed(text))
        else:
            future.set_exception(QuorumError(f"the quorum relay failed: {text}"))

"""Helpers for the Redis quorum's tests: replicas that heartbeat from a thread like the
agent's shim does, sharing one client (one VM)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import redis

from spottrain.ports import free_port
from spottrain.quorum.client import QuorumClient
from spottrain.quorum.errors import QuorumNotReplicated
from spottrain.quorum.model import Answer, Member, QuorumConfig
from spottrain.redis_conn import RedisSettings, connect

# Small timeouts keep the tests fast; deadlines stay generous for a loaded machine.
FAST = QuorumConfig(heartbeat_timeout_ms=600, join_timeout_ms=150, min_replicas=1)


def connect_to(port: int) -> redis.Redis:
    """A client as the agent makes one (spottrain.redis_conn: short retries, 5 s timeout)."""
    return connect(RedisSettings(host="127.0.0.1", port=port))


def wait_until(cond: Callable[[], object], timeout: float = 20.0, what: str = "") -> None:
    """Poll ``cond`` (tests only: the quorum itself never polls)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or cond}")
        time.sleep(0.02)


def joined(client: QuorumClient, *ids: str) -> QuorumClient:
    """``client`` with ``ids`` joined and heartbeating once."""
    for rid in ids:
        client.join(Member(rid))
    client.heartbeat(list(ids))
    return client


class Heartbeater:
    """Heartbeats a set of replica ids every timeout/6 (coalesced, as one VM does)."""

    def __init__(self, client: QuorumClient, interval: float) -> None:
        self.client = client
        self.interval = interval
        self.ids: set[str] = set()
        self.paused: set[str] = set()
        self.gone: set[str] = set()
        self.errors: list[Exception] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            ids = sorted(self.ids - self.paused - self.gone)
            try:
                self.gone.update(self.client.heartbeat(ids))
            except (redis.ConnectionError, redis.TimeoutError, QuorumNotReplicated) as e:
                self.errors.append(e)  # as the shim's: Redis down or refusing writes

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class Fleet:
    """Replicas sharing one QuorumClient (one VM) with one heartbeat thread."""

    def __init__(self, client: QuorumClient, config: QuorumConfig) -> None:
        self.client = client
        self.config = config
        self.hb = Heartbeater(client, config.heartbeat_timeout_ms / 6000)
        self.pool = ThreadPoolExecutor(max_workers=16)

    def add(self, *replica_ids: str) -> None:
        for rid in replica_ids:
            self.client.join(Member(rid, address=f"http://{rid}", store_address=f"{rid}:1"))
            self.hb.ids.add(rid)
        self.client.heartbeat(list(replica_ids))

    def ask(
        self, replica_id: str, step: int, timeout: float = 20.0, **kw: object
    ) -> Future[Answer]:
        return self.pool.submit(self.client.request, replica_id, step, timeout=timeout, **kw)  # type: ignore[arg-type]

    def round(self, steps: dict[str, int], timeout: float = 20.0) -> dict[str, Answer]:
        futures = {rid: self.ask(rid, step, timeout) for rid, step in steps.items()}
        return {rid: f.result(timeout + 10) for rid, f in futures.items()}

    def close(self) -> None:
        self.hb.stop()
        self.pool.shutdown(wait=True, cancel_futures=True)


class CutProxy:
    """A TCP forwarder to Redis whose ``cut()`` closes every connection and refuses new ones
    until ``heal()``: the replicas behind it are partitioned from Redis."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._cut = False
        self.heal()

    def heal(self) -> None:
        self._cut = False
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            if self._cut:
                client.close()
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._socks += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        self._cut = True
        if self._listener is not None:
            with contextlib.suppress(OSError):  # wakes the blocked accept()
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            self._listener = None
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

"""A worker process: hosts a slice of the simulated nodes, each a real rendezvous handler,
and answers the main process's commands (create, form, poll, freeze, await_reform, stats)."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections import Counter
from multiprocessing.connection import Connection
from typing import Any

from .common import PHASES, POLL_INTERVAL_S
from .measure import own_cpu


class _CountingLogHandler(logging.Handler):
    """Counts log records by their message template instead of printing thousands of lines."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.counts: Counter[str] = Counter()
        self._count_lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self._count_lock:
            self.counts[f"{record.name.rsplit('.', 1)[-1]}: {record.msg}"] += 1


class _Node:
    __slots__ = (
        "detect_t",
        "error",
        "form_t",
        "form_ws",
        "frozen",
        "h",
        "idx",
        "member",
        "polling",
        "reform_round",
        "reform_t",
        "reform_ws",
    )

    def __init__(self, idx: int, h: Any) -> None:
        self.idx = idx
        self.h = h
        self.member: str = h.member
        self.polling = False
        self.frozen = False
        self.form_t: float | None = None
        self.form_ws: int | None = None
        self.detect_t: float | None = None
        self.reform_t: float | None = None
        self.reform_ws: int | None = None
        self.reform_round: int | None = None
        self.error: str | None = None


class _Worker:
    def __init__(
        self,
        wid: int,
        endpoint: str,
        run_id: str,
        indices: list[int],
        n_total: int,
        conf: dict[str, Any],
        poll_threads: int,
        cheap_event_names: bool,
    ) -> None:
        self.wid = wid
        self.cheap_event_names = cheap_event_names
        self.endpoint = endpoint
        self.run_id = run_id
        self.indices = indices
        self.n_total = n_total
        self.conf = conf
        self.n_poll_threads = poll_threads
        self.nodes: list[_Node] = []
        self.lock = threading.Lock()
        self.phase = "form"
        # phase -> [set_state calls, has_set False, None (nothing stored)]
        self.cas: dict[str, list[int]] = {p: [0, 0, 0] for p in PHASES}
        self.armed = False
        self.spurious: list[tuple[int, str | None]] = []
        self.poll_errors = 0
        self.poll_stop = threading.Event()
        self.poll_threads: list[threading.Thread] = []
        self.sweeps: list[tuple[float, float]] = []  # (start, duration) of each sweep
        self.go = threading.Event()
        self.go_t: float | None = None
        self.join_threads: list[threading.Thread] = []
        self.logs = _CountingLogHandler()
        for name in ("spottrain", "torch.distributed.elastic"):
            lg = logging.getLogger(name)
            lg.addHandler(self.logs)
            lg.propagate = False
        self.thread_errors: Counter[str] = Counter()
        self.requests = 0  # commands our clients sent (a script call counts once)
        threading.excepthook = self._thread_error

    def _thread_error(self, args: Any) -> None:
        if not self.poll_stop.is_set():  # not the shutdown closing connections under threads
            with self.lock:
                self.thread_errors[f"{args.exc_type.__name__}: {args.exc_value}"[:120]] += 1

    # -- setup -----------------------------------------------------------------------------
    def _count_set_state(self, backend: Any) -> None:
        original = backend.set_state

        def set_state(state: bytes, token: Any | None = None) -> Any:
            result = original(state, token)
            with self.lock:
                counts = self.cas[self.phase]
                counts[0] += 1
                if result is None:
                    counts[2] += 1
                elif not result[2]:
                    counts[1] += 1
            return result

        # torch's _BackendRendezvousStateHolder calls self._backend.set_state: an instance
        # attribute shadows the class's method for the holder and the handler alike.
        backend.set_state = set_state

    def _count_requests(self, client: Any) -> None:
        original = client.execute_command

        def execute_command(*args: Any, **options: Any) -> Any:
            with self.lock:
                self.requests += 1
            return original(*args, **options)

        client.execute_command = execute_command

    def create(self) -> dict[str, Any]:
        from torch.distributed.elastic.rendezvous.api import RendezvousParameters

        from spottrain.agent.rendezvous.handler import create_handler

        if self.cheap_event_names:
            _cheap_torch_event_names()
        for idx in self.indices:
            params = RendezvousParameters(
                backend="redis",
                endpoint=self.endpoint,
                run_id=self.run_id,
                min_nodes=1,
                max_nodes=self.n_total,
                local_addr="127.0.0.1",
                **{**self.conf, "node_id": f"sim{idx}"},
            )
            h = create_handler(params)
            if h._holder._backend is not h._backend or h._state_holder is not h._holder:
                raise RuntimeError("the handler and its state holder use different backends")
            self._count_set_state(h._backend)
            self._count_requests(h._backend.client)
            self.nodes.append(_Node(idx, h))
        for node in self.nodes:
            t = threading.Thread(target=self._form_one, args=(node,), daemon=True)
            t.start()
            self.join_threads.append(t)
        return {"members": {n.idx: n.member for n in self.nodes}, "pid": os.getpid()}

    # -- formation -------------------------------------------------------------------------
    def _form_one(self, node: _Node) -> None:
        self.go.wait()
        try:
            info = node.h.next_rendezvous()
            node.form_t = time.monotonic()
            node.form_ws = info.world_size
        except BaseException as exc:
            node.error = f"form: {type(exc).__name__}: {exc}"

    def form(self, timeout: float) -> dict[str, Any]:
        self.go_t = time.monotonic()
        self.go.set()
        deadline = self.go_t + timeout
        for t in self.join_threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return {
            "go_t": self.go_t,
            "nodes": [(n.idx, n.form_t, n.form_ws, n.error) for n in self.nodes],
        }

    # -- polling (torchrun's monitor loop) ---------------------------------------------------
    def _poll_loop(self, mine: list[_Node]) -> None:
        next_t = time.monotonic()
        while not self.poll_stop.is_set():
            start = time.monotonic()
            for node in mine:
                if not node.polling:
                    continue
                try:
                    waiting = node.h.num_nodes_waiting()
                except Exception:
                    with self.lock:
                        self.poll_errors += 1
                    continue
                if waiting <= 0:
                    continue
                if self.armed:
                    node.detect_t = time.monotonic()
                    node.polling = False
                    threading.Thread(target=self._reform_one, args=(node,), daemon=True).start()
                else:
                    with self.lock:
                        self.spurious.append((node.idx, node.h._last_reason))
            end = time.monotonic()
            with self.lock:
                self.sweeps.append((start, end - start))
            next_t += POLL_INTERVAL_S
            if next_t < end:
                next_t = end  # running late: poll again at once, do not try to catch up
            self.poll_stop.wait(max(0.0, next_t - time.monotonic()))

    def start_polling(self) -> dict[str, Any]:
        self.phase = "steady"
        for node in self.nodes:
            node.polling = node.error is None
        k = max(1, min(self.n_poll_threads, len(self.nodes)))
        for i in range(k):
            t = threading.Thread(target=self._poll_loop, args=(self.nodes[i::k],), daemon=True)
            t.start()
            self.poll_threads.append(t)
        return {"poll_threads": k}

    # -- loss and re-formation ---------------------------------------------------------------
    def freeze(self, idxs: list[int]) -> dict[str, Any]:
        wanted = set(idxs)
        victims = [n for n in self.nodes if n.idx in wanted]
        for node in victims:
            node.frozen = True
            node.polling = False
        for node in victims:
            with node.h._heartbeat_lock:  # let a poll already inside the handler finish
                pass
            node.h._beat_stop.set()
        for node in victims:  # a beat in flight completes before the freeze time is taken
            if node.h._beat_thread is not None:
                node.h._beat_thread.join(5)
        t = time.monotonic()
        with self.lock:
            self.phase = "reform"
        self.armed = True
        return {"freeze_t": t if victims else None, "frozen": [n.member for n in victims]}

    def _reform_one(self, node: _Node) -> None:
        try:
            info = node.h.next_rendezvous()
            node.reform_t = time.monotonic()
            node.reform_ws = info.world_size
            node.reform_round = node.h.round
        except BaseException as exc:
            node.error = f"re-form: {type(exc).__name__}: {exc}"

    def await_reform(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        survivors = [n for n in self.nodes if not n.frozen]
        while time.monotonic() < deadline:
            if all(n.reform_t is not None or n.error is not None for n in survivors):
                break
            time.sleep(0.05)
        return {
            "nodes": [
                (n.idx, n.detect_t, n.reform_t, n.reform_ws, n.reform_round, n.error)
                for n in survivors
            ]
        }

    # -- stats and shutdown -----------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {
                "cas": {p: list(v) for p, v in self.cas.items()},
                "spurious": list(self.spurious),
                "poll_errors": self.poll_errors,
                "sweeps": list(self.sweeps),
                "logs": dict(self.logs.counts) | dict(self.thread_errors),
                "gone": {n.idx: n.h._gone_reason for n in self.nodes if n.h._gone_reason},
                "identity_changes": sum(n.member != n.h.member for n in self.nodes),
                # live nodes told by their own heartbeat that they had been declared dead
                "told_dead": sum(
                    1 for n in self.nodes if not n.frozen and n.h._gone_reason == "dead"
                ),
            }

    def shutdown(self) -> dict[str, Any]:
        self.poll_stop.set()
        for node in self.nodes:
            node.h._beat_stop.set()
        for t in self.poll_threads:
            t.join(2)
        return {}  # the process exits next, closing every connection


def _cheap_torch_event_names() -> None:
    """Make torch's rendezvous event naming cheap (simulation only; see --as-is).

    torch's ``_record`` names every event with ``get_method_name()``, which calls
    ``inspect.stack()`` twice: it stats and reads the source of every frame on the stack,
    several milliseconds per call, and it runs on every sync of a join, whether or not events
    are logged anywhere. A real node pays that on its own CPU; here N nodes would pay it on
    this machine's few cores. This returns the same name from ``sys._getframe``.
    """
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous as dr

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name  # == inspect.stack()[depth].function
        except ValueError:
            return "no_method_name"

    dr.get_method_name = get_method_name


def worker_main(conn: Connection, args: dict[str, Any]) -> None:
    try:
        worker = _Worker(**args)
        conn.send(("ok", {**worker.create(), "cpu": own_cpu(), "requests": worker.requests}))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        conn.close()
        os._exit(1)
    while True:
        try:
            cmd, payload = conn.recv()
        except EOFError:
            os._exit(1)
        try:
            if cmd == "form":
                reply = worker.form(payload)
            elif cmd == "poll":
                reply = worker.start_polling()
            elif cmd == "freeze":
                reply = worker.freeze(payload)
            elif cmd == "await_reform":
                reply = worker.await_reform(payload)
            elif cmd == "stats":
                reply = worker.stats()
            elif cmd == "cpu":
                reply = {}
            elif cmd == "shutdown":
                worker.shutdown()
                conn.send(("ok", {}))
                conn.close()
                os._exit(0)
            else:
                raise ValueError(f"unknown command {cmd!r}")
            if cmd in ("form", "await_reform"):  # in case a later "stats" gets no answer
                reply["stats"] = worker.stats()
            conn.send(("ok", {**reply, "cpu": own_cpu(), "requests": worker.requests}))
        except BaseException:
            conn.send(("error", traceback.format_exc()))

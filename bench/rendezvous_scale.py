"""Benchmark of the Redis rendezvous at scale, with simulated agents.

Every simulated node is a real :class:`RedisRendezvousHandler` (its own Redis connection, its
own heartbeat thread) talking to one real ``redis-server`` that this script starts. There is
no training and no torchrun: the script plays the agent's part, calling ``next_rendezvous()``
to form a round and polling ``num_nodes_waiting()`` every 0.1 s the way torchrun's monitor
loop does. The nodes live in several worker processes (multiprocessing, spawn) so that one
interpreter's GIL does not serialise the whole fleet.

For each fleet size N it measures:

1. form: from the moment all N ``next_rendezvous()`` calls are released until every node
   holds a RendezvousInfo with world size N (``min_nodes=1``, ``max_nodes=N``);
2. loss: 1% of the nodes (at least one) are frozen, meaning their heartbeats stop and nothing
   calls them again. *detect* runs from the freeze until every survivor has seen
   ``num_nodes_waiting() > 0``; it includes the heartbeat timeout (1 s x 5 = 5 s) by design.
   *re-form* runs from the freeze until every survivor has finished a new
   ``next_rendezvous()`` with world size N - lost; a survivor starts it as soon as it has
   detected the loss, as torchrun does;
3. Redis commands/s in steady state (all formed, beating, polled), from the delta of
   ``INFO stats`` ``total_commands_processed`` (which counts the commands that Lua scripts
   run, too), with the client requests and Redis CPU beside it;
4. compare-and-set conflicts: ``set_state`` calls answered ``has_set`` False, of all calls.

Beside our steady-state load it prints the anchor: torch's own dynamic rendezvous writes the
whole pickled state by compare-and-set on every keep-alive (every 5 s by default), that is
N / 5 writes per second of a blob whose size is measured here from Redis.

Caveat: this machine's cores simulate the work of N machines. Every node's pickling,
unpickling and Python bookkeeping shares those cores (and Redis shares them too), so at large
N the times measured here are an upper bound set by the simulation's CPU; the table shows how
busy the CPU was and how late the 0.1 s polls ran.

Usage::

    .venv/bin/python bench/rendezvous_scale.py            # 64, 256 and 1,024 nodes
    .venv/bin/python bench/rendezvous_scale.py --quick    # 16 and 64 nodes, a smoke test

The last line printed is a JSON object of the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import multiprocessing as mp
import os
import random
import resource
import statistics
import sys
import threading
import time
import traceback
from collections import Counter
from multiprocessing.connection import Connection
from typing import Any

import redis

from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.keys import RunKeys

POLL_INTERVAL_S = 0.1  # torchrun's agent monitor interval
TORCH_KEEP_ALIVE_S = 5  # torch's default keep_alive_interval
HEARTBEAT_TIMEOUT_S = 5  # ours: keep_alive_interval 1 s x keep_alive_max_attempt 5

PHASES = ("form", "steady", "reform")


class PhaseTimeout(RuntimeError):
    """A phase of the benchmark did not finish in time."""


# ---------------------------------------------------------------------------------------------
# Worker process: hosts a slice of the simulated nodes.
# ---------------------------------------------------------------------------------------------


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


def _own_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _worker_main(conn: Connection, args: dict[str, Any]) -> None:
    try:
        worker = _Worker(**args)
        conn.send(("ok", {**worker.create(), "cpu": _own_cpu(), "requests": worker.requests}))
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
            conn.send(("ok", {**reply, "cpu": _own_cpu(), "requests": worker.requests}))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


# ---------------------------------------------------------------------------------------------
# Main process: Redis, the workers, the clock and the figures.
# ---------------------------------------------------------------------------------------------


class _Fleet:
    """The worker processes of one fleet size."""

    def __init__(
        self,
        n: int,
        procs: int,
        endpoint: str,
        run_id: str,
        conf: dict[str, Any],
        cheap_event_names: bool,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        indices = list(range(n))
        for w in range(procs):
            mine = indices[w::procs]
            if not mine:
                continue
            parent, child = ctx.Pipe()
            args = {
                "wid": w,
                "endpoint": endpoint,
                "run_id": run_id,
                "indices": mine,
                "n_total": n,
                "conf": conf,
                "poll_threads": max(1, math.ceil(len(mine) / 128)),
                "cheap_event_names": cheap_event_names,
            }
            p = ctx.Process(target=_worker_main, args=(child, args), daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)

    def gather(self, what: str, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        out = []
        for i, conn in enumerate(self.conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise PhaseTimeout(f"{what}: worker {i} did not answer within {timeout:.0f} s")
            try:
                status, payload = conn.recv()
            except EOFError:
                raise RuntimeError(f"{what}: worker {i} died") from None
            if status != "ok":
                raise RuntimeError(f"{what}: worker {i} failed:\n{payload}")
            out.append(payload)
        return out

    def ask(self, cmd: str, payload: Any, timeout: float) -> list[Any]:
        for conn in self.conns:
            conn.send((cmd, payload))
        return self.gather(cmd, timeout)

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(("shutdown", None))
        deadline = time.monotonic() + 10
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(3)
            if p.is_alive():
                p.kill()
                p.join(3)
        for conn in self.conns:
            conn.close()


class _Monitor(threading.Thread):
    """Samples the heartbeat set and the rendezvous state while a fleet runs.

    The oldest beat of a node that should be alive: a value near the heartbeat timeout means
    a live node came close to being declared dead (here: its beat thread starved for CPU).
    The state every 2 s: how a formation or re-formation progresses (or stalls).
    """

    def __init__(self, client: redis.Redis, keys: RunKeys) -> None:
        super().__init__(daemon=True)
        self.client = client
        self.keys = keys
        self.exclude: set[str] = set()
        self.phase = "form"
        self.phase_t0 = time.monotonic()
        self.max_age: dict[str, float] = {p: 0.0 for p in PHASES}
        self.progress: dict[str, list[tuple[float, dict[str, Any]]]] = {p: [] for p in PHASES}
        self.stop = threading.Event()

    def set_phase(self, phase: str) -> None:
        self.phase_t0 = time.monotonic()
        self.phase = phase

    def run(self) -> None:
        tick = 0
        while not self.stop.wait(0.5):
            tick += 1
            if tick % 4 == 0:
                with contextlib.suppress(Exception):
                    summary = _state_summary(self.client, self.keys)
                    self.progress[self.phase].append((time.monotonic() - self.phase_t0, summary))
            try:
                pipe = self.client.pipeline(transaction=False)
                pipe.time()
                pipe.zrange(self.keys.rdzv_presence, 0, -1, withscores=True)
                (sec, usec), beats = pipe.execute()
            except redis.RedisError:
                continue
            now_ms = sec * 1000 + usec // 1000
            ages = [
                (now_ms - score) / 1000
                for member, score in beats
                if member.decode() not in self.exclude
            ]
            if ages:
                self.max_age[self.phase] = max(self.max_age[self.phase], max(ages))


def _cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0, 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    total = sum(fields[:8])
    return total - idle, total


def _snapshot(client: redis.Redis, replies: list[dict[str, Any]]) -> dict[str, Any]:
    """Counters at a phase boundary: Redis's, the machine's and the fleet's CPU."""
    stats = client.info("stats")
    cpu = client.info("cpu")
    cmd = client.info("commandstats")
    return {
        "t": time.monotonic(),
        "commands": stats["total_commands_processed"],
        "net_out": stats["total_net_output_bytes"],
        "net_in": stats["total_net_input_bytes"],
        "redis_cpu": cpu["used_cpu_user"] + cpu["used_cpu_sys"],
        "calls": {k.removeprefix("cmdstat_"): v["calls"] for k, v in cmd.items()},
        "machine": _cpu_times(),
        "fleet_cpu": sum(r["cpu"] for r in replies) + _own_cpu(),
        "requests": sum(r["requests"] for r in replies),
    }


def _usage(a: dict[str, Any], b: dict[str, Any], cores: int) -> dict[str, float]:
    """Cores in use between two snapshots: ours (workers + this process), Redis's, and the
    rest of the machine (other programs; the numbers are only as good as that is small)."""
    wall = b["t"] - a["t"]
    busy, total = b["machine"][0] - a["machine"][0], b["machine"][1] - a["machine"][1]
    machine = cores * busy / total if total > 0 else float("nan")
    fleet = (b["fleet_cpu"] - a["fleet_cpu"]) / wall
    rds = (b["redis_cpu"] - a["redis_cpu"]) / wall
    return {
        "wall_s": wall,
        "fleet_cores": fleet,
        "redis_cores": rds,
        "machine_cores": machine,
        "other_cores": max(0.0, machine - fleet - rds),
    }


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _merge_cas(stats: list[dict[str, Any]]) -> dict[str, list[int]]:
    out = {p: [0, 0, 0] for p in PHASES}
    for s in stats:
        for p, v in s["cas"].items():
            out[p] = [a + b for a, b in zip(out[p], v, strict=True)]
    return out


def _state_summary(client: redis.Redis, keys: RunKeys) -> dict[str, Any]:
    """What the rendezvous state in Redis says (for a phase that did not finish)."""
    import pickle

    try:
        token, raw = client.hmget(keys.rdzv_state, ["token", "state"])
        if raw is None:
            return {}
        state = pickle.loads(raw)  # torch's _RendezvousState; trusted: our fleet wrote it
    except Exception as exc:  # a diagnostic must not fail the run
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "round": state.round,
        "complete": state.complete,
        "participants": len(state.participants),
        "wait_list": len(state.wait_list),
        "redundancy_list": len(state.redundancy_list),
        "token": int(token or 0),
    }


def run_size(
    server: RedisServer, n: int, procs: int, args: argparse.Namespace, log: Any
) -> dict[str, Any]:
    cores = os.cpu_count() or 1
    run_id = f"bench-n{n}-{int(time.time())}-{os.getpid()}"
    keys = RunKeys(run_id)
    lost = max(1, n // 100)
    form_timeout = args.form_timeout or min(200.0, max(60.0, 0.25 * n))
    reform_timeout = args.reform_timeout or min(240.0, max(120.0, 0.5 * n))
    conf = {
        # The first round (min_nodes=1) closes at the end of the last call with whoever has
        # joined by then; give it time for all N, so the figure is "all N formed".
        "last_call_timeout": int(form_timeout),
        # So that nothing in the library waits longer than the benchmark does.
        "join_timeout": int(form_timeout + reform_timeout + 60),
    }
    res: dict[str, Any] = {"nodes": n, "procs": procs, "lost": lost, "run_id": run_id}
    res["loadavg_before"] = os.getloadavg()[0]
    client = server.client(socket_timeout=30)
    monitor = _Monitor(client, keys)
    t_size = time.monotonic()
    fleet = _Fleet(n, procs, server.endpoint, run_id, conf, not args.as_is)
    stats: list[dict[str, Any]] = []
    last_stats: list[dict[str, Any]] = []
    try:
        created = fleet.gather("create handlers", 60 + 0.2 * n)
        members = {int(i): m for c in created for i, m in c["members"].items()}
        res["setup_s"] = time.monotonic() - t_size
        log(f"  {n} handlers up in {len(created)} processes ({res['setup_s']:.1f} s)")
        monitor.start()
        monitor.set_phase("form")

        # 1. formation
        snap0 = _snapshot(client, created)
        try:
            formed = fleet.ask("form", form_timeout, form_timeout + 30)
            last_stats = [f["stats"] for f in formed]
        finally:
            res["form_state"] = _state_summary(client, keys)
        snap1 = _snapshot(client, formed)
        res["form_usage"] = _usage(snap0, snap1, cores)
        go = min(f["go_t"] for f in formed)
        rows = [r for f in formed for r in f["nodes"]]
        errors = [r[3] for r in rows if r[3]]
        done = [r for r in rows if r[1] is not None]
        res["formed"] = len(done)
        res["form_world_sizes"] = dict(Counter(r[2] for r in done))
        res["form_errors"] = errors[:5]
        if len(done) < n:
            raise PhaseTimeout(
                f"formation: {len(done)} of {n} nodes formed within {form_timeout:.0f} s "
                f"({len(errors)} errors); state in Redis: {res['form_state']}"
            )
        res["form_s"] = max(r[1] for r in done) - go
        res["form_median_s"] = statistics.median(r[1] - go for r in done)
        res["state_bytes"] = int(client.hstrlen(keys.rdzv_state, "state"))
        log(
            f"  formed: {res['form_s']:.2f} s (median node {res['form_median_s']:.2f} s), "
            f"world sizes {res['form_world_sizes']}, state {res['state_bytes']} B"
        )

        # 3. steady state: all formed, beating, polled every 0.1 s
        monitor.set_phase("steady")
        fleet.ask("poll", None, 30)
        res["_steady_from"] = time.monotonic()
        time.sleep(args.warmup)
        before = _snapshot(client, fleet.ask("cpu", None, 30))
        time.sleep(args.steady_seconds)
        after = _snapshot(client, fleet.ask("cpu", None, 30))
        dt = after["t"] - before["t"]
        res["_window"] = (before["t"], after["t"])
        res["steady_usage"] = _usage(before, after, cores)
        calls = {k: after["calls"].get(k, 0) - before["calls"].get(k, 0) for k in after["calls"]}
        res["commands_per_s"] = (after["commands"] - before["commands"]) / dt
        # What the clients sent, counted at the clients: a script call is one request (the
        # commands that scripts run inside Redis are in commands_per_s, not here).
        res["requests_per_s"] = (after["requests"] - before["requests"]) / dt
        res["steady_calls_per_s"] = {
            k: round(v / dt, 1) for k, v in sorted(calls.items(), key=lambda kv: -kv[1]) if v
        }
        res["redis_cpu"] = res["steady_usage"]["redis_cores"]
        res["net_out_bytes_per_s"] = (after["net_out"] - before["net_out"]) / dt
        res["net_in_bytes_per_s"] = (after["net_in"] - before["net_in"]) / dt
        res["torch_cas_writes_per_s"] = n / TORCH_KEEP_ALIVE_S
        res["torch_write_bytes_per_s"] = n / TORCH_KEEP_ALIVE_S * res["state_bytes"]
        log(
            f"  steady: {res['commands_per_s']:.0f} commands/s, "
            f"{res['requests_per_s']:.0f} requests/s, Redis CPU {res['redis_cpu']:.0%}, "
            f"fleet {res['steady_usage']['fleet_cores']:.2f} cores, other programs "
            f"{res['steady_usage']['other_cores']:.2f} cores"
        )

        # 2. loss of 1%: freeze, detect, re-form
        rng = random.Random(args.seed * 7919 + n)
        victims = sorted(rng.sample(range(n), lost))
        monitor.exclude = {members[i] for i in victims}
        monitor.set_phase("reform")
        snap0 = _snapshot(client, fleet.ask("cpu", None, 30))
        froze = fleet.ask("freeze", victims, 30)
        res["_steady_to"] = time.monotonic()
        t_freeze = max(f["freeze_t"] for f in froze if f["freeze_t"] is not None)
        res["_reform_from"] = t_freeze
        try:
            reformed = fleet.ask("await_reform", reform_timeout, reform_timeout + 30)
            last_stats = [f["stats"] for f in reformed]
        finally:
            res["reform_state"] = _state_summary(client, keys)
        snap1 = _snapshot(client, reformed)
        res["reform_usage"] = _usage(snap0, snap1, cores)
        rows = [r for f in reformed for r in f["nodes"]]
        detected = [r[1] - t_freeze for r in rows if r[1] is not None]
        redone = [r for r in rows if r[2] is not None]
        res["survivors"] = len(rows)
        res["detected"] = len(detected)
        res["reformed"] = len(redone)
        res["reform_world_sizes"] = dict(Counter(r[3] for r in redone))
        res["reform_rounds"] = dict(Counter(r[4] for r in redone))
        res["reform_errors"] = [r[5] for r in rows if r[5]][:5]
        if detected:
            res["detect_s"] = max(detected)
            res["detect_min_s"] = min(detected)
            res["detect_median_s"] = statistics.median(detected)
        if redone:
            res["reform_s"] = max(r[2] for r in redone) - t_freeze
            res["reform_median_s"] = statistics.median(r[2] - t_freeze for r in redone)
            res["reform_after_detect_s"] = max(r[2] for r in redone) - max(
                r[1] for r in rows if r[1] is not None
            )
        if len(redone) < len(rows):
            raise PhaseTimeout(
                f"re-formation: {len(detected)} of {len(rows)} survivors detected the loss and "
                f"{len(redone)} re-formed within {reform_timeout:.0f} s; state in Redis: "
                f"{res['reform_state']}"
            )
        log(
            f"  lost {lost}: detected in {res['detect_s']:.2f} s "
            f"(first {res['detect_min_s']:.2f} s), re-formed in {res['reform_s']:.2f} s, "
            f"world sizes {res['reform_world_sizes']}"
        )
    except (PhaseTimeout, RuntimeError) as exc:
        res["failure"] = str(exc)
        log(f"  FAILED: {exc}")
    except Exception as exc:  # report it and go on to the next size
        res["failure"] = f"{type(exc).__name__}: {exc}"
        log(f"  FAILED: {traceback.format_exc()}")
    finally:
        monitor.stop.set()
        try:
            stats = fleet.ask("stats", None, 60)
        except Exception as exc:
            res["stats_error"] = f"{exc} (figures below from the last phase's replies)"
            stats = last_stats
        fleet.close()
        monitor.join(2)
    if stats:
        cas = _merge_cas(stats)
        res["cas_by_phase"] = cas
        res["cas_total"] = sum(v[0] for v in cas.values())
        res["cas_conflicts"] = sum(v[1] for v in cas.values())
        res["spurious_restarts"] = sum(len(s["spurious"]) for s in stats)
        res["spurious_reasons"] = dict(
            Counter(str(r)[:80] for s in stats for _, r in s["spurious"]).most_common(3)
        )
        res["poll_errors"] = sum(s["poll_errors"] for s in stats)
        lo, hi = res.get("_window", (0.0, 0.0))
        sweeps = [d for s in stats for (st, d) in s["sweeps"] if lo <= st <= hi]
        res["poll_sweep_p50_s"] = _pct(sweeps, 0.5)
        res["poll_sweep_max_s"] = max(sweeps) if sweeps else float("nan")
        lo = res.get("_reform_from", float("inf"))
        sweeps = [d for s in stats for (st, d) in s["sweeps"] if st >= lo]
        res["reform_poll_sweep_max_s"] = max(sweeps) if sweeps else float("nan")
        logs: Counter[str] = Counter()
        for s in stats:
            logs.update(s["logs"])
        res["log_warnings"] = dict(logs.most_common(6))
        res["identity_changes"] = sum(s["identity_changes"] for s in stats)
        res["told_dead"] = sum(s["told_dead"] for s in stats)
    try:
        gone = {k.decode(): v.decode() for k, v in client.hgetall(keys.rdzv_gone).items()}
        res["declared_dead"] = sum(1 for r in gone.values() if r == "dead")
        res["wrongly_declared_dead"] = sum(
            1 for m, r in gone.items() if r == "dead" and m not in monitor.exclude
        )
        stale = list(client.scan_iter(match=keys.pattern, count=1000))
        if stale:
            client.delete(*stale)
    except redis.RedisError:
        pass
    res["max_heartbeat_age_s"] = dict(monitor.max_age)
    res["progress"] = {p: v for p, v in monitor.progress.items() if p != "steady"}
    res["size_runtime_s"] = time.monotonic() - t_size
    res["loadavg_after"] = os.getloadavg()[0]
    client.close()
    return res


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def _f(value: Any, fmt: str = "{:.2f}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def _bytes(v: float | None) -> str:
    if v is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(v) < 1000:
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1000
    return f"{v:.1f} TB"


def print_report(results: list[dict[str, Any]], runtime: float, cores: int, as_is: bool) -> None:
    print()
    print(f"Redis rendezvous at scale: simulated nodes on {cores} cores, one local Redis")
    print("=" * 100)
    head = (
        f"{'nodes':>6} {'procs':>5} {'form s':>8} {'lost':>5} {'detect s':>9} "
        f"{'re-form s':>10} {'cmds/s':>8} {'reqs/s':>8} {'CAS conflicts/total':>22} "
        f"{'wrongly dead':>12}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        cas = f"{r['cas_conflicts']}/{r['cas_total']}" if "cas_total" in r else "-"
        print(
            f"{r['nodes']:>6} {r['procs']:>5} {_f(r.get('form_s')):>8} {r['lost']:>5} "
            f"{_f(r.get('detect_s')):>9} {_f(r.get('reform_s')):>10} "
            f"{_f(r.get('commands_per_s'), '{:.0f}'):>8} "
            f"{_f(r.get('requests_per_s'), '{:.0f}'):>8} {cas:>22} "
            f"{_f(r.get('wrongly_declared_dead'), '{}'):>12}"
        )
    print()
    print("Steady-state write load: ours vs torch's keep-alive (whole state by CAS every 5 s)")
    head = (
        f"{'nodes':>6} {'state size':>11} {'our CAS/s':>10} {'torch CAS/s':>12} "
        f"{'torch writes':>13} {'our Redis out':>14} {'Redis CPU':>10}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        steady = r.get("cas_by_phase", {}).get("steady", [0])[0]
        span = r.get("_steady_to", 0.0) - r.get("_steady_from", 0.0)
        ours = steady / span if span > 0 else None
        print(
            f"{r['nodes']:>6} {_bytes(r.get('state_bytes')):>11} {_f(ours, '{:.1f}'):>10} "
            f"{_f(r.get('torch_cas_writes_per_s'), '{:.1f}'):>12} "
            f"{_bytes(r.get('torch_write_bytes_per_s')) + '/s':>13} "
            f"{_bytes(r.get('net_out_bytes_per_s')) + '/s':>14} "
            f"{_f(r.get('redis_cpu'), '{:.0%}'):>10}"
        )
    print()
    print("Details")
    for r in results:
        print(f"  N={r['nodes']} (run id {r['run_id']}, {_f(r['size_runtime_s'], '{:.0f}')} s)")
        if "failure" in r:
            print(f"    FAILURE: {r['failure']}")
        print(
            f"    form: median node {_f(r.get('form_median_s'))} s, world sizes "
            f"{r.get('form_world_sizes')}; {_usage_text(r.get('form_usage'))}"
        )
        if "failure" in r:
            print(f"    state in Redis after formation: {r.get('form_state')}")
        print(
            f"    loss: detect first/median/last {_f(r.get('detect_min_s'))}/"
            f"{_f(r.get('detect_median_s'))}/{_f(r.get('detect_s'))} s (includes the "
            f"{HEARTBEAT_TIMEOUT_S} s heartbeat timeout), re-form median "
            f"{_f(r.get('reform_median_s'))} s, last re-form "
            f"{_f(r.get('reform_after_detect_s'))} s after the last detection; world sizes "
            f"{r.get('reform_world_sizes')}, rounds {r.get('reform_rounds')}"
        )
        print(
            f"    loss: {_usage_text(r.get('reform_usage'))}; slowest poll sweep "
            f"{_f(r.get('reform_poll_sweep_max_s'))} s"
        )
        if "failure" in r and "reform_state" in r:
            print(f"    state in Redis after re-formation: {r.get('reform_state')}")
        for phase, samples in r.get("progress", {}).items():
            if samples and ("failure" in r or phase == "reform"):
                print(f"    {phase} progress (s since start: participants/waiting, round, token):")
                print("      " + _timeline(samples))
        if "cas_by_phase" in r:
            parts = ", ".join(
                f"{p} {v[1]}/{v[0]}" + (f" ({v[2]} none)" if v[2] else "")
                for p, v in r["cas_by_phase"].items()
            )
            print(f"    CAS conflicts/calls by phase: {parts}")
        print(
            f"    steady: {_usage_text(r.get('steady_usage'))}; poll sweep p50 "
            f"{_f(r.get('poll_sweep_p50_s'), '{:.3f}')} s / max "
            f"{_f(r.get('poll_sweep_max_s'), '{:.3f}')} s (target period {POLL_INTERVAL_S} s), "
            f"Redis in {_bytes(r.get('net_in_bytes_per_s'))}/s"
        )
        if r.get("steady_calls_per_s"):
            top = list(r["steady_calls_per_s"].items())[:8]
            print("    steady calls/s: " + ", ".join(f"{k} {v}" for k, v in top))
        print(
            f"    oldest live heartbeat (dead after {HEARTBEAT_TIMEOUT_S} s): "
            + ", ".join(f"{p} {v:.2f} s" for p, v in r["max_heartbeat_age_s"].items())
        )
        print(
            f"    declared dead {r.get('declared_dead')} (frozen {r['lost']}), wrongly "
            f"{r.get('wrongly_declared_dead')}; spurious restarts before the loss "
            f"{r.get('spurious_restarts')} {r.get('spurious_reasons') or ''}; poll errors "
            f"{r.get('poll_errors')}"
        )
        if r.get("stats_error"):
            print(f"    stats: {r['stats_error']}")
        if r.get("wrongly_declared_dead"):
            print(
                f"    -> live nodes were declared dead: their heartbeat threads went up to "
                f"{max(r['max_heartbeat_age_s'].values()):.1f} s without running on this "
                "oversubscribed machine."
            )
            if r.get("told_dead") is not None:
                print(
                    f"       {r['told_dead']} of them learned it from their own heartbeat while "
                    "inside next_rendezvous() and went on joining under the dead identity "
                    f"(identities renewed: {r.get('identity_changes')})."
                )
        if r.get("log_warnings"):
            for msg, count in r["log_warnings"].items():
                print(f"    log x{count}: {msg[:90]}")
        for err in r.get("form_errors", []) + r.get("reform_errors", []):
            print(f"    error: {err[:160]}")
    print()
    print(
        f"Caveat: {cores} cores simulate the CPU of N machines (each node's pickling of the "
        "rendezvous state, its threads, and Redis itself share them); times at large N are "
        "bounded by this machine's CPU, not by the rendezvous protocol alone."
    )
    print(
        "torch's event naming (inspect.stack() on every sync) was "
        + (
            "kept as is (--as-is)."
            if as_is
            else "replaced by an equivalent costing microseconds (see --as-is): each real "
            "node pays those milliseconds on its own CPU, not on the simulator's."
        )
    )
    print(f"Total runtime: {runtime:.0f} s")


def _timeline(samples: list[tuple[float, dict[str, Any]]], points: int = 8) -> str:
    step = max(2.0, samples[-1][0] / points)
    out, next_t = [], 0.0
    for t, st in samples:
        if t >= next_t or (t, st) == samples[-1]:
            out.append(
                f"{t:.0f}s {st.get('participants')}/{st.get('wait_list')} "
                f"r{st.get('round')}{'c' if st.get('complete') else ''} t{st.get('token')}"
            )
            next_t = t + step
    return ", ".join(out)


def _usage_text(u: dict[str, float] | None) -> str:
    if not u:
        return "CPU -"
    return (
        f"CPU over {u['wall_s']:.1f} s: fleet {u['fleet_cores']:.2f} + Redis "
        f"{u['redis_cores']:.2f} + other programs {u['other_cores']:.2f} cores "
        f"(machine {u['machine_cores']:.2f})"
    )


def _summary(
    results: list[dict[str, Any]], runtime: float, cores: int, as_is: bool
) -> dict[str, Any]:
    keys = (
        "form_s",
        "detect_s",
        "reform_s",
        "commands_per_s",
        "requests_per_s",
        "cas_conflicts",
        "cas_total",
        "lost",
        "procs",
        "state_bytes",
        "torch_cas_writes_per_s",
        "torch_write_bytes_per_s",
        "net_out_bytes_per_s",
        "redis_cpu",
        "wrongly_declared_dead",
        "spurious_restarts",
        "formed",
        "survivors",
        "detected",
        "reformed",
        "failure",
    )
    out: dict[str, Any] = {}
    for r in results:
        row = {}
        for k in keys:
            v = r.get(k)
            if isinstance(v, float):
                v = None if math.isnan(v) else round(v, 3)
            row[k] = v
        if "failure" in r:
            row["state_at_failure"] = r.get("reform_state") or r.get("form_state")
        row["max_heartbeat_age_s"] = {k: round(v, 2) for k, v in r["max_heartbeat_age_s"].items()}
        for phase in ("form", "steady", "reform"):
            usage = r.get(f"{phase}_usage")
            if usage:
                row[f"{phase}_cores_fleet_redis_other"] = [
                    round(usage[k], 2) for k in ("fleet_cores", "redis_cores", "other_cores")
                ]
        out[str(r["nodes"])] = row
    return {
        "nodes": out,
        "runtime_s": round(runtime, 1),
        "cores": cores,
        "torch_event_naming": "as-is" if as_is else "cheap",
    }


def _default_procs(n: int) -> int:
    # About 32 nodes a process: with more threads behind one GIL, heartbeat threads wait
    # seconds for it while the join threads spin, and get declared dead. Measured on 2 cores
    # at 256 nodes: 2 processes formed in 32 s, 4 in 14 s, 8 in 16 s.
    return max(1, min(16, math.ceil(n / 32)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="64,256,1024", help="fleet sizes (default 64,256,1024)")
    ap.add_argument("--quick", action="store_true", help="only 16 and 64 nodes: a smoke test")
    ap.add_argument("--procs", type=int, default=0, help="worker processes (default: by size)")
    ap.add_argument("--steady-seconds", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=2.0, help="polling before measuring")
    ap.add_argument(
        "--form-timeout", type=float, default=0.0, help="default N/4 s within [60, 200]"
    )
    ap.add_argument(
        "--reform-timeout", type=float, default=0.0, help="default N/2 s within [120, 240]"
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--as-is",
        action="store_true",
        help="keep torch's inspect.stack() event naming (by default the simulation replaces "
        "it with an equivalent that costs microseconds, not milliseconds, per sync)",
    )
    args = ap.parse_args(argv)
    sizes = [16, 64] if args.quick else [int(x) for x in args.nodes.split(",") if x.strip()]
    cores = os.cpu_count() or 1
    started = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {msg}", flush=True)

    results = []
    with RedisServer() as server:
        log(f"redis-server on {server.endpoint}; sizes {sizes}; {cores} cores")
        for n in sizes:
            procs = args.procs or _default_procs(n)
            log(f"N={n}: {procs} worker processes")
            results.append(run_size(server, n, procs, args, log))
    runtime = time.monotonic() - started
    print_report(results, runtime, cores, args.as_is)
    print(json.dumps(_summary(results, runtime, cores, args.as_is)))
    return 0 if all("failure" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

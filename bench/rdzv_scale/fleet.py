"""The main process's side of a fleet: the worker processes of one size, and the monitor that
samples heartbeats and the rendezvous state while it runs."""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import redis

from spottrain.protocol.keys import RunKeys

from .common import PHASES, PhaseTimeout
from .measure import state_summary
from .worker import worker_main


class Fleet:
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
            p = ctx.Process(target=worker_main, args=(child, args), daemon=True)
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


class Monitor(threading.Thread):
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
                    summary = state_summary(self.client, self.keys)
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

"""The heartbeats of one client process's replicas, from a process of their own (the shim
heartbeats off the request path too; in the client process a busy event loop would starve
them, which on a fleet's own VMs it would not): every heartbeat timeout / 4, one HEARTBEAT
call per ``BATCH`` replica ids, pipelined. Driven over a pipe like the client process."""

from __future__ import annotations

import contextlib
import os
import random
import time
from multiprocessing.connection import Connection as Pipe
from typing import Any

import redis
from redis.connection import Connection

from spottrain.protocol.keys import RunKeys
from spottrain.quorum.model import QuorumConfig

from .redis_calls import Calls
from .redis_clients import resp_len

BATCH = 64


class Beats:
    def __init__(self, port: int, run: str, ids: list[str], config: QuorumConfig) -> None:
        self.r = redis.Redis(port=port, socket_timeout=60)
        self.ids = ids
        self.keys = RunKeys(run)
        self.config = config
        self.calls: Calls | None = None
        self.silent: set[str] = set()
        self.gone_seen: set[str] = set()
        self.bytes = 0
        self.calls_made = 0
        self._packer = Connection()  # only packs commands, to count their bytes

    def once(self) -> None:
        assert self.calls is not None
        live = [x for x in self.ids if x not in self.silent]
        cmds = [self.calls.heartbeat(live[i : i + BATCH]) for i in range(0, len(live), BATCH)]
        if not cmds:
            return
        pipe = self.r.pipeline(transaction=False)
        for cmd in cmds:
            pipe.execute_command(*cmd)
        replies = pipe.execute(raise_on_error=False)
        self.bytes += sum(len(p) for p in self._packer.pack_commands(cmds))
        for gone in replies:
            self.bytes += resp_len(gone)
            if isinstance(gone, list):
                self.gone_seen.update(g.decode() for g in gone)
        self.calls_made += len(cmds)

    def handle(self, cmd: str, args: list[Any]) -> dict[str, Any] | None:
        if cmd == "start":
            self.calls = Calls(self.keys, self.config, args[0])
            self.once()
            return {}
        if cmd == "silence":
            self.silent.update(args[0])
            return {"silenced": time.monotonic()}
        if cmd == "rename":  # replicas back under new ids (RedisQuorum.rejoin_dropped)
            self.ids = [args[0].get(rid, rid) for rid in self.ids]
            return {}
        if cmd == "config":
            self.config = args[0]
            assert self.calls is not None
            self.calls.config = args[0]
            return {}
        if cmd == "stats":
            return {
                "hb_bytes": self.bytes,
                "hb_calls": self.calls_made,
                "gone_seen": sorted(self.gone_seen),
            }
        return None  # stop


def beater(pipe: Pipe, port: int, run: str, ids: list[str], config: QuorumConfig) -> None:
    """A heartbeat process's entry point (multiprocessing, spawn)."""
    with contextlib.suppress(OSError):
        # Ahead of the client processes, as a VM's own heartbeats would be: this machine's
        # 2 cores run every simulated replica, and a starved beat is not the quorum's doing.
        os.setpriority(os.PRIO_PROCESS, 0, -10)
    b = Beats(port, run, ids, config)
    interval = config.heartbeat_timeout_ms / 4000
    next_beat: float | None = None  # none before "start"
    while True:
        wait = None if next_beat is None else max(0.0, next_beat - time.monotonic())
        if pipe.poll(wait):
            cmd, *args = pipe.recv()
            reply = b.handle(cmd, args)
            pipe.send(reply or {})
            if reply is None:
                return
            interval = b.config.heartbeat_timeout_ms / 4000
            if cmd == "start":
                next_beat = time.monotonic() + random.uniform(0, interval)
            elif cmd in ("config", "rename"):  # a shorter timeout, new ids: a fresh beat
                b.once()
                next_beat = time.monotonic() + interval
            continue
        b.once()
        assert next_beat is not None
        next_beat += interval
        if next_beat < time.monotonic():  # late (this machine is busy): beat again now
            next_beat = time.monotonic()

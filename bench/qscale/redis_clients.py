"""One client process of the Redis quorum bench: many simulated replicas on one asyncio loop,
each with a ``redis.asyncio`` connection of its own (the one a replica's request and BLPOP
use), plus one shared connection for the joins; their heartbeats come from a process beside
it (``qscale/redis_beats.py``).

Per round a replica sends its request script and its BLPOP in one write (pipelined: one
round trip instead of two, as the client's request-then-wait would cost), then reads both
replies; a BLPOP that timed out calls TICK and waits again, as the blocking client does.
The bytes each replica sends (the packed commands) and receives (its replies, re-encoded
in RESP, which gives their exact size on the wire) are counted.

The coordinator (``qscale/redis_quorum.py``) drives it over a pipe: one command at a time,
answered with a dict."""

from __future__ import annotations

import asyncio
import random
import time
from multiprocessing.connection import Connection as Pipe
from typing import Any

from redis.asyncio.connection import Connection

from spottrain.protocol.keys import RunKeys
from spottrain.quorum.model import Member, QuorumConfig

from .redis_calls import Calls, parse_reply
from .redis_relays import relay_round
from .redis_server import raise_fd_limit


def resp_len(reply: Any) -> int:
    """The size in RESP2 of a reply as redis-py parsed it (ints, bulk strings, arrays,
    nil): what the server wrote for it."""
    if reply is None:
        return 5  # "$-1\r\n" or "*-1\r\n"
    if isinstance(reply, int):
        return len(str(reply)) + 3
    if isinstance(reply, bytes):
        return len(str(len(reply))) + len(reply) + 5
    if isinstance(reply, list):
        return len(str(len(reply))) + 3 + sum(resp_len(x) for x in reply)
    if isinstance(reply, Exception):
        return len(str(reply)) + 3
    raise TypeError(f"unexpected reply {reply!r}")


class Replicas:
    """The replicas ``ids`` of one process and their connections."""

    def __init__(self, port: int, run: str, ids: list[str], config: QuorumConfig) -> None:
        self.port = port
        self.ids = ids
        self.keys = RunKeys(run)
        self.config = config
        self.conns: dict[str, Connection] = {}
        self.shared: Connection | None = None
        self.calls: Calls | None = None
        self.silent: set[str] = set()  # no requests (a silent loss or a leave)
        self.relay_conns: list[Connection] = []  # one per relay (qscale/redis_relays.py)

    def _conn(self) -> Connection:
        return Connection(port=self.port, socket_timeout=None, socket_connect_timeout=60)

    async def connect(self, shas: dict[str, str]) -> dict[str, Any]:
        self.calls = Calls(self.keys, self.config, shas)
        self.shared = self._conn()
        await self.shared.connect()
        for chunk in range(0, len(self.ids), 256):
            part = self.ids[chunk : chunk + 256]
            conns = [self._conn() for _ in part]
            await asyncio.gather(*(c.connect() for c in conns))
            self.conns.update(zip(part, conns, strict=True))
        await self._join(self.ids)
        return {"connections": len(self.conns) + 1}

    async def _join(self, ids: list[str]) -> None:
        assert self.calls is not None and self.shared is not None
        for rid in ids:
            i = int(rid.rsplit("-", 1)[1])
            member = Member(rid, f"10.0.{i // 250}.{i % 250}:29512", f"10.0.0.{i % 250}:29500", 8)
            await self.shared.send_command(*self.calls.join(member))
            await self.shared.read_response()

    async def rename(self, new_ids: dict[str, str]) -> dict[str, Any]:
        """Replicas of this process back under new ids (a dropped id is refused for good,
        so a fleet's dropped replica restarts under a new one), each on a new connection
        (the old one may still owe the refused request's BLPOP reply), and joined."""
        mine = {old: new for old, new in new_ids.items() if old in self.conns}
        for old, new in mine.items():
            await self.conns.pop(old).disconnect()
            self.conns[new] = self._conn()
            await self.conns[new].connect()
        self.ids = [mine.get(rid, rid) for rid in self.ids]
        await self._join(list(mine.values()))
        return {"renamed": len(mine)}

    def _blpop(self, rid: str, remaining: float) -> tuple[Any, ...]:
        c = self.config  # QuorumClient's slice: the join timeout's scale, <= heartbeat / 2
        hb_ms = c.heartbeat_timeout_ms
        wait = min(remaining, min(max(c.join_timeout_ms, hb_ms / 4), hb_ms / 2) / 1000)
        return ("BLPOP", self.calls.reply_key(rid), round(wait * random.uniform(0.8, 1.2), 3))  # type: ignore[union-attr]

    async def _wait(self, rid: str, token: str, deadline: float, out: dict[str, Any]) -> None:
        conn = self.conns[rid]
        try:
            first = await conn.read_response()
            out["recv"] += resp_len(first)
            while True:
                got = await conn.read_response()
                out["recv"] += resp_len(got)
                if got is not None:
                    their, answer = parse_reply(got[1])
                    if their == token:
                        break
                    out["stale"] += 1  # an answer to an earlier round's request: wait on
                remaining = deadline - time.monotonic()
                assert self.calls is not None
                if remaining <= 0:  # withdrawn, as QuorumClient gives up
                    await conn.send_command(*self.calls.tick(rid, token, "withdraw"))
                    await conn.read_response()
                    raise TimeoutError(f"{rid}: no quorum before the round's deadline")
                tick = self.calls.tick(rid, token)
                packed = conn.pack_commands([tick, self._blpop(rid, remaining)])
                await conn.send_packed_command(packed, check_health=False)
                out["sent"] += sum(len(p) for p in packed)
                out["ticks"] += 1
                ticked = await conn.read_response()
                out["recv"] += resp_len(ticked)
                if ticked == b"lost":  # Redis lost the request (it restarted): not here
                    raise RuntimeError(f"{rid}: TICK says the request was lost")
        except Exception as e:  # counted and reported by the coordinator
            out["errors"].append(f"{type(e).__name__}: {e}")
            return
        out["last_recv"] = max(out["last_recv"], time.monotonic())
        out["answers"][answer.replica_count] = out["answers"].get(answer.replica_count, 0) + 1
        out["qids"].add(answer.quorum_id)

    async def round(self, step: int, held_qid: int, timeout_s: float, pipe: Pipe) -> None:
        """Send every live replica's request, tell the coordinator (``sent``), then wait for
        every answer and tell it again (``done``)."""
        assert self.calls is not None
        live = [r for r in self.ids if r not in self.silent]
        out: dict[str, Any] = {"sent": 0, "recv": 0, "ticks": 0, "stale": 0, "errors": []}
        out["answers"] = {}
        out.update(qids=set(), last_recv=0.0, replicas=len(live))
        deadline = time.monotonic() + timeout_s
        out["first_sent"] = time.monotonic()
        token = f"s{step}"  # unique per logical request, as QuorumClient's
        for rid in live:
            conn = self.conns[rid]
            packed = conn.pack_commands(
                [self.calls.request(rid, step, held_qid, token), self._blpop(rid, timeout_s)]
            )
            await conn.send_packed_command(packed, check_health=False)
            out["sent"] += sum(len(p) for p in packed)
        out["last_sent"] = time.monotonic()
        pipe.send({"sent": out["last_sent"]})
        await asyncio.gather(*(self._wait(r, token, deadline, out) for r in live))
        out["qids"] = sorted(out["qids"])
        out["errors"] = out["errors"][:3] + (
            [f"... {len(out['errors'])} in all"] * (len(out["errors"]) > 3)
        )
        pipe.send(out)


async def _serve(pipe: Pipe, reps: Replicas) -> None:
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[Any] = asyncio.Queue()
    loop.add_reader(pipe.fileno(), lambda: inbox.put_nowait(pipe.recv()))
    while True:
        cmd, *args = await inbox.get()
        if cmd == "connect":
            done = await reps.connect(*args)
            pipe.send(done)
        elif cmd == "round":
            await reps.round(*args, pipe)
        elif cmd == "relay_round":
            await relay_round(reps, *args, pipe)
        elif cmd == "rename":
            pipe.send(await reps.rename(args[0]))
        elif cmd == "silence":
            reps.silent.update(args[0])
            pipe.send({"silenced": time.monotonic()})
        elif cmd == "config":
            reps.config = args[0]
            reps.calls.config = args[0]  # type: ignore[union-attr]
            pipe.send({})
        elif cmd == "stop":
            for conn in [*reps.conns.values(), *reps.relay_conns, reps.shared]:
                if conn is not None:
                    await conn.disconnect()
            pipe.send({})
            return


def worker(pipe: Pipe, port: int, run: str, ids: list[str], config: QuorumConfig) -> None:
    """A client process's entry point (multiprocessing, spawn)."""
    raise_fd_limit()
    asyncio.run(_serve(pipe, Replicas(port, run, ids, config)))

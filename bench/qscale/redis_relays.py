"""The relayed round of the Redis quorum bench: a client process's replicas in relays of
``group`` (as RSHIM's relays batch a group's requests), each relay one ``redis.asyncio``
connection sending one RELAY_REQUEST for its whole group and its BLPOP in one write, then
reading the one answer element (``spottrain.quorum.relay``'s format) and counting an answer
for each member: "S" gives every member the same quorum (the member's rank is a lookup in the
relay's cached roster, not timed here), "F" a line each. A BLPOP that timed out calls
RELAY_TICK and waits again, as ``QuorumClient.request_batch`` does."""

from __future__ import annotations

import asyncio
import random
import time
from multiprocessing.connection import Connection as Pipe
from typing import TYPE_CHECKING, Any

from redis.asyncio.connection import Connection

from spottrain.quorum import scripts

if TYPE_CHECKING:
    from .redis_clients import Replicas


def _apply(text: str, ids: list[str], out: dict[str, Any]) -> int:
    """Count the answers in one relay element; returns how many members it answered."""
    if text.startswith("S "):
        _, _, qid, _, count, _, _ = text.split(" ")
        out["answers"][int(count)] = out["answers"].get(int(count), 0) + len(ids)
        out["qids"].add(int(qid))
        return len(ids)
    lines = text.split("\n")[1:]
    for line in lines:
        a = scripts.parse_answer(line.partition(" ")[2])
        out["answers"][a.replica_count] = out["answers"].get(a.replica_count, 0) + 1
        out["qids"].add(a.quorum_id)
    return len(lines)


async def _wait(
    reps: Replicas, conn: Connection, batch: str, ids: list[str], deadline: float,
    out: dict[str, Any],
) -> None:  # fmt: skip
    from .redis_clients import resp_len

    assert reps.calls is not None
    try:
        first = await conn.read_response()
        out["recv"] += resp_len(first)
        if int(first[0]) < 0 or len(first) > 1:
            raise RuntimeError(f"{batch}: RELAY_REQUEST refused {first}")
        left = len(ids)
        while left > 0:
            got = await conn.read_response()
            out["recv"] += resp_len(got)
            if got is not None:
                left -= _apply(got[1].decode(), ids, out)
                if left > 0:
                    await conn.send_command(*_blpop(reps, batch, deadline))
                continue
            if deadline - time.monotonic() <= 0:
                raise TimeoutError(f"{batch}: no quorum before the round's deadline")
            packed = conn.pack_commands(
                [reps.calls.relay_tick(batch, ids), _blpop(reps, batch, deadline)]
            )
            await conn.send_packed_command(packed, check_health=False)
            out["sent"] += sum(len(p) for p in packed)
            out["ticks"] += 1
            out["recv"] += resp_len(await conn.read_response())
    except Exception as e:  # counted and reported by the coordinator
        out["errors"].append(f"{type(e).__name__}: {e}")
        return
    out["last_recv"] = max(out["last_recv"], time.monotonic())


def _blpop(reps: Replicas, batch: str, deadline: float) -> tuple[Any, ...]:
    c = reps.config
    hb_ms = c.heartbeat_timeout_ms
    remaining = max(0.01, deadline - time.monotonic())
    wait = min(remaining, min(max(c.join_timeout_ms, hb_ms / 4), hb_ms / 2) / 1000)
    assert reps.calls is not None
    return ("BLPOP", reps.calls.relay_key(batch), round(wait * random.uniform(0.8, 1.2), 3))


async def relay_round(
    reps: Replicas, step: int, held_qid: int, timeout_s: float, group: int, pipe: Pipe
) -> None:
    """Every relay sends its group's batch, tells the coordinator (``sent``), then waits for
    its answer and tells it again (``done``), as ``Replicas.round`` does per replica."""
    assert reps.calls is not None
    live = [r for r in reps.ids if r not in reps.silent]
    groups = [live[i : i + group] for i in range(0, len(live), group)]
    while len(reps.relay_conns) < len(groups):
        conn = reps._conn()
        await conn.connect()
        reps.relay_conns.append(conn)
    out: dict[str, Any] = {"sent": 0, "recv": 0, "ticks": 0, "stale": 0, "errors": []}
    out.update(answers={}, qids=set(), last_recv=0.0, replicas=len(live))
    deadline = time.monotonic() + timeout_s
    out["first_sent"] = time.monotonic()
    batches = []
    for k, ids in enumerate(groups):
        conn, batch = reps.relay_conns[k], f"relay-{reps.ids[0]}-{k}:s{step}"
        packed = conn.pack_commands(
            [reps.calls.relay_request(batch, ids, step, held_qid), _blpop(reps, batch, deadline)]
        )
        await conn.send_packed_command(packed, check_health=False)
        out["sent"] += sum(len(p) for p in packed)
        batches.append((conn, batch, ids))
    out["last_sent"] = time.monotonic()
    pipe.send({"sent": out["last_sent"]})
    await asyncio.gather(*(_wait(reps, c, b, ids, deadline, out) for c, b, ids in batches))
    out["qids"] = sorted(out["qids"])
    out["errors"] = out["errors"][:3] + (
        [f"... {len(out['errors'])} in all"] * (len(out["errors"]) > 3)
    )
    pipe.send(out)

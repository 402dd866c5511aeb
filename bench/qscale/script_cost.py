"""Redis CPU per quorum script call, read on the Redis side.

A real redis-server (no persistence), N members joined and heartbeating, then steady-state
rounds: every member's REQUEST from one pipelined client (the last one forms the round on the
fast path), then the replies popped. No BLPOP waiters are needed to measure the scripts.
Per size it prints the median over rounds of:

- ``request_us``: Redis CPU of one REQUEST that does not form (``INFO commandstats`` for
  ``evalsha`` over the round, minus the forming call, divided by the non-forming calls);
- ``form_ms``: the REQUEST that formed the round (sent alone, ``commandstats`` around it);
- ``heartbeat_us``: one HEARTBEAT of 8 ids (a VM's replicas), a separate pass per round;
- ``noop_us``: a script ``return 1`` called with REQUEST's arguments (the floor: the machine's
  load inflates every figure, this one shows by how much).

Run: ``.venv/bin/python bench/qscale/script_cost.py [--sizes 100,1000,12500] [--rounds 7]``.
The machine's load moves single figures a lot: compare medians taken in one run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid

import redis

from spottrain.ports import free_port
from spottrain.protocol.keys import RunKeys
from spottrain.quorum import scripts
from spottrain.quorum.model import Member, QuorumConfig

# A long join timeout: the first round (sent from one client) must wait for every member.
CONFIG = QuorumConfig(heartbeat_timeout_ms=5000, join_timeout_ms=60000, min_replicas=1)
PIPE = 1000  # calls per pipeline flush


def _start_redis() -> tuple[subprocess.Popen[bytes], redis.Redis, str]:
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="qcost-")
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", workdir],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    r = redis.Redis(port=port, decode_responses=True)
    for _ in range(200):
        try:
            r.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return proc, r, workdir


def _evalsha(r: redis.Redis) -> tuple[int, int]:
    s = r.info("commandstats").get("cmdstat_evalsha", {})
    return int(s.get("calls", 0)), int(s.get("usec", 0))


class Fleet:
    """N members of one run's quorum, driven from one pipelined client."""

    def __init__(self, r: redis.Redis, n: int) -> None:
        self.r = r
        self.keys = RunKeys(f"qcost-{n}")
        self.ids = [f"replica-{i:05d}:{uuid.uuid4()}" for i in range(n)]
        self.shas = {name: r.script_load(src) for name, src in scripts.ALL.items()}
        self.kargs = scripts.script_keys(self.keys)
        self.cargs = scripts.config_args(self.keys, CONFIG, "0badc0de")
        self.step = 0
        self.qid = 0

    def _call(self, pipe: redis.client.Pipeline, name: str, *args: str) -> None:
        pipe.evalsha(self.shas[name], len(self.kargs), *self.kargs, *self.cargs, *args)

    def _batched(self, make: list[tuple[str, tuple[str, ...]]]) -> list[object]:
        out: list[object] = []
        for i in range(0, len(make), PIPE):
            pipe = self.r.pipeline(transaction=False)
            for name, args in make[i : i + PIPE]:
                self._call(pipe, name, *args)
            out += pipe.execute()
        return out

    def join(self) -> None:
        self._batched(
            [("JOIN", (rid, scripts.member_json(Member(rid, f"http://{rid}", f"{rid}:1"))))
             for rid in self.ids]
        )  # fmt: skip
        self._batched(
            [("HEARTBEAT", tuple(self.ids[i : i + 8])) for i in range(0, len(self.ids), 8)]
        )

    def round(self) -> int:
        """Every member asks at the current step (the last one alone, as it forms the round:
        returns its Redis CPU in us); the replies are popped after."""
        self.step += 1
        token = uuid.uuid4().hex[:12]
        make = [
            ("REQUEST", tuple(scripts.request_args(rid, self.step, self.qid, 0, False, token)))
            for rid in self.ids
        ]
        self._batched(make[:-1])
        before = _evalsha(self.r)[1]
        self._batched(make[-1:])
        form_us = _evalsha(self.r)[1] - before
        pipe = self.r.pipeline(transaction=False)
        for rid in self.ids:
            pipe.lpop(scripts.reply_key(self.keys, rid))
        replies = pipe.execute()
        if any(x is None for x in replies):
            state = self.r.hgetall(self.keys.quorum_key("state"))
            raise RuntimeError(f"a round did not form: {replies.count(None)} unanswered, {state}")
        self.qid = scripts.parse_answer(scripts.split_reply(replies[0])[1]).quorum_id
        return form_us

    def noop(self) -> None:
        """A trivial script with REQUEST's arguments: the floor of any script call."""
        sha = self.r.script_load("return 1")
        for i in range(0, len(self.ids), PIPE):
            pipe = self.r.pipeline(transaction=False)
            for rid in self.ids[i : i + PIPE]:
                args = scripts.request_args(rid, self.step, self.qid, 0, False, "t" * 12)
                pipe.evalsha(sha, len(self.kargs), *self.kargs, *self.cargs, *args)
            pipe.execute()

    def heartbeats(self) -> None:
        self._batched(
            [("HEARTBEAT", tuple(self.ids[i : i + 8])) for i in range(0, len(self.ids), 8)]
        )


def measure(r: redis.Redis, n: int, rounds: int) -> dict[str, float]:
    fleet = Fleet(r, n)
    fleet.join()
    fleet.round()  # forms the first quorum (a membership change)
    fleet.round()
    req_us, form_ms, hb_us, noop_us = [], [], [], []
    for _ in range(rounds):
        r.config_resetstat()
        form = fleet.round()
        calls, usec = _evalsha(r)
        req_us.append((usec - form) / max(1, calls - 1))
        form_ms.append(form / 1000)
        for what, out in ((fleet.heartbeats, hb_us), (fleet.noop, noop_us)):
            r.config_resetstat()
            what()
            calls, usec = _evalsha(r)
            out.append(usec / max(1, calls))
    return {
        "n": n,
        "request_us": round(statistics.median(req_us), 2),
        "form_ms": round(statistics.median(form_ms), 3),
        "heartbeat_us": round(statistics.median(hb_us), 2),
        "noop_us": round(statistics.median(noop_us), 2),
        "request_us_all": [round(x, 1) for x in req_us],
        "form_ms_all": [round(x, 2) for x in form_ms],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="100,1000,12500")
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    proc, r, workdir = _start_redis()
    try:
        for n in (int(s) for s in a.sizes.split(",")):
            print(json.dumps(measure(r, n, a.rounds)), flush=True)
            r.flushall()
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()

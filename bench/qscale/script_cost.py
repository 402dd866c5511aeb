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
  load inflates every figure, this one shows by how much);
- ``*_cpu_us`` / ``form_cpu_ms``: the same calls measured by Redis's main-thread CPU
  (``INFO cpu``), which leaves out the time the loaded machine took the core away but adds
  reading the commands and writing the replies (in ``noop_cpu_us`` too). On a busy machine
  these are the steadier figures; the script's own cost is about ``x_cpu_us - noop_cpu_us``.

Run: ``.venv/bin/python bench/qscale/script_cost.py [--sizes 100,1000,12500] [--rounds 7]
[--ref main]`` (``--ref``: the scripts of that git ref measured right after, on the same
Redis). The machine's load moves single figures a lot: compare medians taken in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator

import redis

from spottrain.ports import free_port
from spottrain.protocol.keys import RunKeys
from spottrain.quorum import scripts
from spottrain.quorum.model import Member, QuorumConfig

# Long timeouts: the first round (sent from one client) must wait for every member, and no
# member may expire while one client drives them all on a loaded machine. They change no cost.
CONFIG = QuorumConfig(heartbeat_timeout_ms=60_000, join_timeout_ms=60_000, min_replicas=1)
PIPE = 1000  # calls per pipeline flush


@contextlib.contextmanager
def scratch_redis() -> Iterator[redis.Redis]:
    """A throwaway redis-server with no persistence on a free port, gone on exit."""
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="qcost-")
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", workdir],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    r = redis.Redis(port=port, decode_responses=True)
    try:
        for _ in range(200):
            try:
                r.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        yield r
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def _evalsha(r: redis.Redis) -> tuple[int, int]:
    s = r.info("commandstats").get("cmdstat_evalsha", {})
    return int(s.get("calls", 0)), int(s.get("usec", 0))


def _cpu_us(r: redis.Redis) -> float:
    """Redis's main thread CPU (user + system): unlike commandstats' wall clock, it does not
    count the time the loaded machine took the core away, but it includes reading the
    commands and writing the replies (``noop`` shows that floor)."""
    c = r.info("cpu")
    return (c["used_cpu_user_main_thread"] + c["used_cpu_sys_main_thread"]) * 1e6


class Fleet:
    """N members of one run's quorum, driven from one pipelined client."""

    def __init__(self, r: redis.Redis, n: int, lua: dict[str, str], tag: str = "") -> None:
        self.r = r
        self.keys = RunKeys(f"qcost{tag}-{n}")
        self.ids = [f"replica-{i:05d}:{uuid.uuid4()}" for i in range(n)]
        self.shas = {name: r.script_load(src) for name, src in lua.items()}
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

    def round(self) -> tuple[int, float, float]:
        """Every member asks at the current step (the last one alone, as it forms the round);
        the replies are popped after. Returns the forming call's commandstats us, its CPU us
        and the other calls' CPU us."""
        self.step += 1
        token = uuid.uuid4().hex[:12]
        make = [
            ("REQUEST", tuple(scripts.request_args(rid, self.step, self.qid, 0, False, token)))
            for rid in self.ids
        ]
        cpu0 = _cpu_us(self.r)
        self._batched(make[:-1])
        cpu1 = _cpu_us(self.r)
        before = _evalsha(self.r)[1]
        self._batched(make[-1:])
        form_us = _evalsha(self.r)[1] - before
        cpu2 = _cpu_us(self.r)
        pipe = self.r.pipeline(transaction=False)
        for rid in self.ids:
            pipe.lpop(scripts.reply_key(self.keys, rid))
        replies = pipe.execute()
        if any(x is None for x in replies):
            state = self.r.hgetall(self.keys.quorum_key("state"))
            raise RuntimeError(f"a round did not form: {replies.count(None)} unanswered, {state}")
        self.qid = scripts.parse_answer(scripts.split_reply(replies[0])[1]).quorum_id
        return form_us, cpu2 - cpu1, cpu1 - cpu0

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


FIGURES = (
    "request_us", "request_cpu_us", "form_ms", "form_cpu_ms", "heartbeat_us", "heartbeat_cpu_us",
    "noop_us", "noop_cpu_us",
)  # fmt: skip


def git_scripts(ref: str) -> dict[str, str]:
    """The scripts as ``spottrain/quorum/lua.py`` (and ``lua_bodies.py``, where the bodies
    moved) had them at git ``ref``."""
    lua: dict[str, object] = {}
    for name in ("lua.py", "lua_bodies.py"):
        got = subprocess.run(
            ["git", "show", f"{ref}:spottrain/quorum/{name}"], capture_output=True, text=True
        )  # fmt: skip
        if got.returncode == 0:
            exec(compile(got.stdout, f"{ref}:{name}", "exec"), lua)  # our own file, from git
    return {
        k: str(lua["PRELUDE"]) + str(lua[f"{k}_BODY"]) for k in scripts.ALL if f"{k}_BODY" in lua
    }


def measure(
    r: redis.Redis, n: int, rounds: int, lua: dict[str, str], tag: str = ""
) -> dict[str, object]:
    fleet = Fleet(r, n, lua, tag)
    fleet.join()
    fleet.round()  # forms the first quorum (a membership change)
    fleet.round()
    got: dict[str, list[float]] = {k: [] for k in FIGURES}
    for _ in range(rounds):
        r.config_resetstat()
        form, form_cpu, req_cpu = fleet.round()
        calls, usec = _evalsha(r)
        got["request_us"].append((usec - form) / max(1, calls - 1))
        got["request_cpu_us"].append(req_cpu / max(1, n - 1))
        got["form_ms"].append(form / 1000)
        got["form_cpu_ms"].append(form_cpu / 1000)
        for what, name in ((fleet.heartbeats, "heartbeat"), (fleet.noop, "noop")):
            r.config_resetstat()
            cpu0 = _cpu_us(r)
            what()
            cpu = _cpu_us(r) - cpu0
            calls, usec = _evalsha(r)
            got[f"{name}_us"].append(usec / max(1, calls))
            got[f"{name}_cpu_us"].append(cpu / max(1, calls))
    out: dict[str, object] = {"n": n}
    for k, v in got.items():
        out[k] = round(statistics.median(v), 3 if k.endswith("ms") else 2)
    out["request_us_all"] = [round(x, 1) for x in got["request_us"]]
    out["form_ms_all"] = [round(x, 2) for x in got["form_ms"]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="100,1000,12500")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument(
        "--ref", help="also measure the scripts of this git ref (e.g. main), size by size"
    )
    a = ap.parse_args()
    with scratch_redis() as r:
        for n in (int(s) for s in a.sizes.split(",")):
            print(json.dumps(measure(r, n, a.rounds, scripts.ALL)), flush=True)
            if a.ref:
                ref = {"ref": a.ref, **measure(r, n, a.rounds, git_scripts(a.ref), "-ref")}
                print(json.dumps(ref), flush=True)
            r.flushall()


if __name__ == "__main__":
    main()

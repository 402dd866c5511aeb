"""Redis CPU of a relayed steady round, read on the Redis side (as ``script_cost.py`` does for
the direct scripts).

A real redis-server (no persistence), N members joined and heartbeating, then steady rounds
through relays of ``--group`` replicas: every relay's RELAY_REQUEST from one pipelined client
(the last one alone: it forms the round, with the steady FORM), then each relay's answer
popped (``LPOP``, where a relay BLPOPs). Per size, medians over rounds of:

- ``round_cpu_ms``: Redis's main-thread CPU for the whole round (every batch, the FORM and
  the pops): what one Redis core spends per step on the quorum;
- ``batch_us`` / ``batch_cpu_us``: one RELAY_REQUEST that does not form (commandstats / CPU);
- ``form_us``: the forming call (a batch plus the steady FORM), commandstats;
- ``noop_cpu_us``: a ``return 1`` script with a batch's arguments (the floor of a call);
- ``commands``: per command inside the scripts, calls and usec per round (commandstats).

Run: ``.venv/bin/python bench/qscale/relay_cost.py [--sizes 1000,12500] [--group 100]
[--rounds 9]``. Load on the machine moves single figures: compare medians of one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from qscale.script_cost import PIPE, Fleet, _cpu_us, _evalsha, scratch_redis
from spottrain.quorum import scripts
from spottrain.quorum.model import BatchItem


class RelayFleet(Fleet):
    """N members asking through relays of ``group``, from one pipelined client."""

    def __init__(self, r: redis.Redis, n: int, group: int) -> None:
        super().__init__(r, n, dict(scripts.ALL), f"-relay{group}")
        self.groups = [self.ids[i : i + group] for i in range(0, n, group)]

    def relay_round(self) -> tuple[int, float, float, dict[str, tuple[int, int]]]:
        """One steady round; returns the forming call's commandstats us, the round's CPU us,
        the non-forming calls' CPU us, and per command (calls, usec)."""
        self.step += 1
        make = []
        for k, ids in enumerate(self.groups):
            items = [BatchItem(rid, self.step) for rid in ids]
            args = scripts.relay_args(f"relay-{k}:s{self.step}", items, [self.qid] * len(ids))
            make.append(("RELAY_REQUEST", tuple(args)))
        self.r.config_resetstat()
        cpu0 = _cpu_us(self.r)
        self._batched(make[:-1])
        cpu1 = _cpu_us(self.r)
        before = _evalsha(self.r)[1]
        self._batched(make[-1:])
        form_us = _evalsha(self.r)[1] - before
        pipe = self.r.pipeline(transaction=False)
        for k in range(len(self.groups)):
            pipe.lpop(scripts.relay_key(self.keys, f"relay-{k}:s{self.step}"))
        lines = pipe.execute()
        cpu2 = _cpu_us(self.r)
        if any(x is None for x in lines):
            raise RuntimeError(f"a relayed round did not form: {lines.count(None)} unanswered")
        self.qid = int(lines[0].split(" ")[2]) if lines[0].startswith("S ") else self.qid
        stats = {
            k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
            for k, v in self.r.info("commandstats").items()
            if k not in ("cmdstat_info", "cmdstat_config")
        }
        return form_us, cpu2 - cpu0, cpu1 - cpu0, stats

    def relay_noop(self) -> float:
        """CPU us of a ``return 1`` script called with one batch's arguments."""
        sha = self.r.script_load("return 1")
        items = [BatchItem(rid, self.step) for rid in self.groups[0]]
        args = scripts.relay_args("relay-0:noop", items, [0] * len(items))
        cpu0 = _cpu_us(self.r)
        for i in range(0, len(self.groups), PIPE):
            pipe = self.r.pipeline(transaction=False)
            for _ in self.groups[i : i + PIPE]:
                pipe.evalsha(sha, len(self.kargs), *self.kargs, *self.cargs, *args)
            pipe.execute()
        return (_cpu_us(self.r) - cpu0) / len(self.groups)


def measure(r: redis.Redis, n: int, group: int, rounds: int) -> dict[str, object]:
    fleet = RelayFleet(r, n, group)
    fleet.join()
    fleet.round()  # direct: forms the first quorum (a membership change)
    fleet.relay_round()  # the first relayed round (its lists and sets are new)
    got: dict[str, list[float]] = {"form_us": [], "round_cpu_ms": [], "batch_cpu_us": []}
    got.update(batch_us=[], noop_cpu_us=[])
    per: dict[str, list[tuple[int, int]]] = {}
    for _ in range(rounds):
        form_us, cpu, batch_cpu, stats = fleet.relay_round()
        nb = len(fleet.groups)
        calls, usec = stats.get("evalsha", (0, 0))
        got["form_us"].append(form_us)
        got["round_cpu_ms"].append(cpu / 1000)
        got["batch_cpu_us"].append(batch_cpu / max(1, nb - 1))
        got["batch_us"].append((usec - form_us) / max(1, calls - 1))
        got["noop_cpu_us"].append(fleet.relay_noop())
        for name, v in stats.items():
            per.setdefault(name, []).append(v)
    out: dict[str, object] = {"n": n, "group": group, "relays": len(fleet.groups)}
    for k, v in got.items():
        out[k] = round(statistics.median(v), 2)
    out["round_cpu_ms_all"] = [round(x, 2) for x in got["round_cpu_ms"]]
    out["commands"] = {
        name: {
            "calls": statistics.median(c for c, _ in v),
            "usec": statistics.median(u for _, u in v),
        }
        for name, v in sorted(per.items())
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1000,12500")
    ap.add_argument("--group", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    with scratch_redis() as r:
        for n in (int(s) for s in a.sizes.split(",")):
            print(json.dumps(measure(r, n, a.group, a.rounds)), flush=True)
            r.flushall()


if __name__ == "__main__":
    main()

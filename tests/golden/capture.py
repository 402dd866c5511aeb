"""Capture the golden fixtures of tests/golden/ from the code as it is NOW.

Run once, by hand, from the repository root::

    .venv/bin/python tests/golden/capture.py

It drives a small real flow against a throwaway Redis (the same ``RedisServer`` the test
fixtures start) and a local cloud, then writes what the run left:

- ``redis_dump.json``: every key of the run (type, value, TTL at capture) and, captured with
  it, what today's readers made of it (``spottrain status --json``'s object, the report's
  data, the rendezvous view and the decoded rendezvous state);
- ``events.json``: the run's event stream as written (ids and fields), and ``events.jsonl``
  as ``archive_run`` writes it;
- ``checkpoint/``: the checkpoint directory the SDK wrote (DCP shards, manifests, pickled
  RNG and SDK objects), and ``checkpoint_expected.json``: the values it must restore.

The tests (``test_golden.py``) only READ these files; they never run this script. Capture
again only when a format changes on purpose, and say so in the commit.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import redis
import torch
import torch.distributed as dist
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/ for spec_samples
sys.path.insert(0, str(HERE))  # for golden_state

from golden_state import make_state  # noqa: E402
from spec_samples import LOCAL, spec_with  # noqa: E402

from spottrain.agent.checkpoint.directory import step_name  # noqa: E402
from spottrain.agent.checkpoint.manifest import Manifest  # noqa: E402
from spottrain.agent.node_record import NodeInfo, NodeRecord  # noqa: E402
from spottrain.agent.rendezvous.handler import create_handler  # noqa: E402
from spottrain.agent.sdk import ENV_NODE, GlobalBatch, TrainSession  # noqa: E402
from spottrain.cloud.local.compute import LocalProvider  # noqa: E402
from spottrain.cloud.local.settings import LocalSettings  # noqa: E402
from spottrain.controller.reconcile.controller import Controller, policy_from_spec  # noqa: E402
from spottrain.controller.reconcile.state import RunState  # noqa: E402
from spottrain.controller.reconcile.summary import summarize  # noqa: E402
from spottrain.controller.report import build_report, read_redis_inputs  # noqa: E402
from spottrain.controller.run.embedded_redis import RedisServer  # noqa: E402
from spottrain.ports import free_port  # noqa: E402
from spottrain.protocol.keys import RunKeys  # noqa: E402
from spottrain.spec import parse_spec  # noqa: E402

RUN_ID = "golden-1700000000"
CREATED_AT = 1_700_000_000.0
SLEEP_BOOT = json.dumps({"argv": ["sleep", "600"]})


# -- encoding Redis values ------------------------------------------------------------------
def enc(raw: bytes) -> dict[str, str]:
    """A Redis value as JSON: text when it is UTF-8, else base64."""
    try:
        return {"s": raw.decode("utf-8")}
    except UnicodeDecodeError:
        return {"b64": base64.b64encode(raw).decode()}


def dump_key(client: redis.Redis, key: bytes) -> dict[str, Any]:
    kind = client.type(key).decode()
    value: Any
    if kind == "string":
        value = enc(client.get(key) or b"")
    elif kind == "hash":
        value = [[enc(k), enc(v)] for k, v in sorted(client.hgetall(key).items())]
    elif kind == "list":
        value = [enc(v) for v in client.lrange(key, 0, -1)]
    elif kind == "set":
        value = [enc(v) for v in sorted(client.smembers(key))]
    elif kind == "zset":
        value = [[enc(m), s] for m, s in client.zrange(key, 0, -1, withscores=True)]
    elif kind == "stream":
        value = [
            [i.decode(), [[enc(k), enc(v)] for k, v in f.items()]] for i, f in client.xrange(key)
        ]
    else:
        raise ValueError(f"{key!r}: type {kind} is not dumped")
    return {"type": kind, "pttl": client.pttl(key), "value": value}


def dump_run(client: redis.Redis, keys: RunKeys) -> dict[str, Any]:
    names = sorted(client.scan_iter(match=keys.pattern, count=1000))
    return {k.decode(): dump_key(client, k) for k in names}


# -- the flow -----------------------------------------------------------------------------------
def _controller(cloud: LocalProvider, client: redis.Redis, keys: RunKeys) -> Controller:
    data = spec_with(LOCAL, "nodes", {"min": 1, "max": 2, "gpus": 0})
    data = spec_with(data, "budget", {"max_usd": 1000})
    spec = parse_spec(yaml.safe_dump(data)).spec
    return Controller(
        spec=spec,
        run_id=keys.run_id,
        providers={"local": cloud},
        state=RunState(client, keys),
        boot=lambda node, offer: SLEEP_BOOT,
        policy=policy_from_spec(spec),
        interval_s=0.1,
    )


def _rendezvous(server: RedisServer, keys: RunKeys) -> Any:
    from torch.distributed.elastic.rendezvous.api import RendezvousParameters

    params = RendezvousParameters(
        backend="redis",
        endpoint=server.endpoint,
        run_id=keys.run_id,
        min_nodes=1,
        max_nodes=1,
        local_addr="127.0.0.1",
        node_id="n0",
        keep_alive_interval=1,
        keep_alive_max_attempt=2,
        last_call_timeout=8,
    )
    handler = create_handler(params)
    handler.next_rendezvous()
    handler._stop_beating()
    return handler


def _train(ckpt: Path, server: RedisServer, keys: RunKeys) -> dict[str, Any]:
    """Rank 0 of a gloo world of one: 4 steps, checkpoints at 2 and 4; returns what a
    restore must give back."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    os.environ[ENV_NODE] = "n0"
    try:
        session = TrainSession(
            ckpt,
            every_steps=2,
            keep=1,
            async_periodic=False,
            redis_url=server.endpoint,
            run_id=keys.run_id,
            install_signal_handlers=False,
            tracking=False,
            report_interval=0.05,
            poll_interval=0.05,
        )
    finally:
        del os.environ[ENV_NODE]
    state, model, opt, sched = make_state(
        1234, lr=0.01, step_size=1, gamma=0.5, batch=GlobalBatch(8, 2, 1, 0), note="golden"
    )
    assert session.restore(state) == 0
    for step in range(1, 5):
        loss = model(torch.ones(2, 4)).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        time.sleep(0.06)
        session.step(step, state, loss=round(loss.item(), 6))
    session.finish(4, state)
    time.sleep(0.2)
    session.close()
    dist.destroy_process_group()
    expected = {
        "step": 4,
        "model": {k: v.tolist() for k, v in model.state_dict().items()},
        "optim": {
            str(k): {n: (t.tolist() if torch.is_tensor(t) else t) for n, t in s.items()}
            for k, s in opt.state_dict()["state"].items()
        },
        "sched": sched.state_dict(),
        "batch": asdict(state["extra"]["batch"]),
        # The generators as saved: the next draws after a restore.
        "torch_rand": torch.rand(4).tolist(),
        "python_random": random.random(),
    }
    np = sys.modules.get("numpy")
    if np is not None:
        expected["numpy_rand"] = np.random.rand(2).tolist()
    return expected


def main() -> None:
    out = HERE
    with tempfile.TemporaryDirectory() as tmp, RedisServer() as server:
        tmp_path = Path(tmp)
        client = server.client()
        keys = RunKeys(RUN_ID)
        cloud = LocalProvider(LocalSettings(tmp_path / "cloud", zones={"local-a": 2}, notice_s=2))
        try:
            ctl = _controller(cloud, client, keys)
            ctl.state.set_ctl(created_at=str(CREATED_AT))
            ctl.step()
            for node in ("n0", "n1"):
                rec = NodeRecord(
                    client, keys, NodeInfo(node, "local", "local-a", "local-cpu", 0, "127.0.0.1")
                )
                rec.register("joining")
                rec.set_state("joined", "rendezvous")
            handler = _rendezvous(server, keys)
            ckpt = tmp_path / "ckpt"
            ckpt.mkdir()
            expected_ckpt = _train(ckpt, server, keys)
            ctl.step()
            handler._backend.client.close()
            now = time.time()
            state = RunState(client, keys)
            status = {
                "run_id": RUN_ID,
                **asdict(summarize(state, now)),
                "ckpt_refused": state.ckpt_refused(),
            }
            inputs = read_redis_inputs(client, keys, now)
            report = build_report(RUN_ID, inputs, start=CREATED_AT, now=now, source="redis")
            dump = dump_run(client, keys)
            events = state.events()
            raw_state = client.hget(keys.rdzv_state, "state")
            assert raw_state is not None
            rdzv = pickle.loads(raw_state)
            readers = {
                "now": now,
                "created_at": CREATED_AT,
                "status_json": status,
                "report": asdict(report),
                "rdzv_view": {
                    k.decode(): v.decode() for k, v in client.hgetall(keys.rdzv_view).items()
                },
                "rdzv_state": {
                    "round": rdzv.round,
                    "complete": rdzv.complete,
                    "closed": rdzv.closed,
                    "participants": sorted(str(n) for n in rdzv.participants),
                },
            }
        finally:
            for rec in cloud.store.all():
                if rec["state"] != "terminated":
                    cloud.preempt(rec["id"], notice=False)
            client.close()
        (out / "redis_dump.json").write_text(
            json.dumps({"run_id": RUN_ID, "keys": dump, "readers": readers}, indent=1) + "\n"
        )
        (out / "events.json").write_text(json.dumps(events, indent=1) + "\n")
        with open(out / "events.jsonl", "w") as f:
            for row in events:
                f.write(json.dumps(row) + "\n")
        target = out / "checkpoint"
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(ckpt, target, symlinks=True)
        manifest = Manifest.read(target / step_name(expected_ckpt["step"]))
        expected_ckpt["manifest"] = {
            "step": manifest.step,
            "world_size": manifest.world_size,
            "round": manifest.round,
            "kind": manifest.kind,
            "request_id": manifest.request_id,
            "epoch": manifest.epoch,
            "extra": manifest.extra,
            "files": sorted(manifest.files),
        }
        (out / "checkpoint_expected.json").write_text(json.dumps(expected_ckpt, indent=1) + "\n")


if __name__ == "__main__":
    main()

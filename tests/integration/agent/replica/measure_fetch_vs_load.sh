#!/bin/bash
# Live state fetch vs disk load of the same state (model and momentum, 2 x 16.8M floats,
# 134 MB), step time with 1 and 2 replicas and the synchronous quorum's wait per step:
# replica-0 trains, replica-1 joins and heals from it, both are killed, replica-2 restores
# from the last checkpoint. Prints key=value lines. Run from anywhere; needs port 29777..83.
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); W=$(mktemp -d); mkdir "$W/ckpt"; cd "$W"; V=$ROOT/.venv/bin; EX=$ROOT/examples/replica_train.py
trap 'rm -rf "$W"' EXIT
$V/torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:29777 --heartbeat_timeout_ms 1000 --join_timeout_ms 200 > lh.log 2>&1 & LH=$!
run() { SPOTTRAIN_REPLICA_ID=$1 SPOTTRAIN_LIGHTHOUSE=127.0.0.1:29777 MASTER_ADDR=127.0.0.1 MASTER_PORT=$2 RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 RUST_LOG=warn \
  $V/python $EX --steps 100000 --dim 1024 --hidden 8192 --every-steps 10 --ckpt-dir ckpt --progress $1.jsonl > $1.log 2>&1 & }
run replica-0 29781; A=$!
until grep -q '"step": 12,' replica-0.jsonl 2>/dev/null; do sleep 0.5; done
run replica-1 29782; B=$!
until grep -q healed replica-1.jsonl 2>/dev/null; do sleep 0.5; done
until [ "$(grep -c '"committed": true' replica-1.jsonl)" -ge 5 ]; do sleep 0.5; done
kill -9 $A $B; sleep 1
run replica-2 29783; C=$!
until grep -q '"committed": true' replica-2.jsonl 2>/dev/null; do sleep 0.5; done
kill -9 $C $LH
python3 - <<'P'
import json
def rows(n): return [json.loads(l) for l in open(f"{n}.jsonl")]
a=[r for r in rows("replica-0") if "event" not in r and r["committed"]]
solo=[r for r in a if r["participants"]==1]; duo=[r for r in a if r["participants"]==2]
gap=lambda rs: sorted(b["t"]-x["t"] for x,b in zip(rs,rs[1:]) if b["step"]==x["step"]+1)
print("step_s_1_replica=%.3f" % gap(solo)[len(gap(solo))//2])
print("step_s_2_replicas=%.3f" % gap(duo)[len(gap(duo))//2])
qw=sorted(r["quorum_wait_s"] for r in duo); print("quorum_wait_s_median=%.4f" % qw[len(qw)//2])
h=[r for r in rows("replica-1") if r.get("event")=="healed"][0]
s=[r for r in rows("replica-2") if r.get("event")=="start"][0]
print("state_bytes=%d fetch_s(heal quorum incl.)=%.3f load_s=%.3f" % (s["state_bytes"], h["heal_s"], s["restore_s"]))
P

"""Rank 0's request channel to the run's Redis: checkpoint requests in, progress, restores,
commits and refusals out, and the fencing question. Redis being away never stops training."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from typing import Any

from spottrain.protocol import events
from spottrain.protocol.env import ENV_NODE
from spottrain.protocol.keys import RunKeys

from ..checkpoint import dcp_io

log = logging.getLogger("spottrain.sdk")

# Seconds between the progress events rank 0 adds to the run's event stream.
PROGRESS_EVENT_S = 60.0


class RequestChannel:
    """Rank 0's link to Redis: polls checkpoint requests, reports progress and commits,
    and answers the fencing question. Redis being away never stops training."""

    def __init__(self, url: str | None, run_id: str | None, interval: float, active: bool) -> None:
        self.client: Any = None
        self.keys: RunKeys | None = None
        self._lock = threading.Lock()
        self._requests: dict[str, dict[str, Any]] = {}
        self._progress: dict[str, Any] | None = None
        self._event_world: Any = None
        self._event_at = float("-inf")
        self.stop_event = threading.Event()
        self._warned = False
        if url and run_id:
            from spottrain.redis_conn import connect, settings_from_url

            self.client = connect(settings_from_url(url, socket_timeout=2.0), retries=1)
            self.keys = RunKeys(run_id)
        self._thread: threading.Thread | None = None
        if active and self.client is not None:
            self._thread = threading.Thread(
                target=self._run, args=(interval,), name="spottrain-requests", daemon=True
            )
            self._thread.start()

    def _run(self, interval: float) -> None:
        assert self.keys is not None
        while not self.stop_event.wait(interval):
            try:
                raw = self.client.hgetall(self.keys.ckpt_requests)
                reqs = {}
                for node, body in raw.items():
                    with contextlib.suppress(ValueError, TypeError):
                        reqs[node.decode()] = json.loads(body)
                with self._lock:
                    self._requests = reqs
                    progress, self._progress = self._progress, None
                if progress is not None:
                    pipe = self.client.pipeline(transaction=False)
                    pipe.hset(self.keys.progress, mapping=progress)
                    if self._progress_event_due(progress):
                        # The hash keeps only the newest step; this keeps a thinned history
                        # in the stream for `spottrain report`'s step-rate timeline.
                        row = {k: str(progress[k]) for k in ("step", "world_size", "round")}
                        if "loss" in progress:
                            row["loss"] = str(progress["loss"])
                        node = os.environ.get(ENV_NODE, "")
                        entry = events.envelope("progress", node, at=progress["at"], **row)
                        events.append(pipe, self.keys.events, entry)
                    pipe.execute()
                self._warned = False
            except Exception as exc:
                if not self._warned:
                    log.warning("cannot reach Redis for checkpoint requests: %s", exc)
                    self._warned = True

    def pending(self, served: int, served_at: float) -> tuple[int, bool] | None:
        """(newest unserved request id, whether any of them drains), or None. A request is
        served when a checkpoint named it (``served``) or when a drain checkpoint was
        committed after it was made (``served_at``)."""
        if not self._requests:  # read without the lock: a stale answer only delays a step
            return None
        now = time.time()
        with self._lock:
            live = [
                r
                for r in self._requests.values()
                if int(r.get("id", 0)) > served
                and float(r.get("at", 0)) > served_at
                and (r.get("deadline") is None or float(r["deadline"]) > now - 5)
            ]
        if not live:
            return None
        return max(int(r["id"]) for r in live), any(bool(r.get("drain")) for r in live)

    def newest_id(self) -> int:
        with self._lock:
            return max((int(r.get("id", 0)) for r in self._requests.values()), default=0)

    def _progress_event_due(self, progress: dict[str, Any]) -> bool:
        """At most one progress event a minute, and one whenever the world size changes
        (about 1,440 a day, far under the stream's cap)."""
        world, at = progress.get("world_size"), float(progress.get("at", 0.0))
        if world != self._event_world or at - self._event_at >= PROGRESS_EVENT_S:
            self._event_world, self._event_at = world, at
            return True
        return False

    def report_progress(
        self, step: int, world: int, round_: int, metrics: dict[str, float]
    ) -> None:
        with self._lock:
            self._progress = {
                "step": step,
                "world_size": world,
                "round": round_,
                "at": time.time(),
                **{k: float(v) for k, v in metrics.items()},
            }

    def report_finished(self, step: int) -> None:
        """Tell the controller that training is over (its final state is committed)."""
        if self.client is None or self.keys is None:
            return
        try:
            self.client.hset(self.keys.progress, mapping={"finished": "1", "final_step": str(step)})
        except Exception as exc:
            log.warning("end of training not reported to Redis: %s", exc)

    def report_restore(self, step: int, world: int, round_: int) -> None:
        """Record a restart of the job's workers: the step restored and the highest step the
        job had reported before (the controller counts lost steps and crash loops by it)."""
        if self.client is None or self.keys is None:
            return
        try:
            reached = max(int(float(self.client.hget(self.keys.progress, "step") or 0)), step)
            pipe = self.client.pipeline(transaction=False)
            entry = events.envelope(
                "restored",
                os.environ.get(ENV_NODE, ""),
                at=time.time(),
                step=str(step),
                reached=str(reached),
                world_size=str(world),
                round=str(round_),
            )
            events.append(pipe, self.keys.events, entry)
            pipe.rpush(self.keys.restores, json.dumps({"step": step, "reached": reached}))
            pipe.execute()
        except Exception as exc:
            log.warning("restore not reported to Redis: %s", exc)

    def report_commit(
        self, result: dcp_io.SaveResult, kind: str, drain: bool, request_id: int
    ) -> None:
        if self.client is None or self.keys is None or result.manifest is None:
            return
        record = {
            "node": os.environ.get(ENV_NODE, ""),
            "step": result.step,
            "round": result.manifest.round,
            "kind": kind,
            "drain": int(drain),
            "request_id": request_id,
            "path": str(result.path),
            "bytes": result.manifest.total_bytes,
            "write_s": round(result.write_s, 4),
            "at": time.time(),
        }
        with self._lock:
            progress, self._progress = self._progress, None
        try:
            pipe = self.client.pipeline(transaction=False)
            if progress is not None:
                # A drained rank 0 exits right after this: its last step reaches the run
                # with the commit, not at a poll it will never make.
                pipe.hset(self.keys.progress, mapping=progress)
            pipe.hset(self.keys.ckpt_last, mapping=record)
            events.append(
                pipe, self.keys.events, events.record_event("checkpoint-committed", record)
            )
            pipe.execute()
        except Exception as exc:
            log.warning("checkpoint committed but not reported to Redis: %s", exc)

    def report_refused(
        self,
        result: dcp_io.SaveResult,
        kind: str,
        drain: bool,
        request_id: int,
        round_: int,
        epoch: int,
    ) -> None:
        """Make a refused commit loud: an event in the run's stream and a count with the
        newest refusal in ``ckpt:refused`` (read by ``spottrain status`` and the agents)."""
        if self.client is None or self.keys is None:
            return
        record = {
            "node": os.environ.get(ENV_NODE, ""),
            "step": str(result.step),
            "kind": kind,
            "drain": str(int(drain)),
            "request_id": str(request_id),
            "round": str(round_),
            "epoch": str(epoch),
            "reason": result.refused or "",
            "at": f"{time.time():.3f}",
        }
        try:
            pipe = self.client.pipeline(transaction=True)
            pipe.hincrby(self.keys.ckpt_refused, "count", 1)
            pipe.hset(self.keys.ckpt_refused, mapping=record)
            events.append(pipe, self.keys.events, events.record_event("checkpoint-refused", record))
            pipe.execute()
        except Exception as exc:
            log.warning("refused checkpoint not reported to Redis: %s", exc)

    def fence(self, round_: int) -> str | None:
        """Why a commit from ``round_`` must be refused, or None. Redis unreachable, or
        without the view (lost data, expired keys, another run id): allow; the checkpoint
        directory's fencing epoch still applies. A view's round only ever grows within one
        Redis state, so a higher one there means a newer round of this very state trains."""
        if self.client is None or self.keys is None:
            return None
        try:
            raw = self.client.hget(self.keys.rdzv_view, "round")
            newest = int(raw) if raw is not None else None
        except Exception as exc:
            log.warning("cannot check the rendezvous round in Redis (%s): committing", exc)
            return None
        if newest is not None and newest > round_:
            return f"rendezvous round {newest} is training now"
        return None

    def stop(self) -> None:
        self.stop_event.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

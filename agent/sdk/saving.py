"""One synchronous checkpoint write of an elastic session, and what follows it: the
bookkeeping of requests served, the refusal or commit reported, the commit tracked."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from spottrain.protocol.env import ENV_RUN_ID
from spottrain.tracking import Tracker

from ..checkpoint import dcp_io
from .signals import EXIT_TRACKING_S, exit_clean
from .tracking import track_commit

if TYPE_CHECKING:
    from .session import TrainSession

log = logging.getLogger("spottrain.sdk")


def write(
    session: TrainSession,
    state: dict[str, Any],
    step: int,
    kind: str,
    request_id: int,
    drain: bool,
    group: Any,
    t0: float,
) -> bool:
    """Write ``state`` as checkpoint ``step`` on ``group`` (the method ``_write`` of
    :class:`TrainSession`); whether it committed."""
    try:
        result = dcp_io.save(
            state,
            session.ckdir,
            step=step,
            round_=session.round,
            kind=kind,
            request_id=request_id,
            extra={"node": session.node, "drain": drain},
            group=group,
            fence=session._requests.fence,
            thread_count=session.thread_count,
            keep=session.keep,
            epoch=session.epoch,
        )
    except dcp_io.CheckpointWriteError as exc:
        log.error("%s checkpoint at step %d failed: %s", kind, step, exc)
        if session._last_save_step == step:
            session._last_save_step = -1  # so that finish() tries this step again
        return False
    session.saves.append(result)
    session._served_request = max(session._served_request, request_id)
    if drain and result.manifest is not None:
        session._served_at = result.manifest.created_at
    if result.refused is not None and session.rank == 0:
        session._requests.report_refused(
            result, kind, drain, request_id, session.round, session.epoch
        )
    if result.committed and session.rank == 0:
        log.warning(
            "%s checkpoint step %d committed in %.2f s (%s)",
            kind,
            step,
            time.monotonic() - t0,
            result.path,
        )
        session._requests.report_commit(result, kind, drain, request_id)
        track_commit(session._tracker, result, kind, drain, session.run_id, session.node)
    return result.committed


def use_cuda_device(device: int | None) -> None:
    if device is not None:
        torch.cuda.set_device(device)


def generation(round_: int, node: str) -> str:
    """A name for this session's generation of writers, unique to it: a rendezvous round
    may repeat (a new rendezvous state starts again at 0), so the round only describes it."""
    run = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get(ENV_RUN_ID) or "-"
    return f"run {run} round {round_} node {node} pid {os.getpid()} {uuid.uuid4().hex[:12]}"


def average(params: list[torch.nn.Parameter], extra: list[torch.Tensor], world: int) -> bool:
    """Average the gradients of ``params`` (a missing one counts as zeros; DTensors, an
    FSDP2 model's, are left alone) and ``extra`` over the default group's ``world`` ranks,
    in place, in one all-reduce; True."""
    tensors = list(extra)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if not isinstance(p.grad, DTensor):  # FSDP2's reduce-scatter averaged it already
            tensors.append(p.grad)
    if world <= 1 or not tensors:
        return True
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return True


def after_drain_save(session: TrainSession, step: int, committed: bool) -> None:
    """After an emergency save for a drain (``_after_drain_save`` of :class:`TrainSession`):
    exit if this rank got SIGTERM, else hold until torchrun restarts it (or give up)."""
    hold_or_exit(
        step,
        committed,
        sigterm=lambda: session._sigterm,
        holding=session._holding,
        tracker=session._tracker,
        hold_timeout=session.hold_timeout,
    )
    session._served_request = max(session._served_request, session._requests.newest_id())


def hold_or_exit(
    step: int,
    committed: bool,
    *,
    sigterm: Callable[[], bool],
    holding: threading.Event,
    tracker: Tracker,
    hold_timeout: float,
) -> None:
    """After an emergency save for a drain, of any worker (the SDK's or a framework
    integration's): exit 0 if this rank got SIGTERM (1 if the save did not commit), else
    hold until torchrun restarts it (a SIGTERM then, caught by :class:`~.signals.SignalWatch`
    while ``holding`` is set, exits 0). Returns only when ``hold_timeout`` passed without
    one: the caller trains on (and counts the pending requests as served)."""
    if sigterm():
        if committed:
            exit_clean(f"stopping after the emergency checkpoint at step {step}", tracker)
        log.error(
            "the emergency checkpoint at step %d did not commit: stopping anyway; the "
            "steps since the newest committed checkpoint are lost",
            step,
        )
        exit_clean("stopping without an emergency checkpoint", tracker, code=1)
    holding.set()
    tracker.flush(EXIT_TRACKING_S)  # its artifact, before a SIGTERM ends us
    log.warning(
        "holding after the emergency checkpoint at step %d until torchrun restarts this "
        "worker (at most %.0f s)",
        step,
        hold_timeout,
    )
    deadline = time.monotonic() + hold_timeout
    while time.monotonic() < deadline:
        if sigterm():
            exit_clean(f"stopped while holding at step {step}", tracker)
        time.sleep(0.05)
    holding.clear()
    log.warning("no restart came within %.0f s: training on", hold_timeout)

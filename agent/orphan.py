"""The agent's dead man's switch: a VM whose controller is gone, and whose training has
stopped, ends itself instead of running on, billed, with nobody to end it.

Two pieces of evidence, both needed, each for ``timeout_s``:

* **no controller**: the controller stamps a heartbeat key in Redis every pass
  (:attr:`spottrain.protocol.keys.RunKeys.ctl_alive`); the watch counts only the time over which
  Redis answered and the key was absent. A Redis that does not answer says nothing about the
  controller, so an outage never adds to that time (training goes on through a Redis outage
  by design, and an outage alone must never make the fleet end itself);
* **no training**, read on the node itself (Redis is not asked):

  - a script that uses the SDK: its workers write their newest step to a file on the node
    (:mod:`spottrain.agent.local_progress`); once a step was seen, a step that has not
    changed for ``timeout_s`` is a stalled node;
  - before any step (a script without the SDK never writes one, one with it is still
    starting): the workers (torchrun's process tree) count as training while they are alive
    and used, over the last ``timeout_s``, at least :data:`MIN_TRAINING_CORES` of one core
    on average. A training loop keeps a core busy (a GPU job's Python thread launches
    kernels and waits on them; a CPU job computes); a loop that is hung, waiting for data
    that never comes, or gone does not.

When both hold, the agent drains through its usual path (an emergency checkpoint, leave),
then ends its VM (:func:`end_this_vm`): through its cloud's API first (AWS: terminated, GCP:
deleted, with the VM's own identity; :mod:`spottrain.cloud.this_vm`), else by powering it
off.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from spottrain.cloud.this_vm import ThisVm, ThisVmError, this_vm
from spottrain.protocol.keys import RunKeys

from .local_progress import read_step

log = logging.getLogger(__name__)

# The least CPU, in cores averaged over the orphan timeout, that a node's workers must use to
# count as training when they report no step: far below any training loop's, far above what
# an idle or hung Python process burns (its background threads wake a few times a second).
MIN_TRAINING_CORES = 0.05


@dataclass
class OrphanView:
    """What the watch has seen so far (monotonic seconds).

    Attributes:
        cpu: (when, the workers' CPU seconds counted since the watch began), oldest first;
            only the last timeout's worth and one sample before it are kept.
        cpu_root: the process tree (torchrun's pid) the last reading was of.
        cpu_high: that tree's highest reading of CPU seconds.
    """

    started_at: float
    controller_absent_s: float = 0.0
    step: int | None = None
    step_changed_at: float | None = None
    cpu: list[tuple[float, float]] = field(default_factory=list)
    cpu_root: int | None = None
    cpu_high: float = 0.0


def note_step(view: OrphanView, now: float, step: int | None) -> None:
    """Fold one reading of the progress file into ``view`` (None: no step in it)."""
    if step is not None and step != view.step:
        view.step, view.step_changed_at = step, now


def note_cpu(
    view: OrphanView, now: float, reading: tuple[int, float] | None, keep_s: float
) -> None:
    """Fold one reading of the workers' CPU into ``view``: (torchrun's pid, the CPU seconds
    its process tree used so far), None when no worker is alive.

    A tree not seen before (torchrun launched or relaunched) used all of its time since the
    previous look. Within one tree only what rises above its highest reading counts: a
    reading that dips (a process reaped between two reads of /proc) adds nothing, nor does
    its recovery. Samples older than ``keep_s`` go, but for the newest of them, which starts
    the window :func:`not_training` measures.
    """
    used = 0.0
    if reading is None:
        view.cpu_root, view.cpu_high = None, 0.0  # a later tree is new, whatever its pid
    else:
        root, seconds = reading
        high = view.cpu_high if view.cpu_root == root else 0.0
        used = max(0.0, seconds - high)
        view.cpu_root, view.cpu_high = root, max(high, seconds)
    total = (view.cpu[-1][1] if view.cpu else 0.0) + used
    view.cpu.append((now, total))
    while len(view.cpu) > 1 and view.cpu[1][0] <= now - keep_s:
        view.cpu.pop(0)


def not_training(
    view: OrphanView, now: float, timeout_s: float, min_cores: float = MIN_TRAINING_CORES
) -> str | None:
    """Why this node shows no training over the last ``timeout_s``, or None when it trains.

    Once the workers reported a step, only steps count; before (or without the SDK), the
    workers' CPU: less than ``min_cores`` on average over the window is no training. Pure.
    """
    if view.step is not None:
        stalled = now - (view.step_changed_at if view.step_changed_at is not None else now)
        if stalled < timeout_s:
            return None
        return f"no training step on this node for {stalled:.0f} s (step {view.step})"
    if now - view.started_at < timeout_s:
        return None  # not watched for a whole window yet
    start = now - timeout_s
    base = next((s for s in reversed(view.cpu) if s[0] <= start), None)
    if base is None:
        base = view.cpu[0] if view.cpu else (now, 0.0)
    last = view.cpu[-1] if view.cpu else base
    span = last[0] - base[0]
    used = last[1] - base[1]
    if span > 0 and used >= min_cores * span:
        return None
    return (
        f"no training on this node for {timeout_s:g} s: no step reported (the SDK's) and its "
        f"workers used {used:.1f} CPU s in {span:.0f} s (training needs {min_cores:g} of a "
        "core)"
    )


def orphaned(
    view: OrphanView, now: float, timeout_s: float, min_cores: float = MIN_TRAINING_CORES
) -> str | None:
    """Whether this VM should end itself, and why (None: it should not).

    Pure: the clock comes in as ``now``.
    """
    if timeout_s <= 0 or view.controller_absent_s < timeout_s:
        return None
    idle = not_training(view, now, timeout_s, min_cores)
    if idle is None:
        return None
    return (
        f"no controller heartbeat for {view.controller_absent_s:.0f} s and {idle} "
        f"(orphan timeout {timeout_s:g} s)"
    )


class OrphanWatch:
    """Looks every ``interval_s`` and calls ``on_orphaned(reason)`` once, when :func:`orphaned`
    says so.

    Args:
        client: the run's Redis.
        keys: the run's keys.
        progress_path: the file this node's workers write their step to.
        timeout_s: the orphan timeout (> 0).
        on_orphaned: what to do (drain, then end the VM).
        workers_cpu: torchrun's pid and the CPU seconds its process tree has used so far
            (:func:`spottrain.agent.local_progress.tree_cpu_s`), None when it is not alive.
        min_cores: see :func:`not_training`.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        progress_path: str,
        timeout_s: float,
        on_orphaned: Callable[[str], None],
        *,
        workers_cpu: Callable[[], tuple[int, float] | None] | None = None,
        min_cores: float = MIN_TRAINING_CORES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"orphan timeout {timeout_s:g} s: give seconds > 0 (0 turns it off)")
        self.client = client
        self.keys = keys
        self.progress_path = progress_path
        self.timeout_s = timeout_s
        self.interval_s = max(0.2, min(5.0, timeout_s / 5))
        self.on_orphaned = on_orphaned
        self.workers_cpu = workers_cpu
        self.min_cores = min_cores
        self.clock = clock
        self.view = OrphanView(started_at=clock())
        self._answered_at: float | None = None  # the last look at which Redis answered
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spottrain-orphan", daemon=True)

    def look(self, now: float | None = None) -> str | None:
        """One look at the evidence; returns the reason to end the VM, if any."""
        now = self.clock() if now is None else now
        note_step(self.view, now, read_step(self.progress_path))
        cpu = self.workers_cpu() if self.workers_cpu is not None else None
        note_cpu(self.view, now, cpu, keep_s=self.timeout_s)
        try:
            present = bool(self.client.exists(self.keys.ctl_alive))
        except redis.RedisError:
            self._answered_at = None  # the time Redis was away counts for nothing
        else:
            if present:
                self.view.controller_absent_s = 0.0
            elif self._answered_at is not None:
                self.view.controller_absent_s += max(0.0, now - self._answered_at)
            self._answered_at = now
        return orphaned(self.view, now, self.timeout_s, self.min_cores)

    def start(self) -> OrphanWatch:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                reason = self.look()
            except Exception as exc:  # the switch must never take the agent down
                log.warning("orphan watch: %s", exc)
                continue
            if reason:
                self.on_orphaned(reason)
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=3)


@dataclass(frozen=True)
class VmEnding:
    """How :func:`end_this_vm` went.

    Attributes:
        how: what ended the VM, one line (empty: nothing did).
        problems: what failed on the way (a refused API call before the power-off, ...).
    """

    how: str
    problems: tuple[str, ...] = ()


def end_this_vm(
    cloud: str,
    command: str = "",
    *,
    vm: ThisVm | None = None,
    metadata_endpoint: str | None = None,
    request_file: str = "",
) -> VmEnding:
    """End this VM, for good where its cloud allows.

    1. Its cloud's API, with the VM's own identity (``vm``, default
       :func:`spottrain.cloud.this_vm.this_vm`): AWS terminates it, GCP deletes it (its
       auto-delete disks with it), the local cloud's VM process is signalled (SIGUSR2). This
       works from inside a container too.
    2. If that failed, the power-off: ``command`` (``--self-terminate-cmd``) or ``shutdown -h
       now``. An AWS VM is launched with ``InstanceInitiatedShutdownBehavior=terminate``, so
       it terminates; a GCP VM stops (its disks stay billed). On the local cloud, ``command``
       replaces step 1 instead, and without one there is no step 2. In a container
       (``request_file``, an image job's) the agent cannot power the host off: it creates
       ``request_file``, which a path unit of the host watches, and the host powers off.
    """
    problems: list[str] = []
    if not (cloud == "local" and command):
        try:
            return VmEnding((vm or this_vm(cloud, metadata_endpoint=metadata_endpoint)).end())
        except ThisVmError as exc:
            problems.append(str(exc))
        except Exception as exc:  # a bug must not keep the power-off from running
            problems.append(f"ending this {cloud} VM through its API: {type(exc).__name__}: {exc}")
        if cloud == "local":
            return VmEnding("", tuple(problems))
    if request_file and not command:
        try:
            fd = os.open(request_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.close(fd)
        except OSError as exc:
            why = f"asking the host to power off ({request_file}): {exc}"
            return VmEnding("", (*problems, why))
        return VmEnding(f"power-off: asked the host ({request_file})", tuple(problems))
    argv = shlex.split(command) if command else ["shutdown", "-h", "now"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return VmEnding("", (*problems, f"{shlex.join(argv)}: {exc}"))
    if done.returncode != 0:
        err = (done.stderr or "").strip()[-500:]
        return VmEnding("", (*problems, f"{shlex.join(argv)} exited {done.returncode}: {err}"))
    return VmEnding(f"power-off: {shlex.join(argv)}", tuple(problems))

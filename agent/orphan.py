"""The agent's dead man's switch: a VM whose controller is gone, and whose training has
stopped, ends itself instead of running on, billed, with nobody to end it.

Two pieces of evidence, both needed, each for ``timeout_s``:

* **no controller**: the controller stamps a heartbeat key in Redis every pass
  (:attr:`spottrain.protocol.keys.RunKeys.ctl_alive`); the watch counts only the time over which
  Redis answered and the key was absent. A Redis that does not answer says nothing about the
  controller, so an outage never adds to that time (training goes on through a Redis outage
  by design, and an outage alone must never make the fleet end itself);
* **no training**: the node's own workers write their newest step to a file on the node
  (:mod:`spottrain.agent.local_progress`); a step that has not changed for ``timeout_s`` (or
  never came) is a stalled node. Redis is not asked.

When both hold, the agent drains through its usual path (an emergency checkpoint, leave),
then powers its VM off (:func:`end_this_vm`).
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from spottrain.protocol.env import ENV_LOCAL_VM_PID
from spottrain.protocol.keys import RunKeys

from .local_progress import read_step

log = logging.getLogger(__name__)

# The local cloud's VM process, which a VM's agent signals to end its own VM (SIGUSR2: a
# shutdown from inside, as `shutdown -h now` is on a real VM).


@dataclass
class OrphanView:
    """What the watch has seen so far (monotonic seconds)."""

    started_at: float
    controller_absent_s: float = 0.0
    step: int | None = None
    step_changed_at: float | None = None

    @property
    def last_progress_at(self) -> float:
        return self.step_changed_at if self.step_changed_at is not None else self.started_at


def orphaned(view: OrphanView, now: float, timeout_s: float) -> str | None:
    """Whether this VM should end itself, and why (None: it should not).

    Pure: the clock comes in as ``now``.
    """
    if timeout_s <= 0:
        return None
    stalled = now - view.last_progress_at
    if view.controller_absent_s < timeout_s or stalled < timeout_s:
        return None
    step = f"step {view.step}" if view.step is not None else "no step yet"
    return (
        f"no controller heartbeat for {view.controller_absent_s:.0f} s and no training step on "
        f"this node for {stalled:.0f} s ({step}; orphan timeout {timeout_s:g} s)"
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
        self.clock = clock
        self.view = OrphanView(started_at=clock())
        self._answered_at: float | None = None  # the last look at which Redis answered
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spottrain-orphan", daemon=True)

    def look(self, now: float | None = None) -> str | None:
        """One look at the evidence; returns the reason to end the VM, if any."""
        now = self.clock() if now is None else now
        step = read_step(self.progress_path)
        if step is not None and step != self.view.step:
            self.view.step, self.view.step_changed_at = step, now
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
        return orphaned(self.view, now, self.timeout_s)

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


def end_this_vm(cloud: str, command: str = "") -> str | None:
    """Power this VM off, the way its cloud ends it; returns what went wrong, or None.

    ``command`` (``--self-terminate-cmd``) replaces the default: on AWS and GCP
    ``shutdown -h now`` (AWS VMs are launched with ``InstanceInitiatedShutdownBehavior=
    terminate``, so a shutdown terminates them; a GCP VM stops, and is no longer billed for
    its machine, only its disks); on the local cloud a SIGUSR2 to the VM's process, which
    ends the VM as a shutdown does.
    """
    if not command and cloud == "local":
        pid = os.environ.get(ENV_LOCAL_VM_PID, "")
        if not pid.isdigit():
            return f"no local VM to end: ${ENV_LOCAL_VM_PID} is not set"
        try:
            os.kill(int(pid), signal.SIGUSR2)
        except OSError as exc:
            return f"cannot signal the local VM (pid {pid}): {exc}"
        return None
    argv = shlex.split(command) if command else ["shutdown", "-h", "now"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{shlex.join(argv)}: {exc}"
    if done.returncode != 0:
        return f"{shlex.join(argv)} exited {done.returncode}: {(done.stderr or '').strip()[-500:]}"
    return None

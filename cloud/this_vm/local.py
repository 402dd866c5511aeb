"""This local-cloud VM: the process that plays it ends as a VM shut down from inside does,
on SIGUSR2 (:mod:`spottrain.cloud.local.vm`); its pid reaches the agent in
``$SPOTTRAIN_LOCAL_VM_PID``."""

from __future__ import annotations

import os
import signal

from spottrain.protocol.env import ENV_LOCAL_VM_PID

from . import ThisVmError


class LocalThisVm:
    """This local-cloud VM (its pid from ``$SPOTTRAIN_LOCAL_VM_PID``, else ``pid``)."""

    def __init__(self, pid: str | None = None) -> None:
        self.pid = pid if pid is not None else os.environ.get(ENV_LOCAL_VM_PID, "")

    def end(self) -> str:
        """Signal the VM's process (SIGUSR2).

        Raises:
            ThisVmError: no VM process named, or it cannot be signalled.
        """
        if not self.pid.isdigit():
            raise ThisVmError(
                f"no local VM to end: ${ENV_LOCAL_VM_PID} is not set (the local cloud's VM "
                "process sets it for its agent)"
            )
        try:
            os.kill(int(self.pid), signal.SIGUSR2)
        except OSError as exc:
            raise ThisVmError(f"cannot signal the local VM (pid {self.pid}): {exc}") from None
        return f"SIGUSR2 to the local VM's process {self.pid}"

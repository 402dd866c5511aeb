"""The cross-replica process group: torchft's reconfigurable gloo (CPU) or NCCL (GPU) group,
with a store prefix unique to the quorum's members and an abort the watchdog can call."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Any

from torchft.process_group import ProcessGroupBabyNCCL, ProcessGroupGloo

from .quorum import RecordingClient, salted_store

log = logging.getLogger("spottrain.replica")


# Groups set aside (see _Salted.retire) kept alive this many reconfigurations: by then the
# collective that hung in one has failed (its peer died) or timed out.
_KEEP_RETIRED = 8


class _Salted:
    """Mixin: configure under a members-unique store prefix; retire a group on demand."""

    recorder: RecordingClient | None = None
    _abort_lock: threading.Lock
    _retired: list[Any]
    _pg: Any

    def configure(self, store_addr: str, *args: Any, **kwargs: Any) -> None:
        recorder = self.recorder
        view = recorder.last if recorder is not None else None
        with self._abort_lock:
            self.retire()
            salt = view.salt if view is not None else "none"
            super().configure(salted_store(store_addr, salt), *args, **kwargs)  # type: ignore[misc]
        if recorder is not None and view is not None:
            recorder.configured_digest = view.digest

    def retire(self) -> None:
        """Set the current group aside without destroying it: gloo's destructor waits for
        a collective hung on a frozen peer (up to the collective timeout), and its abort
        does not interrupt one; the next configure builds a fresh group."""
        if self._pg is not None:
            self._retired.append(self._pg)
            del self._retired[:-_KEEP_RETIRED]
            self._pg = None

    def abort_now(self) -> None:
        """From the watchdog: stop using the group (the next quorum builds a new one)."""
        with self._abort_lock:
            self.retire()


class CpuReplicaGroup(_Salted, ProcessGroupGloo):  # type: ignore[misc]
    def __init__(self, timeout: timedelta) -> None:
        super().__init__(timeout=timeout)
        self._abort_lock = threading.Lock()
        self._retired = []


class GpuReplicaGroup(_Salted, ProcessGroupBabyNCCL):  # type: ignore[misc]
    """NCCL in a subprocess of its own (torchft's "baby" group): a peer that dies cannot hang
    this process, and abort kills the subprocess. Untested here (no GPU on the dev box)."""

    def __init__(self, timeout: timedelta) -> None:
        super().__init__(timeout=timeout)
        self._abort_lock = threading.Lock()
        self._retired = []

    def retire(self) -> None:
        pass  # its configure shuts the old subprocess down itself

    def abort_now(self) -> None:
        # The baby group's abort is a no-op; shutting it down kills its NCCL subprocess,
        # which fails every pending operation (configure starts a new one).
        with self._abort_lock:
            self.shutdown()


def make_group(device: str, timeout: timedelta) -> CpuReplicaGroup | GpuReplicaGroup:
    if device == "cuda":
        return GpuReplicaGroup(timeout)
    return CpuReplicaGroup(timeout)

"""The secret values this VM knows, to keep out of what the agent ships or reports.

A worker can print any of them (an ``env`` dump, a crash reporter's environment, a traceback
of a connection string): the Redis password (the agent's password file, or
``$SPOTTRAIN_REDIS_PASSWORD``, which the workers also get) and every value the boot read from
the cloud's secret store, noted in :data:`~spottrain.protocol.boot.REDACT_FILE`. Shipped log
chunks and the lines of a failing rank shown in ``status`` pass through :meth:`redact`.

The files are read again only when they change (one ``stat`` each per call), so a secret the
boot notes after the agent started is redacted from then on.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping

from spottrain.protocol.boot import REDACT_FILE, parse_redact_lines
from spottrain.protocol.keys import RunKeys
from spottrain.safetext import redact

from .worker_acl import worker_credentials

_Stamp = tuple[int, int, int] | None  # (inode, size, mtime_ns) of a file, None when absent


def _stamp(path: str) -> _Stamp:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


class KnownSecrets:
    """Args:
    password_file: the Redis password's file (its whole content, stripped), if any.
    redact_file: the boot's list of secret values (base64 lines).
    password_env: the variable that may hold the Redis password instead.
    environ: where ``password_env`` is read (the process's environment by default).
    run_keys: the run's keys: the workers' Redis password, derived from the run's
        (:func:`~spottrain.agent.worker_acl.worker_credentials`), is known too.
    """

    def __init__(
        self,
        *,
        password_file: str | None = None,
        redact_file: str = REDACT_FILE,
        password_env: str = "SPOTTRAIN_REDIS_PASSWORD",
        environ: Mapping[str, str] | None = None,
        run_keys: RunKeys | None = None,
    ) -> None:
        self._run_keys = run_keys
        self._redact_file = redact_file
        self._files: dict[str, Callable[[str], list[str]]] = {redact_file: parse_redact_lines}
        if password_file:
            self._files[password_file] = lambda text: [text.strip()] if text.strip() else []
        env = os.environ if environ is None else environ
        self._fixed = [v for v in (env.get(password_env, ""),) if v]
        self._lock = threading.Lock()
        self._stamps: dict[str, _Stamp] = {}
        self._values: dict[str, list[str]] = {}

    def values(self) -> list[str]:
        """Every known secret value now."""
        with self._lock:
            for path, parse in self._files.items():
                stamp = _stamp(path)
                if stamp != self._stamps.get(path, ()):
                    self._stamps[path] = stamp
                    self._values[path] = parse(_read(path)) if stamp else []
            known = [*self._fixed, *(v for vs in self._values.values() for v in vs)]
        if self._run_keys is not None:
            keys = self._run_keys
            known += [worker_credentials(keys, v).password for v in self._passwords()]
        return known

    def _passwords(self) -> list[str]:
        """The run's Redis password, from where this VM holds it."""
        with self._lock:
            files = [vs for path, vs in self._values.items() if path != self._redact_file]
        return [*self._fixed, *(v for vs in files for v in vs)]

    def redact(self, text: str) -> str:
        return redact(text, self.values())

    def redact_bytes(self, data: bytes) -> bytes:
        """``data`` with each known value (as UTF-8) replaced; other bytes untouched (they
        round-trip through :func:`~spottrain.safetext.redact` as surrogate escapes)."""
        text = data.decode("utf-8", errors="surrogateescape")
        return self.redact(text).encode("utf-8", errors="surrogateescape")

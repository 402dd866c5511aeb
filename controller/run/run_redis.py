"""A run's Redis: the embedded server's lifecycle (started, restarted, stopped with the run,
its password in the run directory) and a checked client of whichever Redis the run uses."""

from __future__ import annotations

import contextlib
import logging
import resource
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import redis

from spottrain.controller.run.embedded_redis import (
    config_on_stdin,
    find_redis_server,
    new_password_file,
)
from spottrain.controller.run.processes import (
    end_process,
    mark_process,
    read_mark,
    write_mark,
)
from spottrain.controller.run.records import RunError, RunInfo
from spottrain.ports import free_port
from spottrain.redis_conn import (
    DEFAULT_PASSWORD_ENV,
    RedisConfigError,
    RedisSettings,
    connect,
    describe_error,
    resolve_password,
    settings_from_url,
)
from spottrain.spec import JobSpec

log = logging.getLogger(__name__)

# The Redis quorum's connection budget at 12,500 replicas (100,000 GPUs, 8 per VM): per VM one
# connection blocked on its quorum answer (BLPOP) and one shared for heartbeats, leaves and
# the roster, plus the agent's own and its workers' (rendezvous, progress): about 4 per VM,
# 50,000 in all. Redis's default (10,000) holds 2,500 such VMs.
EMBEDDED_MAXCLIENTS = 50_000
# File descriptors Redis keeps for itself beyond its clients (CONFIG_MIN_RESERVED_FDS).
REDIS_RESERVED_FDS = 32


def maxclients_within_fd_limit(wanted: int = EMBEDDED_MAXCLIENTS) -> int:
    """The ``maxclients`` an unprivileged redis-server started from this process gets: Redis
    raises its open-files limit up to the hard limit it inherits and, short of
    ``wanted + 32``, lowers maxclients to fit."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, hard - REDIS_RESERVED_FDS))


# Redis clients a VM of a run takes at most (the quorum's two, the agent's and its workers').
CLIENTS_PER_VM = 4


def maxclients_note(
    got: int, wanted: int = EMBEDDED_MAXCLIENTS, vms: int | None = None
) -> str | None:
    """A line for a Redis that holds fewer clients than the quorum's budget, or None; with
    ``vms`` (the run's most VMs), only when it holds fewer than that run needs."""
    if got >= wanted or (vms is not None and got >= vms * CLIENTS_PER_VM):
        return None
    return (
        f"the run's Redis holds at most {got} clients, as this machine's open-files limit "
        f"allows: about {got // 4} VMs of a replica run (12,500 need {wanted}); raise the "
        f"hard limit (ulimit -Hn, systemd LimitNOFILE=) to {wanted + REDIS_RESERVED_FDS}"
    )


def embedded_password_file(run_dir: Path) -> Path:
    """Where a run's embedded Redis keeps its password (mode 0600): every local client (the
    controller, ``status``, ``logs``, ``down``, the local VMs' agents) reads it there."""
    return run_dir / "redis" / "password"


def _embedded_password(run_dir: Path) -> str | None:
    """The embedded Redis's password; None for a run made before it had one."""
    path = embedded_password_file(run_dir)
    if not path.exists():
        return None
    try:
        return resolve_password(None, str(path))
    except RedisConfigError as e:
        raise RunError(f"{e}: `spottrain down` the run and start it again") from None


def redis_mark_file(run_dir: Path) -> Path:
    """Where the embedded Redis's :class:`~spottrain.controller.run.processes.ProcessMark`
    is kept: only the process it names is ever signalled (never whatever ``redis.pid``
    names, a pid that may have changed hands since)."""
    return run_dir / "redis" / "process.json"


def _redis_daemon(
    data: Path, port: int | str, password: str | None, vms: int | None = None
) -> None:
    """Start a daemonized redis-server on ``port`` that keeps its data (append-only file)
    in ``data``, and wait until it answers. Only this machine can reach it (127.0.0.1,
    protected mode), and only with ``password``, which goes through its standard input,
    never its command line. It takes up to :data:`EMBEDDED_MAXCLIENTS` clients, as many as
    the open-files limit allows (a warning says when that is fewer). Its mark is recorded
    (:func:`redis_mark_file`)."""
    data.mkdir(mode=0o700, parents=True, exist_ok=True)
    head, config = config_on_stdin(password)
    args = [
        find_redis_server(), *head,
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--dir", str(data),
        # AOF everysec may lose the last second on a crash: the quorum's ids survive it, as
        # every live replica sends the id it holds (the held-id floor, spottrain.quorum).
        "--appendonly", "yes",
        "--appendfsync", "everysec",
        "--save", "",
        # Redis lowers this itself to fit the open-files limit (said once it answers).
        "--maxclients", str(EMBEDDED_MAXCLIENTS),
        "--protected-mode", "yes",
        "--daemonize", "yes",
        "--pidfile", str(data / "redis.pid"),
        "--logfile", str(data / "redis.log"),
    ]  # fmt: skip
    subprocess.run(args, input=config, check=True, capture_output=True, timeout=30)
    settings = _embedded_settings(f"redis://127.0.0.1:{port}/0", password, socket_timeout=1.0)
    deadline = time.monotonic() + 10
    while not _redis_up(settings):
        if time.monotonic() > deadline:
            raise RunError(f"the run's Redis did not start; see {data / 'redis.log'}")
        time.sleep(0.05)
    _record_redis(data)
    with contextlib.suppress(redis.RedisError, KeyError, ValueError):
        got = int(connect(settings, retries=0).config_get("maxclients")["maxclients"])
        note = maxclients_note(got, vms=vms)
        if note:
            log.warning("%s", note)


def _record_redis(data: Path) -> None:
    """Keep the mark of the redis-server that now answers (its pidfile is written before it
    listens, so it names this one; its marker: it works in ``data``)."""
    with contextlib.suppress(OSError, ValueError):
        mark = mark_process(int((data / "redis.pid").read_text()), str(data.resolve()))
        if mark is not None:
            write_mark(data / "process.json", mark)


def _embedded_settings(url: str, password: str | None, socket_timeout: float) -> RedisSettings:
    settings = settings_from_url(url, password_env=None, socket_timeout=socket_timeout)
    return replace(settings, password=password)


def start_embedded_redis(run_dir: Path, vms: int | None = None) -> str:
    """Start a redis-server for the run that outlives this process (a controller killed and
    restarted finds its state), persisted to the run directory, with a fresh password kept
    there (mode 0600). Returns its URL (which holds no password). ``vms``: the run's most
    VMs; a warning says when the machine's open-files limit leaves Redis too few clients
    for them (without it, too few for 12,500)."""
    port = free_port()
    (run_dir / "redis").mkdir(mode=0o700, parents=True, exist_ok=True)
    password = new_password_file(embedded_password_file(run_dir))
    _redis_daemon(run_dir / "redis", port, password, vms)
    return f"redis://127.0.0.1:{port}/0"


def restart_embedded_redis(info: RunInfo) -> None:
    """Start the run's embedded Redis again on its port, from its data, with its password,
    if it is down."""
    if not info.embedded_redis:
        return
    password = _embedded_password(info.dir)
    if _redis_up(_embedded_settings(info.redis_url, password, socket_timeout=1.0)):
        return
    port = info.redis_url.rsplit(":", 1)[1].split("/")[0]
    _redis_daemon(info.dir / "redis", port, password, info.spec().nodes.max)


def stop_embedded_redis(info: RunInfo) -> None:
    """Stop the run's embedded Redis: asked with its password first, then, if the very
    process recorded at its start still runs, SIGTERM (and its end awaited)."""
    with contextlib.suppress(redis.RedisError, RunError):
        settings = _embedded_settings(
            info.redis_url, _embedded_password(info.dir), socket_timeout=2.0
        )
        connect(settings, retries=0).shutdown(save=False)
    mark = read_mark(redis_mark_file(info.dir))
    if mark is not None:
        end_process(mark, kill=False)


def _redis_up(settings: RedisSettings) -> bool:
    try:
        connect(settings, retries=0).ping()
        return True
    except redis.RedisError:
        return False


def open_redis(info: RunInfo, spec: JobSpec | None = None) -> redis.Redis:
    """A client of the run's Redis, checked with a PING.

    Raises:
        RunError: unreachable or refusing (the message names the cause and the fix).
    """
    if info.embedded_redis:
        settings = _embedded_settings(info.redis_url, _embedded_password(info.dir), 5.0)
    else:
        password_env = spec.redis.password_env if spec else DEFAULT_PASSWORD_ENV
        password_file = spec.redis.password_file if spec else None
        settings = settings_from_url(
            info.redis_url, password_file=password_file, password_env=password_env
        )
    client = connect(settings, retries=0)
    try:
        client.ping()
    except redis.RedisError as e:
        raise RunError(describe_error(e, settings)) from None
    return client

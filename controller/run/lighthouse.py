"""The run's torchft lighthouse (replica mode): where it listens, its process, its keeper.

The lighthouse forms each step's quorum of replicas. It runs as torchft's own binary
(``torchft_lighthouse``, installed by the ``replica`` extra beside this Python), never
imported here. Like the embedded Redis it runs in a session of its own, with a pidfile in the
run directory, so it outlives a controller that dies: the VMs train on and need it. While a
controller drives the run, a :class:`LighthouseSupervisor` thread restarts it on the same
port the moment it exits and writes its address to Redis (``RunKeys.replica_lighthouse``);
``down`` and the end of the run stop it by its pidfile.

The stock lighthouse keeps its state in memory: a restarted one hands out quorum id 1 again.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import ipaddress
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from spottrain.controller.run.records import RunError
from spottrain.ports import free_port
from spottrain.protocol.env import ENV_LIGHTHOUSE
from spottrain.spec import FaultTolerance, JobSpec, QuorumKind

log = logging.getLogger(__name__)

LIGHTHOUSE_BINARY = "torchft_lighthouse"
INSTALL_HINT = "pip install 'spottrain[replica]'"
# torchft's default port: a fixed one, so a cloud firewall rule can name it.
REMOTE_PORT = 29510
# A replica that stops heartbeating (killed, or leaving on a notice) is out of the quorum
# after this: the survivors' stall on an unnoticed loss.
HEARTBEAT_TIMEOUT_MS = 1000
# How long a quorum whose membership changed waits for replicas that heartbeat but have not
# asked to join (a joiner still importing torch, a straggler mid-step). An unchanged quorum
# never waits (torchft's fast quorum), so this bounds only the extra stall of a change; the
# default 60 s would hold the survivors of a kill for a minute while a backfill warms up. A
# straggler left out joins the next quorum, one process-group rebuild later. A leaver on a
# notice stops heartbeating at a step boundary, so this (not the heartbeat timeout) is the
# survivors' pause when replicas remain: 0.32 s measured with 200 ms (tests/integration/agent/
# replica), about 1 s with 1000 ms.
JOIN_TIMEOUT_MS = 250
# How often it re-checks a pending quorum: expiry of a dead replica's heartbeat is noticed at
# most this late (10 % of the heartbeat timeout). Each tick walks every replica under the
# lock the quorum requests take, so ticking faster buys little and costs at scale.
QUORUM_TICK_MS = 100
# The launcher that starts the lighthouse without torch (see lighthouse_command).
LAUNCHER = str(Path(__file__).with_name("lighthouse_exec.py"))
USE_STOCK_SCRIPT = False
# A log past this size is rolled over to ``lighthouse.log.1`` at the next (re)start.
LOG_ROLL_BYTES = 64 << 20


# -- the spec ---------------------------------------------------------------------------------
def replica_mode(spec: JobSpec) -> bool:
    return spec.train.fault_tolerance is FaultTolerance.REPLICA


def uses_lighthouse(spec: JobSpec) -> bool:
    """A replica run whose quorum is torchft's lighthouse (``train.replica.quorum:
    lighthouse``): the controller runs it. The Redis quorum (the default) needs no process of
    its own: it lives in the run's Redis."""
    return replica_mode(spec) and spec.train.replica.quorum is QuorumKind.LIGHTHOUSE


def min_replicas(spec: JobSpec) -> int:
    return spec.train.replica.min_replicas


# -- where it listens ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    """``bind``: the address the lighthouse binds; ``address``: the one replicas dial."""

    bind: str
    address: str


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def choose_hosts(redis_host: str, redis_host_is_local: bool, hostname: str) -> tuple[str, str]:
    """(host to bind, host to advertise), beside the run's Redis: a loopback Redis (the local
    cloud) gets a loopback lighthouse; a Redis on this machine reached over the network gets
    the lighthouse on every interface, advertised at the Redis's own host, which the VMs
    already reach; a Redis elsewhere leaves this machine's name (Terraform's
    ENV_LIGHTHOUSE, set on the agents, wins over it)."""
    if not redis_host or is_loopback(redis_host):
        return "127.0.0.1", "127.0.0.1"
    return "0.0.0.0", redis_host if redis_host_is_local else hostname


def _can_bind(host: str, port: int = 0) -> bool:
    """Whether this machine can listen on ``host`` (at ``port``; 0: any port)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family) as s:
            s.bind((host, port))
        return True
    except OSError:
        return False


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def placement_from_env(value: str) -> Placement:
    """The address Terraform gives the controller's unit (ENV_LIGHTHOUSE: this VM's private
    address and the port its firewall opens to the fleet, the one the agents are given)."""
    host, sep, port = value.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RunError(
            f"{ENV_LIGHTHOUSE}={value!r}: give the lighthouse's address as host:port "
            "(Terraform sets it on the controller VM), or unset it"
        )
    bind_host = host if _can_bind(host) else "0.0.0.0"
    return Placement(_host_port(bind_host, int(port)), _host_port(host, int(port)))


def place_lighthouse(redis_url: str, environ: Mapping[str, str] = os.environ) -> Placement:
    """Where a new run's lighthouse listens: ENV_LIGHTHOUSE when the controller's environment
    names it (a Terraform controller VM), else beside the run's Redis (:func:`choose_hosts`):
    a free port on loopback, the fixed :data:`REMOTE_PORT` (when free) where VMs dial in
    over a network."""
    if environ.get(ENV_LIGHTHOUSE):
        return placement_from_env(environ[ENV_LIGHTHOUSE])
    host = urlsplit(redis_url if "://" in redis_url else f"redis://{redis_url}").hostname or ""
    bind_host, adv_host = choose_hosts(host, _can_bind(host), socket.getfqdn())
    port = free_port(bind_host) if bind_host == "127.0.0.1" else REMOTE_PORT
    if port == REMOTE_PORT and not _can_bind(bind_host, port):
        port = free_port(bind_host)
    return Placement(_host_port(bind_host, port), _host_port(adv_host, port))


# -- the process -------------------------------------------------------------------------------
def find_lighthouse_binary(python: str | None = None) -> str:
    """torchft's lighthouse beside this Python (the same virtual environment).

    Raises:
        RunError: not installed, with how to install it.
    """
    path = Path(python or sys.executable).parent / LIGHTHOUSE_BINARY
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise RunError(
            f"train.fault_tolerance: replica needs torchft's lighthouse, not found at {path}: "
            f"install it with {INSTALL_HINT}"
        )
    return str(path)


def find_torchft() -> None:
    """Check that torchft is importable here (the local cloud's VMs run this venv).

    Raises:
        RunError: not installed, with how to install it.
    """
    if importlib.util.find_spec("torchft") is None:
        raise RunError(
            f"train.fault_tolerance: replica needs torchft in this venv ({sys.prefix}), where "
            f"the local cloud's VMs run: install it with {INSTALL_HINT}"
        )


def lighthouse_command(binary: str, bind: str, replicas: int) -> list[str]:
    """The lighthouse's command line. By default through :mod:`lighthouse_exec` (the same
    Rust lighthouse, served 0.05 s after its start instead of the 2-5 s the stock script
    spends importing torch); ``USE_STOCK_SCRIPT`` runs the stock script."""
    head = [binary] if USE_STOCK_SCRIPT else [sys.executable, LAUNCHER]
    return [
        *head,
        "--bind", bind,
        "--min_replicas", str(replicas),
        "--heartbeat_timeout_ms", str(HEARTBEAT_TIMEOUT_MS),
        "--join_timeout_ms", str(JOIN_TIMEOUT_MS),
        "--quorum_tick_ms", str(QUORUM_TICK_MS),
    ]  # fmt: skip


def lighthouse_dir(run_dir: Path) -> Path:
    return run_dir / "lighthouse"


def _pidfile(run_dir: Path) -> Path:
    return lighthouse_dir(run_dir) / "lighthouse.pid"


def _probe_address(bind: str) -> tuple[str, int]:
    host, _, port = bind.rpartition(":")
    host = host.strip("[]")
    return ("127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host), int(port)


def serving(address: str, timeout: float = 1.0) -> bool:
    """Whether a lighthouse answers at ``address`` (its HTTP status page, served on the same
    port as its gRPC)."""
    host, port = _probe_address(address)
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", "/status")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def _alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def running_pid(run_dir: Path, bind: str) -> int | None:
    """The pid of this run's lighthouse if it runs (its pidfile, checked against the process's
    command line: a pid reused by another process is not it)."""
    try:
        pid = int(_pidfile(run_dir).read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ValueError, ProcessLookupError):
        return None
    names = (LIGHTHOUSE_BINARY.encode(), Path(LAUNCHER).name.encode())
    ours = any(arg.endswith(names) for arg in cmdline)
    return pid if ours and bind.encode() in cmdline and _alive(pid) else None


def _roll_log(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        if path.stat().st_size > LOG_ROLL_BYTES:
            path.replace(path.with_name(path.name + ".1"))


def start_lighthouse(run_dir: Path, bind: str, replicas: int, timeout: float = 60.0) -> int:
    """Start the run's lighthouse on ``bind`` in a session of its own (it outlives this
    process) and wait until it serves. Returns its pid.

    Raises:
        RunError: the binary is missing, or it exited or did not serve in time (the message
            holds its log's tail).
    """
    binary = find_lighthouse_binary()
    folder = lighthouse_dir(run_dir)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    logfile = folder / "lighthouse.log"
    _roll_log(logfile)
    with open(logfile, "ab") as out:
        proc = subprocess.Popen(
            lighthouse_command(binary, bind, replicas),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    _pidfile(run_dir).write_text(str(proc.pid))
    deadline = time.monotonic() + timeout
    while not serving(bind, timeout=0.5):
        if proc.poll() is not None or time.monotonic() > deadline:
            _terminate(proc.pid)
            tail = logfile.read_text(errors="replace")[-600:].strip().replace("\n", " | ")
            raise RunError(f"the lighthouse on {bind} did not start ({tail}); see {logfile}")
        time.sleep(0.02)
    return proc.pid


def _terminate(pid: int, grace_s: float = 5.0) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    if not _wait_gone(pid, grace_s):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _wait_gone(pid, grace_s)


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        _reap(pid)
        if not _alive(pid):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def stop_lighthouse(run_dir: Path, bind: str) -> None:
    """Stop the run's lighthouse, whoever started it (its pidfile); nothing if it is down."""
    pid = running_pid(run_dir, bind) if bind else None
    if pid is not None:
        _terminate(pid)
    with contextlib.suppress(FileNotFoundError):
        _pidfile(run_dir).unlink()


def wait_exit(pid: int, stop: threading.Event, poll_s: float = 0.25) -> bool:
    """Block until ``pid`` exits (True) or ``stop`` is set (False). A pidfd wakes at the exit
    itself, for a child as for a process adopted from an earlier controller."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except (OSError, AttributeError):
        fd = -1  # no pidfd (an old kernel): poll the process's state instead
    try:
        while not stop.is_set():
            if fd >= 0:
                if select.select([fd], [], [], poll_s)[0]:
                    break
            elif not _alive(pid):
                break
            else:
                stop.wait(0.05)
        else:
            return False
    finally:
        if fd >= 0:
            os.close(fd)
    _reap(pid)
    return True


# -- the keeper --------------------------------------------------------------------------------
# ``on_start(restarted, down_s)``: called after each start (and on adopting a running one),
# with how long it was down before a restart.
OnStart = Callable[[bool, float | None], None]


class LighthouseSupervisor:
    """Keeps the run's lighthouse up while the controller runs: adopts a running one, starts
    it when down, restarts it on the same address the moment it exits."""

    def __init__(
        self, run_dir: Path, bind: str, replicas: int, on_start: OnStart, retry_s: float = 1.0
    ) -> None:
        self.run_dir, self.bind, self.replicas = run_dir, bind, replicas
        self.on_start, self.retry_s = on_start, retry_s
        self.restarts = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> LighthouseSupervisor:
        """Make sure it serves (here, so the first VMs find it), then keep it up.

        Raises:
            RunError: it cannot be started (missing binary, its port taken).
        """
        pid = running_pid(self.run_dir, self.bind)
        if pid is None:
            pid = start_lighthouse(self.run_dir, self.bind, self.replicas)
        self._notify(False, None)
        self._thread = threading.Thread(
            target=self._keep, args=(pid,), name="lighthouse-supervisor", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop keeping it (the lighthouse itself stays: see :func:`stop_lighthouse`)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _keep(self, pid: int) -> None:
        while wait_exit(pid, self._stop):
            down_at = time.monotonic()
            log.warning("the lighthouse (pid %d) exited; restarting it on %s", pid, self.bind)
            while not self._stop.is_set():
                try:
                    pid = start_lighthouse(self.run_dir, self.bind, self.replicas)
                    break
                except RunError as e:
                    log.error("cannot restart the lighthouse: %s", e)
                    self._stop.wait(self.retry_s)
            else:
                return
            self.restarts += 1
            self._notify(True, time.monotonic() - down_at)

    def _notify(self, restarted: bool, down_s: float | None) -> None:
        try:
            self.on_start(restarted, down_s)
        except Exception as e:  # a Redis outage must not stop the keeper
            log.error("cannot record the lighthouse's start: %s", e)

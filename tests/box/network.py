"""The box's network: Linux network namespaces and the links between them, made and removed by
the box itself, so that no test traffic leaves namespaces the box created.

::

    switch namespace  stb<id>-sw: bridge br0, 10.77.0.1/24 (the "cloud's network")
      |- VM namespace stb<id>-<n>: eth0 10.77.0.<10+n>/24, default route via 10.77.0.1,
      |                            lo with 127.0.0.1 (its own) and 169.254.169.254 (metadata)
      |- ...

Each VM reaches the others over the bridge, by their own addresses. The services the tests
run in this process on 127.0.0.1 (Redis, moto, the GCE/GCS fakes, the package index) are
reached from the switch namespace at ``10.77.0.1:<their port>``, through :class:`Relay`: it
listens inside the box's namespaces and connects, from this process's namespace, to
127.0.0.1. Each VM's metadata server (169.254.169.254:80 inside the VM) is relayed the same
way. The controller runs in the switch namespace, so it reaches Redis and the clouds' APIs at
the same addresses as the VMs do.

Namespaces are per thread in Linux: :func:`socket_in` enters a namespace in a short-lived
thread of its own to create a socket there (a socket stays in the namespace it was made in),
so no other thread of the test process ever leaves the host's namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import secrets
import socket
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

CLONE_NEWNET = 0x40000000
GATEWAY = "10.77.0.1"
PREFIX = 24
METADATA_IP = "169.254.169.254"
_libc = ctypes.CDLL(None, use_errno=True)


def ip(*args: str) -> None:
    """Run ``ip ARGS``; a failure raises with ip's own words."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def socket_in(netns: str, host: str, port: int, *, udp: bool = False) -> socket.socket:
    """A listening TCP socket (or a bound UDP one) on ``host:port`` inside network namespace
    ``netns``, made in a thread of its own that enters the namespace."""
    out: list[socket.socket | BaseException] = []

    def make() -> None:
        try:
            fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
            finally:
                os.close(fd)
            kind = socket.SOCK_DGRAM if udp else socket.SOCK_STREAM
            s = socket.socket(socket.AF_INET, kind)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
            if not udp:
                s.listen(128)
            out.append(s)
        except BaseException as e:  # handed to the caller's thread
            out.append(e)

    t = threading.Thread(target=make, name=f"netns-{netns}")
    t.start()
    t.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


class Relay:
    """TCP relays from sockets listening inside the box's namespaces to ports of 127.0.0.1 in
    this process's namespace, served by one asyncio loop in a thread of its own."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._servers: list[asyncio.AbstractServer] = []
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="box-relay", daemon=True
        )
        self._thread.start()
        self.bytes_relayed = 0

    def add(self, netns: str, host: str, port: int, target_port: int) -> None:
        """Relay ``host:port`` inside ``netns`` to ``127.0.0.1:target_port`` here."""
        sock = socket_in(netns, host, port)
        sock.setblocking(False)
        fut = asyncio.run_coroutine_threadsafe(self._serve(sock, target_port), self._loop)
        self._servers.append(fut.result(timeout=10))

    async def _serve(self, sock: socket.socket, target_port: int) -> asyncio.AbstractServer:
        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                tr, tw = await asyncio.open_connection("127.0.0.1", target_port)
            except OSError:
                w.close()
                return
            await asyncio.gather(self._pump(r, tw), self._pump(tr, w), return_exceptions=True)

        return await asyncio.start_server(handle, sock=sock, limit=1 << 20)

    async def _pump(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(1 << 18):
                self.bytes_relayed += len(data)
                w.write(data)
                await w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                w.close()

    def close(self) -> None:
        async def stop() -> None:
            for s in self._servers:
                s.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        self._loop.close()


@dataclass
class VmNet:
    """One VM's namespace and address."""

    netns: str
    address: str


@dataclass
class BoxNetwork:
    """The switch namespace, its bridge, and the VMs' namespaces (see the module docstring).

    ``services`` maps the ports of 127.0.0.1 the box relays into the switch namespace (at
    :data:`GATEWAY`, same port numbers)."""

    box_id: str = field(default_factory=lambda: secrets.token_hex(3))
    vms: dict[str, VmNet] = field(default_factory=dict)
    relay: Relay = field(default_factory=Relay)
    _next: int = 10
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def switch(self) -> str:
        return f"stb{self.box_id}-sw"

    def create(self) -> None:
        ip("netns", "add", self.switch)
        ip("-n", self.switch, "link", "set", "lo", "up")
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "addr", "add", f"{GATEWAY}/{PREFIX}", "dev", "br0")
        ip("-n", self.switch, "link", "set", "br0", "up")

    def expose(self, port: int) -> str:
        """Relay 127.0.0.1:``port`` of this process into the switch namespace; returns the
        address the VMs and the controller use, ``10.77.0.1:port``."""
        self.relay.add(self.switch, GATEWAY, port, port)
        return f"{GATEWAY}:{port}"

    def add_vm(self, name: str, metadata_port: int) -> VmNet:
        """A VM's namespace, linked to the bridge, with its metadata server relayed to
        ``127.0.0.1:metadata_port`` here."""
        with self._lock:
            n = self._next
            self._next += 1
        netns = f"stb{self.box_id}-{n}"
        address = f"10.77.0.{n}"
        ip("netns", "add", netns)
        peer = f"v{self.box_id}{n}"
        ip("-n", netns, "link", "add", "eth0", "type", "veth", "peer", "name", peer)
        ip("-n", netns, "link", "set", peer, "netns", self.switch)
        ip("-n", self.switch, "link", "set", peer, "master", "br0")
        ip("-n", self.switch, "link", "set", peer, "up")
        ip("-n", netns, "link", "set", "lo", "up")
        ip("-n", netns, "addr", "add", f"{METADATA_IP}/32", "dev", "lo")
        ip("-n", netns, "addr", "add", f"{address}/{PREFIX}", "dev", "eth0")
        ip("-n", netns, "link", "set", "eth0", "up")
        ip("-n", netns, "route", "add", "default", "via", GATEWAY)
        self.relay.add(netns, METADATA_IP, 80, metadata_port)
        vm = VmNet(netns, address)
        self.vms[name] = vm
        return vm

    def remove_vm(self, name: str) -> None:
        vm = self.vms.pop(name, None)
        if vm is not None:
            with contextlib.suppress(RuntimeError):
                ip("netns", "del", vm.netns)

    def run_in_switch(self, argv: list[str], **kw: object) -> subprocess.Popen[bytes]:
        """A process in the switch namespace (the controller's "workstation")."""
        popen: Callable[..., subprocess.Popen[bytes]] = subprocess.Popen
        return popen(["ip", "netns", "exec", self.switch, *argv], **kw)

    def close(self) -> None:
        self.relay.close()
        for name in list(self.vms):
            self.remove_vm(name)
        with contextlib.suppress(RuntimeError):
            ip("netns", "del", self.switch)


def leftover_namespaces(box_id: str) -> list[str]:
    """The namespaces of box ``box_id`` that still exist (for tests of clean-up)."""
    names = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    return [n for n in names if n.startswith(f"stb{box_id}-")]


def box_capable() -> bool:
    """The box needs root, iproute2, nsenter/unshare, overlayfs and cgroup v2 at
    /sys/fs/cgroup/unified (as CI's machines and this project's have)."""
    import shutil

    tools = all(shutil.which(t) for t in ("ip", "nsenter", "unshare", "mount"))
    return os.geteuid() == 0 and tools and os.path.isdir("/sys/fs/cgroup/unified")

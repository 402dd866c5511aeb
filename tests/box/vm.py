"""One box VM, seen from the host: its folders, its metadata server, its process, its console.

A VM is a process tree in namespaces of its own (``tests/box/guest/init.py`` is its PID 1)
whose file system is made from an :class:`Image` (an ``/etc`` of its own, an ``/opt`` to lay
the VM's writes over) and folders of the VM's own, all under ``<box>/vms/<id>/``::

    etc/ var/ root/ home/ run/     the VM's own (copied from the image / made empty)
    opt-upper/ opt-work/           its writes over the image's /opt (overlayfs)
    run/box/                       the guest init, the systemd stand-in, systemctl
    state/                         what the guest tells the host (powered-off)
    console.log                    its console: PID 1's output

Stopping it: :meth:`BoxVm.acpi_shutdown` sends SIGTERM to its PID 1, which stops its units
the way systemd does and powers off, and kills what is left after the grace period;
:meth:`BoxVm.kill` SIGKILLs PID 1, which ends every process of its PID namespace at once, as
a VM reclaimed without notice dies.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from fakes.metadata_server import MetadataServer

from .network import BoxNetwork, VmNet

GUEST = Path(__file__).resolve().parent / "guest"
STANDIN = Path(__file__).resolve().parent / "standin"
CGROUP_BASE = Path("/sys/fs/cgroup/unified")
# What the host's /etc holds that no fresh VM image does: this machine's pip configuration.
_NOT_IN_IMAGES = ("pip.conf", "xdg/pip", "netns", "systemd/system")


@dataclass
class Image:
    """A machine image: its ``/etc``, its ``/opt`` (empty, or baked from a VM), and the
    python3 it has (the host's, or another installation put in its place)."""

    name: str
    root: Path
    python: Path | None = None  # another python3: the prefix of its installation
    baked_from: str = ""  # the VM whose /opt this image's is, if any

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @property
    def opt(self) -> Path:
        return self.root / "opt"


def make_base_image(
    dest: Path, cloud: str, *, python: Path | None = None, ca_pem: bytes = b""
) -> Image:
    """An image from the host's ``/usr`` and a copy of its ``/etc`` without its pip
    configuration; GCP's knows the metadata server's name, as GCE images do; ``ca_pem`` is
    a CA the image trusts besides the system's (in its CA bundle)."""
    etc = dest / "etc"
    shutil.copytree(
        "/etc",
        etc,
        symlinks=True,
        ignore_dangling_symlinks=True,
        ignore=lambda d, names: [n for n in names if _skipped(Path(d) / n)],
    )
    # No services of the host's own (its Redis...): a fresh image's unit folder is empty.
    (etc / "systemd" / "system").mkdir(parents=True, exist_ok=True)
    hosts = "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n"
    if cloud == "gcp":
        hosts += "169.254.169.254 metadata.google.internal metadata\n"
    (etc / "hosts").write_text(hosts)
    # No name server: a lookup fails at once instead of waiting for one that is not there.
    (etc / "resolv.conf").unlink(missing_ok=True)
    (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
    if ca_pem:
        bundle = etc / "ssl" / "certs" / "ca-certificates.crt"
        if bundle.is_symlink():
            bundle.unlink()  # a copy of the image's own, not a link to the host's
            bundle.write_bytes(Path("/etc/ssl/certs/ca-certificates.crt").read_bytes())
        with bundle.open("ab") as f:
            f.write(b"\n" + ca_pem)
    (dest / "opt").mkdir(parents=True, exist_ok=True)
    return Image(f"{cloud}-base", dest, python)


def _skipped(path: Path) -> bool:
    rel = str(path.relative_to("/etc"))
    return any(rel == p or rel.startswith(p + "/") for p in _NOT_IN_IMAGES) or (
        path.is_socket() or path.is_fifo() or path.is_block_device() or path.is_char_device()
    )


@dataclass
class BoxVm:
    """One VM (see the module docstring)."""

    vm_id: str
    cloud: str
    image: Image
    folder: Path
    metadata: MetadataServer
    net: VmNet
    volume: Path | None
    cgroup: Path
    process: subprocess.Popen[bytes] | None = None
    started_at: float = field(default_factory=time.monotonic)
    stopping: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def console_path(self) -> Path:
        return self.folder / "console.log"

    @property
    def state_dir(self) -> Path:
        return self.folder / "state"

    def console(self) -> str:
        try:
            return self.console_path.read_text(errors="replace")
        except OSError:
            return ""

    def powered_off_by_guest(self) -> bool:
        return (self.state_dir / "powered-off").exists()

    def start(self) -> None:
        """Make the VM's folders and start its PID 1 in its namespaces."""
        f = self.folder
        for d in ("var/log", "var/lib", "var/tmp", "var/cache", "root", "home", "run/box"):
            (f / d).mkdir(parents=True, exist_ok=True)
        (f / "var" / "tmp").chmod(0o1777)
        self.state_dir.mkdir(exist_ok=True)
        shutil.copytree(self.image.etc, f / "etc", symlinks=True)
        (f / "etc" / "hostname").write_text(f"{self.vm_id}\n")
        for d in ("opt-upper", "opt-work"):
            (f / d).mkdir(exist_ok=True)
        for src in (GUEST / "init.py", *STANDIN.glob("*.py"), STANDIN / "systemctl"):
            shutil.copy2(src, f / "run" / "box" / src.name)
        binds: list[list[str]] = []
        guest_binds = [["/run/box/systemctl", "/usr/bin/systemctl"]]
        if self.image.python is not None:
            # The image's python3 is another installation: its prefix where it was built
            # (under the VM's /root, which is then bound over /root), its binary in place of
            # the host's python3.11 (to which /usr/bin/python3 points).
            prefix = self.image.python
            inside = f / str(prefix).lstrip("/")
            inside.mkdir(parents=True, exist_ok=True)
            binds.append([str(prefix), str(inside)])
            binary = sorted(prefix.glob("bin/python3.[0-9]*"))[0]
            binds.append([str(binary), "/usr/bin/python3.11"])
        for d in ("etc", "var", "root", "home", "run"):
            binds.append([str(f / d), f"/{d}"])
        lower = str(self.image.opt) if any(self.image.opt.iterdir()) else ""
        conf = {
            "name": self.vm_id,
            "hostname": self.vm_id,
            "cloud": self.cloud,
            "standin_dir": str(f / "run" / "box"),
            "state_dir": "/run/box-state",
            "cgroup_root": str(self.cgroup),
            "binds": [*binds, [str(self.state_dir), "/run/box-state"]],
            "opt": {"lower": lower, "upper": str(f / "opt-upper"), "work": str(f / "opt-work")},
            "volume": str(self.volume) if self.volume else "",
            "guest_binds": guest_binds,
        }
        (f / "init.json").write_text(json.dumps(conf))
        self.cgroup.mkdir(parents=True, exist_ok=True)
        console = self.console_path.open("ab")
        self.process = subprocess.Popen(
            [
                "nsenter",
                f"--net=/run/netns/{self.net.netns}",
                "--",
                "unshare",
                "--mount",
                "--uts",
                "--pid",
                "--fork",
                "--kill-child",
                "--propagation",
                "private",
                "/usr/bin/python3",
                str(f / "run" / "box" / "init.py"),
                str(f / "init.json"),
            ],
            stdin=subprocess.DEVNULL,
            stdout=console,
            stderr=subprocess.STDOUT,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
            start_new_session=True,
        )
        console.close()

    def pid1(self) -> int | None:
        """PID 1 of the VM's PID namespace (unshare's child), seen from the host."""
        if self.process is None:
            return None
        for task in Path(f"/proc/{self.process.pid}/task").glob("*"):
            with contextlib.suppress(OSError):
                kids = (task / "children").read_text().split()
                if kids:
                    return int(kids[0])
        return None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def acpi_shutdown(self, grace_s: float) -> None:
        """Press the power button: the guest stops its units and powers off; what is left
        after ``grace_s`` is killed, as the cloud ends a VM that takes too long."""
        with self._lock:
            self.stopping = True
        pid = self.pid1()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        assert self.process is not None
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """Pull the plug: every process of the VM dies at once."""
        with self._lock:
            self.stopping = True
        pid = self.pid1()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)

    def remove_cgroups(self) -> None:
        """Remove the VM's cgroups (deepest first), killing anything left in them."""
        if not self.cgroup.exists():
            return
        for d in sorted((p for p in self.cgroup.rglob("*") if p.is_dir()), reverse=True):
            _kill_and_remove(d)
        _kill_and_remove(self.cgroup)


def _kill_and_remove(d: Path) -> None:
    with contextlib.suppress(OSError):
        (d / "cgroup.kill").write_text("1")
    for _ in range(50):
        try:
            d.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def start_vm(
    box: BoxNetwork,
    *,
    vm_id: str,
    cloud: str,
    image: Image,
    folder: Path,
    metadata: MetadataServer,
    volume: Path | None,
    cgroup_parent: Path,
) -> BoxVm:
    net = box.add_vm(vm_id, metadata.port)
    vm = BoxVm(
        vm_id,
        cloud,
        image,
        folder,
        metadata,
        net,
        volume,
        cgroup=cgroup_parent / vm_id,
    )
    vm.start()
    return vm

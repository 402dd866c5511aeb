#!/usr/bin/python3
"""PID 1 of a box VM: the machine image's part of a boot (mounts, a service manager, the cloud's
guest agent that runs the user data), standard library only.

The hypervisor (``tests/box/hypervisor.py``) starts it as
``nsenter --net=<VM namespace> unshare --mount --uts --pid --fork ... init.py CONFIG`` with
its standard output as the VM's console. It:

1. stays PID 1 only to reap orphans and pass SIGTERM on (as tini does), and forks the init;
2. makes the VM's file system: the host's ``/usr`` (the image's programs, python3 among
   them), the VM's own ``/etc``, ``/var``, ``/root``, ``/home``, ``/run``, a ``/opt`` over the
   image's (an overlay, so an image baked from a VM boots with its venv), fresh ``/tmp`` and
   ``/mnt``, the shared checkpoint volume at ``/mnt/spottrain``, ``/work`` (the checkout)
   hidden, and the systemd stand-in at ``/usr/bin/systemctl``;
3. starts the stand-in service manager, then does what the cloud's guest agent does: fetches
   the user data (AWS: IMDSv2 ``/latest/user-data``, as cloud-init) or the startup script (GCE
   metadata, as google_metadata_script_runner) from the metadata server and runs it as root
   with a clean environment, its output on the console (GCE's prefixed as the runner does);
4. powers off on SIGTERM (the hypervisor's ACPI shutdown: units stopped as systemd would), or
   when the guest asks (``shutdown -h now``): then it writes ``powered-off`` in the VM's
   state folder first, so the hypervisor knows the guest did it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

with open(sys.argv[1]) as _f:
    CONF = json.load(_f)
sys.path.insert(0, CONF["standin_dir"])
import systemd  # the stand-in, imported before the mounts hide its folder

CLEAN_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "linux",
}


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def make_filesystem() -> None:
    """The VM's file system, in this order: the binds of host paths (the VM's own /etc,
    /var, /root, /home, /run, and whatever the image swaps in), /opt over the image's, a
    fresh /mnt with the shared volume, the binds of paths the VM now sees (the stand-in
    systemctl), then /tmp and /work hidden (last: the VM's folders may live under /tmp)."""
    mount("--make-rprivate", "/")
    for src, dst in CONF["binds"]:
        if os.path.isdir(src):
            os.makedirs(dst, exist_ok=True)
        mount("--rbind", src, dst)
    opt = CONF["opt"]
    if opt.get("lower"):
        lower, upper, work = opt["lower"], opt["upper"], opt["work"]
        options = f"lowerdir={lower},upperdir={upper},workdir={work}"
        mount("-t", "overlay", "overlay", "-o", options, "/opt")
    else:
        mount("--bind", opt["upper"], "/opt")
    mount("-t", "tmpfs", "-o", "mode=0755", "tmpfs", "/mnt")
    if CONF.get("volume"):
        os.makedirs("/mnt/spottrain", exist_ok=True)
        mount("--bind", CONF["volume"], "/mnt/spottrain")
    for src, dst in CONF.get("guest_binds", []):
        mount("--bind", src, dst)
    for path in ("/tmp", "/work"):
        if os.path.isdir(path):
            mount("-t", "tmpfs", "-o", "mode=1777", "tmpfs", path)
    mount("-t", "proc", "proc", "/proc")
    subprocess.run(["hostname", CONF["hostname"]], check=True)


def fetch_user_data() -> str:
    """The user data, as the cloud's guest agent reads it from the metadata server."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    base = "http://169.254.169.254"
    for _ in range(100):
        try:
            if CONF["cloud"] == "aws":
                put = urllib.request.Request(
                    base + "/latest/api/token",
                    method="PUT",
                    headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"},
                )
                token = opener.open(put, timeout=5).read().decode()
                get = urllib.request.Request(
                    base + "/latest/user-data", headers={"X-aws-ec2-metadata-token": token}
                )
            else:
                get = urllib.request.Request(
                    base + "/computeMetadata/v1/instance/attributes/startup-script",
                    headers={"Metadata-Flavor": "Google"},
                )
            return str(opener.open(get, timeout=5).read().decode())
        except OSError as e:
            last = e
            time.sleep(0.2)
    raise SystemExit(f"box init: no user data from the metadata server: {last}")


def run_user_data(script: str) -> int:
    if CONF["cloud"] == "aws":
        path = "/var/lib/cloud/instance/scripts/part-001"
        prefix = ""
        say(f"Cloud-init v. 23.1 running 'modules:final' at {time.ctime()}.")
    else:
        path = "/run/google-startup-script"
        prefix = f"{CONF['hostname']} google_metadata_script_runner[1]: startup-script: "
        say(
            f"{prefix.rsplit('startup-script: ', 1)[0]}Starting startup scripts (version 20250101)."
        )
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(script)
    os.chmod(path, 0o700)
    proc = subprocess.Popen(
        [path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=CLEAN_ENV, cwd="/"
    )
    assert proc.stdout is not None
    for raw in proc.stdout:
        sys.stdout.write(prefix + raw.decode(errors="replace"))
        sys.stdout.flush()
    code = proc.wait()
    if CONF["cloud"] == "aws":
        if code:
            say(f"util.py[WARNING]: Failed running {path} [{code}]")
        say(f"Cloud-init v. 23.1 finished at {time.ctime()}. Datasource DataSourceEc2.")
    else:
        say(f"{prefix}exit status {code}")
        say(f"{prefix.rsplit('startup-script: ', 1)[0]}Finished running startup scripts.")
    return code


def main() -> None:
    done = threading.Event()
    powered_off = threading.Event()

    def on_poweroff() -> None:
        # The guest asked (shutdown -h now): its units are stopped by now.
        with open(os.path.join(CONF["state_dir"], "powered-off"), "w") as f:
            f.write("guest\n")
        powered_off.set()
        done.set()

    signal.signal(signal.SIGTERM, lambda *_: done.set())
    make_filesystem()
    say(f"{CONF['hostname']} login: (box VM {CONF['name']}, {CONF['cloud']})")
    manager = systemd.ServiceManager(
        console=sys.stdout, cgroup_root=CONF["cgroup_root"], on_poweroff=on_poweroff
    )
    manager.serve("/run/systemd/standin.sock")

    def guest_agent() -> None:
        try:
            run_user_data(fetch_user_data())
        except BaseException as e:  # the console is where a VM's troubles are read
            say(f"box init: the guest agent failed: {type(e).__name__}: {e}")

    threading.Thread(target=guest_agent, daemon=True).start()
    done.wait()
    if not powered_off.is_set():
        say("ACPI: power button pressed; stopping services.")
        manager.poweroff()
    say("reboot: Power down")
    manager.close()


def reaper(child: int) -> None:
    """PID 1: reap every orphan, pass SIGTERM to the init, exit with its status."""

    def forward(signum: int, _: Any) -> None:
        os.kill(child, signum)

    signal.signal(signal.SIGTERM, forward)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(0)
        except InterruptedError:
            continue
        if pid == child:
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


if __name__ == "__main__":
    pid = os.fork()
    if pid:
        reaper(pid)
    else:
        os.setsid()
        main()

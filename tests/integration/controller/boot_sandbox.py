"""A VM's boot run for real in a sandbox, lighter than a box VM: the user data runs with bash,
as root, in a mount and PID namespace of its own, whose ``/etc``, ``/var/lib``, ``/var/log``,
``/opt``, ``/run`` and ``/mnt`` are overlays on a tmpfs (the host's are never written), and
with recording stand-ins first on ``PATH`` for what would reach the network or the host's
services: ``python3`` (it runs the real ``fetch.py``, which reads ``file://`` stores only,
and the real interpreter for ``-c``; it records the loader's commands), ``git``, ``docker``,
``systemctl``, the user tools, ``findmnt`` and ``sleep``; ``python3 -m venv`` makes a venv of
stand-ins (its ``pip`` records; its ``python`` records, and runs a script read from stdin).

What it shows: what the boot wrote (copied out of the overlays), every stand-in's argv as
the boot gave it, the boot's output and its exit status. Needs root and overlayfs
(:func:`sandbox_capable`).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The host's folders a boot writes into, each an overlay in the sandbox.
OVERLAID = ("/etc", "/var/lib", "/var/log", "/opt", "/run", "/mnt")
UNSHARE = ("unshare", "--mount", "--pid", "--fork", "--kill-child")
# What is copied out of the sandbox once the boot ended.
COLLECTED = ("/etc/spottrain", "/etc/systemd/system", "/var/lib/spottrain-boot", "/opt/job")
STANDINS = (
    "python3", "git", "docker", "systemctl", "findmnt", "sleep", "id", "getent", "groupadd",
    "useradd", "usermod", "curl",
)  # fmt: skip
# The id the `id` stand-in gives the workers' user (the boot's fixed one).
WORKER_ID = "2470"
# What the loader's `secret` stand-in writes (the Redis password, the git token).
SECRET_VALUE = "s3cr3t-from-the-store"

# One program for every stand-in, told apart by the name it is called by. A call is recorded
# as its name on a line, then each argument as <bytes>:<bytes of it>, then a newline.
_STANDIN = r"""#!/bin/bash
name=${0##*/}
record() {
  ( LC_ALL=C; printf '%s\n' "$1"; shift
    for a in "$@"; do printf '%d:%s' "${#a}" "$a"; done; printf '\n' ) >> "$FUZZ_OUT/calls"
}
record "$name" "$@"
case $name in
  python3)
    case $1 in
      */fetch.py|-c) exec "$FUZZ_PYTHON" -S "$@" ;;
      -m) mkdir -p "$3/bin"; ln -s "$0" "$3/bin/pip"; ln -s "$0" "$3/bin/python" ;;
      */loader.py)
        case $3 in
          secret) ( umask 077; printf '%s' "$FUZZ_SECRET" > "$5" ) ;;
          pip-config|unit-file) : > "$4" ;;
        esac ;;
    esac ;;
  python) if [ "$1" = - ]; then exec "$FUZZ_PYTHON" -; fi ;;
  git)
    dir=$PWD; if [ "$1" = -C ]; then dir=$2; shift 2; fi
    case $1 in
      init) mkdir -p "${@: -1}/.git" ;;
      fetch)
        if [ -n "${GIT_ASKPASS:-}" ]; then
          record askpass "$("$GIT_ASKPASS" "Username for 'https://host': ")" \
            "$("$GIT_ASKPASS" "Password for 'https://host': ")"
        fi
        printf '%s' "${@: -1}" > "$dir/.git/FETCH_HEAD" ;;
      checkout) mkdir -p "$dir/$FUZZ_SUBDIR"; echo six > "$dir/$FUZZ_SUBDIR/requirements.txt" ;;
      rev-parse) cat "$dir/.git/FETCH_HEAD"; echo ;;
    esac ;;
  id) echo "$FUZZ_WORKER_ID" ;;
  findmnt) echo /mnt ;;
  getent) exit 2 ;;
esac
exit 0
"""

_INSIDE = r"""
import json, os, shutil, subprocess, sys

conf = json.load(open(sys.argv[1]))
work = conf["work"]


def sh(*cmd):
    subprocess.run(cmd, check=True)


sh("mount", "--make-rprivate", "/")
sh("mount", "-t", "tmpfs", "tmpfs", work)
for i, d in enumerate(conf["overlaid"]):
    upper, scratch = os.path.join(work, "u%d" % i), os.path.join(work, "w%d" % i)
    os.makedirs(upper)
    os.makedirs(scratch)
    sh("mount", "-t", "overlay", "overlay", "-o",
       "lowerdir=%s,upperdir=%s,workdir=%s" % (d, upper, scratch), d)
for dest, src in conf["place"]:
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    shutil.copyfile(src, dest)
with open(conf["log"], "wb") as log:
    rc = subprocess.run(["bash", conf["script"]], env=conf["env"], cwd=conf["cwd"],
                        stdin=subprocess.DEVNULL,
                        stdout=log, stderr=subprocess.STDOUT, timeout=conf["timeout"]).returncode
for path in conf["collect"]:
    if os.path.isdir(path):
        shutil.copytree(path, conf["root"] + path, symlinks=True)
with open(conf["rc"], "w") as f:
    f.write(str(rc))
"""


@functools.lru_cache(maxsize=1)
def sandbox_capable() -> str:
    """Why the sandbox cannot run here ("" when it can): it needs root, unshare, mount and
    overlayfs over each folder it lays over."""
    if os.geteuid() != 0:
        return "the boot sandbox needs root (mount namespaces, overlayfs)"
    missing = [t for t in ("unshare", "mount", "bash", "cp") if shutil.which(t) is None]
    missing += [d for d in OVERLAID if not os.path.isdir(d)]
    if missing:
        return f"the boot sandbox needs {', '.join(missing)}"
    probe = "mount --make-rprivate / && mount -t tmpfs tmpfs /mnt && mkdir /mnt/u /mnt/w && "
    probe += "mount -t overlay overlay -o lowerdir=/etc,upperdir=/mnt/u,workdir=/mnt/w /etc"
    done = subprocess.run(
        ["unshare", "--mount", "--fork", "bash", "-c", probe], capture_output=True, timeout=30
    )
    return "" if done.returncode == 0 else "the boot sandbox needs overlayfs in a mount namespace"


@dataclass(frozen=True)
class Ran:
    """One boot in the sandbox: its exit status, output, stand-ins' calls and files."""

    rc: int
    output: str
    calls: list[dict[str, Any]]
    root: Path

    def file(self, path: str) -> bytes:
        return (self.root / path.lstrip("/")).read_bytes()

    def text(self, path: str) -> str:
        return self.file(path).decode()

    def argv_of(self, cmd: str) -> list[list[str]]:
        return [c["argv"] for c in self.calls if c["cmd"] == cmd]


def _standins(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    program = folder / "standin"
    program.write_text(_STANDIN)
    program.chmod(0o755)
    for name in STANDINS:
        (folder / name).symlink_to(program)
    return folder


def parse_calls(data: bytes) -> list[dict[str, Any]]:
    """The stand-ins' record: each call's name and argv, byte for byte."""
    calls, i = [], 0
    while i < len(data):
        j = data.index(b"\n", i)
        name, argv, i = data[i:j].decode(), [], j + 1
        while data[i : i + 1] != b"\n":
            k = data.index(b":", i)
            n = int(data[i:k])
            argv.append(data[k + 1 : k + 1 + n].decode(errors="surrogateescape"))
            i = k + 1 + n
        calls.append({"cmd": name, "argv": argv})
        i += 1
    return calls


def run_boot(
    work: Path,
    user_data: str,
    place: Mapping[str, bytes],
    *,
    cwd: Path,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 120.0,
) -> Ran:
    """Run ``user_data`` in a fresh sandbox under ``work`` (a new folder) from the folder
    ``cwd`` (on the host: what the boot writes there stays), after writing each of ``place``
    (a path in the sandbox: its bytes), e.g. the run's store's objects."""
    for d in (work, cwd):
        # What the boot leaves there must outlive the sandbox's overlays.
        assert not any(d.resolve().is_relative_to(o) for o in OVERLAID), f"{d} is overlaid"
    work.mkdir(parents=True)
    out, root, staged = work / "out", work / "out" / "root", work / "staged"
    for d in (out, root, staged, work / "tmpfs"):
        d.mkdir()
    pairs: list[Sequence[str]] = []
    for i, (dest, data) in enumerate(place.items()):
        (staged / str(i)).write_bytes(data)
        pairs.append((dest, str(staged / str(i))))
    script = work / "user-data.sh"
    script.write_text(user_data)
    bins = _standins(work / "bin")
    conf = {
        "work": str(work / "tmpfs"),
        "overlaid": list(OVERLAID),
        "place": pairs,
        "script": str(script),
        "log": str(out / "output"),
        "rc": str(out / "rc"),
        "root": str(root),
        "collect": list(COLLECTED),
        "timeout": timeout_s,
        "cwd": str(cwd),
        "env": {
            "PATH": f"{bins}:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/root",
            "LANG": "C.UTF-8",
            "FUZZ_OUT": str(out),
            "FUZZ_PYTHON": sys.executable,
            "FUZZ_SECRET": SECRET_VALUE,
            "FUZZ_WORKER_ID": WORKER_ID,
            "FUZZ_SUBDIR": "",
            **(env or {}),
        },
    }
    (work / "conf.json").write_text(json.dumps(conf))
    (work / "inside.py").write_text(_INSIDE)
    subprocess.run(
        [*UNSHARE, sys.executable, "-S", str(work / "inside.py"), str(work / "conf.json")],
        check=True,
        timeout=timeout_s + 30,
    )
    calls_file = out / "calls"
    calls = parse_calls(calls_file.read_bytes()) if calls_file.exists() else []
    output = (out / "output").read_text(errors="replace")
    return Ran(int((out / "rc").read_text()), output, calls, root)

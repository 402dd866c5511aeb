"""The systemd stand-in's exec step: what systemd's child does between fork and execve.

The manager is threaded, so it never runs Python between fork and exec (no preexec_fn):
it posix_spawn()s ``python3 -I execwrap.py SPEC`` with stdin, stdout, stderr and the
exec-status pipe (fd 3) already in place, and this program, single-threaded, applies the
unit's settings to itself and then execve()s the command, keeping its pid:

1. joins the unit's cgroup (``cgroup.procs``), before anything can fork;
2. closes every other descriptor, resets signal dispositions and the mask;
3. sets the resource limits (LimitNOFILE=, LimitMEMLOCK=, ...) and umask 022;
4. for a sandboxed command: its own mount namespace (propagation slave, so nothing leaks
   back), PrivateTmp=, ProtectHome=, ProtectKernel*=, ProtectControlGroups=,
   ProtectSystem=, then its own UTS namespace for ProtectHostname= and the capability
   bounding set;
5. chdir to WorkingDirectory=, PR_SET_NO_NEW_PRIVS for NoNewPrivileges=, execve.

A failure at any step is written to fd 3 as one JSON object (the step's name as systemd
calls it, and the error) and the program exits with systemd's code for that step (203/EXEC,
226/NAMESPACE, ...). A successful execve closes fd 3 (close-on-exec) with nothing written,
which is how the manager tells that Type=exec has started.

Standalone on purpose: it runs under Debian's /usr/bin/python3 with nothing but the standard
library, inside VMs where neither spottrain nor the tests are importable.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import platform
import resource
import signal
import sys

STATUS_FD = 3

# systemd's exit codes for a failed step (systemd.exec(5), "Process Exit Codes").
EXIT_CHDIR = 200
EXIT_FDS = 202
EXIT_EXEC = 203
EXIT_LIMITS = 205
EXIT_SIGNAL_MASK = 207
EXIT_CAPABILITIES = 218
EXIT_CGROUP = 219
EXIT_NAMESPACE = 226
EXIT_NO_NEW_PRIVILEGES = 227

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_SLAVE = 1 << 19
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_LOWER = 3
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY = 0x1
# mount_setattr(2) has the same number in the x86_64 and the generic (arm64) tables.
SYS_MOUNT_SETATTR = {"x86_64": 442, "aarch64": 442}.get(platform.machine())
LINUX_CAPABILITY_VERSION_3 = 0x20080522

# The executable search path systemd uses for a command that is a bare name.
SEARCH_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")

# What ProtectKernelTunables= makes read-only (besides /sys).
KERNEL_TUNABLES = (
    "/proc/sys",
    "/proc/sysrq-trigger",
    "/proc/latency_stats",
    "/proc/acpi",
    "/proc/apm",
    "/proc/asound",
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/timer_stats",
)

_libc = ctypes.CDLL(None, use_errno=True)


class StepError(Exception):
    """One step failed: ``step`` as systemd names it, ``code`` the exit code for it."""

    def __init__(self, step: str, code: int, what: str, error: OSError | str) -> None:
        text = (error.strerror or str(error)) if isinstance(error, OSError) else error
        super().__init__(f"{what}: {text}")
        self.step, self.code, self.what, self.text = step, code, what, text


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{os.strerror(err)} ({what})")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None):
    _check(
        _libc.mount(
            None if source is None else os.fsencode(source),
            os.fsencode(target),
            None if fstype is None else fstype.encode(),
            ctypes.c_ulong(flags),
            None if data is None else data.encode(),
        ),
        f"mount {target}",
    )


def _prctl(option: int, arg: int) -> None:
    _check(
        _libc.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), 0),
        f"prctl {option}",
    )


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _unescape_mountinfo(field: str) -> str:
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _remount_read_only_walk(path: str) -> None:
    """Fallback for kernels without mount_setattr: remount each mount at or under path."""
    with open("/proc/self/mountinfo") as f:
        points = [_unescape_mountinfo(line.split()[4]) for line in f]
    prefix = path.rstrip("/") + "/"
    flag_of = {
        os.ST_NOSUID: MS_NOSUID,
        os.ST_NODEV: MS_NODEV,
        os.ST_NOEXEC: MS_NOEXEC,
    }
    for point in dict.fromkeys(points):
        if point != path and not point.startswith(prefix):
            continue
        keep = 0
        try:
            st = os.statvfs(point)
        except OSError:
            continue
        for st_flag, ms_flag in flag_of.items():
            if st.f_flag & st_flag:
                keep |= ms_flag
        _mount(None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | keep, None)


def bind_read_only(path: str) -> None:
    """Bind ``path`` onto itself (with its submounts) and make all of it read-only."""
    _mount(path, path, None, MS_BIND | MS_REC, None)
    if SYS_MOUNT_SETATTR is not None:
        attr = _MountAttr(attr_set=MOUNT_ATTR_RDONLY)
        ret = _libc.syscall(
            ctypes.c_long(SYS_MOUNT_SETATTR),
            ctypes.c_int(AT_FDCWD),
            os.fsencode(path),
            ctypes.c_uint(AT_RECURSIVE),
            ctypes.byref(attr),
            ctypes.c_size_t(ctypes.sizeof(attr)),
        )
        if ret == 0:
            return
        if ctypes.get_errno() != 38:  # ENOSYS: an older kernel; walk the mounts instead
            _check(ret, f"mount_setattr {path}")
    _remount_read_only_walk(path)


def _empty_inaccessible(path: str, mode: str = "000", read_only: bool = True) -> None:
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC | (MS_RDONLY if read_only else 0)
    _mount("tmpfs", path, "tmpfs", flags, f"mode={mode}")


def _exists(path: str) -> bool:
    return os.path.lexists(path)


def apply_sandbox(box: dict) -> None:
    """The mount and UTS namespace of a sandboxed command (systemd.exec's namespacing)."""
    flags = CLONE_NEWNS | (CLONE_NEWUTS if box.get("protect_hostname") else 0)
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")
    # First of all: nothing mounted here may propagate back to the VM (its / may be shared).
    _mount(None, "/", None, MS_SLAVE | MS_REC, None)

    # Mounts that take a source path come first, /tmp last: PrivateTmp= replaces /tmp, where
    # the sources may live.
    if box.get("protect_kernel_logs"):
        for node in ("/proc/kmsg", "/dev/kmsg"):
            if _exists(node):
                _mount(box["inaccessible_file"], node, None, MS_BIND, None)
    private_tmp = box.get("private_tmp")
    if private_tmp:
        tmp_dir, var_tmp_dir = private_tmp
        if not os.path.isdir("/var/tmp"):
            os.makedirs("/var/tmp", exist_ok=True)
            os.chmod("/var/tmp", 0o1777)
        _mount(var_tmp_dir, "/var/tmp", None, MS_BIND | MS_REC, None)
        _mount(tmp_dir, "/tmp", None, MS_BIND | MS_REC, None)

    home = box.get("protect_home", "no")
    if home != "no":
        for path in ("/home", "/root", "/run/user"):
            if not os.path.isdir(path):
                continue
            if home == "yes":
                _empty_inaccessible(path)
            elif home == "tmpfs":
                _empty_inaccessible(path, mode="755", read_only=False)
            else:  # read-only
                bind_read_only(path)

    if box.get("protect_kernel_modules"):
        seen = set()
        for path in ("/lib/modules", "/usr/lib/modules"):
            real = os.path.realpath(path)
            if os.path.isdir(real) and real not in seen:
                seen.add(real)
                _empty_inaccessible(real)
    if box.get("protect_kernel_tunables"):
        for path in KERNEL_TUNABLES:
            if _exists(path):
                bind_read_only(path)
        if os.path.isdir("/sys"):
            bind_read_only("/sys")
    if box.get("protect_control_groups") and os.path.isdir("/sys/fs/cgroup"):
        bind_read_only("/sys/fs/cgroup")

    protect_system = box.get("protect_system", "no")
    if protect_system != "no":
        paths = ["/usr", "/boot", "/efi"]
        if protect_system == "full":
            paths.append("/etc")
        for path in paths:
            if os.path.isdir(path):
                bind_read_only(path)


def drop_capabilities(caps: list[int]) -> None:
    """Remove ``caps`` from the bounding, ambient and inheritable sets, so no exec regains
    them (the effective set of a root exec is bounded by the bounding set)."""
    if not caps:
        return
    for cap in caps:
        _prctl(PR_CAPBSET_DROP, cap)
        # Lowering an ambient capability the kernel does not know is not an error worth
        # failing the unit for; the bounding set is what counts.
        _libc.prctl(PR_CAP_AMBIENT, ctypes.c_ulong(PR_CAP_AMBIENT_LOWER), ctypes.c_ulong(cap), 0, 0)
    header = (ctypes.c_uint32 * 2)(LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    _check(_libc.capget(ctypes.byref(header), ctypes.byref(data)), "capget")
    for cap in caps:
        data[3 * (cap // 32) + 2] &= ~(1 << (cap % 32)) & 0xFFFFFFFF
    _check(_libc.capset(ctypes.byref(header), ctypes.byref(data)), "capset")


def setrlimit_closest(which: int, soft: int, hard: int) -> None:
    """setrlimit as systemd does it (setrlimit_closest): without the privilege to raise the
    hard limit (no CAP_SYS_RESOURCE), get as close as the current hard limit allows."""
    try:
        resource.setrlimit(which, (soft, hard))
        return
    except ValueError as exc:  # Python's EPERM ("not allowed to raise maximum limit")
        refused = exc
    _cur_soft, cur_hard = resource.getrlimit(which)
    if cur_hard == resource.RLIM_INFINITY:
        raise refused

    def closest(value: int) -> int:
        return cur_hard if value == resource.RLIM_INFINITY else min(value, cur_hard)

    resource.setrlimit(which, (closest(soft), closest(hard)))


def resolve_executable(path: str) -> str:
    """A bare name is looked up in systemd's fixed search path; a path is used as is."""
    if "/" in path:
        return path
    for directory in SEARCH_PATH:
        candidate = os.path.join(directory, path)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(2, "No such file or directory")


def run(spec: dict) -> None:
    """Apply ``spec`` to this process and execve its command; raises StepError."""
    try:
        for sig in signal.valid_signals():
            if sig not in (signal.SIGKILL, signal.SIGSTOP):
                with contextlib.suppress(OSError, ValueError):
                    signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
    except OSError as exc:
        raise StepError("SIGNAL_MASK", EXIT_SIGNAL_MASK, "Failed to reset signals", exc) from exc

    procs = spec.get("cgroup_procs")
    if procs:
        try:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        except OSError as exc:
            raise StepError("CGROUP", EXIT_CGROUP, f"Failed to attach to {procs}", exc) from exc

    try:
        os.closerange(STATUS_FD + 1, max(os.sysconf("SC_OPEN_MAX"), 1024))
    except OSError as exc:
        raise StepError("FDS", EXIT_FDS, "Failed to close file descriptors", exc) from exc

    for name, which, soft, hard in spec.get("rlimits", []):
        try:
            setrlimit_closest(which, soft, hard)
        except (OSError, ValueError) as exc:
            raise StepError("LIMITS", EXIT_LIMITS, f"Failed to set Limit{name}=", str(exc)) from exc
    os.umask(spec.get("umask", 0o022))

    box = spec.get("sandbox")
    if box and box.get("namespace"):
        try:
            apply_sandbox(box)
        except OSError as exc:
            raise StepError(
                "NAMESPACE", EXIT_NAMESPACE, "Failed to set up mount namespacing", exc
            ) from exc
    if box:
        try:
            drop_capabilities(box.get("drop_capabilities", []))
        except OSError as exc:
            raise StepError(
                "CAPABILITIES", EXIT_CAPABILITIES, "Failed to drop capabilities", exc
            ) from exc

    cwd = spec.get("cwd") or "/"
    try:
        os.chdir(cwd)
    except OSError as exc:
        if not spec.get("cwd_optional"):
            raise StepError(
                "CHDIR", EXIT_CHDIR, f"Changing to the requested working directory {cwd}", exc
            ) from exc
        os.chdir("/")

    if box and box.get("no_new_privileges"):
        try:
            _prctl(PR_SET_NO_NEW_PRIVS, 1)
        except OSError as exc:
            raise StepError(
                "NO_NEW_PRIVILEGES", EXIT_NO_NEW_PRIVILEGES, "Failed to disable new privileges", exc
            ) from exc

    env = dict(spec["env"])
    env["SYSTEMD_EXEC_PID"] = str(os.getpid())
    try:
        path = resolve_executable(spec["path"])
    except OSError as exc:
        raise StepError(
            "EXEC", EXIT_EXEC, f"Failed to locate executable {spec['path']}", exc
        ) from exc
    try:
        os.execve(path, spec["argv"], env)
    except OSError as exc:
        raise StepError("EXEC", EXIT_EXEC, f"Failed to execute {path}", exc) from exc


def main(argv: list[str]) -> int:
    try:
        os.set_inheritable(STATUS_FD, False)
    except OSError:
        return EXIT_FDS
    try:
        spec = json.loads(argv[1])
        run(spec)
    except StepError as err:
        report = {"step": err.step, "code": err.code, "what": err.what, "error": err.text}
    except Exception as exc:  # a bug here must still fail the unit loudly, not hang it
        report = {"step": "EXEC", "code": EXIT_EXEC, "what": "execwrap", "error": repr(exc)}
    with contextlib.suppress(OSError):
        os.write(STATUS_FD, json.dumps(report).encode())
    return report["code"]


if __name__ == "__main__":
    sys.exit(main(sys.argv))

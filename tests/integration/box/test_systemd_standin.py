"""The systemd stand-in of the box VMs (tests/box/standin) running the real shipped unit.

Each test installs ``agent/systemd/spottrain-agent.service`` as the boot script does (the unit
plus the ``job.conf`` drop-in that ``_unit_lines`` writes), then a ``test.conf`` drop-in that
points ExecStart= at a small program (spottrain-agent is not installed here), the env file
and the output file at this test's folders, and shortens RestartSec=/TimeoutStopSec=.

The service sees its own /tmp (PrivateTmp=yes), so the program and its working directory
live in a folder under /dev/shm, as they would under /opt on a VM; everything the manager
itself reads or writes (unit dirs, state, env file, output file, fstab) is under tmp_path.

Tests that run a unit need root (namespaces, cgroups); CI runs them as root.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[3]
STANDIN = REPO / "tests" / "box" / "standin"
SHIPPED_UNIT = REPO / "agent" / "systemd" / "spottrain-agent.service"
UNIT = "spottrain-agent.service"
PYTHON = "/usr/bin/python3"


def _load_standin() -> ModuleType:
    spec = importlib.util.spec_from_file_location("standin_systemd", STANDIN / "systemd.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


sd = _load_standin()

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="running a unit needs root (namespaces, cgroups)"
)

# The service's program: reports on stdout (the unit's append: file) as JSON lines.
PROGRAM = r"""
import json, os, resource, signal, sys, time

def say(**kw):
    print(json.dumps(kw), flush=True)

def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False

def status():
    with open("/proc/self/status") as f:
        return dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)

mode = sys.argv[1]
if mode == "env":
    say(event="env", env={k: os.environ.get(k) for k in sys.argv[2:]})
elif mode == "exit":
    say(event="run", pid=os.getpid())
    print("to-stderr", file=sys.stderr, flush=True)
    sys.exit(int(sys.argv[2]))
elif mode == "flaky":
    n = (int(open("count").read()) if os.path.exists("count") else 0) + 1
    open("count", "w").write(str(n))
    say(event="run", n=n)
    sys.exit(1 if n == 1 else 0)
elif mode == "probe":
    tag, marker = sys.argv[2], sys.argv[3]
    seen = os.path.exists(f"/tmp/{marker}")
    if tag == "pre":
        open(f"/tmp/{marker}", "w").close()
    st = status()
    try:
        root = os.listdir("/root")
    except OSError as exc:
        root = exc.strerror
    say(event="probe", tag=tag, nnp=st["NoNewPrivs"].strip(), capbnd=int(st["CapBnd"], 16),
        etc_writable=os.access("/etc", os.W_OK), usr_writable=os.access("/usr", os.W_OK),
        proc_sys_writable=os.access("/proc/sys/kernel/hostname", os.W_OK),
        tmp_marker=seen, root=root, nofile=resource.getrlimit(resource.RLIMIT_NOFILE))
    if tag == "main":
        while True:
            time.sleep(1)
elif mode == "graceful":
    def on_term(*_):
        say(event="sigterm")
        time.sleep(0.2)
        say(event="drained")
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    say(event="ready", pid=os.getpid())
    while True:
        time.sleep(0.05)
elif mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    say(event="ready", pid=os.getpid())
    while True:
        time.sleep(0.05)
elif mode == "mixed":
    def child(tag):
        def on_term(*_):
            say(event="child-sigterm", tag=tag, pid=os.getpid())
            os._exit(0)
        signal.signal(signal.SIGTERM, on_term)
        while True:
            time.sleep(0.05)
    plain = os.fork()
    if plain == 0:
        child("plain")
    r, w = os.pipe()
    first = os.fork()
    if first == 0:
        os.setsid()
        if os.fork() == 0:
            os.write(w, str(os.getpid()).encode())
            child("daemon")
        os._exit(0)
    os.close(w)
    daemon = int(os.read(r, 64))
    os.waitpid(first, 0)
    def on_term(*_):
        say(event="main-sigterm")
        time.sleep(0.5)
        say(event="children-after-sigterm", plain=alive(plain), daemon=alive(daemon))
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    say(event="ready", plain=plain, daemon=daemon)
    while True:
        time.sleep(0.05)
"""


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll until ``predicate`` holds (a bound generous for a loaded 2-core machine)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _cgroup_parent() -> Path | None:
    """This process's own cgroup v2 directory, if one is mounted and writable."""
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    roots = [m[4] for m in mounts if m[m.index("-") + 1] == "cgroup2"]
    if not roots:
        return None
    with open("/proc/self/cgroup") as f:
        own = next((line.split(":", 2)[2].strip() for line in f if line.startswith("0::")), "/")
    parent = Path(roots[0]) / own.lstrip("/")
    return parent if os.access(parent, os.W_OK) else None


@dataclass
class Box:
    """One test's stand-in: its folders, the manager and its console."""

    tmp: Path
    work: Path  # the service's working directory (what /opt/job is on a VM)
    units: Path
    console: io.StringIO
    manager: sd.ServiceManager
    socket_path: Path
    poweroffs: list[str] = field(default_factory=list)
    powered_off: threading.Event = field(default_factory=threading.Event)

    @property
    def log_path(self) -> Path:
        return self.tmp / "agent.log"

    def dropin(self, text: str, name: str = "test.conf") -> None:
        d = self.units / f"{UNIT}.d"
        d.mkdir(exist_ok=True)
        (d / name).write_text(text)

    def service(self, *lines: str, exec_args: str) -> None:
        """The test's drop-in: its program as ExecStart= plus ``lines`` in [Service]."""
        self.dropin(
            "[Service]\n"
            "EnvironmentFile=\n"
            f"EnvironmentFile={self.tmp / 'agent.env'}\n"
            "ExecStart=\n"
            f"ExecStart={PYTHON} {self.work / 'prog.py'} {exec_args}\n"
            f"StandardOutput=append:{self.log_path}\n"
            f"Environment=SPOTTRAIN_LOGS_FILE={self.log_path}\n"
            "RestartSec=100ms\n"
            "TimeoutStopSec=20\n" + "".join(f"{line}\n" for line in lines)
        )

    def events(self, kind: str | None = None) -> list[dict]:
        try:
            text = self.log_path.read_text()
        except FileNotFoundError:
            return []
        out = []
        for line in text.splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict) and (kind is None or event.get("event") == kind):
                    out.append(event)
        return out

    def wait_event(self, kind: str, count: int = 1) -> list[dict]:
        wait_until(lambda: len(self.events(kind)) >= count, f"{count} {kind!r} event(s)")
        return self.events(kind)

    def wait_state(self, *states: str) -> str:
        wait_until(lambda: self.manager.is_active(UNIT) in states, f"state in {states}")
        return self.manager.is_active(UNIT)

    def ctl(self, prog: str, *args: str) -> subprocess.CompletedProcess[str]:
        """Run the CLI as ``prog`` (systemctl, shutdown, ...) against this box's socket."""
        link = self.tmp / "bin" / prog
        if not link.exists():
            link.parent.mkdir(exist_ok=True)
            link.symlink_to(STANDIN / "systemctl")
        env = {**os.environ, "SYSTEMD_STANDIN_SOCKET": str(self.socket_path)}
        return subprocess.run(
            [str(link), *args], env=env, capture_output=True, text=True, timeout=120
        )


@pytest.fixture
def make_box(tmp_path: Path) -> Iterator[Callable[..., Box]]:
    """A factory of boxes (``cgroups=False``: the subreaper and /proc walk instead); each
    is closed, its processes killed and its cgroups and folders removed, pass or fail."""
    made: list[tuple[Box, Path | None]] = []

    def make(cgroups: bool = True, mountinfo: str | None = None) -> Box:
        tmp = tmp_path / f"box{len(made)}"
        units = tmp / "units"
        units.mkdir(parents=True)
        shutil.copy(SHIPPED_UNIT, units / UNIT)
        work = Path(tempfile.mkdtemp(prefix="standin-", dir="/dev/shm"))
        (work / "prog.py").write_text(PROGRAM)
        # What the boot script writes (controller/run/boot.py, _unit_lines).
        (units / f"{UNIT}.d").mkdir()
        (units / f"{UNIT}.d" / "job.conf").write_text(
            f"[Service]\nExecStartPre=/bin/mkdir -p {work}/ckpt/run-123\nWorkingDirectory={work}\n"
        )
        (tmp / "agent.env").write_text("SPOTTRAIN_RUN_ID=run-123\n")
        cgroup_root = None
        if cgroups:
            parent = _cgroup_parent()
            if parent is None:
                pytest.skip("no writable cgroup v2 hierarchy")
            cgroup_root = parent / f"standin-test-{uuid.uuid4().hex[:8]}"
        box_holder: list[Box] = []

        def on_poweroff() -> None:
            box = box_holder[0]
            box.poweroffs.append(f"{box.manager.power_action}:{box.manager.is_active(UNIT)}")
            box.powered_off.set()

        console = io.StringIO()
        manager = sd.ServiceManager(
            unit_dirs=[str(units)],
            console=console,
            state_dir=str(tmp / "state"),
            cgroup_root=str(cgroup_root) if cgroup_root else None,
            fstab_path=str(tmp / "fstab"),
            mountinfo_path=mountinfo or "/proc/self/mountinfo",
            on_poweroff=on_poweroff,
            python=PYTHON,
        )
        box = Box(tmp, work, units, console, manager, work / "ctl.sock")
        box_holder.append(box)
        made.append((box, cgroup_root))
        return box

    yield make
    for box, cgroup_root in made:
        try:
            box.manager.close()
        finally:
            shutil.rmtree(box.work, ignore_errors=True)
            if cgroup_root is not None and cgroup_root.exists():
                with contextlib.suppress(OSError):
                    (cgroup_root / "cgroup.kill").write_text("1")
                for d in sorted(cgroup_root.rglob("*/"), reverse=True):
                    with contextlib.suppress(OSError):
                        d.rmdir()
                with contextlib.suppress(OSError):
                    cgroup_root.rmdir()
        if box.console.getvalue() and os.environ.get("STANDIN_CONSOLE"):
            print(box.console.getvalue())


# --------------------------------------------------------------------------------------
# Pure parts: the parsers and the decisions


def test_split_words_follows_systemd_quoting_and_escapes() -> None:
    assert sd.split_words(r"""/bin/sh -c 'a "b" c' x\ty "d\"e" f'g h'i""") == [
        "/bin/sh",
        "-c",
        'a "b" c',
        "x\ty",
        'd"e',
        "fg hi",
    ]
    with pytest.raises(ValueError, match="unbalanced"):
        sd.split_words("'open")


def test_env_file_parser_reads_quotes_escapes_comments_and_continuations() -> None:
    text = (
        "# a comment\n"
        "; another\n"
        "PLAIN=simple value   \n"
        'DQ="double \\"quoted\\" with \\\\ backslash, \\$dollar and \\n kept"\n'
        "SQ='single \"kept\" \\n literal'\n"
        "ESC=back\\\\slash\\ space\n"
        'CONT="line one \\\nline two"\n'
        " SPACED = padded \n"
        "no equals sign\n"
        "9BAD=x\n"
        "EMPTY=\n"
    )
    assert sd.parse_env_file(text) == {
        "PLAIN": "simple value",
        "DQ": 'double "quoted" with \\ backslash, $dollar and \\n kept',
        "SQ": 'single "kept" \\n literal',
        "ESC": "back\\slash space",
        "CONT": "line one line two",
        "SPACED": "padded",
        "EMPTY": "",
    }


def test_unit_syntax_merges_drop_ins_with_continuations_comments_and_resets() -> None:
    unit = sd.parse_unit_text(
        "[Service]\n"
        "ExecStart=/bin/echo one \\\n"
        "# a comment inside a continued line is skipped\n"
        "  two\n"
        "Environment=A=1 'B=two words'\n"
        "RestartPreventExitStatus=2 3\n"
        "ExecStartPre=/bin/true\n",
        "unit",
    )
    dropin = sd.parse_unit_text(
        "[Service]\nExecStartPre=\nExecStartPre=-/bin/false\nRestartPreventExitStatus=SIGABRT\n",
        "dropin",
    )
    config = sd.apply_assignments(UNIT, unit + dropin)
    assert config.exec_start[0].argv == ("/bin/echo", "one", "two")
    assert config.environment == (("A", "1"), ("B", "two words"))
    assert [c.raw for c in config.exec_start_pre] == ["-/bin/false"]
    assert config.exec_start_pre[0].ignore_failure
    assert config.restart_prevent_status == (2, 3)
    assert config.restart_prevent_signals == (signal.SIGABRT,)


def test_exec_lines_expand_variables_as_systemd_does() -> None:
    command = sd.parse_exec("-@/bin/tool argv0 $WORDS ${ONE} --x=${ONE}$$ $UNSET '$NOT_WHOLE x'")
    assert command.ignore_failure and command.path == "/bin/tool"
    env = {"WORDS": "a  b", "ONE": "one word"}
    assert command.expand(env) == ["argv0", "a", "b", "one word", "--x=one word$", "$NOT_WHOLE x"]
    assert sd.parse_exec(":/bin/echo $WORDS").expand(env) == ["/bin/echo", "$WORDS"]


def test_shipped_unit_with_boot_drop_in_loads(tmp_path: Path) -> None:
    shutil.copy(SHIPPED_UNIT, tmp_path / UNIT)
    (tmp_path / f"{UNIT}.d").mkdir()
    (tmp_path / f"{UNIT}.d" / "job.conf").write_text(
        "[Unit]\nRequiresMountsFor=/data/ckpt\n\n[Service]\n"
        "ExecStartPre=/bin/mkdir -p /mnt/spottrain/ckpt/run-123\n"
        "ExecStart=\n"
        "ExecStart=/usr/bin/docker run --rm --init --name spottrain-agent img spottrain-agent run\n"
    )
    config = sd.load_unit(UNIT, [str(tmp_path)])
    assert config.requires_mounts_for == ("/mnt/spottrain", "/data/ckpt")
    assert config.exec_start[0].path == "/usr/bin/docker"
    assert [c.privileged for c in config.exec_start_pre] == [True, False]
    assert config.kill_mode == "mixed" and config.timeout_stop == 170.0
    assert config.limits == (("NOFILE", 1048576, 1048576), ("MEMLOCK", -1, -1))


def test_every_known_directive_says_whether_it_is_enforced_as_the_docs_say() -> None:
    table = sd.support_table()
    assert all(v.startswith(("enforced", "accepted")) for v in table.values())
    assert table["[Service] LockPersonality="].startswith("accepted, not enforced")
    assert table["[Service] NoNewPrivileges="].startswith("enforced")
    doc = (REPO / "docs" / "real-clouds.md").read_text()
    rows = [line for line in doc.splitlines() if line.startswith("| `[")]
    escaped = {k: v.replace("<", "&lt;").replace(">", "&gt;") for k, v in table.items()}
    assert rows == [f"| `{k}` | {v} |" for k, v in escaped.items()]


@pytest.mark.parametrize(
    ("policy", "result", "exit_", "restarts"),
    [
        ("on-failure", "exit-code", sd.ExitStatus("exited", 1), True),
        ("on-failure", "exit-code", sd.ExitStatus("exited", 2), False),
        ("on-failure", "exit-code", sd.ExitStatus("exited", 3), False),
        ("on-failure", "success", sd.ExitStatus("exited", 0), False),
        ("on-failure", "success", sd.ExitStatus("killed", signal.SIGTERM), False),
        ("on-failure", "signal", sd.ExitStatus("killed", signal.SIGKILL), True),
        ("on-abnormal", "exit-code", sd.ExitStatus("exited", 1), False),
        ("always", "success", sd.ExitStatus("exited", 0), True),
        ("always", "start-limit-hit", None, False),
        ("no", "signal", sd.ExitStatus("killed", signal.SIGKILL), False),
    ],
)
def test_restart_decision_follows_systemds_table(policy, result, exit_, restarts) -> None:
    decided, reason = sd.decide_restart(policy, result, exit_, (2, 3), ())
    assert decided is restarts, reason


def test_start_limit_allows_five_starts_in_ten_seconds() -> None:
    limit = sd.StartLimit()
    assert [limit.allow(10.0, 5, t) for t in (0, 1, 2, 3, 4, 5)] == [True] * 5 + [False]
    assert limit.allow(10.0, 5, 10.5)


def test_missing_mounts_are_fstab_prefixes_not_mounted() -> None:
    fstab = sd.parse_fstab("/dev/vdb /mnt/spottrain ext4 defaults 0 2\n/dev/vdc none swap sw 0 0\n")
    assert sd.missing_mounts(["/mnt/spottrain/ckpt"], fstab, {"/"}) == ["/mnt/spottrain"]
    assert sd.missing_mounts(["/mnt/spottrain"], fstab, {"/", "/mnt/spottrain"}) == []
    assert sd.missing_mounts(["/data/ckpt"], fstab, {"/"}) == []
    assert sd.mount_unit_name("/mnt/spot-train") == "mnt-spot\\x2dtrain.mount"


# --------------------------------------------------------------------------------------
# The shipped unit, run


@needs_root
def test_environment_file_values_reach_the_process(make_box) -> None:
    box = make_box()
    (box.tmp / "agent.env").write_text(
        "# written by the boot script\n"
        "PLAIN=simple value\n"
        'DQ="a \\"quoted\\" \\\\ backslash"\n'
        "SQ='single \"kept\" \\n as is'\n"
        "ESC=back\\\\slash\\ space\n"
        "SPOTTRAIN_WORKER_USER=\n"
    )
    names = "PLAIN DQ SQ ESC SPOTTRAIN_WORKER_USER PYTHONUNBUFFERED QUOTED OTHER INVOCATION_ID"
    box.service('Environment="QUOTED=two words" OTHER=x', exec_args=f"env {names}")
    box.manager.daemon_reload()
    box.manager.start(UNIT)
    env = box.wait_event("env")[0]["env"]
    assert env["PLAIN"] == "simple value"
    assert env["DQ"] == 'a "quoted" \\ backslash'
    assert env["SQ"] == 'single "kept" \\n as is'
    assert env["ESC"] == "back\\slash space"
    # The env file overrides Environment= (agent.env may empty the worker user).
    assert env["SPOTTRAIN_WORKER_USER"] == ""
    assert env["PYTHONUNBUFFERED"] == "1"
    assert (env["QUOTED"], env["OTHER"]) == ("two words", "x")
    assert env["INVOCATION_ID"] == box.manager.show(UNIT)["InvocationID"]


@needs_root
def test_standard_output_append_writes_and_appends(make_box) -> None:
    box = make_box()
    box.log_path.write_text("from before the boot\n")
    box.service(exec_args="exit 0")
    box.manager.daemon_reload()
    for run in (1, 2):
        box.manager.start(UNIT)
        box.wait_event("run", run)
        assert box.wait_state("inactive") == "inactive"
    lines = box.log_path.read_text().splitlines()
    assert lines[0] == "from before the boot"
    assert [json.loads(x)["event"] for x in lines[1:] if x.startswith("{")] == ["run", "run"]
    # StandardError=inherit: stderr goes to the same file.
    assert lines.count("to-stderr") == 2


@needs_root
def test_exec_start_pre_dash_failure_is_ignored_and_plus_runs_outside_the_sandbox(
    make_box,
) -> None:
    box = make_box()
    marker = f"standin-marker-{uuid.uuid4().hex}"
    prog = f"{PYTHON} {box.work / 'prog.py'}"
    box.service(
        f"ExecStartPre=+{prog} probe plus {marker}",
        f"ExecStartPre={prog} probe pre {marker}",
        "ExecStartPre=-/bin/false",
        exec_args=f"probe main {marker}",
    )
    box.manager.daemon_reload()
    box.manager.start(UNIT)
    assert box.manager.is_active(UNIT) == "active"
    probes = {p["tag"]: p for p in box.wait_event("probe", 3)}
    plus, pre, main = probes["plus"], probes["pre"], probes["main"]
    # "+": full privileges, the VM's own /etc, /tmp, /proc/sys.
    assert plus["nnp"] == "0" and plus["etc_writable"] and plus["proc_sys_writable"]
    assert not plus["tmp_marker"]
    # The sandbox: NoNewPrivileges, ProtectSystem=full, ProtectKernelTunables, a private
    # /tmp shared by the unit's sandboxed commands, ProtectHome, the capability drops.
    for probe in (pre, main):
        assert probe["nnp"] == "1"
        assert not probe["etc_writable"] and not probe["usr_writable"]
        assert not probe["proc_sys_writable"]
        assert not probe["capbnd"] & (1 << 16)  # CAP_SYS_MODULE
        assert not probe["capbnd"] & (1 << 34)  # CAP_SYSLOG
    assert plus["capbnd"] & (1 << 16)
    assert main["tmp_marker"]
    assert main["root"] == [] or isinstance(main["root"], str)
    assert not Path("/tmp", marker).exists()
    # The boot drop-in's ExecStartPre made the run's checkpoint directory.
    assert (box.work / "ckpt" / "run-123").is_dir()
    console = box.console.getvalue()
    assert "Failed to start" not in console
    assert "Started spottrain agent (elastic training on spot VMs)." in console


@needs_root
def test_restart_on_failure_restarts_after_exit_1(make_box) -> None:
    box = make_box()
    box.service(exec_args="flaky")
    box.manager.daemon_reload()
    box.manager.start(UNIT)
    runs = box.wait_event("run", 2)
    assert box.wait_state("inactive") == "inactive"
    assert [r["n"] for r in runs] == [1, 2]
    console = box.console.getvalue()
    assert f"{UNIT}: Main process exited, code=exited, status=1/FAILURE" in console
    assert f"{UNIT}: Scheduled restart job, restart counter is at 1." in console
    assert box.manager.show(UNIT)["NRestarts"] == "1"


@pytest.mark.parametrize(("code", "state"), [(2, "failed"), (3, "failed"), (0, "inactive")])
@needs_root
def test_restart_on_failure_does_not_restart_after_a_prevented_or_clean_exit(
    make_box, code: int, state: str
) -> None:
    box = make_box()
    box.service(exec_args=f"exit {code}")
    box.manager.daemon_reload()
    box.manager.start(UNIT)
    box.wait_event("run")
    assert box.wait_state("inactive", "failed") == state
    time.sleep(0.5)  # five times RestartSec: a restart would have run by now
    assert len(box.events("run")) == 1
    assert "Scheduled restart job" not in box.console.getvalue()
    assert box.manager.show(UNIT)["ExecMainStatus"] == str(code)


@needs_root
def test_start_rate_limit_ends_restarts(make_box) -> None:
    box = make_box()
    # Nothing but the failing command, so five starts fit well within the default 10 s.
    box.dropin(
        "[Service]\nEnvironmentFile=\nExecStartPre=\nExecStart=\n"
        f"ExecStart=/bin/sh -c 'echo run; exit 1'\nStandardOutput=append:{box.log_path}\n"
        "RestartSec=100ms\n"
    )
    box.manager.daemon_reload()
    box.manager.start(UNIT)
    wait_until(lambda: box.manager.show(UNIT)["Result"] == "start-limit-hit", "start-limit-hit")
    assert box.manager.is_active(UNIT) == "failed"
    assert box.log_path.read_text().splitlines() == ["run"] * 5
    console = box.console.getvalue()
    assert f"{UNIT}: Start request repeated too quickly." in console
    assert console.count("Scheduled restart job") == 5
    with pytest.raises(sd.JobFailedError) as failed:
        box.manager.start(UNIT)
    assert failed.value.result == "start-limit-hit"


@pytest.mark.parametrize("cgroups", [True, False], ids=["cgroup", "proc-walk"])
@needs_root
def test_kill_mode_mixed_terms_the_main_only_then_kills_its_children(
    make_box, cgroups: bool
) -> None:
    box = make_box(cgroups=cgroups)
    box.service(exec_args="mixed")
    box.manager.daemon_reload()
    box.manager.start(UNIT)
    ready = box.wait_event("ready")[0]
    plain, daemon = ready["plain"], ready["daemon"]
    assert _alive(plain) and _alive(daemon)
    box.manager.stop(UNIT)
    after = box.events("children-after-sigterm")
    assert box.events("main-sigterm") and after
    # Both children (one in its own session, double-forked) outlived the SIGTERM ...
    assert after[0]["plain"] and after[0]["daemon"]
    assert box.events("child-sigterm") == []
    # ... and were killed once the main process had exited.
    assert not _alive(plain) and not _alive(daemon)
    console = box.console.getvalue()
    for pid in (plain, daemon):
        assert f"{UNIT}: Killing process {pid} (python3) with signal SIGKILL." in console
    assert box.manager.is_active(UNIT) == "inactive"


@needs_root
def test_timeout_stop_sec_kills_a_main_process_that_ignores_sigterm(make_box) -> None:
    box = make_box()
    box.service("TimeoutStopSec=1", exec_args="ignore-term")
    box.manager.daemon_reload()
    box.manager.start(UNIT)
    pid = box.wait_event("ready")[0]["pid"]
    began = time.monotonic()
    box.manager.stop(UNIT)
    took = time.monotonic() - began
    assert 0.9 <= took < 20
    assert not _alive(pid)
    console = box.console.getvalue()
    assert f"{UNIT}: State 'stop-sigterm' timed out. Killing." in console
    assert f"{UNIT}: Main process exited, code=killed, status=9/KILL" in console
    assert box.manager.is_active(UNIT) == "failed"
    assert box.manager.show(UNIT)["Result"] == "timeout"


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ("[Service]\nFrobnicate=yes\n", "unknown directive Frobnicate="),
        ("[Service]\nExecStartPre=!/bin/true\n", "prefix !"),
        ("[Service]\nExecStartPre=!!/bin/true\n", "prefix !!"),
        ("[Service]\nExecStartPre=/bin/echo %n\n", "'%' specifier"),
        ("[Sandbox]\nPrivateTmp=yes\n", "unknown section [Sandbox]"),
    ],
    ids=["directive", "prefix", "prefix2", "specifier", "section"],
)
def test_daemon_reload_refuses_what_the_stand_in_does_not_know(
    make_box, line: str, named: str
) -> None:
    box = make_box(cgroups=False)
    box.dropin(line, name="bad.conf")
    with pytest.raises(sd.UnitError) as refused:
        box.manager.daemon_reload()
    assert named in str(refused.value)
    assert f"{UNIT}.d/bad.conf:" in str(refused.value)
    with pytest.raises(sd.UnitError):
        box.manager.start(UNIT)


@needs_root
def test_requires_mounts_for_fails_the_start_while_the_fstab_entry_is_not_mounted(
    make_box, tmp_path: Path
) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text("27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n")
    box = make_box(mountinfo=str(mountinfo))
    (box.tmp / "fstab").write_text("/dev/vdb /mnt/spottrain ext4 defaults,nofail 0 2\n")
    box.service(exec_args="graceful")
    box.manager.daemon_reload()
    with pytest.raises(sd.JobFailedError) as failed:
        box.manager.start(UNIT)
    assert failed.value.result == "dependency"
    assert box.manager.is_active(UNIT) == "inactive"
    console = box.console.getvalue()
    assert "mnt-spottrain.mount: /mnt/spottrain is listed in" in console
    assert "Dependency failed for spottrain agent (elastic training on spot VMs)." in console
    assert box.events() == []
    # Once the volume is mounted, the same start succeeds.
    mountinfo.write_text(
        mountinfo.read_text() + "40 27 254:16 / /mnt/spottrain rw,relatime - ext4 /dev/vdb rw\n"
    )
    box.manager.start(UNIT)
    box.wait_event("ready")


@needs_root
def test_start_fails_when_the_binary_cannot_be_executed(make_box) -> None:
    box = make_box()
    box.dropin(
        "[Service]\nExecStart=\nExecStart=/opt/spottrain/venv/bin/spottrain-agent-missing run\n"
        f"EnvironmentFile=\nStandardOutput=append:{box.log_path}\nRestart=no\n",
        name="zz.conf",
    )
    box.manager.daemon_reload()
    with pytest.raises(sd.JobFailedError) as failed:
        box.manager.start(UNIT)
    assert failed.value.result == "exit-code"
    console = box.console.getvalue()
    assert "Failed at step EXEC spawning /opt/spottrain/venv/bin/spottrain-agent-missing" in console
    assert "Main process exited, code=exited, status=203/EXEC" in console
    assert box.manager.is_active(UNIT) == "failed"


@needs_root
def test_shutdown_now_through_the_cli_stops_units_gracefully_then_calls_on_poweroff(
    make_box,
) -> None:
    box = make_box()
    box.service(exec_args="graceful")
    box.manager.daemon_reload()
    box.manager.serve(str(box.socket_path))
    box.manager.start(UNIT)
    box.wait_event("ready")
    done = box.ctl("shutdown", "-h", "now")
    assert done.returncode == 0, done.stderr
    assert box.powered_off.wait(60)
    # The unit had drained and stopped before on_poweroff ran.
    assert box.poweroffs == ["poweroff:inactive"]
    assert box.events("sigterm") and box.events("drained")
    console = box.console.getvalue()
    assert console.index("Stopped spottrain agent") < console.index("Reached target System Power")
    # No unit starts once the VM is powering off.
    with pytest.raises(sd.JobFailedError):
        box.manager.start(UNIT)


@needs_root
def test_systemctl_enable_now_works_end_to_end_through_the_socket(make_box) -> None:
    box = make_box()
    box.service(exec_args="graceful")
    box.manager.serve(str(box.socket_path))
    assert box.ctl("systemctl", "daemon-reload").returncode == 0
    enabled = box.ctl("systemctl", "enable", "--now", f"{UNIT}")
    assert enabled.returncode == 0, enabled.stderr
    link = box.units / "multi-user.target.wants" / UNIT
    assert f"Created symlink {link}" in enabled.stderr
    assert link.resolve() == (box.units / UNIT).resolve()
    box.wait_event("ready")
    active = box.ctl("systemctl", "is-active", "spottrain-agent")
    assert (active.returncode, active.stdout) == (0, "active\n")
    main_pid = box.ctl("systemctl", "show", "-p", "MainPID", "--value", UNIT).stdout.strip()
    assert int(main_pid) == box.events("ready")[0]["pid"]
    status = box.ctl("systemctl", "status", UNIT)
    assert status.returncode == 0
    assert "Active: active (running)" in status.stdout
    assert box.ctl("systemctl", "is-enabled", UNIT).stdout == "enabled\n"
    assert box.ctl("systemctl", "stop", UNIT).returncode == 0
    inactive = box.ctl("systemctl", "is-active", UNIT)
    assert (inactive.returncode, inactive.stdout) == (3, "inactive\n")
    assert box.ctl("systemctl", "start", "nosuch.service").returncode == 5
    assert box.ctl("systemctl", "status", "nosuch.service").returncode == 4


def test_cli_refuses_unknown_verbs_and_options_naming_them(tmp_path: Path) -> None:
    link = tmp_path / "systemctl"
    link.symlink_to(STANDIN / "systemctl")
    env = {**os.environ, "SYSTEMD_STANDIN_SOCKET": str(tmp_path / "none.sock")}
    for args, named in (
        (["frobnicate", UNIT], "frobnicate"),
        (["--frob", "start", UNIT], "--frob"),
        (["start", "-x", UNIT], "'x'"),
    ):
        run = subprocess.run([str(link), *args], env=env, capture_output=True, text=True)
        assert run.returncode == 1
        assert named in run.stderr
    # No manager listening: systemctl's answer without systemd.
    run = subprocess.run([str(link), "is-active", UNIT], env=env, capture_output=True, text=True)
    assert run.returncode == 1 and "not been booted with systemd" in run.stderr

"""A systemd stand-in for "VMs in a box": runs the product's real service unit as systemd would.

A box VM has no systemd, yet its boot script installs ``spottrain-agent.service`` and runs
``systemctl daemon-reload`` and ``systemctl enable --now``. This module is the service
manager behind those commands: it parses unit files with systemd's syntax, refuses every
section, directive, prefix or specifier it does not implement (``UnitError``), and runs a
service with systemd's semantics for what it knows (``DIRECTIVES`` says, for each
directive, how it is enforced or why it is only accepted).

Pieces:

- the parsers (unit files and drop-ins, Exec command lines, Environment=, env files, time
  spans) and the decisions (``decide_restart``, ``StartLimit``, ``missing_mounts``) are pure
  functions of their arguments;
- ``ServiceManager`` holds the units; one worker thread per running unit walks systemd's
  states (start-pre, start, running, stop-sigterm, stop-sigkill, final-sigterm,
  final-sigkill, auto-restart) and writes systemd's lines to the console;
- each command runs through ``execwrap.py`` (joins the unit's cgroup, sets limits and the
  sandbox, then execve), spawned with posix_spawn so that no Python runs between fork and
  exec in this threaded process;
- a unit's processes are tracked by a cgroup v2 per unit (``cgroup_root``) or, without
  one, by a subreaper and a /proc walk;
- ``serve()`` answers the ``systemctl`` / ``shutdown`` CLI on a UNIX socket (JSON lines).

Standalone: only the standard library, runnable under Debian's /usr/bin/python3 (3.11)
inside a VM where neither spottrain nor the tests can be imported.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import errno
import fcntl
import json
import math
import os
import re
import resource
import select
import shutil
import signal
import socket
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

# Read at import: a box VM's init imports this module before its mounts hide the folder, and
# the manager then writes the wrapper into its state directory, which the VM can see.
EXECWRAP_SOURCE = Path(__file__).resolve().with_name("execwrap.py").read_text()
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin"
SECTIONS = ("Unit", "Service", "Install")

# --------------------------------------------------------------------------------------
# Errors


class UnitError(Exception):
    """A unit file the stand-in refuses: bad syntax, an unknown section, directive, value,
    Exec prefix, or a ``%`` specifier. ``problems`` lists each as ``path:line: message``."""

    def __init__(self, problems: str | Sequence[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class UnitNotFoundError(LookupError):
    """No unit file of that name in any unit directory."""

    def __init__(self, unit: str) -> None:
        super().__init__(f"Unit {unit} not found.")
        self.unit = unit


class JobFailedError(RuntimeError):
    """A start (or restart) job did not end with the unit running.

    ``result`` is systemd's: ``exit-code``, ``signal``, ``core-dump``, ``timeout``,
    ``resources``, ``dependency``, ``start-limit-hit``, ``canceled``, ``destructive`` (a
    power-off is under way), ``bad-setting`` or ``masked``.
    """

    def __init__(self, unit: str, result: str, message: str) -> None:
        super().__init__(message)
        self.unit, self.result = unit, result


# --------------------------------------------------------------------------------------
# Value parsers (each raises ValueError with the reason)

_TRUE = {"1", "yes", "y", "true", "t", "on"}
_FALSE = {"0", "no", "n", "false", "f", "off"}

_TIME_UNITS = {
    "us": 1e-6, "usec": 1e-6, "µs": 1e-6, "μs": 1e-6,
    "ms": 1e-3, "msec": 1e-3,
    "": 1.0, "s": 1.0, "sec": 1.0, "second": 1.0, "seconds": 1.0,
    "m": 60.0, "min": 60.0, "minute": 60.0, "minutes": 60.0,
    "h": 3600.0, "hr": 3600.0, "hour": 3600.0, "hours": 3600.0,
    "d": 86400.0, "day": 86400.0, "days": 86400.0,
    "w": 604800.0, "week": 604800.0, "weeks": 604800.0,
    "M": 2629800.0, "month": 2629800.0, "months": 2629800.0,
    "y": 31557600.0, "year": 31557600.0, "years": 31557600.0,
}  # fmt: skip

_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def parse_bool(value: str) -> bool:
    """systemd's boolean: 1/yes/y/true/t/on or 0/no/n/false/f/off."""
    low = value.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"not a boolean: {value!r}")


def parse_timespan(value: str) -> float:
    """A systemd time span in seconds ("170", "5s", "1min 30s", "100ms"); ``math.inf`` for
    "infinity". A bare number is seconds."""
    text = value.strip()
    if text == "infinity":
        return math.inf
    total, pos = 0.0, 0
    token = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-zµμ]*)")
    if not text:
        raise ValueError("empty time span")
    while pos < len(text):
        m = token.match(text, pos)
        if not m or m.group(2) not in _TIME_UNITS:
            raise ValueError(f"not a time span: {value!r}")
        total += float(m.group(1)) * _TIME_UNITS[m.group(2)]
        pos = m.end()
    return total


def parse_timeout(value: str) -> float:
    """TimeoutStartSec=/TimeoutStopSec=: a time span where 0 also means no timeout."""
    span = parse_timespan(value)
    return math.inf if span == 0 else span


def parse_signal(value: str) -> int:
    """A signal by name ("SIGTERM", "TERM") or number."""
    if value.isdigit():
        return int(signal.Signals(int(value)))
    name = value if value.startswith("SIG") else "SIG" + value
    try:
        return int(signal.Signals[name])
    except KeyError:
        raise ValueError(f"unknown signal {value!r}") from None


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


def parse_size(value: str) -> int:
    """A byte count with an optional base-1024 suffix (K, M, G, T, P)."""
    m = re.fullmatch(r"([0-9]+)\s*([KMGTP]?)B?", value.strip())
    if not m:
        raise ValueError(f"not a size: {value!r}")
    return int(m.group(1)) * _SIZE_UNITS[m.group(2)]


# --------------------------------------------------------------------------------------
# systemd's word splitting and escapes (systemd.syntax(7), "Quoting")

_SIMPLE_ESCAPES = {
    "a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
    "\\": "\\", '"': '"', "'": "'", "s": " ", ";": ";",
}  # fmt: skip


def _unescape_one(text: str, i: int) -> tuple[str, int]:
    """The C escape whose backslash is at ``text[i-1]``; returns (char, next index)."""
    c = text[i]
    if c in _SIMPLE_ESCAPES:
        return _SIMPLE_ESCAPES[c], i + 1
    if c == "x" and re.fullmatch(r"[0-9a-fA-F]{2}", text[i + 1 : i + 3]):
        return chr(int(text[i + 1 : i + 3], 16)), i + 3
    if c in "01234567" and re.fullmatch(r"[0-7]{3}", text[i : i + 3]):
        return chr(int(text[i : i + 3], 8)), i + 3
    if c == "u" and re.fullmatch(r"[0-9a-fA-F]{4}", text[i + 1 : i + 5]):
        return chr(int(text[i + 1 : i + 5], 16)), i + 5
    if c == "U" and re.fullmatch(r"[0-9a-fA-F]{8}", text[i + 1 : i + 9]):
        return chr(int(text[i + 1 : i + 9], 16)), i + 9
    raise ValueError(f"unknown escape sequence \\{c}")


def split_words(value: str) -> list[str]:
    """Split like systemd's extract_first_word(UNQUOTE|CUNESCAPE): words separated by
    whitespace, double or single quotes anywhere in a word (removed), C escapes in and out
    of quotes. Unbalanced quotes, a trailing backslash or an unknown escape: ValueError."""
    words: list[str] = []
    i, n = 0, len(value)
    while True:
        while i < n and value[i] in " \t\n\r":
            i += 1
        if i >= n:
            return words
        word: list[str] = []
        quote = ""
        while i < n:
            c = value[i]
            if c == "\\":
                if i + 1 >= n:
                    raise ValueError("trailing backslash")
                ch, i = _unescape_one(value, i + 1)
                word.append(ch)
            elif quote:
                if c == quote:
                    quote = ""
                else:
                    word.append(c)
                i += 1
            elif c in "'\"":
                quote = c
                i += 1
            elif c in " \t\n\r":
                break
            else:
                word.append(c)
                i += 1
        if quote:
            raise ValueError("unbalanced quoting")
        words.append("".join(word))


def parse_environment(value: str) -> tuple[tuple[str, str], ...]:
    """Environment=: one or more (quoted) NAME=VALUE assignments."""
    pairs = []
    for word in split_words(value):
        name, eq, val = word.partition("=")
        if not eq or not _ENV_NAME.match(name):
            raise ValueError(f"invalid environment assignment {word!r}")
        pairs.append((name, val))
    return tuple(pairs)


def parse_env_file(text: str) -> dict[str, str]:
    """An EnvironmentFile= as systemd reads it (its env-file parser): ``KEY=VALUE`` lines;
    ``#``/``;`` comment lines; whitespace around key and value dropped; single quotes keep
    everything; double quotes unescape only \\" \\\\ \\` \\$ (other backslashes stay) and a
    backslash-newline; unquoted, a backslash keeps the next character (backslash-newline
    continues the line). Quoted and unquoted parts of a value join. A line without ``=`` or
    with an invalid name is dropped, as systemd drops it."""
    out: dict[str, str] = {}
    key: list[str] = []
    value: list[str] = []
    state = "pre_key"
    key_ws: int | None = None  # where trailing whitespace of the key starts
    val_ws: int | None = None

    def push() -> None:
        k = "".join(key[:key_ws] if key_ws is not None else key)
        if _ENV_NAME.match(k):
            out[k] = "".join(value)

    for c in text + "\n":
        if state == "pre_key":
            if c in "#;":
                state = "comment"
            elif c not in " \t\n\r":
                state, key, value, key_ws = "key", [c], [], None
        elif state == "key":
            if c in "\n\r":
                state = "pre_key"
            elif c == "=":
                state, val_ws = "pre_value", None
            else:
                if c not in " \t":
                    key_ws = None
                elif key_ws is None:
                    key_ws = len(key)
                key.append(c)
        elif state == "pre_value":
            if c in "\n\r":
                push()
                state = "pre_key"
            elif c == "'":
                state = "single"
            elif c == '"':
                state = "double"
            elif c == "\\":
                state = "value_escape"
            elif c not in " \t":
                state, val_ws = "value", None
                value.append(c)
        elif state == "value":
            if c in "\n\r":
                if val_ws is not None:
                    del value[val_ws:]
                push()
                state = "pre_key"
            elif c == "\\":
                state, val_ws = "value_escape", None
            else:
                if c not in " \t":
                    val_ws = None
                elif val_ws is None:
                    val_ws = len(value)
                value.append(c)
        elif state == "value_escape":
            state = "value"
            if c != "\n":
                value.append(c)
        elif state == "single":
            if c == "'":
                state = "pre_value"
            else:
                value.append(c)
        elif state == "double":
            if c == '"':
                state = "pre_value"
            elif c == "\\":
                state = "double_escape"
            else:
                value.append(c)
        elif state == "double_escape":
            state = "double"
            if c in '"\\`$':
                value.append(c)
            elif c != "\n":
                value += ["\\", c]
        elif state == "comment":
            if c == "\\":
                state = "comment_escape"
            elif c in "\n\r":
                state = "pre_key"
        elif state == "comment_escape":
            state = "pre_key" if c in "\n\r" else "comment"
    return out


# --------------------------------------------------------------------------------------
# Exec command lines


@dataclass(frozen=True)
class ExecCommand:
    """One ExecStart=/ExecStartPre= line: the executable, its argv (not yet expanded) and
    the prefixes: ``-`` failure ignored, ``+`` full privileges (no sandbox), ``@`` the
    second word is argv[0], ``:`` no environment variable substitution."""

    path: str
    argv: tuple[str, ...]
    ignore_failure: bool = False
    privileged: bool = False
    no_env_expand: bool = False
    raw: str = ""

    def expand(self, env: Mapping[str, str]) -> list[str]:
        """argv with systemd's substitution: a word that is exactly ``$NAME`` becomes the
        value split at whitespace (nothing if unset); ``${NAME}`` anywhere becomes the exact
        value; ``$$`` is a ``$``."""
        if self.no_env_expand:
            return list(self.argv)
        out: list[str] = []
        for word in self.argv:
            whole = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
            if whole:
                out.extend(env.get(whole.group(1), "").split())
                continue
            out.append(
                re.sub(
                    r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)\}",
                    lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), ""),
                    word,
                )
            )
        return out


def parse_exec(value: str) -> ExecCommand:
    """One Exec line with its prefixes (``-``, ``+``, ``@``, ``:``; ``!`` and ``!!`` are
    refused: they only matter with User=, which the stand-in does not implement)."""
    text = value.lstrip()
    ignore = privileged = at = colon = False
    while text and text[0] in "-+@:!|":
        c = text[0]
        if c == "!":
            raise ValueError(
                f"Exec prefix {'!!' if text.startswith('!!') else '!'} is not supported"
            )
        if c == "|":
            raise ValueError("Exec prefix | is not supported")
        if c == "-":
            ignore = True
        elif c == "+":
            privileged = True
        elif c == "@":
            at = True
        else:
            colon = True
        text = text[1:]
    words = split_words(text)
    if not words:
        raise ValueError("empty command line")
    if ";" in words:
        raise ValueError("several commands on one line (';') are not supported")
    path = words[0]
    if at:
        if len(words) < 2:
            raise ValueError("'@' prefix without argv[0]")
        argv = tuple(words[1:])
    else:
        argv = tuple(words)
    if not path.startswith("/") and "/" in path:
        raise ValueError(f"neither a valid executable name nor an absolute path: {path!r}")
    return ExecCommand(path, argv, ignore, privileged, colon, value)


# --------------------------------------------------------------------------------------
# Unit configuration


@dataclass(frozen=True)
class Output:
    """StandardOutput=/StandardError=: ``journal`` (the console), ``null``, ``inherit``,
    ``file``/``append``/``truncate`` with a path."""

    kind: str
    path: str | None = None


@dataclass(frozen=True)
class UnitConfig:
    """A service unit after its file and drop-ins are merged. Defaults are systemd's."""

    name: str
    fragment: str = ""
    dropins: tuple[str, ...] = ()
    description: str = ""
    documentation: tuple[str, ...] = ()
    wants: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    before: tuple[str, ...] = ()
    requires_mounts_for: tuple[str, ...] = ()
    start_limit_interval: float = 10.0
    start_limit_burst: int = 5
    type: str = "simple"
    exec_start: tuple[ExecCommand, ...] = ()
    exec_start_pre: tuple[ExecCommand, ...] = ()
    environment: tuple[tuple[str, str], ...] = ()
    environment_files: tuple[tuple[str, bool], ...] = ()  # (path, optional)
    working_directory: tuple[str, bool] | None = None  # (path, optional)
    standard_output: Output = Output("journal")
    standard_error: Output = Output("inherit")
    syslog_identifier: str = ""
    kill_mode: str = "control-group"
    kill_signal: int = int(signal.SIGTERM)
    send_sigkill: bool = True
    timeout_start: float = 90.0
    timeout_stop: float = 90.0
    restart: str = "no"
    restart_sec: float = 0.1
    restart_prevent_status: tuple[int, ...] = ()
    restart_prevent_signals: tuple[int, ...] = ()
    limits: tuple[tuple[str, int, int], ...] = ()  # (name, soft, hard), -1 = infinity
    tasks_max: str = ""
    no_new_privileges: bool = False
    restrict_suid_sgid: bool = False
    protect_system: str = "no"
    protect_home: str = "no"
    private_tmp: bool = False
    protect_kernel_tunables: bool = False
    protect_kernel_modules: bool = False
    protect_kernel_logs: bool = False
    protect_control_groups: bool = False
    protect_hostname: bool = False
    lock_personality: bool = False
    restrict_realtime: bool = False
    system_call_architectures: tuple[str, ...] = ()
    wanted_by: tuple[str, ...] = ()
    required_by: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """What systemd calls the unit in "Started ..." lines: Description= or the name."""
        return self.description or self.name


def _words(value: str) -> tuple[str, ...]:
    return tuple(value.split())


def _abs_paths(value: str) -> tuple[str, ...]:
    paths = split_words(value)
    for p in paths:
        if not p.startswith("/"):
            raise ValueError(f"not an absolute path: {p!r}")
    return tuple(os.path.normpath(p) for p in paths)


def _choice(*options: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if value not in options:
            raise ValueError(f"{value!r} is not one of {', '.join(options)}")
        return value

    return parse


def _positive_int(value: str) -> int:
    if not value.isdigit():
        raise ValueError(f"not a non-negative integer: {value!r}")
    return int(value)


def _optional_path(value: str) -> tuple[str, bool]:
    optional = value.startswith("-")
    path = value[1:] if optional else value
    if path == "~":
        path = "/root"
    if not path.startswith("/"):
        raise ValueError(f"not an absolute path: {path!r}")
    return (path, optional)


def _env_files(value: str) -> tuple[tuple[str, bool], ...]:
    path, optional = _optional_path(value)
    if any(c in path for c in "*?["):
        raise ValueError("wildcards in EnvironmentFile= are not supported")
    return ((path, optional),)


def _output(value: str) -> Output:
    if value in ("journal", "journal+console", "null", "inherit"):
        return Output("journal" if value.startswith("journal") else value)
    kind, colon, path = value.partition(":")
    if colon and kind in ("file", "append", "truncate"):
        if not path.startswith("/"):
            raise ValueError(f"not an absolute path: {path!r}")
        return Output(kind, path)
    raise ValueError(
        f"output {value!r} is not supported (journal, null, inherit, file:, append:, truncate:)"
    )


def _prevent_status(value: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    codes, sigs = [], []
    for word in value.split():
        if word.isdigit():
            if int(word) > 255:
                raise ValueError(f"exit status out of range: {word}")
            codes.append(int(word))
        else:
            sigs.append(parse_signal(word))
    return tuple(codes), tuple(sigs)


_RLIMITS = {
    "NOFILE": resource.RLIMIT_NOFILE,
    "MEMLOCK": resource.RLIMIT_MEMLOCK,
    "CORE": resource.RLIMIT_CORE,
    "NPROC": resource.RLIMIT_NPROC,
    "FSIZE": resource.RLIMIT_FSIZE,
    "STACK": resource.RLIMIT_STACK,
    "AS": resource.RLIMIT_AS,
    "DATA": resource.RLIMIT_DATA,
}
_COUNT_RLIMITS = ("NOFILE", "NPROC")


def _rlimit(name: str) -> Callable[[str], tuple[tuple[str, int, int], ...]]:
    def one(text: str) -> int:
        if text == "infinity":
            return -1
        return _positive_int(text) if name in _COUNT_RLIMITS else parse_size(text)

    def parse(value: str) -> tuple[tuple[str, int, int], ...]:
        soft_text, colon, hard_text = value.partition(":")
        soft = one(soft_text)
        hard = one(hard_text) if colon else soft
        if hard != -1 and (soft == -1 or soft > hard):
            raise ValueError("soft limit above hard limit")
        return ((name, soft, hard),)

    return parse


def _tasks_max(value: str) -> str:
    if value != "infinity":
        raise ValueError(
            "only TasksMax=infinity is supported (the stand-in enforces no pids limit)"
        )
    return value


def _protect_system(value: str) -> str:
    if value.lower() in _TRUE | _FALSE:
        return "yes" if parse_bool(value) else "no"
    if value == "full":
        return value
    raise ValueError(f"ProtectSystem={value} is not supported (yes, no, full)")


def _protect_home(value: str) -> str:
    if value.lower() in _TRUE | _FALSE:
        return "yes" if parse_bool(value) else "no"
    if value in ("read-only", "tmpfs"):
        return value
    raise ValueError(f"ProtectHome={value} is not supported (yes, no, read-only, tmpfs)")


@dataclass(frozen=True)
class Directive:
    """How one directive is read: the UnitConfig field(s), the value parser, whether
    assignments accumulate (``list``: an empty one resets) or replace, and what the
    stand-in does with it (for docs/real-clouds.md)."""

    fields: tuple[str, ...]
    parse: Callable[[str], Any]
    support: str
    accumulate: bool = False


def _d(fields: str, parse: Callable[[str], Any], support: str, accumulate: bool = False):
    return Directive(tuple(fields.split()), parse, support, accumulate)


_NOT_SECCOMP = (
    "accepted, not enforced (systemd enforces it with seccomp, which the stand-in does not install)"
)

DIRECTIVES: dict[str, dict[str, Directive]] = {
    "Unit": {
        "Description": _d(
            "description", str, "enforced as the unit's name in console lines and status"
        ),
        "Documentation": _d("documentation", _words, "accepted (documentation only)", True),
        "Wants": _d(
            "wants",
            _words,
            "accepted, not enforced (the box has no targets or other units to pull in)",
            True,
        ),
        "After": _d(
            "after",
            _words,
            "accepted, not enforced (ordering only; the box starts units when asked)",
            True,
        ),
        "Before": _d("before", _words, "accepted, not enforced (ordering only)", True),
        "RequiresMountsFor": _d(
            "requires_mounts_for",
            _abs_paths,
            "enforced as a start check: a prefix of the path listed in the VM's /etc/fstab that is "
            "not mounted (/proc/self/mountinfo) fails the start as a failed mount dependency; the "
            "stand-in mounts nothing itself",
            True,
        ),
        "StartLimitIntervalSec": _d(
            "start_limit_interval", parse_timespan, "enforced (start rate limit window; 0 disables)"
        ),
        "StartLimitBurst": _d(
            "start_limit_burst", _positive_int, "enforced (starts allowed per window)"
        ),
    },
    "Service": {
        "Type": _d(
            "type",
            _choice("simple", "exec"),
            "enforced for simple and exec (exec: the start fails unless execve succeeds)",
        ),
        "ExecStart": _d(
            "exec_start",
            lambda v: (parse_exec(v),),
            "enforced (one command; prefixes - + @ :)",
            True,
        ),
        "ExecStartPre": _d(
            "exec_start_pre",
            lambda v: (parse_exec(v),),
            "enforced (in order; - ignores failure, + runs outside the sandbox, @, :)",
            True,
        ),
        "EnvironmentFile": _d(
            "environment_files",
            _env_files,
            "enforced (read at each spawn; - prefix: a missing file is skipped)",
            True,
        ),
        "Environment": _d("environment", parse_environment, "enforced", True),
        "WorkingDirectory": _d(
            "working_directory", _optional_path, "enforced (chdir inside the sandbox; - prefix)"
        ),
        "StandardOutput": _d(
            "standard_output",
            _output,
            "enforced: append:/file:/truncate: opened by the manager, null, inherit "
            "(stdin is /dev/null, so /dev/null as in systemd), journal (the console)",
        ),
        "StandardError": _d(
            "standard_error", _output, "enforced like StandardOutput= (inherit: same as stdout)"
        ),
        "SyslogIdentifier": _d(
            "syslog_identifier", str, "enforced as the tag of the unit's console lines"
        ),
        "KillMode": _d(
            "kill_mode", _choice("control-group", "mixed", "process"), "enforced (per systemd.kill)"
        ),
        "KillSignal": _d("kill_signal", parse_signal, "enforced"),
        "SendSIGKILL": _d("send_sigkill", parse_bool, "enforced"),
        "TimeoutStopSec": _d("timeout_stop", parse_timeout, "enforced (each stop phase)"),
        "TimeoutStartSec": _d(
            "timeout_start", parse_timeout, "enforced (ExecStartPre= and exec together)"
        ),
        "TimeoutSec": _d(
            "timeout_start timeout_stop", parse_timeout, "enforced (both of the above)"
        ),
        "Restart": _d(
            "restart",
            _choice(
                "no", "on-success", "on-failure", "on-abnormal", "on-watchdog", "on-abort", "always"
            ),
            "enforced (systemd's table; no watchdog)",
        ),
        "RestartSec": _d("restart_sec", parse_timespan, "enforced"),
        "RestartPreventExitStatus": _d(
            "restart_prevent_status restart_prevent_signals",
            _prevent_status,
            "enforced (exit codes and signal names)",
            True,
        ),
        **{
            f"Limit{name}": _d(
                "limits",
                _rlimit(name),
                "enforced as setrlimit before exec (infinity, soft:hard), as systemd's "
                "setrlimit_closest: clamped to the hard limit where raising it is not permitted",
                True,
            )
            for name in _RLIMITS
        },
        "TasksMax": _d(
            "tasks_max", _tasks_max, "accepted for infinity only (no pids limit to enforce)"
        ),
        "NoNewPrivileges": _d(
            "no_new_privileges", parse_bool, "enforced as prctl(PR_SET_NO_NEW_PRIVS) before exec"
        ),
        "RestrictSUIDSGID": _d("restrict_suid_sgid", parse_bool, _NOT_SECCOMP),
        "ProtectSystem": _d(
            "protect_system",
            _protect_system,
            "enforced as the command's own mount namespace with /usr, /boot, /efi (and /etc "
            "for full) bound read-only, submounts included; strict is refused",
        ),
        "ProtectHome": _d(
            "protect_home",
            _protect_home,
            "enforced: /home, /root, /run/user covered by an empty read-only mode-000 tmpfs "
            "(read-only: bound read-only; tmpfs: an empty writable tmpfs)",
        ),
        "PrivateTmp": _d(
            "private_tmp",
            parse_bool,
            "enforced as fresh /tmp and /var/tmp directories per unit start, bound in each of "
            "the unit's sandboxed commands and removed when the unit stops",
        ),
        "ProtectKernelTunables": _d(
            "protect_kernel_tunables",
            parse_bool,
            "enforced as /proc/sys, /proc/sysrq-trigger (and other /proc tunables) "
            "and /sys bound read-only",
        ),
        "ProtectKernelModules": _d(
            "protect_kernel_modules",
            parse_bool,
            "enforced as CAP_SYS_MODULE dropped from the bounding/inheritable/ambient "
            "sets and /usr/lib/modules made inaccessible (module syscalls are not "
            "filtered: that part is seccomp)",
        ),
        "ProtectKernelLogs": _d(
            "protect_kernel_logs",
            parse_bool,
            "enforced as CAP_SYSLOG dropped and /proc/kmsg, /dev/kmsg covered by an empty "
            "mode-000 file",
        ),
        "ProtectControlGroups": _d(
            "protect_control_groups", parse_bool, "enforced as /sys/fs/cgroup bound read-only"
        ),
        "ProtectHostname": _d(
            "protect_hostname",
            parse_bool,
            "enforced as the command's own UTS namespace (sethostname is not filtered)",
        ),
        "LockPersonality": _d("lock_personality", parse_bool, _NOT_SECCOMP),
        "RestrictRealtime": _d("restrict_realtime", parse_bool, _NOT_SECCOMP),
        "SystemCallArchitectures": _d("system_call_architectures", _words, _NOT_SECCOMP, True),
    },
    "Install": {
        "WantedBy": _d(
            "wanted_by",
            _words,
            "enforced by enable/disable as a symlink in <first unit dir>/<target>.wants/; "
            "ServiceManager.start_enabled() starts them",
            True,
        ),
        "RequiredBy": _d(
            "required_by", _words, "enforced by enable/disable (<target>.requires/)", True
        ),
    },
}


def support_table() -> dict[str, str]:
    """``{"[Section] Directive=": "enforced as ..." | "accepted, not enforced (why)"}``, for
    docs/real-clouds.md; prefixes, specifiers and everything else not listed are refused."""
    return {
        f"[{section}] {name}=": d.support
        for section, table in DIRECTIVES.items()
        for name, d in table.items()
    }


@dataclass(frozen=True)
class Assignment:
    """One ``Key=Value`` line of a unit file or drop-in, with where it came from."""

    section: str
    key: str
    value: str
    path: str
    line: int


def parse_unit_text(text: str, path: str) -> list[Assignment]:
    """systemd.syntax: ``[Section]`` headers, ``#``/``;`` comment lines, ``Key=Value`` with
    whitespace around both stripped, a line ending in an unescaped backslash continued on the
    next (the backslash becomes a space; comment lines inside are skipped). ``X-`` sections
    and keys are ignored as systemd ignores them. Raises UnitError for anything else."""
    out: list[Assignment] = []
    problems: list[str] = []
    section: str | None = None
    pending: str | None = None
    start_line = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if pending is not None and stripped[:1] in ("#", ";"):
            continue
        line = raw if pending is None else pending + raw
        if pending is None:
            start_line = number
        escaped = False
        for ch in line:
            escaped = (not escaped) if ch == "\\" else False
        if escaped:
            pending = line[:-1] + " "
            continue
        pending = None
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        where = f"{path}:{start_line}"
        if line.startswith("["):
            if not line.endswith("]") or len(line) < 3:
                problems.append(f"{where}: invalid section header {line!r}")
                section = "!invalid"
                continue
            section = line[1:-1]
            if section not in SECTIONS and not section.startswith("X-"):
                problems.append(f"{where}: unknown section [{section}]")
            continue
        if section is None:
            problems.append(f"{where}: assignment outside of any section: {line!r}")
            continue
        key, eq, value = line.partition("=")
        if not eq:
            problems.append(f"{where}: missing '=' in {line!r}")
            continue
        key, value = key.strip(), value.strip()
        if section.startswith("X-") or section == "!invalid" or key.startswith("X-"):
            continue
        out.append(Assignment(section, key, value, path, start_line))
    if pending is not None:
        problems.append(f"{path}:{start_line}: file ends inside a continued line")
    if problems:
        raise UnitError(problems)
    return out


def apply_assignments(name: str, assignments: Iterable[Assignment], **paths: Any) -> UnitConfig:
    """Fold assignments (unit file first, then drop-ins in order) into a UnitConfig:
    a repeated list directive accumulates, an empty assignment resets to the default, a
    repeated plain directive keeps the last. Raises UnitError listing every problem."""
    defaults = UnitConfig(name=name)
    values: dict[str, Any] = {}
    problems: list[str] = []
    for a in assignments:
        where = f"{a.path}:{a.line}"
        directive = DIRECTIVES.get(a.section, {}).get(a.key)
        if directive is None:
            problems.append(f"{where}: unknown directive {a.key}= in section [{a.section}]")
            continue
        if "%" in a.value:
            problems.append(
                f"{where}: {a.key}= uses a '%' specifier ({a.value!r}); the stand-in resolves none"
            )
            continue
        if a.value == "":
            for f in directive.fields:
                values[f] = getattr(defaults, f)
            continue
        try:
            parsed = directive.parse(a.value)
        except ValueError as exc:
            problems.append(f"{where}: invalid {a.key}={a.value!r}: {exc}")
            continue
        if len(directive.fields) == 1:
            parts = (parsed,)
        elif directive.accumulate:
            parts = parsed  # one part per field
        else:
            parts = (parsed,) * len(directive.fields)
        for f, part in zip(directive.fields, parts, strict=True):
            if directive.accumulate:
                values[f] = values.get(f, getattr(defaults, f)) + tuple(part)
            else:
                values[f] = part
    config = replace(defaults, **values, **paths)
    if not config.exec_start:
        problems.append(f"{name}: Service has no ExecStart= setting. Refusing.")
    elif len(config.exec_start) > 1:
        problems.append(
            f"{name}: Service has more than one ExecStart= setting, which is only allowed for "
            "Type=oneshot services. Refusing."
        )
    if problems:
        raise UnitError(problems)
    return config


def normalize_unit_name(name: str) -> str:
    """``foo`` -> ``foo.service`` (systemctl's mangling); other names unchanged."""
    if "/" in name or not name:
        raise UnitNotFoundError(name)
    return name if "." in name else f"{name}.service"


def unit_paths(name: str, unit_dirs: Sequence[str]) -> tuple[str | None, list[str]]:
    """The unit's file (first unit dir that has it) and its drop-ins: every
    ``<dir>/<name>.d/*.conf``, a name in an earlier dir shadowing the same name in a later
    one, sorted by file name."""
    fragment = None
    for d in unit_dirs:
        candidate = os.path.join(d, name)
        if os.path.lexists(candidate):
            fragment = candidate
            break
    dropins: dict[str, str] = {}
    for d in unit_dirs:
        ddir = os.path.join(d, name + ".d")
        with contextlib.suppress(OSError):
            for entry in os.listdir(ddir):
                if entry.endswith(".conf") and entry not in dropins:
                    dropins[entry] = os.path.join(ddir, entry)
    return fragment, [dropins[k] for k in sorted(dropins)]


def load_unit(name: str, unit_dirs: Sequence[str]) -> UnitConfig:
    """Read and merge a service unit. Raises UnitNotFoundError or UnitError."""
    if not name.endswith(".service"):
        raise UnitNotFoundError(name)
    fragment, dropins = unit_paths(name, unit_dirs)
    if fragment is None:
        raise UnitNotFoundError(name)
    if os.path.realpath(fragment) == "/dev/null":
        raise UnitError(f"{name}: Unit {name} is masked.")
    problems: list[str] = []
    assignments: list[Assignment] = []
    for path in [fragment, *dropins]:
        try:
            with open(path, encoding="utf-8") as f:
                assignments += parse_unit_text(f.read(), path)
        except UnitError as exc:
            problems += exc.problems
        except (OSError, UnicodeDecodeError) as exc:
            problems.append(f"{path}: cannot read: {exc}")
    if problems:
        raise UnitError(problems)
    return apply_assignments(name, assignments, fragment=fragment, dropins=tuple(dropins))


# --------------------------------------------------------------------------------------
# Decisions: exit statuses, restart, start rate limit, mounts

_EXIT_NAMES = {
    0: "SUCCESS", 1: "FAILURE", 2: "INVALIDARGUMENT", 3: "NOTIMPLEMENTED", 4: "NOPERMISSION",
    5: "NOTINSTALLED", 6: "NOTCONFIGURED", 7: "NOTRUNNING", 200: "CHDIR", 201: "NICE",
    202: "FDS", 203: "EXEC", 204: "MEMORY", 205: "LIMITS", 207: "SIGNAL_MASK", 208: "STDIN",
    209: "STDOUT", 218: "CAPABILITIES", 219: "CGROUP", 220: "SETSID", 226: "NAMESPACE",
    227: "NO_NEW_PRIVILEGES",
}  # fmt: skip
_CLEAN_SIGNALS = (signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE)


@dataclass(frozen=True)
class ExitStatus:
    """How a process ended: ``code`` is exited, killed or dumped; ``status`` the exit code
    or the signal number."""

    code: str
    status: int

    @classmethod
    def from_wait(cls, wstatus: int) -> ExitStatus:
        if os.WIFEXITED(wstatus):
            return cls("exited", os.WEXITSTATUS(wstatus))
        sig = os.WTERMSIG(wstatus)
        return cls("dumped" if os.WCOREDUMP(wstatus) else "killed", sig)

    def describe(self) -> str:
        """``code=exited, status=1/FAILURE`` / ``code=killed, status=9/KILL``."""
        if self.code == "exited":
            name = _EXIT_NAMES.get(self.status, "n/a")
        else:
            name = _signal_name(self.status).removeprefix("SIG")
        return f"code={self.code}, status={self.status}/{name}"

    def main_result(self) -> str:
        """systemd's result for a main process that ended so: exit 0 and death by SIGHUP,
        SIGINT, SIGTERM or SIGPIPE are clean ("success")."""
        if self.code == "exited":
            return "success" if self.status == 0 else "exit-code"
        if self.code == "killed" and self.status in _CLEAN_SIGNALS:
            return "success"
        return "signal" if self.code == "killed" else "core-dump"

    def command_result(self) -> str:
        """The result for a control command (ExecStartPre=): only exit 0 is success."""
        if self.code == "exited":
            return "success" if self.status == 0 else "exit-code"
        return "signal" if self.code == "killed" else "core-dump"


def decide_restart(
    policy: str,
    result: str,
    main_exit: ExitStatus | None,
    prevent_status: Collection[int] = (),
    prevent_signals: Collection[int] = (),
) -> tuple[bool, str]:
    """Whether a unit that just went dead restarts, and why (systemd's service_shall_restart).

    Args:
        policy: Restart=.
        result: the unit's result (success, exit-code, signal, core-dump, timeout, ...).
        main_exit: how the main process ended, if it ran.
        prevent_status / prevent_signals: RestartPreventExitStatus=.
    """
    if result in ("start-limit-hit", "dependency"):
        return False, f"result {result} never restarts"
    if main_exit is not None:
        if main_exit.code == "exited" and main_exit.status in prevent_status:
            return False, f"exit status {main_exit.status} is in RestartPreventExitStatus="
        if main_exit.code != "exited" and main_exit.status in prevent_signals:
            return False, f"signal {_signal_name(main_exit.status)} is in RestartPreventExitStatus="
    restart = {
        "no": False,
        "always": True,
        "on-success": result == "success",
        "on-failure": result != "success",
        "on-abnormal": result not in ("success", "exit-code"),
        "on-watchdog": result == "watchdog",
        "on-abort": result in ("signal", "core-dump"),
    }[policy]
    return restart, f"Restart={policy} with result {result}"


class StartLimit:
    """systemd's start rate limit: at most ``burst`` starts within ``interval`` seconds of
    the first start of the window; the clock is an argument."""

    def __init__(self) -> None:
        self.begin: float | None = None
        self.count = 0

    def allow(self, interval: float, burst: int, now: float) -> bool:
        if interval <= 0 or burst <= 0:
            return True
        if self.begin is None or now - self.begin > interval:
            self.begin, self.count = now, 0
        self.count += 1
        return self.count <= burst

    def reset(self) -> None:
        self.begin, self.count = None, 0


def _unescape_octal(text: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def parse_fstab(text: str) -> list[str]:
    """The mount points of an fstab (swap and ``none`` entries left out)."""
    points = []
    for line in text.splitlines():
        fields = line.split()
        if not fields or fields[0].startswith("#") or len(fields) < 3:
            continue
        point, fstype = _unescape_octal(fields[1]), fields[2]
        if fstype == "swap" or not point.startswith("/"):
            continue
        points.append(os.path.normpath(point))
    return points


def parse_mountinfo(text: str) -> set[str]:
    """The mount points listed in /proc/<pid>/mountinfo."""
    return {
        os.path.normpath(_unescape_octal(line.split()[4]))
        for line in text.splitlines()
        if len(line.split()) > 4
    }


def missing_mounts(
    paths: Iterable[str], fstab: Iterable[str], mounted: Collection[str]
) -> list[str]:
    """RequiresMountsFor=: the fstab mount points that are a prefix of (or equal to) one of
    ``paths`` and are not mounted. Paths no fstab entry covers need nothing."""
    missing: list[str] = []
    points = list(fstab)
    for path in paths:
        for point in points:
            covers = point == "/" or path == point or path.startswith(point + "/")
            if covers and point not in mounted and point not in missing:
                missing.append(point)
    return missing


def mount_unit_name(path: str) -> str:
    """systemd's mount unit name for a path: /mnt/spottrain -> mnt-spottrain.mount."""
    if path == "/":
        return "-.mount"
    parts = path.strip("/").split("/")
    esc = [re.sub(r"[^A-Za-z0-9:_.]", lambda m: f"\\x{ord(m.group(0)):02x}", p) for p in parts]
    return "-".join(esc) + ".mount"


# --------------------------------------------------------------------------------------
# Process tracking


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "n/a"


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, starttime) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    rest = text[text.rindex(")") + 2 :].split()
    return rest[0], int(rest[1]), int(rest[19])


def _alive(pid: int) -> bool:
    stat = _proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


class _Cgroup:
    """A unit's processes as a cgroup v2 directory: every process the unit starts joins it
    before it can fork, and nothing a process does (setsid, double fork) takes it out."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def procs_file(self) -> str:
        return str(self.path / "cgroup.procs")

    def create(self) -> None:
        self.path.mkdir(exist_ok=True)

    def add(self, pid: int) -> None:
        """Nothing to do: the process joins by itself (execwrap) before it runs anything."""

    def _dirs(self) -> list[Path]:
        out = []
        for root, dirs, _files in os.walk(self.path):
            out.append(Path(root))
            dirs.sort()
        return out

    def pids(self) -> list[int]:
        pids: list[int] = []
        for d in self._dirs():
            with contextlib.suppress(OSError):
                pids += [int(x) for x in (d / "cgroup.procs").read_text().split()]
        return [p for p in pids if _alive(p)]

    def signal(self, sig: int, send_cont: bool = True) -> list[int]:
        """Send ``sig`` to every process, again until no new process shows up (forks)."""
        done: set[int] = set()
        for _ in range(20):
            new = [p for p in self.pids() if p not in done]
            if not new:
                break
            for pid in new:
                _signal(pid, sig)
                if send_cont:
                    _signal(pid, signal.SIGCONT)
                done.add(pid)
        return sorted(done)

    def kill(self) -> list[int]:
        """SIGKILL to all, atomically with cgroup.kill where the kernel has it."""
        pids = self.pids()
        try:
            (self.path / "cgroup.kill").write_text("1")
        except OSError:
            self.signal(signal.SIGKILL, send_cont=False)
        return pids

    def empty(self) -> bool:
        try:
            events = (self.path / "cgroup.events").read_text()
            return "populated 0" in events
        except OSError:
            return not self.pids()

    def remove(self) -> bool:
        for d in reversed(self._dirs()):
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        return False
                    time.sleep(0.02)
            else:
                return False
        return True


class _ProcTree:
    """Without cgroups: the unit's processes are those it spawned and, found by walking
    /proc, their descendants. The manager is a child subreaper, so an orphan comes back to
    it; one whose parent exited before a walk saw it is claimed by its INVOCATION_ID."""

    def __init__(self, invocation: str) -> None:
        self.invocation = invocation
        self.members: dict[int, int] = {}  # pid -> starttime
        self.lock = threading.Lock()
        self.procs_file = None

    def create(self) -> None:
        pass

    def add(self, pid: int) -> None:
        stat = _proc_stat(pid)
        with self.lock:
            self.members[pid] = stat[2] if stat else -1

    def _claims(self, pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            return False
        return f"INVOCATION_ID={self.invocation}".encode() in env

    def refresh(self) -> None:
        table: dict[int, tuple[str, int, int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                stat = _proc_stat(int(entry))
                if stat is not None:
                    table[int(entry)] = stat
        me = os.getpid()
        with self.lock:
            members = {
                pid: start
                for pid, start in self.members.items()
                if pid in table and start in (-1, table[pid][2])
            }
            grew = True
            while grew:
                grew = False
                for pid, (_state, ppid, start) in table.items():
                    if pid in members:
                        continue
                    if ppid in members or (ppid in (me, 1) and self._claims(pid)):
                        members[pid] = start
                        grew = True
            self.members = members

    def pids(self) -> list[int]:
        self.refresh()
        with self.lock:
            return [p for p in self.members if _alive(p)]

    def signal(self, sig: int, send_cont: bool = True) -> list[int]:
        done: set[int] = set()
        for _ in range(20):
            new = [p for p in self.pids() if p not in done]
            if not new:
                break
            for pid in new:
                _signal(pid, sig)
                if send_cont:
                    _signal(pid, signal.SIGCONT)
                done.add(pid)
        return sorted(done)

    def kill(self) -> list[int]:
        return self.signal(signal.SIGKILL, send_cont=False)

    def empty(self) -> bool:
        return not self.pids()

    def remove(self) -> bool:
        return self.empty()


# --------------------------------------------------------------------------------------
# The manager


class _SpawnError(Exception):
    """A command could not be started at all; ``result`` is the unit's result for it."""

    def __init__(self, result: str, lines: Sequence[str]) -> None:
        super().__init__("; ".join(lines))
        self.result, self.lines = result, list(lines)


@dataclass
class _Proc:
    pid: int
    role: str  # "main" or "control"
    command: ExecCommand
    argv: list[str]
    status_fd: int
    status: ExitStatus | None = None
    exec_report: dict | None = None
    exec_read: bool = False


@dataclass
class _Job:
    done: threading.Event = field(default_factory=threading.Event)
    result: str = ""


_JOB_MESSAGES = {
    "exit-code": "the control process exited with error code",
    "signal": "a fatal signal was delivered to the control process",
    "core-dump": "a fatal signal was delivered causing the control process to dump core",
    "timeout": "a timeout was exceeded",
    "resources": "of unavailable resources or another system error",
    "start-limit-hit": "start of the service was attempted too often",
}


def _job_message(unit: str, result: str) -> str:
    if result == "dependency":
        return f"A dependency job for {unit} failed. See 'journalctl -xe' for details."
    if result == "canceled":
        return f"Job for {unit} canceled."
    why = _JOB_MESSAGES.get(result, f"of result '{result}'")
    return (
        f"Job for {unit} failed because {why}.\n"
        f'See "systemctl status {unit}" and "journalctl -xeu {unit}" for details.'
    )


class _Unit:
    """One service's runtime: its state, processes, and the worker thread that drives it.
    Every field is guarded by ``cond``."""

    def __init__(self, manager: ServiceManager, name: str) -> None:
        self.m = manager
        self.name = name
        self.cond = threading.Condition()
        self.config: UnitConfig | None = None
        self.load_error: UnitError | None = None
        self.not_found = False
        self.run_config: UnitConfig | None = None
        self.active, self.sub, self.result = "inactive", "dead", "success"
        self.since = time.time()
        self.main: _Proc | None = None
        self.control: _Proc | None = None
        self.exec_main: ExitStatus | None = None
        self.exec_main_pid = 0
        self.nrestarts = 0
        self.limit = StartLimit()
        self.worker: threading.Thread | None = None
        self.jobs: list[_Job] = []
        self.stop_requested = False
        self.restart_planned = False
        self.invocation = ""
        self.tracker: _Cgroup | _ProcTree | None = None
        self.private_tmp: Path | None = None

    # -- small helpers

    def log(self, text: str, prefix: bool = True) -> None:
        self.m._log(f"{self.name}: {text}" if prefix else text)

    def _set(self, active: str, sub: str) -> None:
        """Change state; the caller holds cond."""
        if (active, sub) != (self.active, self.sub):
            self.active, self.sub, self.since = active, sub, time.time()
        self.cond.notify_all()

    def _complete_jobs(self, result: str) -> None:
        """Finish every pending start job; the caller holds cond."""
        for job in self.jobs:
            job.result = result
            job.done.set()
        self.jobs = []

    def _alive_procs(self) -> list[_Proc]:
        return [p for p in (self.main, self.control) if p is not None and p.status is None]

    # -- the worker

    def run(self) -> None:
        try:
            while True:
                outcome = self._activate()
                if outcome == "running":
                    outcome = self._supervise()
                if outcome == "dead" and self.restart_planned and self._wait_restart():
                    continue
                with self.cond:
                    if self.stop_requested:
                        self.stop_requested = False
                    if self.jobs and not self.m._powering_off:
                        continue
                    self._complete_jobs("canceled")
                    self.worker = None
                    self.cond.notify_all()
                    return
        except BaseException as exc:
            self.log(f"Internal error in the stand-in: {exc!r}")
            with self.cond:
                self.result = "resources"
                self._set("failed", "failed")
                self.stop_requested = False
                self._complete_jobs("resources")
                self.worker = None
                self.cond.notify_all()
            raise

    def _activate(self) -> str:
        m = self.m
        with self.cond:
            cfg = self.config
            if self.stop_requested:
                self._complete_jobs("canceled")
                return "stopped"
            if cfg is None:
                self.log("Unit configuration has fatal error, unit will not be started.")
                self.result = "resources"
                self._set("failed", "failed")
                self._complete_jobs("bad-setting")
                return "final"
            self.run_config = cfg
            self.restart_planned = False
            if not self.limit.allow(cfg.start_limit_interval, cfg.start_limit_burst, m._clock()):
                self.log("Start request repeated too quickly.")
                self.result = "start-limit-hit"
                self.log("Failed with result 'start-limit-hit'.")
                self._set("failed", "failed")
                self.log(f"Failed to start {cfg.label}.", prefix=False)
                self._complete_jobs("start-limit-hit")
                return "final"
        missing = missing_mounts(cfg.requires_mounts_for, m._fstab(), m._mounted())
        if missing:
            for point in missing:
                m._log(
                    f"{mount_unit_name(point)}: {point} is listed in {m.fstab_path} but is not "
                    "mounted (the stand-in mounts nothing itself)."
                )
            with self.cond:
                self.log(f"Dependency failed for {cfg.label}.", prefix=False)
                if self.active != "failed":
                    self._set("inactive", "dead")
                self._complete_jobs("dependency")
            return "final"

        with self.cond:
            self.result = "success"
            self.main = self.control = None
            self.exec_main = None
            self.exec_main_pid = 0
            self.invocation = uuid.uuid4().hex
            self._set("activating", "start-pre")
        self.log(f"Starting {cfg.label}...", prefix=False)
        m._prepare_runtime(self)
        deadline = m._clock() + cfg.timeout_start

        for cmd in cfg.exec_start_pre:
            try:
                proc = m._spawn(self, cfg, cmd, "control")
            except _SpawnError as exc:
                for line in exc.lines:
                    self.log(line)
                return self._fail_start(cfg, exc.result)
            waited = self._wait_proc(proc, deadline)
            if waited == "stop":
                return self._stop(cfg)
            if waited == "timeout":
                self.log("start-pre operation timed out. Terminating.")
                return self._fail_start(cfg, "timeout")
            self._report_exec_error(proc)
            assert proc.status is not None
            res = proc.status.command_result()
            if res != "success" and not cmd.ignore_failure:
                self.log(f"Control process exited, {proc.status.describe()}")
                return self._fail_start(cfg, res)

        with self.cond:
            self._set("activating", "start")
        try:
            main = m._spawn(self, cfg, cfg.exec_start[0], "main")
        except _SpawnError as exc:
            for line in exc.lines:
                self.log(line)
            return self._fail_start(cfg, exc.result)
        with self.cond:
            self.main, self.exec_main_pid = main, main.pid
        if cfg.type == "exec":
            waited = self._wait_exec(main, deadline)
            if waited == "stop":
                return self._stop(cfg)
            if waited == "timeout":
                self.log("start operation timed out. Terminating.")
                return self._fail_start(cfg, "timeout")
            if waited == "failed":
                self._wait_proc(main, m._clock() + 10.0)
                self._note_main_exit()
                return self._fail_start(cfg, "exit-code")
        with self.cond:
            self._set("active", "running")
            self.log(f"Started {cfg.label}.", prefix=False)
            self._complete_jobs("done")
        return "running"

    def _supervise(self) -> str:
        cfg = self.run_config
        assert cfg is not None and self.main is not None
        main = self.main
        with self.cond:
            self.cond.wait_for(lambda: main.status is not None or self.stop_requested)
            if self.stop_requested:
                stop = True
            else:
                stop = False
                self._set("deactivating", "stop-sigterm")
        if stop:
            return self._stop(cfg)
        self._note_main_exit()
        self._terminate(cfg)
        self._enter_dead(cfg, allow_restart=True)
        return "dead"

    def _wait_restart(self) -> bool:
        """In auto-restart: wait RestartSec (or a start or a stop); True to start again."""
        cfg = self.run_config
        assert cfg is not None
        deadline = self.m._clock() + cfg.restart_sec
        with self.cond:
            while not self.stop_requested and not self.jobs and not self.m._powering_off:
                left = deadline - self.m._clock()
                if left <= 0:
                    break
                self.cond.wait(min(left, 0.5))
            if self.stop_requested or self.m._powering_off:
                self.restart_planned = False
                self._set(
                    "failed" if self.result != "success" else "inactive",
                    "failed" if self.result != "success" else "dead",
                )
                return False
            if not self.jobs:
                self.nrestarts += 1
                self.log(f"Scheduled restart job, restart counter is at {self.nrestarts}.")
            self.log(f"Stopped {cfg.label}.", prefix=False)
        return True

    # -- waiting

    def _wait_proc(self, proc: _Proc, deadline: float) -> str:
        with self.cond:
            while proc.status is None:
                if self.stop_requested:
                    return "stop"
                left = deadline - self.m._clock()
                if left <= 0:
                    return "timeout"
                self.cond.wait(min(left, 0.5))
        return "exited"

    def _wait_exec(self, proc: _Proc, deadline: float) -> str:
        """Type=exec: wait until execve succeeded (the status pipe closes empty)."""
        data = b""
        poller = select.poll()
        poller.register(proc.status_fd, select.POLLIN)
        while True:
            with self.cond:
                if self.stop_requested:
                    return "stop"
            left = deadline - self.m._clock()
            if left <= 0:
                return "timeout"
            if not poller.poll(min(left, 0.1) * 1000):
                continue
            chunk = os.read(proc.status_fd, 65536)
            if chunk:
                data += chunk
                continue
            break
        os.close(proc.status_fd)
        proc.exec_read = True
        if not data:
            return "ok"
        proc.exec_report = json.loads(data)
        self._log_exec_report(proc)
        return "failed"

    def _report_exec_error(self, proc: _Proc) -> None:
        """After a command ended: read what execwrap said of a failed step, if anything."""
        if proc.exec_read:
            return
        proc.exec_read = True
        data = b""
        with contextlib.suppress(OSError):
            os.set_blocking(proc.status_fd, False)
            while chunk := os.read(proc.status_fd, 65536):
                data += chunk
        os.close(proc.status_fd)
        if data:
            with contextlib.suppress(ValueError):
                proc.exec_report = json.loads(data)
                self._log_exec_report(proc)

    def _log_exec_report(self, proc: _Proc) -> None:
        report = proc.exec_report or {}
        self.log(f"{report.get('what')}: {report.get('error')}")
        self.log(
            f"Failed at step {report.get('step')} spawning {proc.command.path}: "
            f"{report.get('error')}"
        )

    def _note_main_exit(self) -> None:
        """Record the main process's end; log it when it was not clean."""
        main = self.main
        if main is None or main.status is None or self.exec_main is not None:
            return
        self._report_exec_error(main)
        self.exec_main = main.status
        res = main.status.main_result()
        if res != "success":
            self.log(f"Main process exited, {main.status.describe()}")
            with self.cond:
                if self.result == "success":
                    self.result = res

    def _wait_gone(self, procs: Sequence[_Proc], need_empty: bool, timeout: float) -> bool:
        deadline = self.m._clock() + timeout
        tracker = self.tracker
        while True:
            with self.cond:
                done = all(p.status is not None for p in procs)
            if done and (not need_empty or tracker is None or tracker.empty()):
                return True
            left = deadline - self.m._clock()
            if left <= 0:
                return False
            with self.cond:
                self.cond.wait(min(left, 0.05))

    # -- stopping

    def _fail_start(self, cfg: UnitConfig, result: str) -> str:
        with self.cond:
            if self.result == "success":
                self.result = result
            self._set("deactivating", "stop-sigterm")
        self._terminate(cfg)
        self._enter_dead(cfg, allow_restart=True)
        self.log(f"Failed to start {cfg.label}.", prefix=False)
        with self.cond:
            self._complete_jobs(self.result)
        return "dead"

    def _stop(self, cfg: UnitConfig) -> str:
        self.log(f"Stopping {cfg.label}...", prefix=False)
        with self.cond:
            self._set("deactivating", "stop-sigterm")
            self._complete_jobs("canceled")
        self._terminate(cfg)
        self._enter_dead(cfg, allow_restart=False)
        self.log(f"Stopped {cfg.label}.", prefix=False)
        return "stopped"

    def _kill_all(self, cfg: UnitConfig, main_pid: int) -> None:
        tracker = self.tracker
        if tracker is None:
            return
        for pid in tracker.pids():
            if pid != main_pid:
                self.log(f"Killing process {pid} ({_comm(pid)}) with signal SIGKILL.")
        tracker.kill()

    def _stop_sigterm(self, cfg: UnitConfig, primaries: Sequence[_Proc]) -> bool:
        """KillSignal= to the main and control processes (process, mixed) or to the whole
        unit (control-group), with SIGCONT; True if there is anything to wait for."""
        if cfg.kill_mode == "control-group" and self.tracker is not None:
            return bool(self.tracker.signal(cfg.kill_signal)) or bool(primaries)
        for p in primaries:
            _signal(p.pid, cfg.kill_signal)
            _signal(p.pid, signal.SIGCONT)
        return bool(primaries)

    def _terminate(self, cfg: UnitConfig) -> None:
        """systemd's stop-sigterm, stop-sigkill, final-sigterm, final-sigkill phases for the
        KillMode=; the main and control processes may already be gone."""
        tracker = self.tracker
        mode, sig, timeout = cfg.kill_mode, cfg.kill_signal, cfg.timeout_stop
        with self.cond:
            primaries = self._alive_procs()
        main_pid = self.main.pid if self.main is not None else 0
        if self._stop_sigterm(cfg, primaries) and not self._wait_gone(
            primaries, mode == "control-group", timeout
        ):
            with self.cond:
                if self.result == "success":
                    self.result = "timeout"
            if cfg.send_sigkill:
                self.log("State 'stop-sigterm' timed out. Killing.")
                with self.cond:
                    self._set("deactivating", "stop-sigkill")
                if mode == "process" or tracker is None:
                    for p in primaries:
                        _signal(p.pid, signal.SIGKILL)
                else:
                    self._kill_all(cfg, main_pid)
                if not self._wait_gone(primaries, mode != "process", timeout):
                    self.log("Processes still around after SIGKILL. Ignoring.")
            else:
                self.log("State 'stop-sigterm' timed out. Skipping SIGKILL.")
        self._note_main_exit()
        if tracker is None:
            return
        if mode == "control-group" and not tracker.empty():
            with self.cond:
                self._set("deactivating", "final-sigterm")
            tracker.signal(sig)
            if not self._wait_gone([], True, timeout):
                with self.cond:
                    if self.result == "success":
                        self.result = "timeout"
                if cfg.send_sigkill:
                    self.log("State 'final-sigterm' timed out. Killing.")
                else:
                    self.log("State 'final-sigterm' timed out. Skipping SIGKILL.")
        if mode in ("mixed", "control-group") and cfg.send_sigkill and not tracker.empty():
            with self.cond:
                self._set("deactivating", "final-sigkill")
            self._kill_all(cfg, main_pid)
            if not self._wait_gone([], True, timeout):
                self.log("Processes still around after final SIGKILL. Entering failed mode.")
        for pid in tracker.pids():
            self.log(f"Unit process {pid} ({_comm(pid)}) remains running after unit stopped.")

    def _enter_dead(self, cfg: UnitConfig, allow_restart: bool) -> None:
        self.m._release_runtime(self)
        with self.cond:
            if self.result == "success":
                self.log("Deactivated successfully.")
            else:
                self.log(f"Failed with result '{self.result}'.")
            restart = False
            if allow_restart and not self.stop_requested and not self.m._powering_off:
                restart, _why = decide_restart(
                    cfg.restart,
                    self.result,
                    self.exec_main,
                    cfg.restart_prevent_status,
                    cfg.restart_prevent_signals,
                )
            self.restart_planned = restart
            if restart:
                self._set("activating", "auto-restart")
            elif self.result == "success":
                self._set("inactive", "dead")
            else:
                self._set("failed", "failed")


class ServiceManager:
    """systemd, as far as a box VM's boot script and the spottrain agent unit need it.

    Thread-safe. ``start``/``stop``/``restart`` block until the job is done, as
    ``systemctl`` does. Every unit the manager starts runs under ``execwrap.py``.

    Args:
        unit_dirs: where unit files and ``<unit>.d/*.conf`` drop-ins live, first wins.
        console: where systemd's lines and journal output go (one line per write).
        state_dir: the manager's own files (private /tmp directories, inaccessible nodes).
        sandbox: apply the sandboxing directives (False for tests that cannot unshare).
        cgroup_root: a cgroup v2 directory under which each unit gets its own cgroup
            (created if missing, removed by ``close`` if created); None tracks processes
            with a child subreaper and a /proc walk instead.
        fstab_path / mountinfo_path: what RequiresMountsFor= checks.
        on_poweroff: called (no arguments) after a power-off asked through the control
            socket has stopped every unit; ``power_action`` then says which ("poweroff",
            "halt" or "reboot").
        python: the interpreter each command's exec wrapper runs under.
        execwrap: the wrapper's path; by default a copy of ``execwrap.py`` (read when this
            module was imported) written into ``state_dir``.
        environment: the manager's base environment for services (systemd's
            DefaultEnvironment=); PATH only by default.
        clock: monotonic seconds (tests may pass their own).
    """

    def __init__(
        self,
        *,
        unit_dirs: Sequence[str] = ("/etc/systemd/system",),
        console: TextIO,
        state_dir: str = "/run/systemd/standin",
        sandbox: bool = True,
        cgroup_root: str | None = None,
        fstab_path: str = "/etc/fstab",
        mountinfo_path: str = "/proc/self/mountinfo",
        on_poweroff: Callable[[], None] | None = None,
        python: str = sys.executable,
        execwrap: str | None = None,
        environment: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.unit_dirs = [str(d) for d in unit_dirs]
        self.console = console
        self.state_dir = Path(state_dir)
        self.sandbox = sandbox
        self.fstab_path = fstab_path
        self.mountinfo_path = mountinfo_path
        self.on_poweroff = on_poweroff
        self.python = python
        self.power_action = ""
        self.environment = dict(environment or {"PATH": DEFAULT_PATH})
        self._clock = clock
        self._lock = threading.RLock()
        self._console_lock = threading.Lock()
        self._spawn_lock = threading.Lock()
        self._units: dict[str, _Unit] = {}
        self._children: set[int] = set()
        self._start_order: list[str] = []
        self._powering_off = False
        self._power_cancel = threading.Event()
        self._power_thread: threading.Thread | None = None
        self._closed = threading.Event()
        self._server: socket.socket | None = None
        self._socket_path: str | None = None
        self._subreaper = False
        self._scanner: threading.Thread | None = None

        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._inaccessible = self.state_dir / "inaccessible"
        if not self._inaccessible.exists():
            self._inaccessible.touch()
        os.chmod(self._inaccessible, 0)
        (self.state_dir / "private").mkdir(exist_ok=True)
        if execwrap is None:
            execwrap = str(self.state_dir / "execwrap.py")
            Path(execwrap).write_text(EXECWRAP_SOURCE)
        self.execwrap = execwrap

        self.cgroup_root = Path(cgroup_root) if cgroup_root else None
        self._created_cgroup_root = False
        if self.cgroup_root is not None:
            if not self.cgroup_root.is_dir():
                self.cgroup_root.mkdir()
                self._created_cgroup_root = True
        else:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(36, ctypes.c_ulong(1), 0, 0, 0) == 0:  # PR_SET_CHILD_SUBREAPER
                self._subreaper = True
            self._scanner = threading.Thread(target=self._scan, name="standin-scan", daemon=True)
            self._scanner.start()

    # -- console

    def _log(self, text: str) -> None:
        with self._console_lock:
            self.console.write(f"systemd[1]: {text}\n")
            with contextlib.suppress(Exception):
                self.console.flush()

    def _journal(self, ident: str, pid: int, line: str) -> None:
        with self._console_lock:
            self.console.write(f"{ident}[{pid}]: {line}\n")
            with contextlib.suppress(Exception):
                self.console.flush()

    # -- units

    def _unit(self, name: str) -> _Unit:
        """The unit, loaded from disk on first use (as systemd loads on demand)."""
        name = normalize_unit_name(name)
        with self._lock:
            unit = self._units.get(name)
            if unit is None:
                unit = self._units[name] = _Unit(self, name)
                self._load(unit)
            return unit

    def _load(self, unit: _Unit) -> UnitError | None:
        try:
            config = load_unit(unit.name, self.unit_dirs)
        except UnitNotFoundError:
            with unit.cond:
                unit.config, unit.load_error, unit.not_found = None, None, True
            return None
        except UnitError as exc:
            with unit.cond:
                unit.config, unit.load_error, unit.not_found = None, exc, False
            return exc
        with unit.cond:
            unit.config, unit.load_error, unit.not_found = config, None, False
        return None

    def _loaded(self, name: str) -> _Unit:
        unit = self._unit(name)
        with unit.cond:
            if unit.not_found and unit.worker is None:
                raise UnitNotFoundError(unit.name)
            if unit.load_error is not None:
                raise unit.load_error
            if unit.config is None and unit.worker is None:
                raise UnitNotFoundError(unit.name)
        return unit

    def daemon_reload(self) -> None:
        """Re-read every ``*.service`` in the unit dirs (and every unit already known).
        A running unit keeps its configuration until its next start. Raises UnitError
        listing every refused file; the others are loaded all the same."""
        names: set[str] = set()
        for d in self.unit_dirs:
            with contextlib.suppress(OSError):
                for entry in os.listdir(d):
                    path = os.path.join(d, entry)
                    if entry.endswith(".service") and not os.path.isdir(path):
                        names.add(entry)
        with self._lock:
            names |= set(self._units)
            for name in names:
                self._units.setdefault(name, _Unit(self, name))
            units = [self._units[n] for n in sorted(names)]
        problems: list[str] = []
        for unit in units:
            err = self._load(unit)
            if err is not None:
                problems += err.problems
        if problems:
            for p in problems:
                self._log(p)
            raise UnitError(problems)

    # -- enable / disable

    def enable(self, name: str) -> list[str]:
        """Link the unit into ``<first unit dir>/<target>.wants/`` for each WantedBy= (and
        ``.requires/`` for RequiredBy=). Returns systemctl's lines ("Created symlink ...")."""
        unit = self._loaded(name)
        config = unit.config
        assert config is not None
        lines: list[str] = []
        targets = [(t, "wants") for t in config.wanted_by] + [
            (t, "requires") for t in config.required_by
        ]
        if not targets:
            return [
                "The unit files have no installation config (WantedBy=, RequiredBy=, Also=,\n"
                "Alias= settings in the [Install] section, and DefaultInstance= for template\n"
                "units). This means they are not meant to be enabled or disabled using systemctl."
            ]
        for target, kind in targets:
            link = Path(self.unit_dirs[0]) / f"{target}.{kind}" / unit.name
            if os.path.lexists(link):
                continue
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(config.fragment)
            lines.append(f"Created symlink {link} → {config.fragment}.")
        return lines

    def disable(self, name: str) -> list[str]:
        """Remove the unit's links from every ``*.wants``/``*.requires`` directory."""
        name = normalize_unit_name(name)
        lines = []
        for link in self._links(name):
            link.unlink()
            lines.append(f'Removed "{link}".')
        return lines

    def _links(self, name: str) -> list[Path]:
        links = []
        for d in self.unit_dirs:
            with contextlib.suppress(OSError):
                for entry in sorted(os.listdir(d)):
                    if entry.endswith((".wants", ".requires")):
                        link = Path(d) / entry / name
                        if os.path.lexists(link):
                            links.append(link)
        return links

    def is_enabled(self, name: str) -> str:
        """enabled, disabled, static (no [Install]), bad or not-found."""
        name = normalize_unit_name(name)
        if self._links(name):
            return "enabled"
        try:
            config = load_unit(name, self.unit_dirs)
        except UnitNotFoundError:
            return "not-found"
        except UnitError:
            return "bad"
        return "disabled" if config.wanted_by or config.required_by else "static"

    def start_enabled(self, target: str = "multi-user.target") -> dict[str, JobFailedError]:
        """Start every unit linked into ``<target>.wants``/``.requires`` (what booting to
        the target does); returns the jobs that failed by unit."""
        names: list[str] = []
        for d in self.unit_dirs:
            for kind in ("wants", "requires"):
                with contextlib.suppress(OSError):
                    names += sorted(os.listdir(Path(d) / f"{target}.{kind}"))
        failed: dict[str, JobFailedError] = {}
        for name in dict.fromkeys(names):
            try:
                self.start(name)
            except JobFailedError as exc:
                failed[name] = exc
        return failed

    # -- jobs

    def start(self, name: str) -> None:
        """Start the unit and wait until it runs (Type=exec: its execve succeeded).

        Raises:
            UnitNotFoundError: no such unit file.
            UnitError: the unit file is refused.
            JobFailedError: the start failed (``result`` says how).
        """
        unit = self._loaded(name)
        job = _Job()
        with self._lock:  # (never taken while holding a unit's lock elsewhere)
            if unit.name in self._start_order:
                self._start_order.remove(unit.name)
            self._start_order.append(unit.name)
        with unit.cond:
            if self._powering_off or self._closed.is_set():
                raise JobFailedError(
                    unit.name,
                    "destructive",
                    f"Transaction for {unit.name}/start is destructive (poweroff.target has "
                    "'start' job queued, but 'stop' is included in transaction).",
                )
            if unit.active == "active" and unit.worker is not None and not unit.stop_requested:
                return
            unit.jobs.append(job)
            if unit.worker is None:
                unit.worker = threading.Thread(
                    target=unit.run, name=f"standin-{unit.name}", daemon=True
                )
                unit.worker.start()
            unit.cond.notify_all()
        job.done.wait()
        if job.result != "done":
            raise JobFailedError(unit.name, job.result, _job_message(unit.name, job.result))

    def stop(self, name: str) -> None:
        """Stop the unit with its KillMode=, KillSignal= and TimeoutStopSec= and wait until
        it is inactive (or failed). A unit that is not running is left as it is.

        Raises:
            UnitNotFoundError: never loaded and no such unit file.
        """
        name = normalize_unit_name(name)
        with self._lock:
            unit = self._units.get(name)
        if unit is None:
            unit = self._loaded(name)
        with unit.cond:
            if unit.worker is None:
                return
            unit.stop_requested = True
            unit.cond.notify_all()
            unit.cond.wait_for(lambda: not unit.stop_requested or unit.worker is None)

    def restart(self, name: str) -> None:
        """Stop (if running) and start again; raises as ``start``."""
        self._loaded(name)
        self.stop(name)
        self.start(name)

    def reset_failed(self, name: str | None = None) -> None:
        """Forget a failed state and the start rate limit counter (one unit or all)."""
        with self._lock:
            units = list(self._units.values()) if name is None else [self._unit(name)]
        for unit in units:
            with unit.cond:
                unit.limit.reset()
                if unit.active == "failed" and unit.worker is None:
                    unit.result = "success"
                    unit._set("inactive", "dead")

    def is_active(self, name: str) -> str:
        """active, activating, deactivating, inactive or failed (inactive for no unit)."""
        try:
            unit = self._unit(name)
        except UnitNotFoundError:
            return "inactive"
        with unit.cond:
            return unit.active

    def show(self, name: str) -> dict[str, str]:
        """Properties as ``systemctl show`` names them."""
        unit = self._unit(name)
        with unit.cond:
            cfg = unit.config or unit.run_config
            main = unit.main
            main_pid = main.pid if main is not None and main.status is None else 0
            exit_ = unit.exec_main
            load = (
                "loaded" if unit.config is not None
                else "not-found" if unit.not_found
                else "bad-setting"
            )  # fmt: skip
            tracker = unit.tracker
            return {
                "Id": unit.name,
                "Description": cfg.label if cfg else unit.name,
                "LoadState": load,
                "ActiveState": unit.active,
                "SubState": unit.sub,
                "Result": unit.result,
                "MainPID": str(main_pid),
                "ExecMainPID": str(unit.exec_main_pid),
                "ExecMainCode": {"exited": "1", "killed": "2", "dumped": "3"}.get(
                    exit_.code if exit_ else "", "0"
                ),
                "ExecMainStatus": str(exit_.status if exit_ else 0),
                "NRestarts": str(unit.nrestarts),
                "UnitFileState": self.is_enabled(unit.name),
                "FragmentPath": cfg.fragment if cfg else "",
                "DropInPaths": " ".join(cfg.dropins) if cfg else "",
                "InvocationID": unit.invocation,
                "ControlGroup": (str(tracker.path) if isinstance(tracker, _Cgroup) else ""),
                "Type": cfg.type if cfg else "",
                "Restart": cfg.restart if cfg else "",
                "KillMode": cfg.kill_mode if cfg else "",
            }

    def status(self, name: str) -> str:
        """``systemctl status`` text."""
        unit = self._unit(name)
        props = self.show(name)
        with unit.cond:
            cfg = unit.config or unit.run_config
            if cfg is None:
                return f"Unit {unit.name} could not be found."
            marks = {"active": "●", "failed": "×"}  # noqa: RUF001 (systemctl's marks)
            dot = marks.get(unit.active, "○")
            since = datetime.datetime.fromtimestamp(unit.since).strftime("%a %Y-%m-%d %H:%M:%S")
            state = f"{unit.active} ({unit.sub})"
            if unit.result != "success" and unit.active in ("failed", "activating"):
                state += f" (Result: {unit.result})"
            lines = [
                f"{dot} {unit.name} - {cfg.label}",
                f"     Loaded: {props['LoadState']} ({cfg.fragment}; {props['UnitFileState']})",
            ]
            if cfg.dropins:
                lines.append(f"    Drop-In: {os.path.dirname(cfg.dropins[0])}")
                lines += [f"             └─{os.path.basename(p)}" for p in cfg.dropins]
            lines.append(f"     Active: {state} since {since}")
            main, exit_ = unit.main, unit.exec_main
            if main is not None and main.status is None:
                lines.append(f"   Main PID: {main.pid} ({_comm(main.pid)})")
            elif main is not None and exit_ is not None:
                lines.append(f"   Main PID: {main.pid} ({exit_.describe()})")
            tracker = unit.tracker
        if tracker is not None:
            pids = tracker.pids()
            if pids:
                label = tracker.path if isinstance(tracker, _Cgroup) else "(process tree)"
                lines.append(f"     CGroup: {label}")
                for i, pid in enumerate(pids):
                    branch = "└─" if i == len(pids) - 1 else "├─"
                    lines.append(f"             {branch}{pid} {_cmdline(pid)}")
        return "\n".join(lines)

    # -- power

    def poweroff(self) -> None:
        """Stop every started unit in the reverse of its start order, each with its own stop
        logic and TimeoutStopSec=, then return. No unit starts afterwards."""
        with self._lock:
            self._powering_off = True
            order = list(reversed(self._start_order))
            others = [n for n in self._units if n not in order]
        for name in order + others:
            self.stop(name)

    def _kill_everything(self) -> None:
        with self._lock:
            units = list(self._units.values())
        for unit in units:
            tracker = unit.tracker
            if tracker is not None:
                tracker.kill()

    def request_poweroff(
        self, action: str = "poweroff", delay: float = 0.0, force: bool = False
    ) -> bool:
        """What ``shutdown``/``poweroff`` ask: after ``delay`` seconds (cancellable), stop
        every unit (``force``: SIGKILL them first), then call ``on_poweroff()``.
        Returns at once; False if a power-off is already scheduled or under way."""
        if action not in ("poweroff", "halt", "reboot"):
            raise ValueError(f"unknown power action {action!r}")
        with self._lock:
            if self._power_thread is not None and self._power_thread.is_alive():
                return False
            self._power_cancel.clear()
            self._power_thread = threading.Thread(
                target=self._power_sequence,
                args=(action, delay, force),
                daemon=True,
                name="standin-poweroff",
            )
            self._power_thread.start()
        return True

    def cancel_poweroff(self) -> bool:
        """Cancel a delayed power-off that has not started; True if one was pending."""
        with self._lock:
            pending = (
                self._power_thread is not None
                and self._power_thread.is_alive()
                and not self._powering_off
            )
            self._power_cancel.set()
        return pending

    def _power_sequence(self, action: str, delay: float, force: bool) -> None:
        if delay > 0 and self._power_cancel.wait(delay):
            self._log("Shutdown canceled.")
            return
        with self._lock:
            if self._power_cancel.is_set() and delay > 0:
                return
            self._powering_off = True
        verb = {"poweroff": "powering down", "halt": "halting", "reboot": "rebooting"}[action]
        self._log(f"System is {verb}.")
        if force:
            self._kill_everything()
        self.poweroff()
        target = {"poweroff": "System Power Off", "halt": "System Halt", "reboot": "System Reboot"}
        self._log(f"Reached target {target[action]}.")
        self.power_action = action
        if self.on_poweroff is not None:
            try:
                self.on_poweroff()
            except Exception as exc:
                self._log(f"on_poweroff() failed: {exc!r}")

    # -- spawning

    def _fstab(self) -> list[str]:
        try:
            with open(self.fstab_path) as f:
                return parse_fstab(f.read())
        except FileNotFoundError:
            return []

    def _mounted(self) -> set[str]:
        with open(self.mountinfo_path) as f:
            return parse_mountinfo(f.read())

    def _prepare_runtime(self, unit: _Unit) -> None:
        cfg = unit.run_config
        assert cfg is not None
        if self.cgroup_root is not None:
            tracker: _Cgroup | _ProcTree = _Cgroup(self.cgroup_root / unit.name)
        else:
            tracker = _ProcTree(unit.invocation)
        tracker.create()
        private = None
        if cfg.private_tmp and self.sandbox:
            private = self.state_dir / "private" / f"{unit.name}-{unit.invocation[:12]}"
            private.mkdir(mode=0o700)
            for sub in ("tmp", "var-tmp"):
                (private / sub).mkdir()
                os.chmod(private / sub, 0o1777)
        with unit.cond:
            unit.tracker, unit.private_tmp = tracker, private

    def _release_runtime(self, unit: _Unit) -> None:
        with unit.cond:
            tracker, private = unit.tracker, unit.private_tmp
            unit.private_tmp = None
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)
        if isinstance(tracker, _Cgroup) and tracker.empty():
            tracker.remove()

    def _environment(self, unit: _Unit, cfg: UnitConfig) -> dict[str, str]:
        env = dict(self.environment)
        env["INVOCATION_ID"] = unit.invocation
        env.update(cfg.environment)
        for path, optional in cfg.environment_files:
            try:
                with open(path, encoding="utf-8") as f:
                    env.update(parse_env_file(f.read()))
            except OSError as exc:
                if optional and isinstance(exc, FileNotFoundError):
                    continue
                raise _SpawnError(
                    "resources",
                    [f"Failed to load environment files: {exc.strerror or exc}"],
                ) from exc
        return env

    def _open_output(self, out: Output, ident: str, readers: list[tuple[int, str]]) -> int:
        if out.kind in ("null", "inherit"):
            return os.open("/dev/null", os.O_WRONLY | os.O_CLOEXEC)
        if out.kind == "journal":
            r, w = os.pipe()
            readers.append((r, ident))
            return w
        flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOCTTY
        flags |= {"append": os.O_APPEND, "truncate": os.O_TRUNC, "file": 0}[out.kind]
        assert out.path is not None
        return os.open(out.path, flags, 0o644)

    def _sandbox_spec(self, unit: _Unit, cfg: UnitConfig) -> dict | None:
        if not self.sandbox:
            return None
        box: dict[str, Any] = {
            "protect_system": cfg.protect_system,
            "protect_home": cfg.protect_home,
            "protect_kernel_tunables": cfg.protect_kernel_tunables,
            "protect_kernel_modules": cfg.protect_kernel_modules,
            "protect_kernel_logs": cfg.protect_kernel_logs,
            "protect_control_groups": cfg.protect_control_groups,
            "protect_hostname": cfg.protect_hostname,
            "no_new_privileges": cfg.no_new_privileges,
            "inaccessible_file": str(self._inaccessible),
            "drop_capabilities": (
                ([16] if cfg.protect_kernel_modules else [])  # CAP_SYS_MODULE
                + ([34] if cfg.protect_kernel_logs else [])  # CAP_SYSLOG
            ),
        }
        if unit.private_tmp is not None:
            box["private_tmp"] = [
                str(unit.private_tmp / "tmp"),
                str(unit.private_tmp / "var-tmp"),
            ]
        needs_ns = any(
            box[k] not in (False, "no")
            for k in (
                "protect_system", "protect_home", "protect_kernel_tunables",
                "protect_kernel_modules", "protect_kernel_logs", "protect_control_groups",
                "protect_hostname",
            )
        ) or "private_tmp" in box  # fmt: skip
        if not needs_ns and not box["no_new_privileges"] and not box["drop_capabilities"]:
            return None
        box["namespace"] = needs_ns
        return box

    def _rlimits(self, cfg: UnitConfig) -> list[list]:
        out = []
        for name, soft, hard in cfg.limits:
            inf = resource.RLIM_INFINITY
            if name == "NOFILE":
                # infinity for open files is the kernel's ceiling, as systemd maps it.
                with open("/proc/sys/fs/nr_open") as f:
                    inf = int(f.read())
            out.append(
                [name, _RLIMITS[name], inf if soft == -1 else soft, inf if hard == -1 else hard]
            )
        return out

    def _spawn(self, unit: _Unit, cfg: UnitConfig, cmd: ExecCommand, role: str) -> _Proc:
        env = self._environment(unit, cfg)
        argv = cmd.expand(env)
        ident = cfg.syslog_identifier or os.path.basename(cmd.path)
        readers: list[tuple[int, str]] = []
        fds: list[int] = []
        status_r = -1
        spawned = False
        try:
            try:
                out = self._open_output(cfg.standard_output, ident, readers)
                fds.append(out)
                if cfg.standard_error.kind == "inherit":
                    err = os.dup(out)
                else:
                    err = self._open_output(cfg.standard_error, ident, readers)
                fds.append(err)
            except OSError as exc:
                raise _SpawnError(
                    "exit-code",
                    [
                        f"Failed to set up standard output: {exc.strerror}",
                        f"Failed at step STDOUT spawning {cmd.path}: {exc.strerror}",
                    ],
                ) from exc
            status_r, status_w = os.pipe()
            fds.append(status_w)
            box = None if cmd.privileged else self._sandbox_spec(unit, cfg)
            cwd, cwd_optional = cfg.working_directory or ("/", False)
            tracker = unit.tracker
            spec = {
                "path": cmd.path,
                "argv": argv,
                "env": env,
                "cgroup_procs": tracker.procs_file if tracker is not None else None,
                "rlimits": self._rlimits(cfg),
                "umask": 0o022,
                "cwd": cwd,
                "cwd_optional": cwd_optional,
                "sandbox": box,
            }
            # Descriptors above the ones the child's file actions write (0-3).
            out_hi = _high_fd(out)
            err_hi = _high_fd(err)
            status_hi = _high_fd(status_w)
            fds += [out_hi, err_hi, status_hi]
            actions = [
                (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, out_hi, 1),
                (os.POSIX_SPAWN_DUP2, err_hi, 2),
                (os.POSIX_SPAWN_DUP2, status_hi, 3),
            ]
            wrapper = [self.python, "-I", self.execwrap, json.dumps(spec)]
            defaults = signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}
            with self._spawn_lock:
                try:
                    pid = os.posix_spawn(
                        self.python,
                        wrapper,
                        {},
                        file_actions=actions,
                        setsigdef=defaults,
                        setsigmask=(),
                        setsid=True,
                    )
                except OSError as exc:
                    raise _SpawnError(
                        "resources",
                        [f"Failed to spawn {role} process {self.python}: {exc.strerror}"],
                    ) from exc
                self._children.add(pid)
                spawned = True
        finally:
            leftovers = fds if spawned else fds + [r for r, _ in readers] + [status_r]
            for fd in leftovers:
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
        if tracker is not None:
            tracker.add(pid)
        proc = _Proc(pid, role, cmd, argv, status_r)
        for r, name in readers:
            threading.Thread(
                target=self._pump, args=(r, name, pid), daemon=True, name=f"standin-out-{pid}"
            ).start()
        threading.Thread(
            target=self._wait_child, args=(unit, proc), daemon=True, name=f"standin-wait-{pid}"
        ).start()
        return proc

    def _pump(self, fd: int, ident: str, pid: int) -> None:
        """Journal output: the process's lines to the console as ``ident[pid]: line``."""
        buf = b""
        with os.fdopen(fd, "rb", buffering=0) as f:
            while chunk := f.read(65536):
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    self._journal(ident, pid, line.decode(errors="replace"))
        if buf:
            self._journal(ident, pid, buf.decode(errors="replace"))

    def _wait_child(self, unit: _Unit, proc: _Proc) -> None:
        try:
            _, wstatus = os.waitpid(proc.pid, 0)
            status = ExitStatus.from_wait(wstatus)
        except ChildProcessError:
            # Someone else reaped it (a PID 1 that reaps everything: see reap_orphans).
            status = ExitStatus("exited", 0)
        with self._spawn_lock:
            self._children.discard(proc.pid)
        with unit.cond:
            proc.status = status
            unit.cond.notify_all()

    def reap_orphans(self, keep: Collection[int] = ()) -> list[int]:
        """Reap zombie children of this process that the manager did not spawn and that
        ``keep`` does not name: the orphans a PID 1 (or a subreaper) inherits. A box PID 1
        must reap through this, never with waitpid(-1), or it steals the manager's exit
        statuses."""
        me = os.getpid()
        reaped = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            stat = _proc_stat(pid)
            if stat is None or stat[1] != me or stat[0] != "Z" or pid in keep:
                continue
            with self._spawn_lock:
                if pid in self._children:
                    continue
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
                    reaped.append(pid)
        return reaped

    def _scan(self) -> None:
        """Without cgroups: keep each unit's process tree current and reap orphans."""
        while not self._closed.wait(0.05):
            with self._lock:
                units = list(self._units.values())
            for unit in units:
                tracker = unit.tracker
                if isinstance(tracker, _ProcTree) and unit.worker is not None:
                    with contextlib.suppress(OSError):
                        tracker.refresh()
            if self._subreaper:
                with contextlib.suppress(OSError):
                    self.reap_orphans()

    # -- control socket

    def serve(self, socket_path: str) -> None:
        """Listen for the CLI on a UNIX socket (mode 0666; changes need uid 0) in a
        background thread; one JSON request per line, one JSON reply per line:
        ``{"op": ..., ...}`` -> ``{"rc": int, "out": str, "err": str}``."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(socket_path)
        os.chmod(socket_path, 0o666)
        server.listen(16)
        self._server, self._socket_path = server, socket_path
        threading.Thread(
            target=self._accept, args=(server,), daemon=True, name="standin-accept"
        ).start()

    def _accept(self, server: socket.socket) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=self._converse, args=(conn,), daemon=True).start()

    def _converse(self, conn: socket.socket) -> None:
        with conn:
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            _pid, uid, _gid = struct.unpack("3i", creds)
            reader = conn.makefile("rb")
            for line in reader:
                try:
                    request = json.loads(line)
                    reply = handle_request(self, request, uid)
                except Exception as exc:
                    reply = {"rc": 1, "out": "", "err": f"Failed: {exc}\n"}
                try:
                    conn.sendall(json.dumps(reply).encode() + b"\n")
                except OSError:
                    return

    # -- teardown

    def close(self) -> None:
        """The VM is gone: stop serving, cancel restarts and power-offs, SIGKILL every
        process of every unit, remove their cgroups and private /tmp directories."""
        self._closed.set()
        self._power_cancel.set()
        server, self._server = self._server, None
        if server is not None:
            with contextlib.suppress(OSError):
                server.shutdown(socket.SHUT_RDWR)
            server.close()
            if self._socket_path:
                with contextlib.suppress(OSError):
                    os.unlink(self._socket_path)
        with self._lock:
            self._powering_off = True
            units = list(self._units.values())
        for unit in units:
            with unit.cond:
                worker = unit.worker
                unit.stop_requested = worker is not None
                unit.cond.notify_all()
            if unit.tracker is not None:
                unit.tracker.kill()
            if worker is not None:
                worker.join(timeout=30)
            tracker = unit.tracker
            if tracker is not None:
                tracker.kill()
                deadline = time.monotonic() + 10
                while not tracker.empty() and time.monotonic() < deadline:
                    time.sleep(0.02)
                if isinstance(tracker, _Cgroup):
                    tracker.remove()
        if self._created_cgroup_root and self.cgroup_root is not None:
            with contextlib.suppress(OSError):
                self.cgroup_root.rmdir()
        shutil.rmtree(self.state_dir / "private", ignore_errors=True)
        if self._scanner is not None:
            self._scanner.join(timeout=5)
        if self._subreaper:
            self.reap_orphans()
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(36, ctypes.c_ulong(0), 0, 0, 0)
            self._subreaper = False

    def __enter__(self) -> ServiceManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _high_fd(fd: int) -> int:
    """A close-on-exec copy of ``fd`` numbered 10 or above."""
    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)


# --------------------------------------------------------------------------------------
# The control socket's requests (what the CLI sends)

_CHANGES = {"daemon-reload", "enable", "disable", "start", "stop", "restart", "reset-failed",
            "poweroff", "cancel-shutdown"}  # fmt: skip


def _reply(rc: int = 0, out: str = "", err: str = "") -> dict:
    return {"rc": rc, "out": out, "err": err}


def handle_request(manager: ServiceManager, request: Mapping[str, Any], uid: int) -> dict:
    """One CLI request. ``op`` is a systemctl verb or ``poweroff``/``cancel-shutdown``;
    ``units`` the unit names; the reply carries systemctl's exit code and its output.

    Requests:
        {"op": "daemon-reload"}
        {"op": "enable" | "disable", "units": [...], "now": bool}
        {"op": "start" | "stop" | "restart", "units": [...], "no_block": bool}
        {"op": "is-active" | "is-failed" | "is-enabled" | "status" | "reset-failed",
         "units": [...]}
        {"op": "show", "units": [...], "properties": [...], "value": bool}
        {"op": "poweroff", "action": "poweroff" | "halt" | "reboot", "delay_s": float,
         "force": bool}
        {"op": "cancel-shutdown"}
    """
    op = request.get("op")
    units = [str(u) for u in request.get("units", [])]
    if op in _CHANGES and uid != 0:
        return _reply(4, err=f"Failed to {op}: Access denied\n")

    if op == "daemon-reload":
        try:
            manager.daemon_reload()
        except UnitError as exc:
            return _reply(
                1,
                err="".join(f"{p}\n" for p in exc.problems)
                + "Failed to reload daemon: the unit files above are refused.\n",
            )
        return _reply()

    if op in ("start", "stop", "restart"):
        if request.get("no_block"):

            def later(u: str = "") -> None:
                with contextlib.suppress(Exception):
                    getattr(manager, op)(u)

            for u in units:
                threading.Thread(target=later, args=(u,), daemon=True).start()
            return _reply()
        return _run_jobs(manager, op, units)

    if op in ("enable", "disable"):
        lines: list[str] = []
        for u in units:
            try:
                lines += manager.enable(u) if op == "enable" else manager.disable(u)
            except UnitNotFoundError as exc:
                return _reply(1, err=f"Failed to {op} unit: Unit file {exc.unit} does not exist.\n")
            except UnitError as exc:
                return _reply(1, err=f"Failed to {op} unit: {exc}\n")
        err = "".join(f"{line}\n" for line in lines)
        if request.get("now"):
            reply = _run_jobs(manager, "start" if op == "enable" else "stop", units)
            reply["err"] = err + reply["err"]
            return reply
        return _reply(err=err)

    if op in ("is-active", "is-failed"):
        states = [manager.is_active(u) for u in units]
        want = "active" if op == "is-active" else "failed"
        out = "" if request.get("quiet") else "".join(f"{s}\n" for s in states)
        return _reply(0 if want in states else (3 if op == "is-active" else 1), out=out)

    if op == "is-enabled":
        states = [manager.is_enabled(u) for u in units]
        out = "" if request.get("quiet") else "".join(f"{s}\n" for s in states)
        ok = any(s == "enabled" for s in states)
        return _reply(0 if ok else 1, out=out)

    if op == "reset-failed":
        for u in units or [None]:
            manager.reset_failed(u)
        return _reply()

    if op == "status":
        texts, rc = [], 0
        for u in units:
            props = manager.show(u)
            if props["LoadState"] == "not-found":
                return _reply(4, err=f"Unit {props['Id']} could not be found.\n")
            texts.append(manager.status(u))
            if props["ActiveState"] != "active":
                rc = 3
        return _reply(rc, out="\n\n".join(texts) + "\n")

    if op == "show":
        wanted = list(request.get("properties") or [])
        blocks = []
        for u in units:
            props = manager.show(u)
            names = wanted or list(props)
            if request.get("value"):
                blocks.append("".join(f"{props[n]}\n" for n in names if n in props))
            else:
                blocks.append("".join(f"{n}={props[n]}\n" for n in names if n in props))
        return _reply(out="\n".join(blocks))

    if op == "poweroff":
        action = str(request.get("action", "poweroff"))
        delay = float(request.get("delay_s", 0))
        if not manager.request_poweroff(action, delay, bool(request.get("force"))):
            return _reply(err="A shutdown is already scheduled or under way.\n")
        return _reply()

    if op == "cancel-shutdown":
        manager.cancel_poweroff()
        return _reply()

    return _reply(1, err=f"Unknown operation {op!r}.\n")


def _run_jobs(manager: ServiceManager, op: str, units: Sequence[str]) -> dict:
    verb = {"start": "start", "stop": "stop", "restart": "restart"}[op]
    for u in units:
        try:
            getattr(manager, op)(u)
        except UnitNotFoundError as exc:
            return _reply(5, err=f"Failed to {verb} {exc.unit}: Unit {exc.unit} not found.\n")
        except UnitError as exc:
            name = normalize_unit_name(u)
            return _reply(
                6,
                err=f"Failed to {verb} {name}: Unit {name} has a bad unit file setting.\n{exc}\n",
            )
        except JobFailedError as exc:
            if exc.result == "destructive":
                return _reply(4, err=f"Failed to {verb} {exc.unit}: {exc}\n")
            return _reply(1, err=f"{exc}\n")
    return _reply()

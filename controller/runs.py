"""A run on this workstation: its directory, its Redis, its code, and its controller.

``$SPOTTRAIN_HOME/runs/<run id>/`` holds ``run.json`` (the spec, where Redis is, where the
code archive went), the embedded Redis's data (append-only file) and its password
(``redis/password``, mode 0600), the controller's log, and,
after the run, ``summary.json`` and ``events.jsonl`` so ``status`` and ``logs`` still answer
once its Redis is gone. ``$SPOTTRAIN_HOME/jobs/<name>`` names the newest run of a job.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import redis

from spottrain.bootstrap import CodeRef, NodeIdentity, render_boot_script, render_local_boot
from spottrain.cloud.base import Offer, Provider
from spottrain.embedded_redis import (
    config_on_stdin,
    find_redis_server,
    free_port,
    new_password_file,
)
from spottrain.keys import RunKeys, make_run_id, validate_run_id
from spottrain.redis_conn import (
    RedisConfigError,
    RedisSettings,
    connect,
    describe_error,
    resolve_password,
    settings_from_url,
)
from spottrain.spec import ArchiveCode, JobSpec, LoadedSpec, parse_spec

from .env_lock import ResolveError, capture_locks
from .group_loop import GROUP_TUNABLES, GroupController, group_policy_from_spec
from .loop import Controller, policy_from_spec
from .providers import Endpoints, build_group, build_providers, preemption_injector
from .state import RunState, new_owner


class RunError(Exception):
    """A run cannot be started, found or reached; the message says why and what to do."""


def home_dir() -> Path:
    return Path(os.environ.get("SPOTTRAIN_HOME") or Path.home() / ".spottrain")


# The specs this process has parsed, by (text, source, base dir): `up` validates the file
# once and hands its spec on, and each later `RunInfo.spec()` of the same run reuses it
# instead of parsing the text again. A JobSpec is frozen, so sharing it is safe.
_parsed_specs: dict[tuple[str, str, str], JobSpec] = {}


@dataclass
class RunInfo:
    """``run.json``: what every command needs to find a run's parts."""

    run_id: str
    spec_text: str
    spec_source: str
    base_dir: str
    redis_url: str
    embedded_redis: bool
    created_at: float
    local_state_dir: str = ""
    code_url: str = ""
    code_sha256: str = ""
    controller_pid: int = 0
    # The hashed lock of the agent's environment per cloud (controller/env_lock.py):
    # {cloud: {"file": "env-aws.lock", "sha256": ..., "packages": n}}, files in the run dir.
    env_locks: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def dir(self) -> Path:
        return home_dir() / "runs" / self.run_id

    def save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / "run.json.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=1))
        os.replace(tmp, self.dir / "run.json")

    def spec(self) -> JobSpec:
        key = (self.spec_text, self.spec_source, self.base_dir)
        spec = _parsed_specs.get(key)
        if spec is None:
            spec = parse_spec(self.spec_text, self.spec_source, Path(self.base_dir)).spec
            _parsed_specs[key] = spec
        return spec

    @classmethod
    def load(cls, run_id: str) -> RunInfo:
        path = home_dir() / "runs" / run_id / "run.json"
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            raise RunError(f"no run {run_id!r} on this machine (see `spottrain status`)") from None


def find_run(name_or_id: str | None) -> RunInfo:
    """A run by run id, by job name (its newest run), or the newest run of all (``None``:
    no name given).

    Raises:
        RunError: nothing matches, or the name is empty or not a run id or job name (an
            unset shell variable must never pick the newest run).
    """
    runs = home_dir() / "runs"
    if name_or_id is not None:
        _check_run_name(name_or_id)
        if (runs / name_or_id / "run.json").exists():
            return RunInfo.load(name_or_id)
        latest = home_dir() / "jobs" / name_or_id
        if latest.exists():
            return RunInfo.load(latest.read_text().strip())
        raise RunError(f"no run or job named {name_or_id!r} on this machine")
    candidates = sorted(runs.glob("*/run.json"), key=lambda p: p.stat().st_mtime)
    if not candidates:
        raise RunError("no runs on this machine yet: start one with `spottrain up JOB.yaml`")
    return RunInfo.load(candidates[-1].parent.name)


def _check_run_name(name: str) -> None:
    if not name.strip():
        raise RunError(
            "the run name is empty (an unset variable?): give a run id or job name, or leave "
            "it out to mean the newest run"
        )
    try:
        validate_run_id(name)
    except ValueError:
        raise RunError(
            f"{name!r} is not a run id or job name: use letters, digits, '.', '_' or '-'"
        ) from None
    if name in (".", ".."):
        raise RunError(f"{name!r} is not a run id or job name")


# --- Redis ----------------------------------------------------------------------------------


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


def _redis_daemon(data: Path, port: int | str, password: str | None) -> None:
    """Start a daemonized redis-server on ``port`` that keeps its data (append-only file)
    in ``data``, and wait until it answers. Only this machine can reach it (127.0.0.1,
    protected mode), and only with ``password``, which goes through its standard input,
    never its command line."""
    data.mkdir(mode=0o700, parents=True, exist_ok=True)
    head, config = config_on_stdin(password)
    args = [
        find_redis_server(), *head,
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--dir", str(data),
        "--appendonly", "yes",
        "--appendfsync", "everysec",
        "--save", "",
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


def _embedded_settings(url: str, password: str | None, socket_timeout: float) -> RedisSettings:
    settings = settings_from_url(url, password_env=None, socket_timeout=socket_timeout)
    return replace(settings, password=password)


def start_embedded_redis(run_dir: Path) -> str:
    """Start a redis-server for the run that outlives this process (a controller killed and
    restarted finds its state), persisted to the run directory, with a fresh password kept
    there (mode 0600). Returns its URL (which holds no password)."""
    port = free_port()
    (run_dir / "redis").mkdir(mode=0o700, parents=True, exist_ok=True)
    password = new_password_file(embedded_password_file(run_dir))
    _redis_daemon(run_dir / "redis", port, password)
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
    _redis_daemon(info.dir / "redis", port, password)


def stop_embedded_redis(info: RunInfo) -> None:
    pidfile = info.dir / "redis" / "redis.pid"
    with contextlib.suppress(redis.RedisError, RunError):
        settings = _embedded_settings(
            info.redis_url, _embedded_password(info.dir), socket_timeout=2.0
        )
        connect(settings, retries=0).shutdown(save=False)
    with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
        pid = int(pidfile.read_text())
        os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            os.kill(pid, 0)
            time.sleep(0.05)


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
        password_env = spec.redis.password_env if spec else "SPOTTRAIN_REDIS_PASSWORD"
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


# --- code and boot ---------------------------------------------------------------------------


def local_secret_files(spec: JobSpec) -> dict[str, str]:
    """The local cloud's secret store: ``train.secret_env`` names files in
    ``$SPOTTRAIN_HOME/secrets``, which only their owner may read.

    Raises:
        RunError: a secret is missing, outside that folder, or readable by others.
    """
    root = (home_dir() / "secrets").resolve()
    files = {}
    for name, secret in spec.train.secret_env.items():
        path = (root / secret).resolve()
        if not path.is_relative_to(root):
            raise RunError(f"train.secret_env.{name}: {secret!r} leaves {root}")
        if not path.is_file():
            raise RunError(
                f"train.secret_env.{name}: no secret {secret!r} on the local cloud: write it "
                f"to {path} (install -m 600 /dev/stdin {path})"
            )
        if path.stat().st_mode & 0o077:
            raise RunError(
                f"train.secret_env.{name}: {path} is readable by others: chmod 600 {path}"
            )
        files[name] = str(path)
    return files


def prepare_code(spec: JobSpec, base_dir: Path, run_dir: Path) -> CodeRef:
    """Archive and upload ``code.archive`` (nothing to do for an image or a commit)."""
    if not isinstance(spec.code, ArchiveCode):
        return CodeRef()
    from spottrain.cloud.code_archive import build_archive, upload_archive
    from spottrain.cloud.storage import LocalStore, open_store

    src = spec.code.archive
    archive = build_archive(base_dir / src.path, run_dir / "archive", exclude=src.exclude)
    if src.store:
        store = open_store(src.store)
    elif spec.checkpoint.copy_to:
        store = open_store(spec.checkpoint.copy_to.rstrip("/") + "/code")
    else:
        store = LocalStore(home_dir() / "store", create=True)
    url = upload_archive(store, archive)
    return CodeRef(url, archive.sha256)


def local_copy_to(spec: JobSpec) -> str:
    """Where a local job's checkpoints are copied: ``checkpoint.copy_to``, else a directory
    under ``$SPOTTRAIN_HOME`` (the local cloud's "object storage")."""
    if spec.checkpoint.copy_to:
        return spec.checkpoint.copy_to
    root = home_dir() / "store" / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    return f"file://{root}"


def boot_renderer(spec: JobSpec, info: RunInfo) -> Any:
    code = CodeRef(info.code_url, info.code_sha256)
    password = embedded_password_file(info.dir) if info.embedded_redis else None
    password_file = str(password) if password is not None and password.exists() else None
    secrets = local_secret_files(spec) if "local" in spec.resources.clouds else {}
    locks = {c: (info.dir / v["file"]).read_text() for c, v in info.env_locks.items()}

    def render(node: str, offer: Offer) -> str:
        ident = NodeIdentity(info.run_id, node, offer.cloud, offer.zone, offer.instance_type)
        if offer.cloud == "local":
            return render_local_boot(
                spec,
                ident,
                info.redis_url,
                workdir=info.dir / "nodes" / node / "code",
                code=code,
                copy_to=local_copy_to(spec),
                password_file=password_file,
                secret_files=secrets,
            )
        return render_boot_script(
            spec,
            ident,
            info.redis_url,
            code=code,
            password_secret=spec.redis.password_secret,
            env_lock=locks.get(offer.cloud),
        )

    return render


# --- building and starting -------------------------------------------------------------------


def create_run(
    loaded: LoadedSpec, *, run_id: str | None = None, env_locks: dict[str, Path] | None = None
) -> RunInfo:
    """Make a new run of a spec: its directory, Redis (embedded or checked), and code.

    Raises:
        RunError: Redis unreachable or refusing, the code cannot be archived or uploaded,
            the agent's environment cannot be locked (``env_locks``: the user's lock files
            by cloud, instead of resolving).
    """
    spec = loaded.spec
    if run_id:
        rid = validate_run_id(run_id)
    elif spec.fleet is not None:
        # The fleet's VMs were booted with the module's run id: the run must be that one.
        rid = spec.fleet.run_id
        if (home_dir() / "runs" / rid / "run.json").exists():
            raise RunError(
                f"run {rid} of this Terraform fleet already exists on this machine: "
                f"`spottrain resume {rid}` drives it again, `spottrain down {rid}` ends it"
            )
    else:
        rid = make_run_id(spec.name)
    if "local" in spec.resources.clouds:
        local_secret_files(spec)  # fail now, before anything starts
    info = RunInfo(
        run_id=rid,
        spec_text=loaded.text,
        spec_source=loaded.source,
        base_dir=str(loaded.base_dir),
        redis_url="",
        embedded_redis=spec.redis.url == "embedded",
        created_at=time.time(),
    )
    _parsed_specs[(info.spec_text, info.spec_source, info.base_dir)] = spec
    info.dir.mkdir(parents=True, exist_ok=True)
    try:
        info.env_locks = capture_locks(spec, loaded.base_dir, info.dir, env_locks)
    except ResolveError as e:
        raise RunError(str(e)) from None
    if info.embedded_redis:
        info.redis_url = start_embedded_redis(info.dir)
    else:
        info.redis_url = spec.redis.url
        open_redis(info, spec)  # fail now, before anything is launched
    if "local" in spec.resources.clouds:
        info.local_state_dir = str(home_dir() / "local")
    try:
        # A Terraform fleet's boot script pins and fetches the code itself.
        code = CodeRef() if spec.fleet else prepare_code(spec, loaded.base_dir, info.dir)
    except Exception as e:
        if info.embedded_redis:
            stop_embedded_redis(info)
        raise RunError(f"cannot prepare the job's code: {e}") from None
    info.code_url, info.code_sha256 = code.archive_url, code.archive_sha256
    info.save()
    jobs = home_dir() / "jobs"
    jobs.mkdir(parents=True, exist_ok=True)
    (jobs / spec.name).write_text(rid)
    return info


def build_controller(
    info: RunInfo,
    *,
    interval_s: float = 1.0,
    endpoints: Endpoints | None = None,
    policy: dict[str, float] | None = None,
) -> Controller | GroupController:
    """The controller of a run, with its providers, state and local preemptions; for a
    Terraform fleet, the controller that adopts its group.

    Raises:
        RunError: Redis unreachable or refusing.
    """
    spec = info.spec()
    client = open_redis(info, spec)
    keys = RunKeys(info.run_id)
    state = RunState(client, keys)
    if spec.fleet is not None:
        if not state.ctl().get("started_at"):
            state.set_ctl(started_at=str(time.time()), phase="running")
        return GroupController(
            spec=spec,
            run_id=info.run_id,
            group=build_group(spec, endpoints=endpoints),
            state=state,
            policy=group_policy_from_spec(
                spec, **{k: v for k, v in (policy or {}).items() if k in GROUP_TUNABLES}
            ),
            interval_s=max(interval_s, 5.0),
            notice_window_s=min(60.0, *spec.notice_windows.values()),
            owner=new_owner(),
            region=spec.fleet.region or "",
        )
    providers: dict[str, Provider] = build_providers(
        spec,
        local_state_dir=Path(info.local_state_dir) if info.local_state_dir else None,
        endpoints=endpoints,
    )
    ctl = state.ctl()
    started = float(ctl.get("started_at") or time.time())
    if not ctl.get("started_at"):
        state.set_ctl(started_at=str(started), phase="running")
    tick = None
    if "local" in providers:
        injector = preemption_injector(
            spec, providers["local"], info.run_id, started_at=started, base_dir=Path(info.base_dir)
        )
        if injector is not None:

            def tick(now: float) -> None:
                for vm, notice in injector.tick(now):
                    state.event("inject-preemption", vm=vm, notice=int(notice))

    return Controller(
        spec=spec,
        run_id=info.run_id,
        providers=providers,
        state=state,
        boot=boot_renderer(spec, info),
        policy=policy_from_spec(spec, **(policy or {})),
        interval_s=interval_s,
        tick=tick,
        owner=new_owner(),
    )


def spawn_controller(info: RunInfo) -> int:
    """Run the controller of ``info`` in the background; returns its pid."""
    log = open(info.dir / "controller.log", "ab")  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen(
        [sys.executable, "-m", "spottrain.controller.daemon", info.run_id],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    log.close()
    info.controller_pid = proc.pid
    info.save()
    return proc.pid


def archive_run(info: RunInfo, client: redis.Redis, summary: dict[str, Any]) -> None:
    """Keep the run's events and summary on disk (its Redis may go away)."""
    keys = RunKeys(info.run_id)
    with open(info.dir / "events.jsonl", "w") as f:
        for row in RunState(client, keys).events():
            f.write(json.dumps(row) + "\n")
    (info.dir / "summary.json").write_text(json.dumps(summary, indent=1))
    from .report import write_report_inputs  # here: report imports this module

    write_report_inputs(info.dir, client, keys)

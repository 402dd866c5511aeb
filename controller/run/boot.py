"""What a new VM runs first: the boot script that installs the job's pinned code and starts
the agent, rendered from the job spec and the node's identity.

On AWS it is the instance's user data, on GCP its ``startup-script`` metadata, and on the
local cloud a JSON command line (:mod:`spottrain.cloud.local.vm`). The Terraform modules
render the same agent settings into their own templates.

Everything the agent needs travels in ``/etc/spottrain/agent.env`` (the systemd unit's
``EnvironmentFile=``), using only the ``SPOTTRAIN_*`` variables that ``spottrain-agent run``
reads; beside them, the job's own variables for its workers (``train.env``, and the
``WANDB_*`` ones of its ``wandb:`` section), which torchrun passes on. Secrets never travel
in a boot script, which anyone allowed to describe the VM can read: the Redis password, the
git token (``code.git.token_secret``) and the job's secret variables (``train.secret_env``)
are fetched at boot from the cloud's secret store into root-only files, and reach git and
the agent through files and the environment, never a command line. With the run's
environment lock (:mod:`spottrain.envlock`), the agent's venv is built from the lock with
hashes required and verified at every boot, so a backfilled VM runs the others' packages.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from spottrain import __version__
from spottrain.cloud.aws import secrets as aws_secrets
from spottrain.cloud.gcp import secrets as gcp_secrets
from spottrain.controller.run.env_lock import spec_agent_requirement
from spottrain.envlock import lock_sha256, parse_lock
from spottrain.protocol import env as env_names
from spottrain.spec import ArchiveCode, GitCode, ImageCode, JobSpec, replica_agent_env
from spottrain.tracking import trainer_env

AGENT_ENV_PATH = "/etc/spottrain/agent.env"
PASSWORD_PATH = "/etc/spottrain/redis-password"
GIT_TOKEN_PATH = "/etc/spottrain/git-token"
GIT_ASKPASS_PATH = "/etc/spottrain/git-askpass"
DOCKER_ENV_PATH = "/etc/spottrain/agent.docker.env"
AGENT_LOG = "/var/log/spottrain-agent.log"
VOLUME_ROOT = "/mnt/spottrain"
JOB_DIR = "/opt/job"
VENV = "/opt/spottrain/venv"
ENV_LOCK_PATH = "/etc/spottrain/env.lock"
# The sha256 of the lock a venv was built from: a VM whose venv came from another lock
# (a reused disk, an image with a venv) builds it again.
ENV_LOCK_MARK = f"{VENV}/.spottrain-env-lock"
# The unprivileged user torchrun and the workers run as (the unit's SPOTTRAIN_WORKER_USER).
# Fixed ids: every VM writes the same shared checkpoint volume, which knows owners by number.
WORKER_USER = "spottrain"
WORKER_UID = 2470


@dataclass(frozen=True)
class NodeIdentity:
    """Who a VM is: the run it belongs to, its node name, and where it runs."""

    run_id: str
    node_id: str
    cloud: str
    zone: str
    instance_type: str


@dataclass(frozen=True)
class CodeRef:
    """Where the pinned code is, once ``spottrain up`` has resolved it (an uploaded archive
    has a URL and a hash only after the upload)."""

    archive_url: str = ""
    archive_sha256: str = ""


def run_ckpt_dir(spec: JobSpec, node: NodeIdentity) -> str:
    """Where a run's checkpoints live: ``<volume>/<run id>``, so runs sharing a volume never
    restore each other's state. The local cloud gives each zone a volume of its own
    (``<volume>/<run id>/<zone>``), as zonal file systems are on real clouds, so moving a
    job between zones really needs its object-storage copy."""
    base = f"{spec.checkpoint.volume.path.rstrip('/')}/{node.run_id}"
    return f"{base}/{node.zone}" if node.cloud == "local" else base


def agent_env(
    spec: JobSpec,
    node: NodeIdentity,
    redis_url: str,
    *,
    password_file: str | None = None,
    copy_to: str | None = None,
) -> dict[str, str]:
    """The ``SPOTTRAIN_*`` settings of one node's agent, plus the job's own variables.

    ``copy_to`` (default: ``checkpoint.copy_to``) is where checkpoints are copied, so that
    the job can move zones and restore there. The ``wandb:`` section becomes
    ``WANDB_PROJECT``, ``WANDB_ENTITY``, ``WANDB_MODE`` (when the spec sets it) and
    ``WANDB_RUN_GROUP=<run id>`` for the workers' rank 0; ``train.env`` overrides them. No
    API key travels here: give the VMs one through the image or ``~/.netrc``, or use
    ``mode: offline`` and ``wandb sync`` afterwards. A replica-mode job adds the mode, the
    replica's size and the quorum's floor; an elastic job's settings are what they were
    before replica mode existed."""
    env = {
        env_names.ENV_REDIS: redis_url,
        env_names.ENV_RUN_ID: node.run_id,
        env_names.ENV_NODE: node.node_id,
        env_names.ENV_CLOUD: node.cloud,
        env_names.ENV_ZONE: node.zone,
        env_names.ENV_INSTANCE_TYPE: node.instance_type,
        env_names.ENV_NNODES: f"{spec.nodes.min}:{spec.nodes.max}",
        env_names.ENV_NPROC_PER_NODE: str(spec.nodes.workers_per_node),
        env_names.ENV_EXPECT_GPUS: str(spec.nodes.gpus),
        env_names.ENV_CKPT_DIR: run_ckpt_dir(spec, node),
        env_names.ENV_TRAIN_CMD: shlex.join(spec.train.command),
        # A VM the controller launched ends itself once its controller is long gone.
        env_names.ENV_ORPHAN_TIMEOUT: f"{spec.controller.orphan_timeout_minutes * 60:g}",
    }
    if password_file:
        env[env_names.ENV_REDIS_PASSWORD_FILE] = password_file
    if copy_to or spec.checkpoint.copy_to:
        env[env_names.ENV_COPY_TO] = copy_to or spec.checkpoint.copy_to or ""
    # Logs ship to <copy_to>/logs unless logs.to says otherwise: on the local cloud that is
    # beside the copies it really makes (local_copy_to), so its demo ships too.
    env.update(spec.logs.agent_env())
    env.update(replica_agent_env(spec))
    return {**trainer_env(spec.wandb, node.run_id), **spec.train.env, **env}


def render_env_file(env: Mapping[str, str]) -> str:
    """``env`` as a systemd ``EnvironmentFile``: every value in double quotes, with the two
    characters systemd unescapes inside them (``\\`` and ``"``) escaped.

    Raises:
        ValueError: a value holds a newline (an env file cannot carry one).
    """
    lines = []
    for k, v in env.items():
        if "\n" in v or "\r" in v:
            raise ValueError(f"{k}: a value in an environment file cannot hold a newline")
        quoted = v.replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f'{k}="{quoted}"')
    return "\n".join(lines) + "\n"


def _secret_get(cloud: str, secret: str) -> str:
    """A shell command that prints a secret from the cloud's secret store to its stdout."""
    if cloud == "aws":
        return aws_secrets.secret_read_command(secret)
    return gcp_secrets.secret_read_command(secret)


def _secret_fetch(cloud: str, secret: str) -> str:
    """Shell lines that write the Redis password from the cloud's secret store."""
    get = _secret_get(cloud, secret)
    return (
        f"umask 077\n{get} > {PASSWORD_PATH}.tmp\n"
        f"test -s {PASSWORD_PATH}.tmp || {{ echo 'spottrain: the Redis password secret is "
        f"empty' >&2; exit 1; }}\nmv {PASSWORD_PATH}.tmp {PASSWORD_PATH}\numask 022\n"
    )


# Appends `NAME="value"` (systemd's quoting) to the agent's env file, and `NAME=value` to
# docker's, from the secret on stdin: printf is a bash builtin, so the value is on no
# command line, and a secret holding a newline is refused (an env file cannot carry one).
_SECRET_ENV_FN = r"""spottrain_secret_env() {
  local raw quoted
  raw="$(cat)"
  [ -n "$raw" ] || { echo "spottrain: the secret for $1 is empty" >&2; exit 1; }
  case "$raw" in *$'\n'*|*$'\r'*)
    echo "spottrain: the secret for $1 holds a newline" >&2; exit 1;;
  esac
  quoted="${raw//\\/\\\\}"
  quoted="${quoted//\"/\\\"}"
  printf '%s="%s"\n' "$1" "$quoted" >> "$2"
  if [ -n "${3:-}" ]; then printf '%s=%s\n' "$1" "$raw" >> "$3"; fi
}
"""


def _secret_env_lines(spec: JobSpec, cloud: str) -> str:
    """Shell lines that add ``train.secret_env`` to the agent's env file(s) (mode 0600)."""
    if not spec.train.secret_env:
        return ""
    docker = DOCKER_ENV_PATH if isinstance(spec.code, ImageCode) else ""
    lines = ["umask 077\n", _SECRET_ENV_FN]
    for name, secret in spec.train.secret_env.items():
        lines.append(
            f"{_secret_get(cloud, secret)} | spottrain_secret_env {name} {AGENT_ENV_PATH}"
            + (f" {docker}" if docker else "")
            + "\n"
        )
    return "".join(lines) + "umask 022\n"


def _git_fetch_lines(spec: JobSpec, cloud: str) -> str:
    """Fetch the pinned commit; with ``token_secret``, git asks a root-only helper for the
    token (GIT_ASKPASS), which is removed once the commit is fetched."""
    assert isinstance(spec.code, GitCode)
    g = spec.code.git
    fetch = f"git -C {JOB_DIR} fetch -q --depth 1 {shlex.quote(g.repo)} {g.commit}"
    if not g.token_secret:
        return f"  {fetch}\n"
    askpass = (
        "#!/bin/sh\n"
        f'case "$1" in Username*) echo {g.token_user} ;; *) cat {GIT_TOKEN_PATH} ;; esac\n'
    )
    return (
        f"  umask 077\n"
        f"  {_secret_get(cloud, g.token_secret)} > {GIT_TOKEN_PATH}\n"
        f"  test -s {GIT_TOKEN_PATH} || {{ echo 'spottrain: the git token secret is empty' "
        ">&2; exit 1; }\n"
        f"  cat > {GIT_ASKPASS_PATH} <<'SH'\n{askpass}SH\n"
        f"  chmod 0700 {GIT_ASKPASS_PATH}\n"
        "  umask 022\n"
        f"  GIT_ASKPASS={GIT_ASKPASS_PATH} GIT_TERMINAL_PROMPT=0 {fetch} || "
        f"{{ rm -f {GIT_TOKEN_PATH} {GIT_ASKPASS_PATH}; exit 1; }}\n"
        f"  rm -f {GIT_TOKEN_PATH} {GIT_ASKPASS_PATH}\n"
    )


def _job_requirements(path: str, env_lock: str | None, *, constrained: bool) -> str:
    """Install the job's ``requirements.txt``. Without a lock: as it says. With one, an
    archive's file is already in the lock (resolved with the agent at ``up``): nothing to
    install; a git checkout's is installed constrained to the lock's versions, and the lock
    is verified afterwards (a job requirement cannot move a locked package)."""
    if env_lock is None:
        return f"if [ -f {path} ]; then {VENV}/bin/pip install -q -r {path}; fi\n"
    if not constrained:
        return ""
    pins = f"{ENV_LOCK_PATH}.constraints"
    return (
        f"if [ -f {path} ]; then\n"
        f"  sed -e 's/ --hash=[^ ]*//g' {ENV_LOCK_PATH} > {pins}\n"
        f"  {VENV}/bin/pip install -q -c {pins} -r {path}\n"
        f"  {_verify_line()}\n"
        "fi\n"
    )


def _verify_line() -> str:
    return f"{VENV}/bin/python -m spottrain.envlock verify {ENV_LOCK_PATH}"


def _venv_lines(requirement: str, env_lock: str | None) -> str:
    """Create the agent's venv. With a lock (``spottrain.envlock``): write it, build the
    venv from it with hashes required (again when the venv came from another lock), and
    verify it at every boot."""
    if env_lock is None:
        return (
            f"if [ ! -x {VENV}/bin/spottrain-agent ]; then\n"
            f"  python3 -m venv {VENV}\n"
            f"  {VENV}/bin/pip install -q {shlex.quote(requirement)}\n"
            "fi\n"
        )
    lock = parse_lock(env_lock, "the env lock")
    sha = lock_sha256(env_lock)
    text = env_lock if env_lock.endswith("\n") else env_lock + "\n"
    py = lock.target.split()[1] if lock.target.startswith("python ") else ""
    check_py = (
        f'python3 -c \'import sys; sys.exit("%d.%d" % sys.version_info[:2] != "{py}")\' || '
        f"{{ echo \"spottrain: the env lock is for python {py}; this image's python3 is "
        f'$(python3 -V 2>&1)" >&2; exit 1; }}\n'
        if py
        else ""
    )
    return (
        f"cat > {ENV_LOCK_PATH} <<'LOCK'\n{text}LOCK\n"
        f'if [ "$(cat {ENV_LOCK_MARK} 2>/dev/null)" != {sha} ]; then\n'
        f"  {check_py}"
        f"  rm -rf {VENV}\n"
        f"  python3 -m venv {VENV}\n"
        f"  {VENV}/bin/pip install -q --require-hashes --no-deps --only-binary=:all: "
        f"-r {ENV_LOCK_PATH}\n"
        f"  echo {sha} > {ENV_LOCK_MARK}\n"
        "fi\n"
        f"{_verify_line()}\n"
    )


def _code_lines(spec: JobSpec, code: CodeRef, cloud: str, env_lock: str | None = None) -> str:
    if isinstance(spec.code, GitCode):
        g = spec.code.git
        workdir = f"{JOB_DIR}/{g.subdir}" if g.subdir else JOB_DIR
        return (
            f"if [ ! -d {JOB_DIR}/.git ]; then\n"
            f"  git init -q {JOB_DIR}\n"
            + _git_fetch_lines(spec, cloud)
            + f"  git -C {JOB_DIR} checkout -q FETCH_HEAD\n"
            "fi\n"
            f'test "$(git -C {JOB_DIR} rev-parse HEAD)" = {g.commit} || '
            "{ echo 'spottrain: the job checkout is not at the pinned commit' >&2; exit 1; }\n"
            + _job_requirements(f"{workdir}/requirements.txt", env_lock, constrained=True)
        )
    if isinstance(spec.code, ArchiveCode):
        if not (code.archive_url and code.archive_sha256):
            raise ValueError("code.archive: render the boot script after the upload (no URL yet)")
        return (
            f"{VENV}/bin/python -m spottrain.cloud.code_archive fetch "
            f"{shlex.quote(code.archive_url)} {code.archive_sha256} {JOB_DIR}\n"
            + _job_requirements(f"{JOB_DIR}/requirements.txt", env_lock, constrained=False)
        )
    assert isinstance(spec.code, ImageCode)
    return f"docker pull {shlex.quote(spec.code.image)}\n"


def worker_user_lines() -> str:
    """Shell lines that create the workers' user with its fixed ids, or stop the boot when
    the image has one with other ids (the Terraform templates hold the same lines). The user
    joins ``video`` and ``render`` where the image has them: some distributions give GPU
    device files to those groups instead of mode 0666."""
    u, i = WORKER_USER, WORKER_UID
    return (
        f"if ! id -u {u} >/dev/null 2>&1; then\n"
        f"  getent group {u} >/dev/null || groupadd --system --gid {i} {u}\n"
        f"  useradd --system --uid {i} --gid {i} --home-dir /var/lib/{u} --create-home "
        f"--shell /usr/sbin/nologin {u}\n"
        "fi\n"
        f'[ "$(id -u {u}):$(id -g {u})" = {i}:{i} ] || {{ echo "spottrain: the user {u} is '
        f"$(id -u {u}):$(id -g {u}), not {i}:{i}; VMs sharing the checkpoint volume need the "
        f'same ids: give it these or remove it from the image" >&2; exit 1; }}\n'
        'for g in video render; do if getent group "$g" >/dev/null; then '
        f'usermod -a -G "$g" {u}; fi; done\n'
    )


def _unit_lines(spec: JobSpec, ckpt_dir: str) -> str:
    """Install the packaged unit, plus a drop-in for what differs per job."""
    # The run's checkpoint directory is made once the volume is mounted (ExecStartPre runs
    # after RequiresMountsFor's mounts); the agent refuses a missing one.
    drop = ["[Service]", f"ExecStartPre=/bin/mkdir -p {shlex.quote(ckpt_dir)}"]
    volume = spec.checkpoint.volume.path
    unit_lines = ""
    if not volume.startswith(VOLUME_ROOT + "/") and volume != VOLUME_ROOT:
        drop = ["[Unit]", f"RequiresMountsFor={volume}", "", *drop]
    if isinstance(spec.code, ImageCode):
        image = spec.code.image
        # The agent runs inside the job's image (which must have spottrain installed); --init
        # forwards systemd's SIGTERM to it and reaps the workers' orphans.
        docker = (
            "/usr/bin/docker run --rm --init --name spottrain-agent --gpus all --network host "
            "--ipc host --ulimit memlock=-1 --stop-timeout 170 "
            f"-v {VOLUME_ROOT}:{VOLUME_ROOT} -v /etc/spottrain:/etc/spottrain:ro "
            # It ships the host file the unit appends its output to (-e: the unit's values).
            f"-v {AGENT_LOG}:{AGENT_LOG} -e {env_names.ENV_LOGS_FILE} "
            f"-e {env_names.ENV_LOGS_FILE_MAX_MB} "
            f"--env-file /etc/spottrain/agent.docker.env {image} spottrain-agent run"
        )
        drop += ["ExecStart=", f"ExecStart={docker}"]
    else:
        drop.append(f"WorkingDirectory={JOB_DIR}")
    unit_lines += (
        f"{VENV}/bin/python - <<'PY'\n"
        "from importlib import resources\n"
        "unit = resources.files('spottrain.agent.systemd') / 'spottrain-agent.service'\n"
        "open('/etc/systemd/system/spottrain-agent.service', 'w').write(unit.read_text())\n"
        "PY\n"
        "mkdir -p /etc/systemd/system/spottrain-agent.service.d\n"
        "cat > /etc/systemd/system/spottrain-agent.service.d/job.conf <<'UNIT'\n"
        + "\n".join(drop)
        + "\nUNIT\n"
        "systemctl daemon-reload\n"
        "systemctl enable --now spottrain-agent.service\n"
    )
    return unit_lines


def render_boot_script(
    spec: JobSpec,
    node: NodeIdentity,
    redis_url: str,
    *,
    code: CodeRef | None = None,
    password_secret: str | None = None,
    spottrain_requirement: str | None = None,
    env_lock: str | None = None,
) -> str:
    """The bash boot script of a VM on AWS (user data) or GCP (``startup-script``).

    It is safe to run again (GCP runs the startup script at every boot): each step checks
    whether it is done.

    Args:
        spec: the job.
        node: the VM's identity.
        redis_url: the job's Redis as the VM reaches it.
        code: the uploaded archive, for ``code.archive``.
        password_secret: the secret holding the Redis password (AWS Secrets Manager id or
            GCP Secret Manager name); None when Redis has no password.
        spottrain_requirement: what pip installs (default: this version of spottrain with
            the ``agent`` and the cloud's extras, and ``replica`` for a replica-mode job),
            without ``env_lock``.
        env_lock: the text of the run's lock for this cloud (:mod:`spottrain.envlock`): the
            venv is built from it (hashes required) and verified at every boot.

    Raises:
        ValueError: the node is on the local cloud, the archive has no URL yet, or the
            lock cannot be read.
    """
    if node.cloud not in ("aws", "gcp"):
        raise ValueError(f"boot scripts are for aws and gcp VMs, not {node.cloud!r}")
    requirement = spottrain_requirement or spec_agent_requirement(spec, node.cloud)
    env = agent_env(spec, node, redis_url, password_file=PASSWORD_PATH if password_secret else None)
    parts = [
        "#!/bin/bash\n",
        f"# spottrain {__version__}: boot script of node {node.node_id} of run {node.run_id}.\n",
        "set -euo pipefail\n",
        "exec >>/var/log/spottrain-boot.log 2>&1\n",
        # Not /opt/job: the code step creates it (an archive fetch refuses an existing one).
        "install -d -m 0755 /etc/spottrain /opt/spottrain\n",
        worker_user_lines(),
        _venv_lines(requirement, env_lock),
        f"mountpoint -q {VOLUME_ROOT} || echo 'spottrain: {VOLUME_ROOT} is not mounted yet; "
        "the agent waits for it (RequiresMountsFor)' >&2\n",
        _code_lines(spec, code or CodeRef(), node.cloud, env_lock),
    ]
    if password_secret:
        parts.append(_secret_fetch(node.cloud, password_secret))
    parts += [
        f"umask 077\ncat > {AGENT_ENV_PATH} <<'ENV'\n",
        render_env_file(env),
        "ENV\n",
    ]
    if isinstance(spec.code, ImageCode):
        # docker's --env-file takes values literally (no quotes), unlike systemd.
        parts += [
            f"cat > {DOCKER_ENV_PATH} <<'ENV'\n",
            "".join(f"{k}={v}\n" for k, v in env.items()),
            "ENV\n",
        ]
    parts.append(_secret_env_lines(spec, node.cloud))
    parts += ["umask 022\n", _unit_lines(spec, env[env_names.ENV_CKPT_DIR])]
    return "".join(parts)


def parse_env_file(text: str) -> dict[str, str]:
    """Read back an env file written by :func:`render_env_file` (for tests and ``status``)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        k, _, v = line.partition("=")
        if len(v) >= 2 and v[0] == v[-1] == '"':
            v = v[1:-1].replace('\\"', '"').replace("\\\\", "\\")
        out[k] = v
    return out


def render_local_boot(
    spec: JobSpec,
    node: NodeIdentity,
    redis_url: str,
    *,
    workdir: str | Path,
    code: CodeRef | None = None,
    copy_to: str | None = None,
    password_file: str | None = None,
    secret_files: Mapping[str, str] | None = None,
    python: str = sys.executable,
) -> str:
    """The local cloud's boot command as JSON: fetch the code archive into ``workdir`` (when
    ``code`` names one), then ``spottrain-agent run`` there.

    The settings travel as the same ``SPOTTRAIN_*`` variables a real VM's env file holds;
    the password, if any, reaches the VM as ``password_file`` (the embedded Redis's, mode
    0600) or else through the controller's own environment, never in this command. So do
    the values of ``train.secret_env``: ``secret_files`` maps each variable to the local
    secret store's file, which the boot command reads into the agent's environment.
    """
    env = agent_env(spec, node, redis_url, copy_to=copy_to, password_file=password_file)
    env["PYTHONUNBUFFERED"] = "1"
    agent = [python, "-m", "spottrain.agent.cli", "run"]
    if spec.nodes.gpus == 0:
        agent.append("--no-health-check")
    local = spec.local
    if local is not None:
        # The agent's SIGTERM deadline is the local cloud's notice window.
        agent.append(f"--sigterm-grace={local.notice_s:g}")
    # The local cloud "mounts" the zone's checkpoint volume by creating its directory.
    steps = [f"mkdir -p {shlex.quote(env[env_names.ENV_CKPT_DIR])}"]
    if code is not None and code.archive_url:
        fetch = [
            python,
            "-m",
            "spottrain.cloud.code_archive",
            "fetch",
            code.archive_url,
            code.archive_sha256,
            str(workdir),
        ]
        steps.append(shlex.join(fetch))
    else:
        steps.append(f"mkdir -p {shlex.quote(str(workdir))}")
    for name, path in (secret_files or {}).items():
        # $(cat FILE) inside bash: the value lands in the environment, on no command line.
        steps.append(f'{name}="$(cat {shlex.quote(path)})" && export {name}')
    # exec: the agent replaces the shell, so the VM's SIGTERM reaches it directly.
    steps += [f"cd {shlex.quote(str(workdir))}", f"exec {shlex.join(agent)}"]
    return json.dumps({"argv": ["bash", "-c", " && ".join(steps)], "env": env, "cwd": ""})

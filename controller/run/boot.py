"""What a new VM runs first: the boot that installs the job's pinned code and environment and
starts the agent, rendered from the job spec and the node's identity.

On AWS it is the instance's user data, on GCP its ``startup-script`` metadata, and on the
local cloud a JSON command line (:mod:`spottrain.cloud.local.vm`). An AWS or GCP VM's boot
comes in two parts (see :func:`render_user_data` and :func:`render_job_boot`): a small user
data per VM, which carries the loader (:mod:`spottrain.cloud.vmboot`) and the sha256 of every
file it fetches, and the job's boot, its environment lock and spottrain's own wheel, fetched
from the run's store. It runs in the named stages of :mod:`spottrain.protocol.boot`; its
output goes to the console and to the node's log file from its first line, and a stage that
fails stops the boot with its reason reported (Redis, the console, the run's log store).

Everything the agent needs travels in ``/etc/spottrain/agent.env`` (the systemd unit's
``EnvironmentFile=``), using only the ``SPOTTRAIN_*`` variables that ``spottrain-agent run``
reads; beside them, the job's own variables for its workers (``train.env``, and the
``WANDB_*`` ones of its ``wandb:`` section), which torchrun passes on. Secrets never travel
in a boot script, which anyone allowed to describe the VM can read: the Redis password, the
git token (``code.git.token_secret``), the index's credentials
(``packages.credentials_secret``) and the job's secret variables (``train.secret_env``) are
read at boot from the cloud's secret store into root-only files, and reach git, pip and the
agent through files and the environment, never a command line. The agent's venv is built
from the run's environment lock (:mod:`spottrain.envlock`) with hashes required, spottrain
itself from the wheel the run shipped, and verified at every boot, so a backfilled VM runs
the others' packages.

Nothing read from the spec or a file reaches a shell as code: the lock only as its sha256;
each value on a command line quoted (``shlex.quote``); files written through here-documents
whose quoted delimiter no line of their text can end (:func:`heredoc`); the systemd drop-in's
values quoted as systemd reads them (:func:`unit_word`). What none of these can carry (a
newline, a NUL) the spec refuses at validation.
"""

from __future__ import annotations

import ast
import base64
import functools
import gzip
import json
import os
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spottrain import __version__
from spottrain.cloud.stores import GCS_ENDPOINT_ENV
from spottrain.cloud.vmboot import fetch as vmboot_fetch
from spottrain.cloud.vmboot import loader as vmboot_loader
from spottrain.envlock import lock_sha256
from spottrain.protocol import boot
from spottrain.protocol import env as env_names
from spottrain.protocol.events import EVENTS_MAXLEN
from spottrain.protocol.keys import RunKeys
from spottrain.protocol.node_logs import node_prefix
from spottrain.safetext import LINE_CONTROLS
from spottrain.spec import ArchiveCode, GitCode, ImageCode, JobSpec, replica_agent_env
from spottrain.tracking import trainer_env

AGENT_ENV_PATH = "/etc/spottrain/agent.env"
# The job's part of agent.env (the same on every VM) and the VM's own part.
JOB_ENV_PATH = "/etc/spottrain/job.env"
NODE_ENV_PATH = "/etc/spottrain/node.env"
PASSWORD_PATH = "/etc/spottrain/redis-password"
GIT_TOKEN_PATH = "/etc/spottrain/git-token"
GIT_ASKPASS_PATH = "/etc/spottrain/git-askpass"
DOCKER_ENV_PATH = "/etc/spottrain/agent.docker.env"
PIP_CONF_PATH = "/etc/spottrain/pip.conf"
UNIT_PATH = "/etc/systemd/system/spottrain-agent.service"
# An image job's agent, in its container, cannot power off the host: it creates POWEROFF_
# REQUEST (a folder of the host's mounted in the container), and a path unit of the host
# powers the VM off (the dead man's switch's fallback when the cloud's API refused).
POWEROFF_DIR = "/run/spottrain-poweroff"
POWEROFF_REQUEST = f"{POWEROFF_DIR}/request"
POWEROFF_UNIT = "/etc/systemd/system/spottrain-poweroff"
# The node's output file: the boot writes its own lines there first, the agent's unit
# appends after them, and the agent ships the whole file (agent/logship).
AGENT_LOG = "/var/log/spottrain-agent.log"
VOLUME_ROOT = "/mnt/spottrain"
REDACT_DIR = os.path.dirname(boot.REDACT_FILE)
JOB_DIR = "/opt/job"
VENV = "/opt/spottrain/venv"
ENV_LOCK_PATH = "/etc/spottrain/env.lock"
# The sha256 of the lock a venv was built from: a VM whose venv came from another lock
# (a reused disk, an image with a venv) builds it again; one from this lock (an image baked
# from a VM of the run) is reused.
ENV_LOCK_MARK = f"{VENV}/.spottrain-env-lock"
# Where the loader and what it fetches live on the VM.
# Not under /var/lib/spottrain: that is the workers' home, which useradd must create.
BOOT_DIR = "/var/lib/spottrain-boot"
FETCH_PATH = f"{BOOT_DIR}/fetch.py"
LOADER_PATH = f"{BOOT_DIR}/loader.py"
BOOT_CONF = f"{BOOT_DIR}/boot.json"
JOB_SCRIPT = f"{BOOT_DIR}/job.sh"
WHEEL_DIR = f"{BOOT_DIR}/wheels"
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


def node_env(node: NodeIdentity) -> dict[str, str]:
    """The settings that differ from one VM of a run to the next: who it is and where."""
    return {
        env_names.ENV_NODE: node.node_id,
        env_names.ENV_ZONE: node.zone,
        env_names.ENV_INSTANCE_TYPE: node.instance_type,
    }


def vm_endpoint_env(spec: JobSpec, cloud: str) -> dict[str, str]:
    """The variables that point a VM's storage and secret clients at the spec's endpoints
    (``aws.endpoints``, ``gcp.endpoints``): boto3's own ``AWS_ENDPOINT_URL_<SERVICE>``, and
    Cloud Storage's ``API_ENDPOINT_OVERRIDE``. Empty when the spec names none."""
    out: dict[str, str] = {}
    if cloud == "aws" and spec.aws is not None:
        e = spec.aws.endpoints
        if e.s3:
            out["AWS_ENDPOINT_URL_S3"] = e.s3
        if e.secretsmanager:
            out["AWS_ENDPOINT_URL_SECRETS_MANAGER"] = e.secretsmanager
    if cloud == "gcp" and spec.gcp is not None and spec.gcp.endpoints.storage:
        out[GCS_ENDPOINT_ENV] = spec.gcp.endpoints.storage
    return out


def job_env(
    spec: JobSpec,
    cloud: str,
    run_id: str,
    redis_url: str,
    *,
    password_file: str | None = None,
    copy_to: str | None = None,
    ckpt_dir: str | None = None,
) -> dict[str, str]:
    """The ``SPOTTRAIN_*`` settings every agent of a run on ``cloud`` shares, plus the job's
    own variables (:func:`agent_env` adds the VM's own)."""
    env = {
        env_names.ENV_REDIS: redis_url,
        env_names.ENV_RUN_ID: run_id,
        env_names.ENV_CLOUD: cloud,
        env_names.ENV_NNODES: f"{spec.nodes.min}:{spec.nodes.max}",
        env_names.ENV_NPROC_PER_NODE: str(spec.nodes.workers_per_node),
        env_names.ENV_EXPECT_GPUS: str(spec.nodes.gpus),
        env_names.ENV_CKPT_DIR: ckpt_dir or f"{spec.checkpoint.volume.path.rstrip('/')}/{run_id}",
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
    env.update(spec.train.integration_env())
    env.update(replica_agent_env(spec))
    env.update(vm_endpoint_env(spec, cloud))
    return {**trainer_env(spec.wandb, run_id), **spec.train.env, **env}


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
    env = job_env(
        spec,
        node.cloud,
        node.run_id,
        redis_url,
        password_file=password_file,
        copy_to=copy_to,
        ckpt_dir=run_ckpt_dir(spec, node),
    )
    return {**env, **node_env(node)}


def render_env_file(env: Mapping[str, str]) -> str:
    """``env`` as a systemd ``EnvironmentFile``: every value in double quotes, with the two
    characters systemd unescapes inside them (``\\`` and ``"``) escaped.

    Raises:
        ValueError: a value holds a newline or a NUL (an env file cannot carry either, nor
            the boot script that writes it).
    """
    lines = []
    for k, v in env.items():
        if "\n" in v or "\r" in v or "\0" in v:
            raise ValueError(f"{k}: a value in an environment file cannot hold a newline or a NUL")
        quoted = v.replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f'{k}="{quoted}"')
    return "\n".join(lines) + "\n"


def heredoc(command: str, text: str, delimiter: str) -> str:
    """Shell lines that give ``text`` to ``command`` as a here-document: the delimiter is
    quoted, so the shell expands nothing in the text, and lengthened until no line of the
    text is the delimiter, so no value in the text can end it early and run what follows.

    Raises:
        ValueError: the text holds a NUL, which bash drops from a script (joining what is
            around it into a line that could end the here-document).
    """
    if "\0" in text:
        raise ValueError(f"{command}: a boot script cannot carry a NUL character")
    body = text if text.endswith("\n") else text + "\n"
    lines = set(body.split("\n"))
    while delimiter in lines:
        delimiter += "_"
    return f"{command} <<'{delimiter}'\n{body}{delimiter}\n"


# What a unit file's word may hold bare: anything else is quoted (systemd.syntax).
_UNIT_BARE = re.compile(r"[A-Za-z0-9_@+=:,./-]+\Z")


def unit_word(value: str, *, exec_line: bool = False) -> str:
    """``value`` as one word of a systemd unit setting, which systemd reads back exactly:
    bare when plain, else in double quotes with ``\\`` and ``"`` escaped; ``%`` doubled
    (systemd's specifiers are resolved in every setting) and, on an ``Exec`` line, ``$``
    doubled too (systemd substitutes its variables there, quoted or not).

    Raises:
        ValueError: a control character (a unit's setting is one line).
    """
    if LINE_CONTROLS.search(value):
        raise ValueError(f"{value!r}: a systemd unit's setting cannot hold a control character")
    if _UNIT_BARE.match(value):
        return value
    out = value.replace("%", "%%").replace("\\", "\\\\").replace('"', '\\"')
    if exec_line:
        out = out.replace("$", "$$")
    return f'"{out}"'


# --- the boot of an AWS or GCP VM ------------------------------------------------------------
#
# Two parts. The user data (AWS) or startup-script (GCP) is per VM and small: the loader
# (spottrain.cloud.vmboot, stdlib only), its settings, the VM's identity, the first two
# stages, and the sha256 of every file it fetches. The rest, the job's boot (one per run and
# cloud), the environment lock and spottrain's wheel, sit in the run's store by content, so a
# lock of any size launches on both clouds (AWS takes 16 KB of user data, GCP 256 KB per
# metadata value) and a backfill a week later boots exactly what the first VM did.


# What each cloud takes: AWS refuses user data over 16 KB, GCP a metadata value over 256 KB.
USER_DATA_LIMITS = {"aws": 16 * 1024, "gcp": 256 * 1024}


class UserDataTooLarge(ValueError):
    """A VM's user data over what its cloud takes (the lock never is in it: the store's URLs,
    the job's paths and names are)."""


@dataclass(frozen=True)
class BootFile:
    """A file a VM fetches at boot from the run's store, pinned by its sha256."""

    url: str
    sha256: str


@dataclass(frozen=True)
class BootFiles:
    """What a run ships for its VMs of one cloud: the job's boot script, the loader
    (:mod:`spottrain.cloud.vmboot.loader`), the lock (for jobs that install an environment)
    and spottrain's wheel."""

    script: BootFile
    loader: BootFile
    lock: BootFile | None = None
    wheel: BootFile | None = None
    wheel_name: str = ""

    def as_dict(self) -> dict[str, dict[str, str]]:
        out = {
            "script": {"url": self.script.url, "sha256": self.script.sha256},
            "loader": {"url": self.loader.url, "sha256": self.loader.sha256},
        }
        if self.lock is not None:
            out["lock"] = {"url": self.lock.url, "sha256": self.lock.sha256}
        if self.wheel is not None:
            out["wheel"] = {
                "url": self.wheel.url,
                "sha256": self.wheel.sha256,
                "name": self.wheel_name,
            }
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Mapping[str, str]]) -> BootFiles:
        def one(name: str) -> BootFile | None:
            f = d.get(name)
            return BootFile(f["url"], f["sha256"]) if f else None

        script, loader = one("script"), one("loader")
        if script is None or loader is None:
            raise ValueError("a run's boot files name no script or no loader")
        return cls(
            script, loader, one("lock"), one("wheel"), (d.get("wheel") or {}).get("name", "")
        )


def _stage(name: str) -> str:
    return f"spottrain_stage {shlex.quote(name)}\n"


def _loader(*args: str) -> str:
    return shlex.join(["python3", LOADER_PATH, BOOT_CONF, *args])


def _secret_fetch(secret: str) -> str:
    """Lines that write the Redis password from the cloud's secret store (root only)."""
    return _stage(boot.STAGE_PASSWORD) + f"{_loader('secret', secret, PASSWORD_PATH)}\n"


def _secret_env_lines(spec: JobSpec) -> str:
    """Lines that add ``train.secret_env`` to the agent's env file (mode 0600); an image
    job's go to the secret variables file its agent reads in the container instead
    (:data:`spottrain.protocol.boot.SECRET_ENV_FILE`): docker's ``--env-file`` would show
    them in ``docker inspect``."""
    if not spec.train.secret_env:
        return ""
    lines = [_stage(boot.STAGE_SECRETS)]
    if isinstance(spec.code, ImageCode):
        lines.append(f"rm -f {boot.SECRET_ENV_FILE}\n")  # a boot again starts it afresh
        for name, secret in spec.train.secret_env.items():
            lines.append(_loader("secret-env-json", name, secret, boot.SECRET_ENV_FILE) + "\n")
    else:
        for name, secret in spec.train.secret_env.items():
            lines.append(_loader("secret-env", name, secret, JOB_ENV_PATH) + "\n")
    return "".join(lines)


# The host's units that power the VM off when an image job's agent asks (POWEROFF_REQUEST).
_POWEROFF_PATH_UNIT = f"""[Unit]
Description=spottrain: power off when the agent in its container asks

[Path]
PathExists={POWEROFF_REQUEST}

[Install]
WantedBy=multi-user.target
"""
_POWEROFF_SERVICE = """[Unit]
Description=spottrain: power off (the agent's dead man's switch)

[Service]
Type=oneshot
ExecStart=/usr/bin/systemctl poweroff --no-block
"""


def _poweroff_lines() -> str:
    """The host's path unit an image job's agent asks to power off through."""
    return (
        f"mkdir -p -m 0700 {POWEROFF_DIR}\n"
        + heredoc(f"cat > {POWEROFF_UNIT}.path", _POWEROFF_PATH_UNIT, "UNIT")
        + heredoc(f"cat > {POWEROFF_UNIT}.service", _POWEROFF_SERVICE, "UNIT")
        + "systemctl daemon-reload\n"
        "systemctl enable --now spottrain-poweroff.path\n"
    )


def _git_fetch_lines(spec: JobSpec) -> str:
    """Fetch the pinned commit; with ``token_secret``, git asks a root-only helper for the
    token (GIT_ASKPASS), which is removed once the commit is fetched."""
    assert isinstance(spec.code, GitCode)
    g = spec.code.git
    fetch = f"git -C {JOB_DIR} fetch -q --depth 1 {shlex.quote(g.repo)} {g.commit}"
    if not g.token_secret:
        return f"  {fetch}\n"
    user = shlex.quote(g.token_user)
    askpass = f'#!/bin/sh\ncase "$1" in Username*) echo {user} ;; *) cat {GIT_TOKEN_PATH} ;; esac\n'
    return (
        f"  {_loader('secret', g.token_secret, GIT_TOKEN_PATH)}\n"
        + heredoc(f"  ( umask 077; cat > {GIT_ASKPASS_PATH}", askpass, "SH")
        + "  )\n"
        f"  chmod 0700 {GIT_ASKPASS_PATH}\n"
        f"  GIT_ASKPASS={GIT_ASKPASS_PATH} GIT_TERMINAL_PROMPT=0 {fetch} || "
        f"{{ rm -f {GIT_TOKEN_PATH} {GIT_ASKPASS_PATH}; exit 1; }}\n"
        f"  rm -f {GIT_TOKEN_PATH} {GIT_ASKPASS_PATH}\n"
    )


def _job_requirements(path: str, *, constrained: bool) -> str:
    """A git checkout's ``requirements.txt``, installed constrained to the lock's versions,
    then the lock verified (a job requirement cannot move a locked package). An archive's
    file is already in the lock (resolved with the agent at ``up``)."""
    if not constrained:
        return ""
    pins = f"{ENV_LOCK_PATH}.constraints"
    path = shlex.quote(path)
    return (
        f"if [ -f {path} ]; then\n"
        f"  sed -e 's/ --hash=[^ ]*//g' {ENV_LOCK_PATH} > {pins}\n"
        f"  {VENV}/bin/pip install -q -c {pins} -r {path}\n"
        f"  {_verify_line()}\n"
        "fi\n"
    )


def _verify_line() -> str:
    return f"{VENV}/bin/python -m spottrain.envlock verify {ENV_LOCK_PATH}"


def _venv_lines(env_lock: str) -> str:
    """Build the agent's venv from the lock (hashes required, spottrain's wheel from the
    files the loader fetched), unless it was built from this very lock (a pre-baked image,
    or a VM that boots again), and verify it."""
    sha = lock_sha256(env_lock)
    return (
        _stage(boot.STAGE_ENV)
        + f"{_loader('pip-config', PIP_CONF_PATH)}\n"
        + f"export PIP_CONFIG_FILE={PIP_CONF_PATH}\n"
        + f'if [ "$(cat {ENV_LOCK_MARK} 2>/dev/null)" != {sha} ]; then\n'
        f"  rm -rf {VENV}\n"
        f"  python3 -m venv {VENV}\n"
        f"  {VENV}/bin/pip install -q --require-hashes --no-deps --only-binary=:all: "
        f"--find-links {WHEEL_DIR} -r {ENV_LOCK_PATH}\n"
        f"  echo {sha} > {ENV_LOCK_MARK}\n"
        "else\n"
        f"  echo 'the venv in {VENV} was built from this lock (sha256 {sha[:16]}): reused'\n"
        "fi\n"
        f"{_verify_line()}\n"
    )


def _image_pull(spec: JobSpec) -> str:
    assert isinstance(spec.code, ImageCode)
    return _stage(boot.STAGE_ENV) + f"docker pull {shlex.quote(spec.code.image)}\n"


def _code_lines(spec: JobSpec, code: CodeRef) -> str:
    if isinstance(spec.code, GitCode):
        g = spec.code.git
        workdir = f"{JOB_DIR}/{g.subdir}" if g.subdir else JOB_DIR
        return (
            _stage(boot.STAGE_CODE) + f"if [ ! -d {JOB_DIR}/.git ]; then\n"
            f"  git init -q {JOB_DIR}\n"
            + _git_fetch_lines(spec)
            + f"  git -C {JOB_DIR} checkout -q FETCH_HEAD\n"
            "fi\n"
            f'test "$(git -C {JOB_DIR} rev-parse HEAD)" = {g.commit} || '
            "{ echo 'spottrain: the job checkout in /opt/job is not at the pinned commit' "
            ">&2; exit 1; }\n" + _job_requirements(f"{workdir}/requirements.txt", constrained=True)
        )
    if isinstance(spec.code, ArchiveCode):
        if not (code.archive_url and code.archive_sha256):
            raise ValueError("code.archive: render the boot script after the upload (no URL yet)")
        return _stage(boot.STAGE_CODE) + (
            f"{VENV}/bin/python -m spottrain.cloud.code_archive fetch "
            f"{shlex.quote(code.archive_url)} {shlex.quote(code.archive_sha256)} {JOB_DIR}\n"
        )
    # An image is the job's environment and its code at once: pulled as the environment.
    assert isinstance(spec.code, ImageCode)
    return ""


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


def _volume_lines(spec: JobSpec) -> str:
    """Stop the boot unless the checkpoint volume is a mounted file system (not the root
    disk, whose checkpoints would die with the VM and reach no other node), waiting a while
    for a mount the image makes late."""
    path = shlex.quote(spec.checkpoint.volume.path)
    return (
        _stage(boot.STAGE_VOLUME) + f"v={path}\n"
        "for _ in $(seq 60); do\n"
        '  p=$v; while [ ! -e "$p" ]; do p=$(dirname "$p"); done\n'
        '  m=$(findmnt -n -o TARGET -T "$p" 2>/dev/null || echo /)\n'
        '  [ "$m" != / ] && break\n'
        "  sleep 2\n"
        "done\n"
        '[ "$m" != / ] || { echo "spottrain: the checkpoint volume $v is not mounted (it would '
        "be the root disk, which dies with the VM): mount the shared volume there in the image "
        '(/etc/fstab) or change checkpoint.volume.path" >&2; exit 1; }\n'
        'echo "checkpoint volume: $v on $m"\n'
    )


# What writes the packaged unit from the venv's spottrain (a fixed text).
_UNIT_FROM_WHEEL = (
    "from importlib import resources\n"
    "unit = resources.files('spottrain.agent.systemd') / 'spottrain-agent.service'\n"
    f"open('{UNIT_PATH}', 'w').write(unit.read_text())\n"
)


def _unit_lines(spec: JobSpec, ckpt_dir: str) -> str:
    """Install the packaged unit, plus a drop-in for what differs per job."""
    # The run's checkpoint directory is made once the volume is mounted (ExecStartPre runs
    # after RequiresMountsFor's mounts); the agent refuses a missing one.
    drop = ["[Service]", f"ExecStartPre=/bin/mkdir -p {unit_word(ckpt_dir, exec_line=True)}"]
    volume = spec.checkpoint.volume.path
    if not volume.startswith(VOLUME_ROOT + "/") and volume != VOLUME_ROOT:
        drop = ["[Unit]", f"RequiresMountsFor={unit_word(volume)}", "", *drop]
    if isinstance(spec.code, ImageCode):
        image = spec.code.image
        # The agent runs inside the job's image (which must have spottrain installed); --init
        # forwards systemd's SIGTERM to it and reaps the workers' orphans.
        docker = (
            "/usr/bin/docker run --rm --init --name spottrain-agent --gpus all --network host "
            "--ipc host --ulimit memlock=-1 --stop-timeout 170 "
            f"-v {VOLUME_ROOT}:{VOLUME_ROOT} -v /etc/spottrain:/etc/spottrain:ro "
            # The secrets the boot noted (redacted from what the agent ships), and where it
            # asks the host to power off.
            f"-v {REDACT_DIR}:{REDACT_DIR}:ro -v {POWEROFF_DIR}:{POWEROFF_DIR} "
            # It ships the host file the unit appends its output to (-e: the unit's values).
            f"-v {AGENT_LOG}:{AGENT_LOG} -e {env_names.ENV_LOGS_FILE} "
            f"-e {env_names.ENV_LOGS_FILE_MAX_MB} "
            f"--env-file /etc/spottrain/agent.docker.env {unit_word(image, exec_line=True)} "
            "spottrain-agent run"
        )
        # /run is a tmpfs: after a reboot the mounts' folders are made again (first: the
        # checkpoint directory's line stays the last ExecStartPre).
        at = drop.index("[Service]") + 1
        drop.insert(at, f"ExecStartPre=/bin/mkdir -p -m 0700 {REDACT_DIR} {POWEROFF_DIR}")
        drop += ["ExecStart=", f"ExecStart={docker}"]
        unit_from = _loader("unit-file", UNIT_PATH)
    else:
        drop.append(f"WorkingDirectory={JOB_DIR}")
        unit_from = f"{VENV}/bin/python - <<'PY'\n" + _UNIT_FROM_WHEEL + "PY"
    return (
        f"{unit_from}\n"
        f"mkdir -p {UNIT_PATH}.d\n"
        + heredoc(f"cat > {UNIT_PATH}.d/job.conf", "\n".join(drop), "UNIT")
        + "systemctl daemon-reload\n"
        "systemctl enable --now spottrain-agent.service\n"
    )


def render_job_boot(
    spec: JobSpec,
    cloud: str,
    run_id: str,
    redis_url: str,
    *,
    code: CodeRef | None = None,
    password_secret: str | None = None,
    env_lock: str | None = None,
) -> str:
    """The job's boot on ``cloud``: what every VM of the run runs once the loader fetched
    it (sourced by the user data, after the stages ``check the image`` and ``fetch the boot
    files``). The same text for every VM of the run on that cloud, and nothing secret in it:
    it sits in the run's store, pinned by its sha256 in each VM's user data.

    It is safe to run again (GCP runs the startup script at every boot): each step checks
    whether it is done.

    Args:
        spec: the job.
        cloud: ``aws`` or ``gcp``.
        run_id: the run.
        redis_url: the job's Redis as the VMs reach it.
        code: the uploaded archive, for ``code.archive``.
        password_secret: the secret holding the Redis password (AWS Secrets Manager id or
            GCP Secret Manager name); None when Redis has no password.
        env_lock: the text of the run's lock for this cloud (:mod:`spottrain.envlock`):
            the venv is built from it (hashes required) and verified at every boot. Every
            job but an image job has one.

    Raises:
        ValueError: not a real cloud, an archive without its upload, or a job that
            installs an environment without its lock.
    """
    if cloud not in ("aws", "gcp"):
        raise ValueError(f"boot scripts are for aws and gcp VMs, not {cloud!r}")
    image = isinstance(spec.code, ImageCode)
    if env_lock is None and not image:
        raise ValueError("the job's boot needs the run's environment lock for its cloud")
    env = job_env(
        spec, cloud, run_id, redis_url, password_file=PASSWORD_PATH if password_secret else None
    )
    endpoints = vm_endpoint_env(spec, cloud)
    parts = [
        f"# spottrain {__version__}: the boot of run {run_id} on {cloud}, run by every VM's\n"
        "# user data after the loader fetched it and checked its sha256.\n",
        # The spec's endpoints, for what the boot itself fetches (the code archive).
        "".join(f"export {k}={shlex.quote(v)}\n" for k, v in endpoints.items()),
        _secret_fetch(password_secret) if password_secret else "",
        _stage(boot.STAGE_USER),
        worker_user_lines(),
        _image_pull(spec) if image else _venv_lines(env_lock or ""),
        _code_lines(spec, code or CodeRef()),
        heredoc(f"( umask 077; cat > {JOB_ENV_PATH}", render_env_file(env), "ENV") + ")\n",
    ]
    if image:
        # docker's --env-file takes values literally (no quotes), unlike systemd. What
        # `docker inspect` may show: never a secret (those come in SECRET_ENV_FILE).
        in_docker = {**env, env_names.ENV_POWEROFF_REQUEST: POWEROFF_REQUEST}
        if spec.train.secret_env:
            in_docker[env_names.ENV_SECRET_ENV_FILE] = boot.SECRET_ENV_FILE
        docker_env = "".join(f"{k}={v}\n" for k, v in in_docker.items())
        parts.append(heredoc(f"( umask 077; cat > {DOCKER_ENV_PATH}", docker_env, "ENV") + ")\n")
    parts.append(_secret_env_lines(spec))
    parts.append(_volume_lines(spec))
    parts.append(_stage(boot.STAGE_AGENT))
    parts.append(
        f"( umask 077; cat {JOB_ENV_PATH} {NODE_ENV_PATH} > {AGENT_ENV_PATH}.part && "
        f"mv {AGENT_ENV_PATH}.part {AGENT_ENV_PATH} )\n"
    )
    if image:
        parts.append(
            f"( umask 077; sed -e 's/^\\([A-Z_]*\\)=\"\\(.*\\)\"$/\\1=\\2/' {NODE_ENV_PATH} "
            f">> {DOCKER_ENV_PATH} )\n"
        )
    if image:
        parts.append(_poweroff_lines())
    parts.append(_unit_lines(spec, env[env_names.ENV_CKPT_DIR]))
    parts.append(_loader("booted") + "\n")
    return "".join(parts)


def _stripped(path: Path) -> str:
    """A script's code without comments or docstrings (the file in the package is the
    readable one)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, ast.Module | ast.FunctionDef | ast.ClassDef)
            and isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            body.pop(0)
            if not body:
                body.append(ast.Pass())
    return ast.unparse(tree) + "\n"


# The same text for every VM: compressed once, not at each launch.
@functools.lru_cache(maxsize=1)
def fetch_part() -> str:
    """The loader's first part (:mod:`spottrain.cloud.vmboot.fetch`) as the user data
    carries it: its code, gzipped and in base64 (AWS takes 16 KB of user data)."""
    code = _stripped(Path(vmboot_fetch.__file__)).encode()
    return base64.encodebytes(gzip.compress(code, compresslevel=9, mtime=0)).decode()


def loader_text() -> str:
    """The loader's second part (:mod:`spottrain.cloud.vmboot.loader`), which the run ships
    to its store beside the job's boot."""
    return Path(vmboot_loader.__file__).read_text()


def loader_settings(
    spec: JobSpec,
    node: NodeIdentity,
    redis_url: str,
    files: BootFiles,
    *,
    password_secret: str | None,
) -> dict[str, Any]:
    """The loader's settings for one VM (nothing secret: they travel in its user data)."""
    keys = RunKeys(node.run_id)
    endpoints = {}
    if node.cloud == "aws" and spec.aws is not None:
        endpoints = spec.aws.endpoints.model_dump(exclude_none=True)
    elif node.cloud == "gcp" and spec.gcp is not None:
        endpoints = spec.gcp.endpoints.model_dump(exclude_none=True, exclude={"compute"})
    logs = spec.logs_url()
    pip = spec.packages
    return {
        "cloud": node.cloud,
        "run_id": node.run_id,
        "node": node.node_id,
        "redis": {
            "url": redis_url,
            "password_file": PASSWORD_PATH if password_secret else "",
            "password_secret": password_secret or "",
            "boot_key": keys.boot(node.node_id),
            "events_key": keys.events,
            "events_maxlen": EVENTS_MAXLEN,
        },
        "endpoints": endpoints,
        "logs": {"url": logs, "prefix": node_prefix(node.run_id, node.node_id)} if logs else None,
        "files": files.as_dict(),
        "pip": {
            "index_url": pip.index_url or "",
            "extra_index_urls": list(pip.extra_index_urls),
            "find_links": list(pip.find_links),
            "credentials_secret": pip.credentials_secret or "",
            "trusted_hosts": pip.trusted_hosts(),
        },
    }


# What the user data does before the job's boot: its output goes to the console (as the
# cloud gives it) and to the node's log file from the first line; each stage is announced;
# on any failure the exit trap has the loader name the stage and the reason, report it and
# ship the log. Before the loader can run (no python3), bash says it alone.
_PRELUDE = r"""set -euo pipefail
umask 022
B={boot_dir}
LOG={log}
NODE={node}
mkdir -p "$B/wheels" /etc/spottrain /var/log
install -d -m 0700 /run/spottrain
date +%s%3N > "$B/started-ms"
rm -f "$B/vm-id"
exec 3>&1 4>&2
exec > >(tee -a "$LOG") 2>&1
TEE=$!
STAGE=start
OFFSET=0
LOADER=
spottrain_stage() {{
  STAGE=$1
  OFFSET=$(stat -c %s "$LOG" 2>/dev/null || echo 0)
  if [ -n "$LOADER" ]; then python3 "$B/loader.py" "$B/boot.json" stage "$1"
  else echo "spottrain-boot: $NODE -: stage '$1'"; fi
}}
spottrain_exit() {{
  local rc=$?
  set +e
  exec >&3 2>&4
  wait "$TEE" 2>/dev/null
  if [ "$rc" -ne 0 ]; then
    # A failure before the loader was fetched (the image's check) is still reported where
    # the controller looks first, when the image's python3 can run the loader at all.
    if [ -z "$LOADER" ] && python3 "$B/fetch.py" "$B/boot.json" loader "$B/loader.py" \
        >/dev/null 2>&1; then
      LOADER=1
    fi
    if [ -n "$LOADER" ]; then
      python3 "$B/loader.py" "$B/boot.json" fail "$STAGE" "$LOG" "$OFFSET" 2>&1 | tee -a "$LOG"
    else
      why=$(tail -c +$((OFFSET + 1)) "$LOG" | grep '^spottrain: ' | tail -n 1 | cut -c 12-)
      echo "spottrain-boot: $NODE -: failed in '$STAGE': ${{why:-exit $rc}}" | tee -a "$LOG"
    fi
  fi
  exit "$rc"
}}
trap spottrain_exit EXIT
"""


def _image_check(python: str) -> str:
    """The stage ``check the image``: a python3 of the locked version, with venv."""
    return (
        _stage(boot.STAGE_IMAGE)
        + 'command -v python3 >/dev/null || { echo "spottrain: the image has no python3: use '
        f'an image with Python {python} and its venv module" >&2; exit 1; }}\n'
        "have=$(python3 -c 'import sys; print(\"%d.%d\" % sys.version_info[:2])')\n"
        f'[ "$have" = {python} ] || {{ echo "spottrain: the image\'s python3 is '
        f"$(python3 -V 2>&1 | cut -d' ' -f2), but the run's environment is locked for Python "
        f"{python}: use an image with Python {python}, or set packages.python: '$have' and "
        'start a new run" >&2; exit 1; }\n'
        "python3 -c 'import venv, ensurepip' 2>/dev/null || { echo \"spottrain: the image's "
        f'python3 has no venv module: install python{python}-venv in the image" >&2; '
        "exit 1; }\n"
    )


def render_user_data(
    spec: JobSpec,
    node: NodeIdentity,
    redis_url: str,
    files: BootFiles,
    *,
    password_secret: str | None = None,
) -> str:
    """A VM's user data (AWS) or ``startup-script`` (GCP): the loader and its settings, the
    VM's identity, the stages ``check the image`` and ``fetch the boot files``, then the
    job's boot from the run's store (:func:`render_job_boot`).

    Raises:
        ValueError: the node is not on AWS or GCP.
        UserDataTooLarge: the text is over its cloud's limit (:data:`USER_DATA_LIMITS`).
    """
    if node.cloud not in ("aws", "gcp"):
        raise ValueError(f"boot scripts are for aws and gcp VMs, not {node.cloud!r}")
    settings = loader_settings(spec, node, redis_url, files, password_secret=password_secret)
    fetches = [_fetch("loader", LOADER_PATH), "LOADER=1", _fetch("script", JOB_SCRIPT)]
    if files.lock is not None:
        fetches.append(_fetch("lock", ENV_LOCK_PATH))
    if files.wheel is not None:
        fetches.append(_fetch("wheel", f"{WHEEL_DIR}/{files.wheel_name}"))
    text = "".join(
        [
            "#!/bin/bash\n",
            f"# spottrain {__version__}: the boot of node {node.node_id} of run {node.run_id} "
            f"on {node.cloud}.\n# The rest comes from the run's store, each file checked "
            "against the sha256 in boot.json. Nothing secret is in this script.\n",
            _PRELUDE.format(boot_dir=BOOT_DIR, log=AGENT_LOG, node=shlex.quote(node.node_id)),
            f"# {FETCH_PATH}: spottrain.cloud.vmboot.fetch of spottrain {__version__} "
            "(gzip, base64)\n",
            f"base64 -d <<'B64' | gunzip > {FETCH_PATH}\n{fetch_part()}B64\n",
            heredoc(f"cat > {BOOT_CONF}", json.dumps(settings, sort_keys=True), "JSON"),
            heredoc(f"cat > {NODE_ENV_PATH}", render_env_file(node_env(node)), "ENV"),
            _image_check(spec.packages.python),
            _stage(boot.STAGE_FETCH),
            "".join(f"{f}\n" for f in fetches),
            f". {JOB_SCRIPT}\n",
        ]
    )
    size, limit = len(text.encode()), USER_DATA_LIMITS[node.cloud]
    if size > limit:
        raise UserDataTooLarge(
            f"the boot of node {node.node_id} on {node.cloud} is {size} bytes, over the "
            f"{limit} bytes {node.cloud} takes as user data: name fewer or shorter "
            "packages.extra_index_urls and find_links, or a shorter store URL "
            "(code.archive.store, checkpoint.copy_to), in the spec"
        )
    return text


def check_user_data_fits(
    spec: JobSpec,
    run_id: str,
    redis_url: str,
    files: Mapping[str, BootFiles],
    *,
    password_secret: str | None = None,
) -> None:
    """Render the user data of a node of every cloud, its own parts (name, zone, type) at
    their longest, so that what is too large is refused before any launch rather than by
    the cloud at every one.

    Raises:
        UserDataTooLarge: one cloud's is over its limit.
    """
    for cloud, shipped in files.items():
        probe = NodeIdentity(run_id, "n" + "9" * 8, cloud, "z" * 40, "t" * 40)
        try:
            render_user_data(spec, probe, redis_url, shipped, password_secret=password_secret)
        except UserDataTooLarge as e:
            raise UserDataTooLarge(str(e).replace(f"node {probe.node_id} ", "a node ")) from None


def _fetch(name: str, dest: str) -> str:
    return shlex.join(["python3", FETCH_PATH, BOOT_CONF, name, dest])


def render_boot_script(
    spec: JobSpec,
    node: NodeIdentity,
    redis_url: str,
    *,
    code: CodeRef | None = None,
    password_secret: str | None = None,
    env_lock: str | None = None,
    files: BootFiles | None = None,
) -> str:
    """The whole boot of one VM as one text: its user data with the job's boot in place of
    the line that sources it (for reading and for tests; VMs get the two apart)."""
    job = render_job_boot(
        spec,
        node.cloud,
        node.run_id,
        redis_url,
        code=code,
        password_secret=password_secret,
        env_lock=env_lock,
    )
    pinned = files or BootFiles(
        BootFile("file:///job.sh", lock_sha256(job)),
        BootFile("file:///loader.py", lock_sha256(loader_text())),
        BootFile("file:///env.lock", lock_sha256(env_lock)) if env_lock else None,
    )
    user = render_user_data(spec, node, redis_url, pinned, password_secret=password_secret)
    return user.replace(f". {JOB_SCRIPT}\n", job)


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

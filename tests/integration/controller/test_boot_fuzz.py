"""Nothing a spec or a lock says runs in a VM's boot, and each value arrives exact (issue 26,
item 3).

The string fields are enumerated, not listed: from the spec's model (:class:`JobSpec`'s
pydantic fields, down every section, list and mapping) and from the lock's format
(:class:`EnvLock`, :class:`LockedPackage`). Each gets a marker first, to learn which reach the
rendered boot (a VM's user data or the job's boot, on either cloud; the lock reaches it only
as its sha256); then every field gets values made of shell metacharacters, quotes, escapes,
newlines, control characters, heredoc delimiters and format characters, each carrying a
canary command (``touch canary-N``). A value the spec's validation (or the lock's parser)
refuses must be refused in one line per problem, control characters escaped; any other
must render (these checks need no root). Then, as root, each value that reaches the boot
is booted in the sandbox (:mod:`boot_sandbox`: bash in namespaces, the network and the
host's services shadowed by recording stand-ins; a few boots carry every value, side by
side), where the boot runs to its end, no canary fires, and each value arrives byte for
byte where it belongs: the env files read back with systemd's rules (the box's stand-in
parser, which is what reads them under the agent), the loader's JSON settings, the fetched
lock and job boot, the argv of git, pip, docker and the loader, and the unit's drop-in as
systemd parses it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import importlib.util
import re
import shlex
import sys
import types
import typing
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

import pytest
import yaml
from boot_sandbox import Ran, run_boot, sandbox_capable
from pydantic import BaseModel
from spec_samples import COMMIT, DIGEST

from spottrain.controller.run.boot import (
    AGENT_ENV_PATH,
    BOOT_CONF,
    DOCKER_ENV_PATH,
    ENV_LOCK_PATH,
    JOB_ENV_PATH,
    JOB_SCRIPT,
    LOADER_PATH,
    PASSWORD_PATH,
    POWEROFF_REQUEST,
    UNIT_PATH,
    BootFile,
    BootFiles,
    CodeRef,
    NodeIdentity,
    job_env,
    loader_settings,
    loader_text,
    node_env,
    render_job_boot,
    render_user_data,
)
from spottrain.envlock import EnvLock, LockedPackage, LockError, make_lock, parse_lock
from spottrain.protocol.boot import SECRET_ENV_FILE
from spottrain.protocol.env import (
    ENV_CKPT_DIR,
    ENV_POWEROFF_REQUEST,
    ENV_SECRET_ENV_FILE,
    ENV_TRAIN_CMD,
)
from spottrain.protocol.keys import make_run_id
from spottrain.spec import ArchiveCode, GitCode, ImageCode, JobSpec, SpecError, parse_spec

REPO = Path(__file__).resolve().parents[3]
needs_sandbox = pytest.mark.skipif(bool(sandbox_capable()), reason=sandbox_capable() or "-")

Path_ = tuple[str, ...]
# A string field: its path and how it holds strings: "str" (the value), "item" (the items of
# a list), "key" or "value" (of a mapping). "*" in a path: every item of a list of records.
Leaf = tuple[Path_, str]


# --- the fields, from the models ------------------------------------------------------------------
def _bare(t: Any) -> Any:
    while get_origin(t) is Annotated:
        t = get_args(t)[0]
    return t


def _record_fields(t: Any) -> dict[str, Any] | None:
    """A record type's fields and their types: a pydantic model's or a dataclass's."""
    if isinstance(t, type) and issubclass(t, BaseModel):
        return {k: f.annotation for k, f in t.model_fields.items()}
    if isinstance(t, type) and dataclasses.is_dataclass(t):
        hints = typing.get_type_hints(t)
        return {f.name: hints[f.name] for f in dataclasses.fields(t)}
    return None


def string_leaves(t: Any, path: Path_ = ()) -> Iterator[Leaf]:
    """Every string field under the type ``t``, walked through records, optionals, unions
    (a spec's code kinds), lists and mappings."""
    t = _bare(t)
    fields = _record_fields(t)
    if fields is not None:
        for name, sub in fields.items():
            yield from string_leaves(sub, (*path, name))
    elif get_origin(t) in (Union, types.UnionType):
        for arm in get_args(t):
            yield from string_leaves(arm, path)
    elif t is str:
        yield path, "str"
    elif get_origin(t) is tuple:
        item = _bare(get_args(t)[0])
        if item is str:
            yield path, "item"
        else:
            yield from string_leaves(item, (*path, "*"))
    elif get_origin(t) is dict:
        key, value = (_bare(a) for a in get_args(t))
        if key is str:
            yield path, "key"
        if value is str:
            yield path, "value"
        else:
            yield from string_leaves(value, (*path, "*"))


SPEC_LEAVES = sorted(set(string_leaves(JobSpec)))
LOCK_LEAVES = sorted(set(string_leaves(EnvLock)))
# Sections whose values never reach an AWS or GCP VM's boot: the local cloud cannot be mixed
# with real clouds, and a Terraform fleet's VMs boot from the module's own template.
NO_VM_BOOT = ("local", "fleet")
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"  # the sandbox's python3

# A spec with every string field the VMs' boot may carry set (both clouds, every section).
FULL: dict[str, Any] = {
    "name": "gpt-small",
    "train": {
        "command": ["python", "train.py", "--lr", "3e-4"],
        "env": {"HF_HOME": "/data/hf"},
        "secret_env": {"HF_HUB_KEY": "hf/key"},
        "not_secrets": ["--lr"],
    },
    "nodes": {"min": 2, "max": 4, "gpus": 8},
    "resources": {
        "clouds": ["aws", "gcp"],
        "regions": ["us-east-1", "us-central1"],
        "zones": ["us-east-1a", "us-central1-a"],
        "instance_types": ["p4d.24xlarge", "a2-highgpu-8g"],
    },
    "budget": {"max_usd": 1000},
    "checkpoint": {
        # Outside /mnt/spottrain: the unit then requires its mount too.
        "volume": {"path": "/fsx/ckpt", "write_gbps": 4},
        "every_steps": 500,
        "params": "7B",
        "copy_to": "file:///mnt/shared/ckpt",
    },
    "redis": {
        "url": "rediss://redis.internal:6380",
        "password_env": "REDIS_PASS",
        "password_file": "/etc/redis-pass",
        "password_secret": "spottrain/redis",
    },
    "wandb": {"project": "llm", "entity": "acme"},
    "aws": {
        "images": {"us-east-1": "ami-0123456789abcdef0"},
        "subnets": {"us-east-1a": "subnet-0abc"},
        "security_groups": ["sg-0abc"],
        "instance_profile": "spottrain-vm",
        "key_name": "ops",
        "root_volume_kms_key": "alias/ebs",
        "endpoints": {"s3": "https://s3.internal", "secretsmanager": "https://sm.internal"},
    },
    "gcp": {
        "project": "acme-train",
        "image": "projects/p/global/images/family/f",
        "network": "net",
        "subnetwork": "sub",
        "service_account": "vm@acme-train.iam.gserviceaccount.com",
        "scopes": ["cloud-platform"],
        "endpoints": {
            "compute": "https://compute.internal",
            "storage": "https://storage.internal",
            "secretmanager": "https://secrets.internal",
        },
    },
    "logs": {"to": "file:///mnt/shared/logs"},
    "packages": {
        "index_url": "https://pypi.internal/simple",
        "extra_index_urls": ["https://extra.internal/simple"],
        "find_links": ["https://wheels.internal/"],
        "credentials_secret": "pip/creds",
        "python": PYTHON,
    },
}
CODES: dict[str, dict[str, Any]] = {
    "archive": {"archive": {"path": ".", "exclude": ["*.tmp"], "store": "file:///mnt/store"}},
    "git": {
        "git": {
            "repo": "https://git.internal/acme/train",
            "commit": COMMIT,
            "subdir": "src",
            "token_secret": "git/token",
            "token_user": "x-access-token",
        }
    },
    "image": {"image": f"ghcr.io/acme/train@{DIGEST}"},
}
ARCHIVE_SHA = "cd" * 32
WHEEL = b"PK the shipped wheel"
WHEEL_NAME = "spottrain-0.1.0-py3-none-any.whl"
# The lock as its format holds it: what make_lock takes.
FULL_LOCK: dict[str, Any] = {
    "target": f"python {PYTHON} cp manylinux_2_28_x86_64",
    "requires": ["spottrain[agent,aws]==0.1.0"],
    "packages": [
        {"name": "spottrain", "version": "0.1.0", "hashes": ["sha256:" + "ab" * 32], "url": ""},
        {
            "name": "alpha",
            "version": "1.0",
            "hashes": ["sha256:" + "ef" * 32],
            "url": "https://files.internal/alpha-1.0-py3-none-any.whl",
        },
    ],
}

# The values tried in each field. {c} is the canary's file name (relative: the boot runs in
# the canary folder); no spaces but in the one about whitespace, since URL fields refuse them.
PAYLOADS = (
    # command substitution, both spellings
    "$(touch${{IFS}}{c})`touch${{IFS}}{c}`",
    # out of single quotes, then out of double quotes
    "';touch${{IFS}}{c};'\";touch${{IFS}}{c};\"",
    # escaped quotes and a trailing backslash
    "\\'$(touch${{IFS}}{c})\\'\\\"`touch${{IFS}}{c}`\\\"\\",
    # variables (the shell's and systemd's), lists, background
    "$HOME${{HOME}}$$!#;touch${{IFS}}{c}||touch${{IFS}}{c}&",
    # format strings (Python's, printf's) and systemd's specifiers
    "{{}}{{0}}%s%n%%",
    # word splitting, globs, a tilde, a redirection
    " a b\t*?[x] ~root >{c} ",
    "\ntouch {c}\n",
    # each here-document's delimiter on a line of its own
    "\nENV\nUNIT\nJSON\nSH\nB64\nPY\nLOCK\ntouch {c}\n",
    "\r\ntouch {c}\r",
    "\x00{c}",
    "\x1b[2J\x7f{c}",
)


# --- placing a text in a field --------------------------------------------------------------------
def _at(data: Any, path: Path_) -> Any:
    for part in path:
        data = data[1 if part == "*" else part]
    return data


def _cuts(text: str) -> list[int]:
    """Where a text may go into a value: its start, its end, after each separator."""
    return list(
        dict.fromkeys([0, len(text)] + [i + 1 for i, c in enumerate(text) if c in ":/.@-_"])
    )


def forms(data: dict[str, Any], leaf: Leaf) -> list[tuple[Any, ...]]:
    """The ways ``leaf`` of ``data`` can take a text (none when ``data`` lacks it)."""
    path, kind = leaf
    try:
        value = _at(data, path)
    except (KeyError, IndexError):
        return []
    if kind == "str":
        return [("at", i) for i in _cuts(value)]
    if kind == "item":
        return [("item", i) for i in _cuts(value[0])] + [("append",)]
    if kind == "key":
        return [("key",)]
    return [("value", i) for i in _cuts(next(iter(value.values())))]


def placed(data: dict[str, Any], leaf: Leaf, form: tuple[Any, ...], text: str) -> dict[str, Any]:
    """A copy of ``data`` with ``text`` in ``leaf``, the way ``form`` says."""
    path, _ = leaf
    out = copy.deepcopy(data)
    parent, last = _at(out, path[:-1]), path[-1]
    last_key: Any = 1 if last == "*" else last
    value = parent[last_key]
    if form[0] == "at":
        parent[last_key] = value[: form[1]] + text + value[form[1] :]
    elif form[0] == "item":
        value[0] = value[0][: form[1]] + text + value[0][form[1] :]
    elif form[0] == "append":
        value.append(text)
    elif form[0] == "key":
        value[text] = next(iter(value.values()))
    else:
        first = next(iter(value))
        value[first] = value[first][: form[1]] + text + value[first][form[1] :]
    return out


# --- rendering a VM's boot ------------------------------------------------------------------------
# libyaml's writer where there is one: the probes write a few hundred specs.
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def parse(data: dict[str, Any], base_dir: Path) -> JobSpec:
    return parse_spec(yaml.dump(data, Dumper=_DUMPER), "job.yaml", base_dir).spec


def lock_text(data: dict[str, Any]) -> str:
    """The lock ``data`` describes, as the run writes it (read back by its parser).

    Raises:
        LockError: the lock's format refuses it.
    """
    packages = [
        LockedPackage(p["name"], p["version"], tuple(p["hashes"]), p["url"])
        for p in data["packages"]
    ]
    text = make_lock(packages, target=data["target"], requires=data["requires"]).text()
    return parse_lock(text).text()


@dataclass
class Vm:
    """One VM's boot as a run renders it, and what its store holds."""

    spec: JobSpec
    cloud: str
    node: NodeIdentity
    lock: str | None
    job: str
    files: BootFiles
    user_data: str
    store: dict[str, bytes] = field(default_factory=dict)


def render_vm(spec: JobSpec, cloud: str, lock: str | None) -> Vm:
    """The boot of node ``n3`` of a run of ``spec`` on ``cloud``, its files in the run's store
    (a ``file://`` store, as the spec names it) pinned by sha256 as ``up`` ships them."""
    lock = None if isinstance(spec.code, ImageCode) else lock
    run_id = make_run_id(spec.name, 1_795_000_000)
    store = (spec.files_store() or "").rstrip("/")
    code = CodeRef(f"{store}/{ARCHIVE_SHA}.tar.gz", ARCHIVE_SHA)
    secret = spec.redis.password_secret
    job = render_job_boot(
        spec, cloud, run_id, spec.redis.url, code=code, password_secret=secret, env_lock=lock
    )
    parts = {"script": job.encode(), "loader": loader_text().encode(), "wheel": WHEEL}
    if lock is not None:
        parts["lock"] = lock.encode()
    pinned = {
        k: BootFile(f"{store}/boot/{k}", hashlib.sha256(v).hexdigest()) for k, v in parts.items()
    }
    files = BootFiles(
        pinned["script"], pinned["loader"], pinned.get("lock"), pinned["wheel"], WHEEL_NAME
    )
    zone = "us-east-1a" if cloud == "aws" else "us-central1-a"
    node = NodeIdentity(run_id, "n3", cloud, zone, "p4d.24xlarge")
    user = render_user_data(spec, node, spec.redis.url, files, password_secret=secret)
    vm = Vm(spec, cloud, node, lock, job, files, user)
    for k, data in parts.items():
        vm.store[urllib.parse.unquote(pinned[k].url.removeprefix("file://"))] = data
    return vm


def rendered_texts(spec: JobSpec, lock: str) -> dict[str, str]:
    """Each cloud's user data and job's boot."""
    out = {}
    for cloud in ("aws", "gcp"):
        vm = render_vm(spec, cloud, lock)
        out[f"{cloud} user data"], out[f"{cloud} job boot"] = vm.user_data, vm.job
    return out


# --- which fields reach the boot, and what each takes ---------------------------------------------
@dataclass
class Reach:
    """A field of the spec (or the lock) that reaches a VM's boot: where its marker went
    (``form``), the clouds whose boot holds it, and the payloads its validation takes."""

    leaf: Leaf
    form: tuple[Any, ...]
    clouds: frozenset[str]
    accepted: list[int] = field(default_factory=list)


def _dotted(path: Path_) -> str:
    return ".".join(p for p in path if p != "*")


_CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f]")


def assert_clean_refusal(e: SpecError | LockError, leaf: Leaf, value: str) -> None:
    """A refusal in one line per problem, control characters escaped, each problem placed
    (the field's section, or the spec as a whole for a rule between sections)."""
    problems = e.problems if isinstance(e, SpecError) else [str(e)]
    for line in problems:
        assert not _CONTROL.search(line), (leaf, value, line)
    if isinstance(e, SpecError):
        places = (leaf[0][0], "(top level)")
        assert all(line.startswith(places) for line in problems), (leaf, problems)


def _marker_reach(
    data: dict[str, Any], leaf: Leaf, base: Path, lock: str, marker: str
) -> tuple[tuple[Any, ...] | None, frozenset[str]]:
    """The first way ``leaf`` takes a plain marker (None: it takes none) and the clouds
    whose boot the marker then reaches."""
    for form in forms(data, leaf):
        try:
            spec = parse(placed(data, leaf, form, marker), base)
        except SpecError:
            continue
        texts = rendered_texts(spec, lock)
        return form, frozenset(k.split()[0] for k, v in texts.items() if marker in v)
    return None, frozenset()


def probe_spec(data: dict[str, Any], base: Path, lock: str) -> list[Reach]:
    """The spec's fields that reach the boot of a job of ``data``'s code kind, each with the
    payloads the spec takes there. Every field is tried with every payload: one the spec
    refuses must be refused cleanly, one it takes must render."""
    found = []
    for n, leaf in enumerate(SPEC_LEAVES):
        if leaf[0][0] in NO_VM_BOOT or not forms(data, leaf):
            continue
        form, clouds = _marker_reach(data, leaf, base, lock, f"zq{n:02d}mk")
        reach = Reach(leaf, form or forms(data, leaf)[0], clouds)
        for i, payload in enumerate(PAYLOADS):
            value = payload.format(c="canary")
            try:
                spec = parse(placed(data, leaf, reach.form, value), base)
            except SpecError as e:
                assert_clean_refusal(e, leaf, value)
                continue
            assert form is not None, f"{leaf} takes {value!r} but no plain text"
            try:
                rendered_texts(spec, lock)
            except ValueError as e:
                raise AssertionError(
                    f"{_dotted(leaf[0])}: the spec takes {value!r}, the boot refuses it: {e}"
                ) from None
            reach.accepted.append(i)
        if clouds:
            found.append(reach)
    return found


def probe_lock(spec: JobSpec) -> list[Reach]:
    """The lock's fields, each with the payloads its format takes (those it refuses are
    checked to be refused cleanly); none reaches the boot's text, which pins the lock by its
    sha256 only."""
    found = []
    for n, leaf in enumerate(LOCK_LEAVES):
        marker, form = f"zl{n:02d}mk", None
        for candidate in forms(FULL_LOCK, leaf):
            try:
                text = lock_text(placed(FULL_LOCK, leaf, candidate, marker))
            except LockError:
                continue
            texts = rendered_texts(spec, text)
            assert not [k for k, v in texts.items() if marker in v], f"the lock's {leaf} is there"
            form = candidate
            break
        reach = Reach(leaf, form or forms(FULL_LOCK, leaf)[0], frozenset({"aws", "gcp"}))
        for i, payload in enumerate(PAYLOADS):
            value = payload.format(c="canary")
            try:
                lock_text(placed(FULL_LOCK, leaf, reach.form, value))
            except LockError as e:
                assert_clean_refusal(e, leaf, value)
                continue
            assert form is not None, f"{leaf} takes {value!r} but no plain text"
            reach.accepted.append(i)
        if form is not None:
            found.append(reach)
    return found


@dataclass
class Plan:
    """One boot in the sandbox: its cloud and, per field, the payload it carries."""

    cloud: str
    spec_values: dict[Leaf, int] = field(default_factory=dict)
    lock_values: dict[Leaf, int] = field(default_factory=dict)


def schedule(spec_fields: list[Reach], lock_fields: list[Reach]) -> list[Plan]:
    """Few boots that together put every accepted payload in every field once, each field
    on a cloud whose boot it reaches (the clouds take turns)."""
    plans: list[Plan] = []
    every = [(r, True) for r in spec_fields] + [(r, False) for r in lock_fields]
    for reach, in_spec in sorted(every, key=lambda x: len(x[0].clouds)):
        for i in reach.accepted:
            for plan in plans:
                values = plan.spec_values if in_spec else plan.lock_values
                if plan.cloud in reach.clouds and reach.leaf not in values:
                    values[reach.leaf] = i
                    break
            else:
                while True:
                    plans.append(Plan("aws" if len(plans) % 2 == 0 else "gcp"))
                    if plans[-1].cloud in reach.clouds:
                        break
                values = plans[-1].spec_values if in_spec else plans[-1].lock_values
                values[reach.leaf] = i
    return plans


# --- the boots, and what must arrive --------------------------------------------------------------
def _systemd() -> Any:
    """The box's systemd stand-in: its parsers of env files, unit files and Exec lines follow
    systemd's own rules."""
    path = REPO / "tests" / "box" / "standin" / "systemd.py"
    spec = importlib.util.spec_from_file_location("standin_systemd_fuzz", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


SYSTEMD = _systemd()


def fill(plan: Plan, data: dict[str, Any], fields: list[Reach], base: Path) -> Any:
    """The plan's spec and lock, and which canary stands for which field and value (the
    spec's and the lock's field paths never meet)."""
    forms_of = {r.leaf: r.form for r in fields}
    canaries: dict[str, tuple[Leaf, str]] = {}
    lock = copy.deepcopy(FULL_LOCK)
    for values, is_lock in ((plan.spec_values, False), (plan.lock_values, True)):
        for leaf, i in values.items():
            name = f"canary-{len(canaries)}"
            value = PAYLOADS[i].format(c=name)
            canaries[name] = (leaf, value)
            if is_lock:
                lock = placed(lock, leaf, forms_of[leaf], value)
            else:
                data = placed(data, leaf, forms_of[leaf], value)
    return parse(data, base), lock_text(lock), canaries


def check_env_files(ran: Ran, vm: Vm) -> dict[str, str]:
    """The agent's env files, read as systemd reads them (docker's: literally), hold every
    value exactly; returns the agent's."""
    spec, secret = vm.spec, vm.spec.redis.password_secret
    job = job_env(
        spec,
        vm.cloud,
        vm.node.run_id,
        spec.redis.url,
        password_file=PASSWORD_PATH if secret else None,
    )
    assert SYSTEMD.parse_env_file(ran.text(JOB_ENV_PATH)) == job
    agent: dict[str, str] = SYSTEMD.parse_env_file(ran.text(AGENT_ENV_PATH))
    assert agent == {**job, **node_env(vm.node)}
    if isinstance(spec.code, ImageCode):
        lines = ran.text(DOCKER_ENV_PATH).splitlines()
        # Besides the agent's: where it asks the host to power off and reads its secrets.
        extra = {ENV_POWEROFF_REQUEST: POWEROFF_REQUEST}
        if spec.train.secret_env:
            extra[ENV_SECRET_ENV_FILE] = SECRET_ENV_FILE
        assert dict(line.split("=", 1) for line in lines) == {**agent, **extra}
    assert shlex.split(agent[ENV_TRAIN_CMD]) == list(spec.train.command)
    return agent


def check_argv(ran: Ran, vm: Vm) -> None:
    """What the boot gave the loader, git, pip, docker and the code's fetch, exactly."""
    spec, loader = vm.spec, [LOADER_PATH, BOOT_CONF]
    said = ran.argv_of("python3")
    if spec.redis.password_secret:
        assert [*loader, "secret", spec.redis.password_secret, PASSWORD_PATH] in said
    image = isinstance(spec.code, ImageCode)
    for name, secret in spec.train.secret_env.items():
        if image:
            assert [*loader, "secret-env-json", name, secret, SECRET_ENV_FILE] in said
        else:
            assert [*loader, "secret-env", name, secret, JOB_ENV_PATH] in said
    venv_python = ran.argv_of("python")
    if isinstance(spec.code, GitCode):
        g = spec.code.git
        fetch = ["-C", "/opt/job", "fetch", "-q", "--depth", "1", g.repo, g.commit]
        assert fetch in ran.argv_of("git")
        if g.token_secret:
            assert ran.argv_of("askpass") == [[g.token_user, "s3cr3t-from-the-store"]]
        where = f"/opt/job/{g.subdir}/requirements.txt" if g.subdir else "/opt/job/requirements.txt"
        assert [a[-1] for a in ran.argv_of("pip") if "-c" in a] == [where]
    if isinstance(spec.code, ArchiveCode):
        url = f"{(spec.files_store() or '').rstrip('/')}/{ARCHIVE_SHA}.tar.gz"
        fetch = ["-m", "spottrain.cloud.code_archive", "fetch", url, ARCHIVE_SHA, "/opt/job"]
        assert fetch in venv_python
    if isinstance(spec.code, ImageCode):
        assert ran.argv_of("docker") == [["pull", spec.code.image]]


def _specifiers(value: str) -> str:
    """A unit setting's value once systemd resolved its specifiers: the boot writes only
    ``%%`` (a ``%``), which the box's stand-in leaves to systemd."""
    assert re.fullmatch(r"([^%]|%%)*", value), value
    return value.replace("%%", "%")


def check_unit(ran: Ran, vm: Vm, agent: dict[str, str]) -> None:
    """The unit's drop-in, parsed as systemd does, names the volume and the run's checkpoint
    directory exactly."""
    drop_in = f"{UNIT_PATH}.d/job.conf"
    said = SYSTEMD.parse_unit_text(ran.text(drop_in), drop_in)
    got = {a.key: _specifiers(a.value) for a in said}
    volume = vm.spec.checkpoint.volume.path
    if "RequiresMountsFor" in got:
        assert SYSTEMD.split_words(got["RequiresMountsFor"]) == [volume]
    else:
        assert volume.startswith("/mnt/spottrain/")
    mkdir = SYSTEMD.parse_exec(got["ExecStartPre"]).expand(agent)
    assert mkdir == ["/bin/mkdir", "-p", agent[ENV_CKPT_DIR]]
    if isinstance(vm.spec.code, ImageCode):
        assert vm.spec.code.image in SYSTEMD.parse_exec(got["ExecStart"]).expand(agent)
    assert f"checkpoint volume: {volume} on /mnt\n" in ran.output


def boot_in_sandbox(work: Path, vm: Vm, canaries: dict[str, Any]) -> None:
    """Run the VM's boot: it ends well, no canary fires, every value arrives exact."""
    cwd = work / "cwd"
    cwd.mkdir(parents=True)
    subdir = vm.spec.code.git.subdir if isinstance(vm.spec.code, GitCode) else ""
    ran = run_boot(work / "box", vm.user_data, vm.store, cwd=cwd, env={"FUZZ_SUBDIR": subdir})
    fired = {p.name: canaries.get(p.name, "?") for p in cwd.iterdir()}
    assert not fired, f"ran a value as code: {fired}"
    assert ran.rc == 0, ran.output[-3000:]
    assert [LOADER_PATH, BOOT_CONF, "booted"] in ran.argv_of("python3")
    secret = vm.spec.redis.password_secret
    settings = loader_settings(
        vm.spec, vm.node, vm.spec.redis.url, vm.files, password_secret=secret
    )
    assert yaml.safe_load(ran.text(BOOT_CONF)) == yaml.safe_load(yaml.safe_dump(settings))
    assert ran.text(JOB_SCRIPT) == vm.job
    if vm.lock is not None:
        assert ran.text(ENV_LOCK_PATH) == vm.lock
    agent = check_env_files(ran, vm)
    check_argv(ran, vm)
    check_unit(ran, vm, agent)


def _job(kind: str) -> dict[str, Any]:
    return {**copy.deepcopy(FULL), "code": copy.deepcopy(CODES[kind])}


@functools.cache
def probes(kind: str) -> tuple[list[Reach], list[Reach]]:
    """The spec's and the lock's fields that reach a boot of a job of ``kind``, each with the
    payloads it takes (an image job has no lock)."""
    data = _job(kind)
    spec_fields = probe_spec(data, REPO, lock_text(FULL_LOCK))
    lock_fields = probe_lock(parse(data, REPO)) if kind != "image" else []
    return spec_fields, lock_fields


def test_every_string_field_a_vm_may_carry_is_fuzzed() -> None:
    """The fields come from the models: one added later must get a value here, or be in a
    section no VM's boot renders."""
    jobs = (FULL, *({"code": c} for c in CODES.values()))
    missing = [
        _dotted(path)
        for path, kind in SPEC_LEAVES
        if path[0] not in NO_VM_BOOT and not any(forms(d, (path, kind)) for d in jobs)
    ]
    assert not missing, f"give these fields a value in FULL or CODES: {missing}"
    assert {leaf for leaf, _ in LOCK_LEAVES} == {
        ("target",),
        ("requires",),
        ("packages", "*", "name"),
        ("packages", "*", "version"),
        ("packages", "*", "hashes"),
        ("packages", "*", "url"),
    }


@pytest.mark.parametrize("kind", sorted(CODES))
def test_every_value_is_refused_in_one_line_or_rendered(kind: str) -> None:
    """Without the sandbox (no root needed): in every field, each payload is refused by the
    spec's validation in one line per problem, or renders a boot."""
    spec_fields, lock_fields = probes(kind)
    assert {_dotted(r.leaf[0]) for r in spec_fields if r.accepted} >= {
        "checkpoint.volume.path",
        "train.command",
        "train.env",
        "redis.password_secret",
    }
    assert kind == "image" or any(r.accepted for r in lock_fields)


@needs_sandbox
@pytest.mark.parametrize("kind", sorted(CODES))
def test_no_spec_or_lock_value_runs_in_a_vms_boot_and_each_arrives_exact(
    kind: str, tmp_path: Path
) -> None:
    spec_fields, lock_fields = probes(kind)
    boots = []
    for n, plan in enumerate(schedule(spec_fields, lock_fields)):
        spec, lock, canaries = fill(plan, _job(kind), spec_fields + lock_fields, REPO)
        boots.append((tmp_path / f"boot{n}", render_vm(spec, plan.cloud, lock), canaries))
    # Each boot has a sandbox of its own: they run side by side.
    with ThreadPoolExecutor(max_workers=4) as pool:
        for done in [pool.submit(boot_in_sandbox, *b) for b in boots]:
            done.result()

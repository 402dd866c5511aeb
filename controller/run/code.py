"""A run's code and boot: the code archive uploaded, the local cloud's secrets and
checkpoint store, and the boot script each new VM gets."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from spottrain.cloud.base import Offer
from spottrain.controller.run.boot import (
    BootFiles,
    CodeRef,
    NodeIdentity,
    render_local_boot,
    render_user_data,
)
from spottrain.controller.run.boot_files import ensure_shipped
from spottrain.controller.run.progress import Waiting, size
from spottrain.controller.run.records import RunError, RunInfo, home_dir
from spottrain.controller.run.run_redis import embedded_password_file
from spottrain.spec import ArchiveCode, JobSpec


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
    from spottrain.cloud.storage import LocalStore
    from spottrain.cloud.stores import open_store

    src = spec.code.archive
    out = run_dir / "archive"

    def written() -> str:
        # The archive is written to a temporary file beside where it ends.
        part = sum(p.stat().st_size for p in out.glob(".code-*.part")) if out.is_dir() else 0
        return f"{size(part)} compressed so far" if part else ""

    with Waiting(f"archiving the code in {base_dir / src.path}", written) as wait:
        archive = build_archive(base_dir / src.path, out, exclude=src.exclude)
        wait.done(
            f"code archived: {len(archive.files)} files, {size(archive.size)} compressed, "
            f"in {time.monotonic() - wait.started:.1f} s"
        )
    if src.store:
        store = open_store(src.store)
    elif spec.checkpoint.copy_to:
        store = open_store(spec.checkpoint.copy_to.rstrip("/") + "/code")
    else:
        store = LocalStore(home_dir() / "store", create=True)
    with Waiting(f"uploading the code ({size(archive.size)}) to {store.url()}") as wait:
        url = upload_archive(store, archive)
        wait.done(f"code uploaded in {time.monotonic() - wait.started:.1f} s")
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
    """The function that renders a new VM's boot (its user data, or the local cloud's boot
    command) for the run's controller. Before it is given out, the run's boot files are
    checked to still be in its store (any that went missing put back).

    Raises:
        RunError: the boot files cannot be checked or put back.
    """
    code = CodeRef(info.code_url, info.code_sha256)
    password = embedded_password_file(info.dir) if info.embedded_redis else None
    password_file = str(password) if password is not None and password.exists() else None
    secrets = local_secret_files(spec) if "local" in spec.resources.clouds else {}
    files = {cloud: BootFiles.from_dict(d) for cloud, d in info.boot_files.items()}
    if files:
        ensure_shipped(info)

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
        if offer.cloud not in files:
            raise RunError(
                f"run {info.run_id} shipped no boot files for {offer.cloud} VMs (made by an "
                "older spottrain?): start a new run (spottrain up)"
            )
        return render_user_data(
            spec,
            ident,
            info.redis_url,
            files[offer.cloud],
            password_secret=spec.redis.password_secret,
        )

    return render

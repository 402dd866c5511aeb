"""What a run ships to its store for its AWS and GCP VMs to fetch at boot, by content.

Per cloud, ``spottrain up`` renders the job's boot (:func:`~.boot.render_job_boot`) and puts
it in the run's store (``JobSpec.files_store``: beside the code archive) with the loader, the
environment lock and spottrain's own wheel, each under a key made of its sha256::

    <store>/boot/<sha256>.sh          the job's boot
    <store>/boot/<sha256>.py          the loader (spottrain.cloud.vmboot.loader)
    <store>/locks/<sha256>.lock       the environment lock
    <store>/wheels/<sha256>/spottrain-<version>-py3-none-any.whl

Every VM's user data pins those sha256s, so what it fetches is what the run started with, a
week later too. The run's directory keeps a copy of each file (``boot/``), and a controller
that starts (``up``, ``resume``) checks that each object is still in the store, putting back
any that went missing, before it launches anything.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from spottrain.cloud.storage import ObjectNotFound, StorageError, parse_store_url
from spottrain.controller.run.boot import (
    BootFile,
    BootFiles,
    CodeRef,
    loader_text,
    render_job_boot,
)
from spottrain.controller.run.env_lock import ResolveError, read_run_lock
from spottrain.controller.run.records import RunError, RunInfo
from spottrain.controller.run.wheel import SelfWheel
from spottrain.spec import ImageCode, JobSpec

LOCAL_COPIES = "boot"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _key(kind: str, sha: str, name: str = "") -> str:
    if kind == "wheel":
        return f"wheels/{sha}/{name}"
    suffix = {"script": ".sh", "loader": ".py", "lock": ".lock"}[kind]
    folder = "locks" if kind == "lock" else "boot"
    return f"{folder}/{sha}{suffix}"


def _put(store: Any, key: str, data: bytes, sha: str) -> None:
    """Put ``data`` under ``key`` unless an object of that sha256 is there already."""
    try:
        if store.stat(key).sha256 == sha:
            return
    except ObjectNotFound:
        pass
    store.put_bytes(key, data)


def _made(url: str) -> str:
    """``url``, its folder made first when it is a file:// store's ``code/`` under an
    existing ``checkpoint.copy_to`` (a missing copy_to itself stays an error: an unmounted
    volume must not become an empty folder)."""
    parsed = parse_store_url(url)
    if parsed.scheme == "file":
        path = Path(parsed.path)
        if path.parent.is_dir():
            path.mkdir(exist_ok=True)
    return url


def ship_boot_files(
    spec: JobSpec, info: RunInfo, code: CodeRef, wheel: SelfWheel
) -> dict[str, dict[str, dict[str, str]]]:
    """Render, keep (in the run's directory) and upload each cloud's boot files; returns
    what ``run.json`` records (``BootFiles.as_dict`` per cloud).

    Raises:
        RunError: the store cannot be written, or the run's lock is not the recorded one.
    """
    from spottrain.cloud.stores import open_store

    url = spec.files_store()
    clouds = [c for c in spec.resources.clouds if c in ("aws", "gcp")]
    if not clouds or url is None:
        return {}
    copies = info.dir / LOCAL_COPIES
    copies.mkdir(parents=True, exist_ok=True)
    wheel_data = wheel.path.read_bytes()
    loader = loader_text().encode()
    out: dict[str, dict[str, dict[str, str]]] = {}
    try:
        store = open_store(_made(url))
        wheel_key = _key("wheel", wheel.sha256, wheel.filename)
        loader_key = _key("loader", _sha256(loader))
        _put(store, wheel_key, wheel_data, wheel.sha256)
        _put(store, loader_key, loader, _sha256(loader))
        (copies / wheel.filename).write_bytes(wheel_data)
        (copies / "loader.py").write_bytes(loader)
        for cloud in clouds:
            lock_text = None
            if cloud in info.env_locks:
                lock_text = read_run_lock(info.dir, cloud, info.env_locks[cloud])
            elif not isinstance(spec.code, ImageCode):
                continue  # no lock for this cloud: a Terraform fleet boots its own way
            script = render_job_boot(
                spec,
                cloud,
                info.run_id,
                info.redis_url,
                code=code,
                password_secret=spec.redis.password_secret,
                env_lock=lock_text,
            ).encode()
            script_key = _key("script", _sha256(script))
            _put(store, script_key, script, _sha256(script))
            (copies / f"job-{cloud}.sh").write_bytes(script)
            lock = None
            if lock_text is not None:
                data = lock_text.encode()
                lock_key = _key("lock", _sha256(data))
                _put(store, lock_key, data, _sha256(data))
                lock = BootFile(store.url(lock_key), _sha256(data))
            files = BootFiles(
                BootFile(store.url(script_key), _sha256(script)),
                BootFile(store.url(loader_key), _sha256(loader)),
                lock,
                BootFile(store.url(wheel_key), wheel.sha256),
                wheel.filename,
            )
            out[cloud] = files.as_dict()
    except StorageError as e:
        raise RunError(f"cannot ship the boot files to {url}: {e}") from None
    except ResolveError as e:
        raise RunError(str(e)) from None
    return out


def ensure_shipped(info: RunInfo) -> None:
    """Put back any of the run's boot files that went missing from its store (from the
    copies in the run's directory), so a VM launched now can boot.

    Raises:
        RunError: the store cannot be reached, or a copy is missing or was changed.
    """
    from spottrain.cloud.stores import open_store

    url = info.spec().files_store()
    if not info.boot_files or url is None:
        return
    wanted: dict[str, tuple[str, Path]] = {}  # key -> (sha256, the run's copy)
    for cloud, files in info.boot_files.items():
        for kind, f in files.items():
            name = f.get("name", "")
            copy_name = {
                "wheel": name,
                "loader": "loader.py",
                "script": f"job-{cloud}.sh",
                "lock": f"../{info.env_locks.get(cloud, {}).get('file', '')}",
            }[kind]
            wanted[_key(kind, f["sha256"], name)] = (
                f["sha256"],
                info.dir / LOCAL_COPIES / copy_name,
            )
    try:
        store = open_store(url)
        for key, (sha, copy) in sorted(wanted.items()):
            try:
                if store.stat(key).sha256 == sha:
                    continue
            except ObjectNotFound:
                pass
            try:
                data = copy.read_bytes()
            except OSError as e:
                raise RunError(
                    f"{store.url(key)} is gone from the store and its copy {copy} cannot be "
                    f"read ({e.strerror}): start a new run (spottrain up)"
                ) from None
            if _sha256(data) != sha:
                raise RunError(
                    f"{store.url(key)} is gone from the store and the copy {copy} is not the "
                    "file the run shipped: start a new run (spottrain up)"
                )
            store.put_bytes(key, data)
    except StorageError as e:
        raise RunError(f"cannot check the run's boot files in {url}: {e}") from None

"""What a run ships to its store for its AWS and GCP VMs to fetch at boot, by content.

Per cloud, ``spottrain up`` renders the job's boot (:func:`~.boot.render_job_boot`) and puts
it in the run's store (``JobSpec.files_store``: beside the code archive) with the loader, the
environment lock and spottrain's own wheel, each under a key made of its sha256::

    <store>/boot/<sha256>.sh          the job's boot
    <store>/boot/<sha256>.py          the loader (spottrain.cloud.vmboot.loader)
    <store>/locks/<sha256>.lock       the environment lock
    <store>/wheels/<sha256>/spottrain-<version>-py3-none-any.whl

Every VM's user data pins those sha256s, so what it fetches is what the run started with, a
week later too. The run's directory keeps a copy of each file (``boot/``; the lock beside
``run.json``), and a controller that starts (``up``, ``resume``) checks, before it launches
anything, each copy against the sha256 ``run.json`` pins (an edited one stops it, in one
line naming the file) and each object in the store, putting back any that went missing.
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
        RunError: the store cannot be written, the run's lock is not the recorded one, or a
            value of the spec cannot be carried by a boot script.
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
    except ValueError as e:
        # What the spec's validation let through and a boot script cannot carry.
        raise RunError(f"cannot render the boot of the run's VMs: {e}") from None
    return out


def _copies(info: RunInfo) -> dict[str, tuple[str, Path]]:
    """Each boot file the run pins, by its key in the store: (sha256, the run's copy)."""
    wanted: dict[str, tuple[str, Path]] = {}
    for cloud, files in info.boot_files.items():
        for kind, f in files.items():
            name = f.get("name", "")
            copy_name = {
                "wheel": f"{LOCAL_COPIES}/{name}",
                "loader": f"{LOCAL_COPIES}/loader.py",
                "script": f"{LOCAL_COPIES}/job-{cloud}.sh",
                "lock": str(info.env_locks.get(cloud, {}).get("file", "")),
            }[kind]
            wanted[_key(kind, f["sha256"], name)] = (f["sha256"], info.dir / copy_name)
    return wanted


def _checked_copies(info: RunInfo) -> dict[str, bytes]:
    """The run's copies of its boot files (its lock, job boot scripts, loader and wheel), by
    key, each checked against the sha256 ``run.json`` pins: an edited copy must not reach a
    VM launched later.

    Raises:
        RunError: a copy is missing or is not the file the run shipped (one line naming it).
    """
    for cloud, record in info.env_locks.items():
        try:
            read_run_lock(info.dir, cloud, record)
        except ResolveError as e:
            raise RunError(str(e)) from None
    out = {}
    for key, (sha, copy) in sorted(_copies(info).items()):
        try:
            data = copy.read_bytes()
        except OSError as e:
            raise RunError(
                f"the run's boot file {copy} cannot be read ({e.strerror}): put it back, or "
                "start a new run (spottrain up JOB.yaml)"
            ) from None
        if _sha256(data) != sha:
            raise RunError(
                f"the run's boot file {copy} is not the one this run shipped (sha256 "
                f"{_sha256(data)[:16]}, run.json says {sha[:16]}): it was changed; put the "
                "original back, or start a new run (spottrain up JOB.yaml)"
            )
        out[key] = data
    return out


def ensure_shipped(info: RunInfo) -> None:
    """Check the run's copies of its boot files (:func:`_checked_copies`), then put back any
    of the files that went missing from its store, so a VM launched now boots what the run
    started with.

    Raises:
        RunError: the store cannot be reached, or a copy is missing or was changed.
    """
    from spottrain.cloud.stores import open_store

    url = info.spec().files_store()
    if not info.boot_files or url is None:
        return
    copies = _checked_copies(info)
    pinned = {key: sha for key, (sha, _) in _copies(info).items()}
    try:
        store = open_store(url)
        for key, data in copies.items():
            try:
                if store.stat(key).sha256 == pinned[key]:
                    continue
            except ObjectNotFound:
                pass
            store.put_bytes(key, data)
    except StorageError as e:
        raise RunError(f"cannot check the run's boot files in {url}: {e}") from None

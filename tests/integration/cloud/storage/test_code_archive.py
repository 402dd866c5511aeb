"""The code archive: deterministic builds, excludes, safe fetches, and the boot-script CLI."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto.server import ThreadedMotoServer

from spottrain.cloud.aws.s3 import S3Store
from spottrain.cloud.code_archive import (
    FETCHED_MARKER,
    ArchiveChecksumError,
    ArchiveError,
    ArchiveTooLarge,
    UnsafeArchiveError,
    build_archive,
    data_members,
    fetch_archive,
    upload_archive,
)
from spottrain.cloud.storage import LocalStore

BUCKET = "spottrain-code"
SHA_OF_NOTHING = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "work"
    files = {
        "train.py": "print('training')\n",
        "pkg/__init__.py": "",
        "pkg/model.py": "class Model: ...\n",
        "configs/base.yaml": "lr: 0.001\n",
        "scripts/launch.sh": "#!/bin/sh\nexec python train.py\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "scripts/launch.sh").chmod(0o755)
    return root


def _members(path: Path) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(path, "r:gz") as tar:
        return {m.name: m for m in tar.getmembers()}


# --- determinism ----------------------------------------------------------------------------


def test_the_same_tree_gives_the_same_bytes_and_hash(tree: Path, tmp_path: Path) -> None:
    first = build_archive(tree, tmp_path / "a")
    second = build_archive(tree, tmp_path / "b")
    assert first.sha256 == second.sha256
    assert first.path.read_bytes() == second.path.read_bytes()
    assert first.path.name == f"code-{first.sha256[:16]}.tar.gz"
    assert first.key == f"code/{first.sha256}.tar.gz"
    assert first.size == first.path.stat().st_size
    assert first.files == (
        "configs/base.yaml",
        "pkg/__init__.py",
        "pkg/model.py",
        "scripts/launch.sh",
        "train.py",
    )


def test_touching_mtimes_and_non_exec_mode_bits_does_not_change_the_hash(
    tree: Path, tmp_path: Path
) -> None:
    before = build_archive(tree, tmp_path / "a").sha256
    for path in tree.rglob("*"):
        os.utime(path, (1_234_567, 7_654_321))
    (tree / "train.py").chmod(0o600)
    (tree / "pkg/model.py").chmod(0o664)
    assert build_archive(tree, tmp_path / "b").sha256 == before


def test_changing_one_byte_or_the_exec_bit_changes_the_hash(tree: Path, tmp_path: Path) -> None:
    before = build_archive(tree, tmp_path / "a").sha256
    (tree / "configs/base.yaml").write_text("lr: 0.002\n")
    changed = build_archive(tree, tmp_path / "b").sha256
    assert changed != before
    (tree / "train.py").chmod(0o755)
    assert build_archive(tree, tmp_path / "c").sha256 not in (before, changed)


def test_entries_are_sorted_with_zeroed_owners_times_and_normalised_modes(
    tree: Path, tmp_path: Path
) -> None:
    members = _members(build_archive(tree, tmp_path / "out").path)
    assert list(members) == sorted(members)
    for m in members.values():
        assert (m.mtime, m.uid, m.gid, m.uname, m.gname) == (0, 0, 0, "", "")
    assert members["scripts/launch.sh"].mode == 0o755
    assert members["train.py"].mode == 0o644
    assert members["pkg"].isdir() and members["pkg"].mode == 0o755


# --- what goes in ---------------------------------------------------------------------------


def test_vcs_virtualenvs_and_caches_are_always_left_out(tree: Path, tmp_path: Path) -> None:
    for rel in [
        ".git/HEAD",
        ".venv/bin/python3",
        "pkg/__pycache__/model.cpython-311.pyc",
        "stray.pyc",
        ".mypy_cache/x.json",
        ".ruff_cache/y",
        ".pytest_cache/z",
        "nested/.git/config",
    ]:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text("x")
    archive = build_archive(tree, tmp_path / "out")
    assert not any(
        part in f for f in archive.files for part in (".git", ".venv", "cache", ".pyc")
    ), archive.files
    assert "nested" in _members(archive.path)  # the directory stays, its .git does not


def test_exclude_patterns_match_names_anywhere_and_paths_from_the_root(
    tree: Path, tmp_path: Path
) -> None:
    for rel in ["run.log", "pkg/debug.log", "data/shard-0.bin", "pkg/data/keep.txt", "pkg/x.txt"]:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text("x")
    archive = build_archive(
        tree, tmp_path / "out", exclude=["*.log", "/data/", "pkg/x.txt", "configs"]
    )
    assert archive.files == (
        "pkg/__init__.py",
        "pkg/data/keep.txt",  # '/data/' names only the top-level directory
        "pkg/model.py",
        "scripts/launch.sh",
        "train.py",
    )


def test_spottrainignore_patterns_are_honoured(tree: Path, tmp_path: Path) -> None:
    (tree / "outputs").mkdir()
    (tree / "outputs/ckpt.pt").write_text("weights")
    (tree / ".spottrainignore").write_text("# big stuff\n\noutputs/\n  *.yaml  \n")
    archive = build_archive(tree, tmp_path / "out")
    assert "outputs/ckpt.pt" not in archive.files
    assert "configs/base.yaml" not in archive.files
    assert ".spottrainignore" in archive.files


def test_a_negated_ignore_pattern_is_refused(tree: Path, tmp_path: Path) -> None:
    (tree / ".spottrainignore").write_text("*.yaml\n!configs/base.yaml\n")
    with pytest.raises(ArchiveError, match=r"\.spottrainignore:2: negated patterns"):
        build_archive(tree, tmp_path / "out")


def test_an_archive_written_inside_the_tree_does_not_pack_itself(tree: Path) -> None:
    first = build_archive(tree, tree / ".spottrain")
    second = build_archive(tree, tree / ".spottrain")
    assert first.sha256 == second.sha256
    assert not any(f.startswith(".spottrain/") for f in second.files)


def test_a_symlink_inside_the_tree_is_kept_as_a_relative_link(tree: Path, tmp_path: Path) -> None:
    (tree / "latest.yaml").symlink_to(tree / "configs/base.yaml")  # absolute target
    (tree / "lib").symlink_to("pkg")
    members = _members(build_archive(tree, tmp_path / "out").path)
    assert members["latest.yaml"].issym()
    assert members["latest.yaml"].linkname == "configs/base.yaml"
    assert members["lib"].issym() and members["lib"].linkname == "pkg"
    assert "lib/model.py" not in members


def test_a_symlink_pointing_outside_the_tree_is_refused(tree: Path, tmp_path: Path) -> None:
    (tmp_path / "secret.txt").write_text("outside")
    (tree / "pkg/secret.txt").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(UnsafeArchiveError, match=r"pkg/secret\.txt.*outside") as excinfo:
        build_archive(tree, tmp_path / "out")
    assert ".spottrainignore" in str(excinfo.value)
    assert not (tmp_path / "out").exists()


def test_a_pipe_in_the_tree_is_refused_rather_than_read_forever(tree: Path, tmp_path: Path) -> None:
    os.mkfifo(tree / "pkg/control.fifo")
    with pytest.raises(ArchiveError, match="not a regular file"):
        build_archive(tree, tmp_path / "out")
    assert build_archive(tree, tmp_path / "out", exclude=["*.fifo"]).files


def test_a_tree_above_the_size_limit_is_refused_saying_how_to_exclude(
    tree: Path, tmp_path: Path
) -> None:
    (tree / "data").mkdir()
    (tree / "data/big.bin").write_bytes(b"\0" * (3 << 20))
    with pytest.raises(ArchiveTooLarge, match=r"data/big\.bin") as excinfo:
        build_archive(tree, tmp_path / "out", max_bytes=2 << 20)
    assert ".spottrainignore" in str(excinfo.value)
    assert build_archive(tree, tmp_path / "out", max_bytes=2 << 20, exclude=["data/"]).files


# --- storing and fetching -------------------------------------------------------------------


def test_an_archive_round_trips_through_a_local_store(tree: Path, tmp_path: Path) -> None:
    archive = build_archive(tree, tmp_path / "out")
    store = LocalStore(tmp_path / "store", create=True)
    url = upload_archive(store, archive)
    assert url == store.url(f"code/{archive.sha256}.tar.gz")
    dest = fetch_archive(url, archive.sha256, tmp_path / "node" / "code")
    assert (dest / "train.py").read_text() == "print('training')\n"
    assert os.access(dest / "scripts/launch.sh", os.X_OK)
    assert not os.access(dest / "train.py", os.X_OK)
    assert (dest / FETCHED_MARKER).read_text().strip() == archive.sha256
    assert sorted(p.name for p in (tmp_path / "node").iterdir()) == ["code"]


def test_uploading_an_archive_already_stored_sends_nothing(tree: Path, tmp_path: Path) -> None:
    archive = build_archive(tree, tmp_path / "out")
    store = LocalStore(tmp_path / "store", create=True)
    upload_archive(store, archive)
    version = store.stat(archive.key).version
    upload_archive(store, archive)
    assert store.stat(archive.key).version == version


def test_a_tampered_archive_is_rejected_and_nothing_is_extracted(
    tree: Path, tmp_path: Path
) -> None:
    archive = build_archive(tree, tmp_path / "out")
    store = LocalStore(tmp_path / "store", create=True)
    upload_archive(store, archive)
    (tree / "train.py").write_text("print('something else')\n")
    other = build_archive(tree, tmp_path / "other")
    store.put_file(archive.key, other.path)  # a valid object, just not the pinned archive
    dest = tmp_path / "node" / "code"
    with pytest.raises(ArchiveChecksumError, match=f"not the pinned {archive.sha256}"):
        fetch_archive(archive.key, archive.sha256, dest, store=store)
    assert list((tmp_path / "node").iterdir()) == []


def _evil_archive(member: tarfile.TarInfo, data: bytes = b"") -> tuple[bytes, str]:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        ok = tarfile.TarInfo("ok.txt")
        ok.size = 2
        tar.addfile(ok, io.BytesIO(b"ok"))
        member.size = len(data) if member.isreg() else 0
        tar.addfile(member, io.BytesIO(data) if member.isreg() else None)
    raw = buf.getvalue()
    return raw, hashlib.sha256(raw).hexdigest()


def _symlink(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.SYMTYPE
    info.linkname = target
    return info


@pytest.mark.parametrize(
    "member",
    [
        tarfile.TarInfo("../evil.txt"),
        tarfile.TarInfo("/tmp/spottrain-evil-absolute.txt"),
        _symlink("escape", "../../outside"),
        _symlink("abs-link", "/etc/passwd"),
    ],
    ids=["dotdot", "absolute", "link-escape", "absolute-link"],
)
def test_an_unsafe_tar_is_refused_and_writes_nothing_outside(
    member: tarfile.TarInfo, tmp_path: Path
) -> None:
    raw, sha = _evil_archive(member, b"pwned")
    store = LocalStore(tmp_path / "store", create=True)
    store.put_bytes("code/evil.tar.gz", raw)
    node = tmp_path / "node"
    with pytest.raises(UnsafeArchiveError, match="refusing archive"):
        fetch_archive("code/evil.tar.gz", sha, node / "code", store=store)
    assert list(node.iterdir()) == []
    assert not (tmp_path / "evil.txt").exists()
    assert not Path("/tmp/spottrain-evil-absolute.txt").exists()


def test_fetching_again_into_the_same_directory_is_a_no_op(tree: Path, tmp_path: Path) -> None:
    archive = build_archive(tree, tmp_path / "out")
    store = LocalStore(tmp_path / "store", create=True)
    url = upload_archive(store, archive)
    dest = fetch_archive(url, archive.sha256, tmp_path / "code")
    store.delete(archive.key)  # a second fetch must not even need the object
    assert fetch_archive(url, archive.sha256, dest) == dest


def test_fetching_into_a_directory_with_other_content_is_refused(
    tree: Path, tmp_path: Path
) -> None:
    archive = build_archive(tree, tmp_path / "out")
    store = LocalStore(tmp_path / "store", create=True)
    url = upload_archive(store, archive)
    (tmp_path / "code").mkdir()
    with pytest.raises(ArchiveError, match="already exists"):
        fetch_archive(url, archive.sha256, tmp_path / "code")


# --- through S3 -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    _aws_session().client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    yield endpoint
    server.stop()


def _aws_session() -> Any:
    return boto3.Session(
        aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
    )


def test_an_archive_round_trips_through_s3(moto_endpoint: str, tree: Path, tmp_path: Path) -> None:
    store = S3Store(BUCKET, "runs/r1", session=_aws_session(), endpoint_url=moto_endpoint)
    archive = build_archive(tree, tmp_path / "out")
    url = upload_archive(store, archive)
    assert url == f"s3://{BUCKET}/runs/r1/code/{archive.sha256}.tar.gz"
    dest = fetch_archive(archive.key, archive.sha256, tmp_path / "code", store=store)
    assert (dest / "pkg/model.py").read_text() == "class Model: ...\n"


def test_the_cli_fetches_from_s3_with_the_default_credential_chain(
    moto_endpoint: str, tree: Path, tmp_path: Path
) -> None:
    store = S3Store(BUCKET, "runs/r2", session=_aws_session(), endpoint_url=moto_endpoint)
    archive = build_archive(tree, tmp_path / "out")
    url = upload_archive(store, archive)
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": moto_endpoint,
    }
    result = _cli("fetch", url, archive.sha256, str(tmp_path / "code"), env=env)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "code/train.py").exists()


# --- the command line -----------------------------------------------------------------------


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spottrain.cloud.code_archive", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_the_cli_fetches_verifies_and_extracts(tree: Path, tmp_path: Path) -> None:
    archive = build_archive(tree, tmp_path / "out")
    url = upload_archive(LocalStore(tmp_path / "store", create=True), archive)
    result = _cli("fetch", url, archive.sha256, str(tmp_path / "code"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path / "code")
    assert (tmp_path / "code/scripts/launch.sh").exists()


@pytest.mark.parametrize(
    "args",
    [
        ("fetch",),
        ("fetch", "file:///tmp/x.tar.gz", "not-a-sha", "/tmp/dest"),
        ("fetch", "ftp://host/x.tar.gz", SHA_OF_NOTHING, "/tmp/dest"),
        ("unpack", "a", "b", "c"),
    ],
    ids=["missing-args", "bad-sha", "bad-url", "unknown-command"],
)
def test_the_cli_exits_2_on_bad_arguments(args: tuple[str, ...]) -> None:
    result = _cli(*args)
    assert result.returncode == 2
    assert "error:" in result.stderr


def test_the_cli_exits_1_with_one_line_when_the_fetch_fails(tree: Path, tmp_path: Path) -> None:
    archive = build_archive(tree, tmp_path / "out")
    url = upload_archive(LocalStore(tmp_path / "store", create=True), archive)
    wrong = _cli("fetch", url, SHA_OF_NOTHING, str(tmp_path / "code"))
    assert wrong.returncode == 1
    assert wrong.stderr.count("\n") == 1 and wrong.stderr.startswith("error: ")
    assert "not the pinned" in wrong.stderr
    missing = _cli("fetch", url + ".gone", archive.sha256, str(tmp_path / "code"))
    assert missing.returncode == 1
    assert missing.stderr.startswith("error: no object at")
    assert not (tmp_path / "code").exists()


@pytest.mark.parametrize(
    "member",
    [
        _symlink("escape", "../../outside"),
        _symlink("abs-link", "/etc/passwd"),
        tarfile.TarInfo("pipe"),
    ],
    ids=["link-escape", "absolute-link", "fifo"],
)
def test_without_extraction_filters_the_same_members_are_refused(
    member: tarfile.TarInfo, tmp_path: Path
) -> None:
    """Python 3.11.0-3.11.3 (Debian 12's python3, which a VM's venv may be built on) have no
    ``filter="data"``: :func:`data_members` makes the same checks there."""
    if member.name == "pipe":
        member.type = tarfile.FIFOTYPE
    raw, _ = _evil_archive(member, b"pwned")
    with (
        tarfile.open(fileobj=io.BytesIO(raw), mode="r:gz") as tar,
        pytest.raises(UnsafeArchiveError, match=r"refusing archive a\.tar\.gz"),
    ):
        data_members(tar, "a.tar.gz")


def test_without_extraction_filters_owners_and_special_modes_are_dropped(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, mode, data in (("run.sh", 0o4777, b"#!/bin/sh\n"), ("a.txt", 0o666, b"a")):
            info = tarfile.TarInfo(name)
            info.mode, info.uid, info.uname, info.size = mode, 1234, "someone", len(data)
            tar.addfile(info, io.BytesIO(data))
        tar.addfile(_symlink("link", "a.txt"))
    buf.seek(0)
    with tarfile.open(fileobj=buf, mode="r:gz") as tar:
        members = data_members(tar, "a.tar.gz")
        assert {m.name: (m.mode, m.uid, m.uname) for m in members if not m.issym()} == {
            "run.sh": (0o755, 0, ""),
            "a.txt": (0o644, 0, ""),
        }
        tar.extractall(tmp_path / "tree", members=members, filter="fully_trusted")
    assert os.readlink(tmp_path / "tree" / "link") == "a.txt"

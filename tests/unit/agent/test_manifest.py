"""The checkpoint manifest: it survives a round trip, refuses to be trusted when torn, edited,
of another format or short of a field, and catches every way the files can differ from it."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

from spottrain.agent.checkpoint.manifest import (
    FORMAT,
    MANIFEST_NAME,
    FileSum,
    Manifest,
    ManifestError,
    crc32,
    file_crc32,
    verify_files,
)


def make_manifest(files: dict[str, FileSum] | None = None) -> Manifest:
    return Manifest(
        step=120,
        world_size=4,
        round=7,
        kind="emergency",
        created_at=1700000000.25,
        files=files if files is not None else {"__0_0.distcp": FileSum(11, 0x1234ABCD)},
        request_id=3,
        extra={"node": "n-1", "drain": True},
    )


def resealed(body: dict[str, object]) -> bytes:
    """``body`` with a correct self-checksum, as a writer of that content would seal it."""
    body = {k: v for k, v in body.items() if k != "manifest_crc32"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return json.dumps({**body, "manifest_crc32": zlib.crc32(canonical)}).encode()


@pytest.fixture
def ckpt(tmp_path: Path) -> tuple[Path, Manifest]:
    """A checkpoint directory of two files and the manifest that describes them."""
    files = {"__0_0.distcp": b"shard zero bytes", ".metadata": b"\x00\x01metadata\xff"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    manifest = make_manifest({n: FileSum(len(d), zlib.crc32(d)) for n, d in files.items()})
    (tmp_path / MANIFEST_NAME).write_bytes(manifest.to_bytes())
    return tmp_path, manifest


def test_manifest_round_trips_through_bytes_and_disk(tmp_path: Path) -> None:
    manifest = make_manifest({"a": FileSum(5, 1), "b": FileSum(7, 2**32 - 1)})
    assert Manifest.from_bytes(manifest.to_bytes()) == manifest
    (tmp_path / MANIFEST_NAME).write_bytes(manifest.to_bytes())
    assert Manifest.read(tmp_path) == manifest
    assert manifest.total_bytes == 12


def test_manifest_bytes_are_the_same_whatever_the_order_files_were_recorded_in() -> None:
    a = make_manifest({"x": FileSum(1, 1), "y": FileSum(2, 2)})
    b = make_manifest({"y": FileSum(2, 2), "x": FileSum(1, 1)})
    assert a.to_bytes() == b.to_bytes()


@pytest.mark.parametrize("keep", [0, 1, 10, -40, -2])
def test_torn_manifest_is_refused(keep: int) -> None:
    raw = make_manifest().to_bytes()
    with pytest.raises(ManifestError, match=r"manifest is not JSON \(torn write\?\)"):
        Manifest.from_bytes(raw[:keep])


def test_torn_manifest_that_is_still_json_is_refused_by_its_checksum() -> None:
    body = json.loads(make_manifest().to_bytes())
    del body["files"]  # a prefix of the fields, as if the rest never reached the disk
    with pytest.raises(ManifestError, match="checksum does not match"):
        Manifest.from_bytes(json.dumps(body).encode())


@pytest.mark.parametrize(
    ("field", "value"),
    [("step", 121), ("round", 8), ("kind", "periodic"), ("world_size", 2)],
)
def test_edited_manifest_fails_its_checksum(field: str, value: object) -> None:
    body = json.loads(make_manifest().to_bytes())
    body[field] = value
    with pytest.raises(ManifestError, match="checksum does not match"):
        Manifest.from_bytes(json.dumps(body).encode())


def test_edited_file_entry_fails_the_checksum() -> None:
    body = json.loads(make_manifest().to_bytes())
    body["files"]["__0_0.distcp"]["crc32"] ^= 1
    with pytest.raises(ManifestError, match="checksum does not match"):
        Manifest.from_bytes(json.dumps(body).encode())


def test_flipped_byte_in_manifest_is_refused() -> None:
    raw = bytearray(make_manifest().to_bytes())
    pos = raw.index(b'"step": 120') + len(b'"step": 1')
    raw[pos] = ord("3")  # 120 -> 130: still JSON
    with pytest.raises(ManifestError, match="checksum does not match"):
        Manifest.from_bytes(bytes(raw))


def test_manifest_without_its_checksum_is_refused() -> None:
    body = json.loads(make_manifest().to_bytes())
    del body["manifest_crc32"]
    with pytest.raises(ManifestError, match="checksum does not match"):
        Manifest.from_bytes(json.dumps(body).encode())


@pytest.mark.parametrize("fmt", [FORMAT + 1, 0, "1", None])
def test_manifest_of_another_format_is_refused(fmt: object) -> None:
    body = json.loads(make_manifest().to_bytes())
    body["format"] = fmt
    with pytest.raises(ManifestError, match=rf"manifest format {fmt!r} is not {FORMAT}"):
        Manifest.from_bytes(resealed(body))


@pytest.mark.parametrize("missing", ["step", "world_size", "round", "kind", "created_at", "files"])
def test_manifest_missing_a_field_is_refused_naming_it(missing: str) -> None:
    body = json.loads(make_manifest().to_bytes())
    del body[missing]
    with pytest.raises(ManifestError, match=rf"lacks or mangles a field: KeyError\('{missing}'\)"):
        Manifest.from_bytes(resealed(body))


@pytest.mark.parametrize(
    ("field", "value"),
    [("step", "twelve"), ("files", ["a"]), ("files", {"a": {"size": 1}}), ("created_at", None)],
)
def test_manifest_with_a_mangled_field_is_refused(field: str, value: object) -> None:
    body = json.loads(make_manifest().to_bytes())
    body[field] = value
    with pytest.raises(ManifestError, match="lacks or mangles a field"):
        Manifest.from_bytes(resealed(body))


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"[1, 2]", "manifest is not a JSON object"),
        (b'"text"', "manifest is not a JSON object"),
        (b"\xff\xfe\x00", "manifest is not JSON"),
        (b"\x00" * 64, "manifest is not JSON"),  # a file whose blocks never reached the disk
    ],
)
def test_manifest_that_is_not_a_json_object_is_refused(raw: bytes, why: str) -> None:
    with pytest.raises(ManifestError, match=why):
        Manifest.from_bytes(raw)


def test_missing_manifest_file_is_a_manifest_error(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match=f"no {MANIFEST_NAME}"):
        Manifest.read(tmp_path)


def test_manifest_that_is_a_directory_is_a_manifest_error(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_NAME).mkdir()
    with pytest.raises(ManifestError, match=f"cannot read {MANIFEST_NAME}"):
        Manifest.read(tmp_path)


def test_files_that_match_the_manifest_verify(ckpt: tuple[Path, Manifest]) -> None:
    directory, manifest = ckpt
    assert verify_files(directory, Manifest.read(directory)) == []
    assert verify_files(directory, manifest, checksums=False) == []


def test_verify_files_reports_a_missing_file(ckpt: tuple[Path, Manifest]) -> None:
    directory, manifest = ckpt
    (directory / ".metadata").unlink()
    assert verify_files(directory, manifest) == [".metadata is missing"]


def test_verify_files_reports_an_extra_file(ckpt: tuple[Path, Manifest]) -> None:
    directory, manifest = ckpt
    (directory / "__1_0.distcp").write_bytes(b"stray")
    assert verify_files(directory, manifest) == ["__1_0.distcp is not in the manifest"]


def test_verify_files_reports_a_size_mismatch(ckpt: tuple[Path, Manifest]) -> None:
    directory, manifest = ckpt
    path = directory / "__0_0.distcp"
    path.write_bytes(path.read_bytes()[:-3])
    want = manifest.files["__0_0.distcp"].size
    assert verify_files(directory, manifest, checksums=False) == [
        f"__0_0.distcp has {want - 3} bytes, the manifest says {want}"
    ]


def test_verify_files_catches_a_flipped_byte_by_crc(ckpt: tuple[Path, Manifest]) -> None:
    directory, manifest = ckpt
    path = directory / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[5] ^= 0x01
    path.write_bytes(bytes(data))
    problems = verify_files(directory, manifest)
    assert len(problems) == 1
    assert problems[0].startswith("__0_0.distcp fails its CRC32")
    # Same size, so without checksums the flip goes unnoticed: the CRC is what caught it.
    assert verify_files(directory, manifest, checksums=False) == []


def test_file_crc32_matches_zlib_across_read_chunks(tmp_path: Path) -> None:
    data = bytes(range(256)) * (40 * 1024 + 3)  # ~10 MiB: more than one 8 MiB read
    (tmp_path / "f").write_bytes(data)
    assert file_crc32(tmp_path / "f") == zlib.crc32(data)


def test_the_checksums_are_zlibs_whichever_library_computes_them(tmp_path: Path) -> None:
    """zlib-ng computes them (3x faster) where its wheel is installed: the numbers must stay
    zlib's, so checkpoints written before, or on a VM without it, verify, and theirs here."""
    data = bytes(range(256)) * 4099 + b"tail"
    assert crc32.__module__.startswith("zlib_ng")  # the agent extra installs it
    assert crc32(data, 0) == zlib.crc32(data)
    half = len(data) // 3
    assert crc32(data[half:], crc32(data[:half], 0)) == zlib.crc32(data)
    assert crc32(memoryview(data)[7:], 5) == zlib.crc32(data[7:], 5)
    path = tmp_path / "shard.distcp"
    path.write_bytes(data)
    assert file_crc32(path) == zlib.crc32(data)

"""The environment lock's format and its verification against installed distributions
(issue 18 item 3: a backfilled node must run exactly the packages the others run)."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest

from spottrain.envlock import (
    LockedPackage,
    LockError,
    canonical_name,
    differences,
    lock_sha256,
    main,
    make_lock,
    parse_lock,
    verify,
)

H1, H2 = "sha256:" + "a" * 64, "sha256:" + "b" * 64


def test_a_lock_is_sorted_canonical_hashed_requirements_with_a_header() -> None:
    lock = make_lock(
        [
            LockedPackage("Typing_Extensions", "4.12.0", (H2,)),
            LockedPackage("NumPy", "2.1.0", (H1,)),
        ],
        target="python 3.11 cp manylinux_2_28_x86_64",
        requires=["spottrain[agent,aws]==0.1.0"],
    )
    text = lock.text()
    assert text.splitlines() == [
        "# spottrain environment lock",
        "# target: python 3.11 cp manylinux_2_28_x86_64",
        "# requires: spottrain[agent,aws]==0.1.0",
        f"numpy==2.1.0 --hash={H1}",
        f"typing-extensions==4.12.0 --hash={H2}",
    ]
    again = parse_lock(text)
    assert again == lock and again.text() == text
    assert lock_sha256(text) == lock_sha256(again.text())


def test_a_direct_url_keeps_its_url_and_the_wheels_version() -> None:
    url = "https://files.example.com/spottrain-0.1.0-py3-none-any.whl"
    lock = parse_lock(f"spottrain @ {url} --hash={H1}\n")
    (pkg,) = lock.packages
    assert (pkg.name, pkg.version, pkg.url) == ("spottrain", "0.1.0", url)
    assert pkg.line() == f"spottrain @ {url} --hash={H1}"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("numpy==2.1.0\n", "no sha256 hash"),
        ("numpy==2.1.0 --hash=md5:abc\n", "is not a sha256"),
        ("numpy>=2 --hash=" + H1 + "\n", "not `name==version"),
        ("-e .\n", "not `name==version"),
        ("numpy==2.1.0 --index-url https://x --hash=" + H1 + "\n", "only --hash options"),
        (f"numpy==2.1.0 --hash={H1}\nNumPy==2.1.0 --hash={H1}\n", "twice"),
    ],
)
def test_a_bad_lock_is_refused_naming_the_line(text: str, says: str) -> None:
    with pytest.raises(LockError, match=says):
        parse_lock(text, "env.lock")


def test_verify_passes_on_this_environment_and_names_each_package_that_differs() -> None:
    yaml_version = metadata.version("PyYAML")
    redis_version = metadata.version("redis")
    good = make_lock(
        [
            LockedPackage("pyyaml", yaml_version, (H1,)),
            LockedPackage("redis", redis_version, (H2,)),
        ]
    )
    assert verify(good) == []
    bad = make_lock(
        [
            LockedPackage("pyyaml", yaml_version, (H1,)),
            LockedPackage("redis", "0.0.1", (H2,)),
            LockedPackage("no-such-package-here", "1.0", (H1,)),
        ]
    )
    assert verify(bad) == [
        "no-such-package-here: locked 1.0, not installed",
        f"redis: locked 0.0.1, installed {redis_version}",
    ]


def test_differences_compare_canonical_names() -> None:
    lock = make_lock([LockedPackage("Foo.Bar", "1.0", (H1,))])
    assert differences(lock, {canonical_name("foo_bar"): ["1.0"]}) == []
    assert differences(lock, {"foo-bar": ["1.1"]}) == ["foo-bar: locked 1.0, installed 1.1"]
    # Two versions at once (a leftover .dist-info): which one imports is anybody's guess.
    assert differences(lock, {"foo-bar": ["1.0", "0.9"]}) == [
        "foo-bar: locked 1.0, installed 1.0 and 0.9"
    ]


def test_the_verify_command_exits_1_naming_the_package(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good, bad, junk = tmp_path / "good.lock", tmp_path / "bad.lock", tmp_path / "junk.lock"
    version = metadata.version("redis")
    good.write_text(make_lock([LockedPackage("redis", version, (H1,))]).text())
    bad.write_text(make_lock([LockedPackage("redis", "0.0.1", (H1,))]).text())
    junk.write_text("redis\n")
    assert main(["verify", str(good)]) == 0
    assert "1 packages match" in capsys.readouterr().out
    assert main(["verify", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "does not match the lock" in err and f"redis: locked 0.0.1, installed {version}" in err
    assert main(["verify", str(junk)]) == 2
    assert main(["check", str(good)]) == 2
    assert main(["verify", str(tmp_path / "missing.lock")]) == 2

"""The git smart-HTTP server, driven by the real ``git``: a pinned commit is fetched the way a
VM's boot fetches it (``git init``, ``git fetch --depth 1 URL COMMIT``), a private repository
takes the token from the boot's ``GIT_ASKPASS`` helper and nothing else, and a push is
refused."""

from __future__ import annotations

import base64
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakes.git_http import GitHttpServer

TOKEN = "ghp_0123456789abcdefghijklmnopqrstuvwxyzAB"
TOKEN_USER = "x-access-token"
FILES = {"train.py": "print('step')\n", "pkg/__init__.py": "", "requirements.txt": "numpy\n"}


@pytest.fixture
def git(tmp_path: Path, no_egress: None) -> Iterator[GitHttpServer]:
    with GitHttpServer(tmp_path / "served") as server:
        yield server
    assert server.internal_errors == []


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GIT_") and k not in ("HOME", "XDG_CONFIG_HOME")
    }
    return {
        **env,
        "HOME": str(home),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_TERMINAL_PROMPT": "0",
        **extra,
    }


def _run(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )


def _askpass(tmp_path: Path, token: str) -> Path:
    """The boot's helper: the user name for git's user name prompt, the token for the other."""
    (tmp_path / "git-token").write_text(token)
    helper = tmp_path / "git-askpass"
    helper.write_text(
        "#!/bin/sh\n"
        f'case "$1" in Username*) echo {TOKEN_USER} ;; *) cat {tmp_path / "git-token"} ;; esac\n'
    )
    helper.chmod(0o700)
    return helper


def _boot_fetch(tmp_path: Path, url: str, commit: str, **env: str) -> tuple[Path, str]:
    """What a VM's boot does: an empty repository, then the one pinned commit."""
    job = tmp_path / "job"
    job.mkdir(exist_ok=True)
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    assert _run("init", "-q", cwd=job, env=_env(home)).returncode == 0
    done = _run("fetch", "-q", "--depth", "1", url, commit, cwd=job, env=_env(home, **env))
    return job, done.stderr


def _tree(job: Path) -> dict[str, str]:
    return {
        str(p.relative_to(job)): p.read_text()
        for p in job.rglob("*")
        if p.is_file() and ".git" not in p.relative_to(job).parts
    }


def test_a_pinned_commit_of_a_public_repository_is_fetched_at_depth_1(
    git: GitHttpServer, tmp_path: Path
) -> None:
    url, first = git.create_repo("acme/train", FILES)
    assert url == f"{git.url}/acme/train.git" and len(first) == 40
    second = git.commit("acme/train", {**FILES, "train.py": "print('v2')\n"})
    job, err = _boot_fetch(tmp_path, url, first)
    assert err == ""
    home = _env(tmp_path / "home")
    assert _run("checkout", "-q", "FETCH_HEAD", cwd=job, env=home).returncode == 0
    assert _tree(job) == FILES
    log = _run("log", "--format=%H", cwd=job, env=home).stdout.split()
    assert log == [first]  # one commit: the history was not fetched
    clone = _run("clone", "-q", url, str(tmp_path / "clone"), cwd=tmp_path, env=home)
    assert clone.returncode == 0, clone.stderr
    head = _run("rev-parse", "HEAD", cwd=tmp_path / "clone", env=home).stdout.strip()
    assert head == second
    assert git.count("acme/train", service="git-upload-pack", status=200) >= 2
    assert git.users == []


def test_a_private_repository_is_fetched_with_the_token_from_git_askpass_only(
    git: GitHttpServer, tmp_path: Path
) -> None:
    url, commit = git.create_repo("acme/private-train", FILES, private=True, token=TOKEN)
    job, err = _boot_fetch(tmp_path, url, commit)
    assert "could not read Username" in err
    assert git.count("acme/private-train", status=401) == 1
    helper = _askpass(tmp_path, TOKEN)
    job, err = _boot_fetch(tmp_path, url, commit, GIT_ASKPASS=str(helper))
    assert err == ""
    home = _env(tmp_path / "home")
    assert _run("checkout", "-q", "FETCH_HEAD", cwd=job, env=home).returncode == 0
    assert _tree(job) == FILES
    assert set(git.users) == {TOKEN_USER}
    assert git.count("acme/private-train", service="git-upload-pack", status=200) >= 2
    # Nothing the server keeps holds the token.
    kept = repr((git.requests, git.users, git.backend_errors, git.__dict__))
    assert TOKEN not in kept


def test_a_wrong_token_or_user_name_is_refused_with_401(git: GitHttpServer, tmp_path: Path) -> None:
    url, commit = git.create_repo(
        "acme/private-train", FILES, private=True, token=TOKEN, user=TOKEN_USER
    )
    helper = _askpass(tmp_path, "ghp_wrong")
    _, err = _boot_fetch(tmp_path, url, commit, GIT_ASKPASS=str(helper))
    assert "Authentication failed" in err
    assert git.count("acme/private-train", status=200) == 0
    other = tmp_path / "other-user"
    other.write_text(f'#!/bin/sh\ncase "$1" in Username*) echo me ;; *) echo {TOKEN} ;; esac\n')
    other.chmod(0o700)
    _, err = _boot_fetch(tmp_path, url, commit, GIT_ASKPASS=str(other))
    assert "Authentication failed" in err
    assert git.users == [TOKEN_USER, "me"]
    assert git.count("acme/private-train", status=401) == 4


def test_a_push_is_refused_and_the_repository_is_unchanged(
    git: GitHttpServer, tmp_path: Path
) -> None:
    url, commit = git.create_repo("acme/train", FILES)
    home = _env(tmp_path / "home")
    (tmp_path / "home").mkdir()
    work = tmp_path / "work"
    assert _run("clone", "-q", url, str(work), cwd=tmp_path, env=home).returncode == 0
    (work / "train.py").write_text("print('pushed')\n")
    ident = ["-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    assert _run(*ident, "commit", "-qam", "push me", cwd=work, env=home).returncode == 0
    pushed = _run("push", "-q", "origin", "HEAD:main", cwd=work, env=home)
    assert pushed.returncode != 0 and "403" in pushed.stderr
    assert git.count("acme/train", service="git-receive-pack", status=403) == 1
    remote = _run("ls-remote", url, "refs/heads/main", cwd=tmp_path, env=home)
    assert remote.stdout.split()[0] == commit


def test_an_unknown_repository_is_404(git: GitHttpServer, tmp_path: Path) -> None:
    git.create_repo("acme/train", FILES)
    _, err = _boot_fetch(tmp_path, f"{git.url}/acme/nope.git", "0" * 40)
    assert "404" in err or "not found" in err
    assert git.count("acme/nope", status=404) == 1


def test_a_large_pack_and_a_chunked_request_stream_through(
    git: GitHttpServer, tmp_path: Path
) -> None:
    big = base64.b64encode(os.urandom(4_000_000)).decode()
    url, commit = git.create_repo("acme/big", {"weights.txt": big})
    # 1600 branches on their own commits: the mirror's wants outgrow git's post buffer,
    # so git sends that request chunked.
    stream = "".join(
        f"commit refs/heads/b{i}\ncommitter t <t@example.invalid> 1700000000 +0000\n"
        f"data {len(str(i))}\n{i}\nfrom {commit}\n\n"
        for i in range(1600)
    )
    bare = str(git.root / "acme/big.git")
    home = _env(tmp_path)
    imported = subprocess.run(
        ["git", "--git-dir", bare, "fast-import", "--quiet"],
        input=stream,
        env=home,
        capture_output=True,
        text=True,
    )
    assert imported.returncode == 0, imported.stderr
    mirror = tmp_path / "mirror.git"
    trace = {**home, "GIT_TRACE_CURL": "1", "GIT_TRACE_CURL_NO_DATA": "1"}
    done = _run(
        "-c",
        "http.postBuffer=70000",
        "clone",
        "-q",
        "--mirror",
        url,
        str(mirror),
        cwd=tmp_path,
        env=trace,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "=> Send header: Transfer-Encoding: chunked" in done.stderr
    refs = _run("for-each-ref", "--format=%(refname)", cwd=mirror, env=home).stdout.split()
    assert len(refs) == 1601
    shown = _run("show", f"{commit}:weights.txt", cwd=mirror, env=home)
    assert shown.stdout == big

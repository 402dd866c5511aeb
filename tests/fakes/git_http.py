"""A git smart-HTTP server for tests, over real HTTP on 127.0.0.1, served by git's own
``git http-backend`` (run as a CGI program for each request), so real ``git`` clones and
fetches from it exactly as from GitHub.

It serves the bare repositories :meth:`GitHttpServer.create_repo` made under its directory
(another is 404), read-only: a push (``git-receive-pack``) is answered 403 whoever asks, and
the repositories refuse it too (``http.receivepack`` false). A commit is fetched by its hash
as from GitHub (``uploadpack.allowReachableSHA1InWant``). A repository can be private, as on
GitHub: then every request needs HTTP Basic credentials whose password is the repository's
token (and whose user name is the one required, if one is), or it is answered 401 with
``WWW-Authenticate: Basic realm="..."``, which makes git ask its ``GIT_ASKPASS`` helper (or
fail with ``GIT_TERMINAL_PROMPT=0`` and none).

Requests are recorded (:attr:`GitHttpServer.requests`: repository, service, user name,
status) and counted; the user names sent are kept in :attr:`GitHttpServer.users`, and no
password or token ever is: the server holds a private repository's token only as its sha256.
An exception inside the server is answered 500 and kept in ``internal_errors``, for the test
to assert empty::

    with GitHttpServer(tmp_path / "git") as git:
        url, commit = git.create_repo("acme/train", {"train.py": "print(1)"},
                                      private=True, token="ghp_x", user="x-access-token")
        # git init; GIT_ASKPASS=helper GIT_TERMINAL_PROMPT=0 git fetch --depth 1 URL COMMIT
        git.count("acme/train", status=401)
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import hmac
import os
import re
import shutil
import ssl
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from io import BufferedIOBase
from pathlib import Path
from typing import IO
from urllib.parse import parse_qs, unquote, urlsplit

from fakes.http_fake import DispatchingHandler, HTTPFake

BACKEND = "/usr/lib/git-core/git-http-backend"
CHUNK = 1 << 16
_REPO_RE = re.compile(r"^/(?P<repo>[^?]+?\.git)(?P<rest>/.*)?$")
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*\Z")
# What commits are made with: no user or system configuration, a fixed identity and clock.
_GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_AUTHOR_NAME": "spottrain tests",
    "GIT_AUTHOR_EMAIL": "tests@spottrain.invalid",
    "GIT_COMMITTER_NAME": "spottrain tests",
    "GIT_COMMITTER_EMAIL": "tests@spottrain.invalid",
    "GIT_AUTHOR_DATE": "2024-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2024-01-01T00:00:00Z",
}


@dataclass(frozen=True)
class GitRequest:
    """One request: the repository (``acme/train``), the service (``git-upload-pack``,
    ``git-receive-pack``, or ``dumb`` for a plain file), the user name sent, and the status."""

    method: str
    repo: str
    service: str
    user: str | None
    status: int


@dataclass
class _Repo:
    private: bool
    token_sha: str
    user: str | None


class _Handler(DispatchingHandler, methods=("GET", "POST", "PUT", "HEAD")):
    disable_nagle_algorithm = True

    def reply(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


class _Refused(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


class GitHttpServer(HTTPFake):
    """The server; use it as a context manager (or call start() and close()).

    Args:
        root: the directory of the bare repositories (``NAME.git``); None: a temporary one,
            removed by close().
        realm: the Basic realm a 401 names.
        backend: git's ``git-http-backend`` program.
        tls: serve HTTPS with this context (a private repository's token needs it: the boot
            sends a token over https:// only).

    Attributes:
        requests: every request, oldest first.
        users: the user name of every request that sent Basic credentials, in order.
        backend_errors: what ``git http-backend`` wrote on its stderr.
        internal_errors: exceptions inside the server, for the test to assert empty.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        realm: str = "spottrain test git",
        backend: str = BACKEND,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        if not os.access(backend, os.X_OK):
            raise FileNotFoundError(f"git http-backend is not at {backend}")
        self._own_root = root is None
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="git-http-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.realm = realm
        self.backend = backend
        self.requests: list[GitRequest] = []
        self.users: list[str] = []
        self.backend_errors: list[str] = []
        self.internal_errors: list[str] = []
        self._lock = threading.Lock()
        self._repos: dict[str, _Repo] = {}
        super().__init__(_Handler, thread_name="fake-git-http", tls=tls)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def close(self) -> None:
        super().close()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    # --- repositories -------------------------------------------------------------------

    def repo_url(self, name: str) -> str:
        return f"{self.url}/{name}.git"

    def create_repo(
        self,
        name: str,
        files: dict[str, str],
        *,
        private: bool = False,
        token: str | None = None,
        user: str | None = None,
    ) -> tuple[str, str]:
        """A bare repository ``NAME.git`` whose branch ``main`` holds one commit of
        ``files`` (path -> text); returns its URL and the commit.

        Args:
            name: ``owner/repo`` (letters, digits, ``._-``, slashes between parts).
            private: every request needs Basic credentials with ``token`` as the password.
            token: the private repository's token (its sha256 is kept, not the token).
            user: the user name a private repository requires; None takes any.

        Raises:
            ValueError: a bad name, a repository that exists, or a private one with no token.
        """
        if not _NAME_RE.match(name) or ".." in name.split("/"):
            raise ValueError(f"a repository name is owner/repo, got {name!r}")
        if private and not token:
            raise ValueError("a private repository needs a token")
        bare = self.root / f"{name}.git"
        with self._lock:
            if name in self._repos or bare.exists():
                raise ValueError(f"repository {name} exists")
            self._repos[name] = _Repo(
                private, hashlib.sha256((token or "").encode()).hexdigest(), user
            )
        bare.parent.mkdir(parents=True, exist_ok=True)
        _git("init", "-q", "--bare", "--initial-branch=main", str(bare))
        for key, value in (
            ("http.receivepack", "false"),
            ("uploadpack.allowReachableSHA1InWant", "true"),
        ):
            _git("--git-dir", str(bare), "config", key, value)
        return self.repo_url(name), self.commit(name, files, message="initial commit")

    def commit(self, name: str, files: dict[str, str], *, message: str = "a commit") -> str:
        """A new commit on ``main`` of repository ``name`` whose tree is exactly ``files``;
        its hash."""
        bare = self.root / f"{name}.git"
        with tempfile.TemporaryDirectory(prefix="git-http-work-") as scratch:
            work = Path(scratch, "tree")
            for path, text in files.items():
                target = work / path
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text)
            work.mkdir(exist_ok=True)
            tree = ["--git-dir", str(bare), "--work-tree", str(work)]
            index = {"GIT_INDEX_FILE": str(Path(scratch, "index"))}
            _git(*tree, "add", "-A", env=index)
            _git(*tree, "commit", "-q", "--allow-empty", "-m", message, env=index)
        return _git("--git-dir", str(bare), "rev-parse", "refs/heads/main").strip()

    # --- inspection ---------------------------------------------------------------------

    def count(
        self, repo: str | None = None, *, service: str | None = None, status: int | None = None
    ) -> int:
        """Requests for ``repo`` of ``service`` answered ``status``; None matches any."""
        with self._lock:
            return sum(
                1
                for r in self.requests
                if repo in (None, r.repo)
                and service in (None, r.service)
                and status in (None, r.status)
            )

    # --- serving ------------------------------------------------------------------------

    def _handle(self, handler: _Handler, method: str) -> None:
        parts = urlsplit(handler.path)
        path = unquote(parts.path)
        m = _REPO_RE.match(path)
        name = m["repo"][: -len(".git")] if m else ""
        rest = (m["rest"] or "/") if m else ""
        query = parse_qs(parts.query)
        if "service" in query:
            service = query["service"][-1]
        elif rest.rsplit("/", 1)[-1] in ("git-upload-pack", "git-receive-pack"):
            service = rest.rsplit("/", 1)[-1]
        else:
            service = "dumb"
        user = _basic_user(handler.headers.get("Authorization"))
        if user is not None:
            with self._lock:
                self.users.append(user[0])

        def record(status: int) -> None:
            # Before the answer goes out: a client may act on it at once.
            with self._lock:
                self.requests.append(
                    GitRequest(method, name, service, user[0] if user else None, status)
                )

        exchange = _Exchange(handler, record)
        try:
            remote_user = self._admit(name, service, user)
            self._run_backend(exchange, method, path, parts.query, remote_user)
        except _Refused as e:
            exchange.drain()
            exchange.reply(e.status, f"{e}\n".encode(), e.headers)
        except (BrokenPipeError, ConnectionResetError):
            handler.close_connection = True
        except Exception as e:
            handler.close_connection = True
            with self._lock:
                self.internal_errors.append(f"{method} {path}: {type(e).__name__}: {e}")
            if not exchange.answered:
                exchange.reply(500, f"git http server: {type(e).__name__}: {e}\n".encode())

    def _admit(self, name: str, service: str, user: tuple[str, str] | None) -> str | None:
        """The user to name to the backend (REMOTE_USER), or a refusal."""
        with self._lock:
            repo = self._repos.get(name)
        if repo is None:
            raise _Refused(404, "Repository not found.")
        authenticated = None
        if repo.private:
            password_sha = hashlib.sha256((user[1] if user else "").encode()).hexdigest()
            good = (
                user is not None
                and hmac.compare_digest(password_sha, repo.token_sha)
                and repo.user in (None, user[0])
            )
            if not good:
                raise _Refused(
                    401,
                    "Authentication required." if user is None else "Invalid credentials.",
                    {"WWW-Authenticate": f'Basic realm="{self.realm}"'},
                )
            authenticated = user[0] if user else None
        if service == "git-receive-pack":
            raise _Refused(403, "Pushing is not allowed: this test server is read-only.")
        return authenticated

    def _run_backend(
        self, exchange: _Exchange, method: str, path: str, query: str, remote_user: str | None
    ) -> int:
        handler = exchange.handler
        headers = handler.headers
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "GIT_PROJECT_ROOT": str(self.root),
            "GIT_HTTP_EXPORT_ALL": "1",
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": os.devnull,
            "GATEWAY_INTERFACE": "CGI/1.1",
            "SERVER_PROTOCOL": "HTTP/1.1",
            "SERVER_SOFTWARE": "spottrain-git-http",
            "SERVER_NAME": "127.0.0.1",
            "SERVER_PORT": str(self.port),
            "REQUEST_METHOD": method,
            "SCRIPT_NAME": "",
            "PATH_INFO": path,
            "QUERY_STRING": query,
            "REMOTE_ADDR": handler.client_address[0],
        }
        for header, var in (
            ("Content-Type", "CONTENT_TYPE"),
            ("Content-Length", "CONTENT_LENGTH"),
            ("Content-Encoding", "HTTP_CONTENT_ENCODING"),
            ("Git-Protocol", "HTTP_GIT_PROTOCOL"),
            ("Accept", "HTTP_ACCEPT"),
            ("User-Agent", "HTTP_USER_AGENT"),
        ):
            if headers.get(header):
                env[var] = headers[header]
        if remote_user is not None:
            env["REMOTE_USER"] = remote_user
            env["AUTH_TYPE"] = "Basic"
        proc = subprocess.Popen(
            [self.backend],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        feeder = threading.Thread(target=_feed, args=(exchange.body, proc.stdin), daemon=True)
        feeder.start()
        errors = threading.Thread(target=self._collect, args=(proc.stderr,), daemon=True)
        errors.start()
        try:
            return exchange.relay(proc.stdout)
        finally:
            proc.stdout.close()
            feeder.join(timeout=30)
            errors.join(timeout=30)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if feeder.is_alive():
                handler.close_connection = True
            else:
                exchange.drain()  # what the backend did not read, to keep the framing

    def _collect(self, stderr: IO[bytes]) -> None:
        text = stderr.read().decode("utf-8", "replace").strip()
        stderr.close()
        if text:
            with self._lock:
                self.backend_errors.append(text)


def _basic_user(authorization: str | None) -> tuple[str, str] | None:
    """The (user, password) of Basic credentials, or None."""
    scheme, _, encoded = (authorization or "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user, _, password = base64.b64decode(encoded.strip()).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return user, password


class _Exchange:
    """One request's state: its body (read once, in pieces) and whether it was answered. The
    handler serves every request of one connection, so this cannot live on it."""

    def __init__(self, handler: _Handler, record: Callable[[int], None]) -> None:
        self.handler = handler
        self.record = record
        self.answered = False
        self.body = self._read_body()

    def drain(self) -> None:
        for _ in self.body:
            pass

    def reply(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.answered = True
        self.record(status)
        self.handler.reply(status, body, headers)

    def _read_body(self) -> Iterator[bytes]:
        rfile = self.handler.rfile
        headers = self.handler.headers
        if "chunked" in (headers.get("Transfer-Encoding") or "").lower():
            while True:
                size = int(rfile.readline(65537).split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return
                yield from _read(rfile, size)
                rfile.readline(3)
        yield from _read(rfile, int(headers.get("Content-Length") or 0))

    def relay(self, stdout: IO[bytes]) -> int:
        """Answer with the CGI program's output: its headers (``Status:`` the status), then
        its body, chunked unless it gave a length."""
        status, reason = 200, "OK"
        out_headers: list[tuple[str, str]] = []
        while True:
            line = stdout.readline(65537).decode("latin-1").rstrip("\r\n")
            if not line:
                break
            key, _, value = line.partition(":")
            if key.lower() == "status":
                code, _, reason = value.strip().partition(" ")
                status = int(code)
            else:
                out_headers.append((key.strip(), value.strip()))
        h = self.handler
        self.answered = True
        self.record(status)
        h.send_response(status, reason or None)
        sized = False
        for key, value in out_headers:
            if key.lower() in ("connection", "transfer-encoding"):
                continue
            sized = sized or key.lower() == "content-length"
            h.send_header(key, value)
        if not sized:
            h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        if h.command == "HEAD":
            return status
        while True:
            piece = stdout.read1(CHUNK)  # type: ignore[attr-defined]
            if not piece:
                break
            h.wfile.write(piece if sized else b"%x\r\n%b\r\n" % (len(piece), piece))
        if not sized:
            h.wfile.write(b"0\r\n\r\n")
        return status


def _read(rfile: BufferedIOBase, n: int) -> Iterator[bytes]:
    while n > 0:
        piece = rfile.read(min(n, CHUNK))
        if not piece:
            raise ConnectionResetError("the client hung up mid-body")
        n -= len(piece)
        yield piece


def _feed(body: Iterator[bytes], stdin: IO[bytes]) -> None:
    try:
        for piece in body:
            stdin.write(piece)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the backend stopped reading; its answer says why
    finally:
        with contextlib.suppress(BrokenPipeError):
            stdin.close()


def _git(*args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        ["git", *args],
        env={**os.environ, **_GIT_ENV, **(env or {})},
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout

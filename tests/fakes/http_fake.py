"""What the HTTP fakes share: a quiet threaded server on a free port of 127.0.0.1, a request
handler that passes each request to the fake, and the fake's start/close lifecycle.

Each fake keeps its own reply helper: their framing differs on purpose (the metadata and
Compute Engine fakes close the connection after every answer, the GCS fake keeps it alive).
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Self


class QuietHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    # The default joins every handler thread on close, hung ones included.
    block_on_close = False
    fake: Any

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that timed out and hung up makes the late answer fail; that is expected.
        pass


class DispatchingHandler(BaseHTTPRequestHandler):
    """Passes each request to ``server.fake._handle(handler, method)``.

    A subclass names the methods its fake serves::

        class _Handler(DispatchingHandler, methods=("GET", "PUT")): ...

    Only those get a ``do_`` method, so BaseHTTPRequestHandler itself answers any other with
    501, without the fake counting or seeing it.
    """

    server: QuietHTTPServer
    protocol_version = "HTTP/1.1"

    def __init_subclass__(cls, *, methods: Iterable[str] = (), **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for method in methods:
            setattr(cls, f"do_{method}", _dispatcher(method))

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _dispatcher(method: str) -> Callable[[DispatchingHandler], None]:
    def dispatch(self: DispatchingHandler) -> None:
        self.server.fake._handle(self, method)

    dispatch.__name__ = f"do_{method}"
    return dispatch


class HTTPFake:
    """A fake served over HTTP; use it as a context manager (or call start() and close()).

    The port is bound on construction, so a test can read ``port`` before start().
    """

    def __init__(
        self,
        handler: type[DispatchingHandler],
        *,
        thread_name: str,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._server = QuietHTTPServer(("127.0.0.1", 0), handler)
        self._server.fake = self
        self.tls = tls is not None
        if tls is not None:
            # The handshake happens on each connection's first read, in its handler thread,
            # so a client that never speaks cannot stall the accept loop.
            self._server.socket = tls.wrap_socket(
                self._server.socket, server_side=True, do_handshake_on_connect=False
            )
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=thread_name,
            daemon=True,
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> Self:
        self._thread.start()
        return self

    def close(self) -> None:
        # shutdown() waits for serve_forever to return, forever if it never started.
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

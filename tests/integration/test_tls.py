"""The rendezvous over TLS (rediss://) against a real TLS-enabled redis-server."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousParameters,
)

from spottrain.agent.rendezvous.handler import create_handler
from spottrain.embedded_redis import find_redis_server, free_port


def make_certs(d: Path) -> None:
    def run(*args: str) -> None:
        subprocess.run(args, cwd=d, check=True, capture_output=True)

    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        "-subj", "/CN=spottrain-test-ca", "-keyout", "ca.key", "-out", "ca.pem")  # fmt: skip
    run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
        "-keyout", "server.key", "-out", "server.csr")  # fmt: skip
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    run("openssl", "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "1", "-extfile", "ext.cnf", "-out", "server.pem")  # fmt: skip


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    make_certs(tmp_path)
    port = free_port()
    # fmt: off
    args = [
        find_redis_server(),
        "--port", "0",
        "--tls-port", str(port),
        "--tls-cert-file", str(tmp_path / "server.pem"),
        "--tls-key-file", str(tmp_path / "server.key"),
        "--tls-ca-cert-file", str(tmp_path / "ca.pem"),
        "--tls-auth-clients", "no",
        "--bind", "127.0.0.1",
        "--dir", str(tmp_path),
        "--save", "",
    ]
    # fmt: on
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    client = redis.Redis(
        host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(tmp_path / "ca.pem")
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.RedisError:
                if proc.poll() is not None:
                    pytest.skip("this redis-server was built without TLS")
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield port, tmp_path / "ca.pem"
    finally:
        client.close()
        proc.kill()
        proc.wait()


def params(endpoint: str, **conf: object) -> RendezvousParameters:
    return RendezvousParameters(
        backend="redis",
        endpoint=endpoint,
        run_id="tls-1",
        min_nodes=1,
        max_nodes=1,
        local_addr="127.0.0.1",
        socket_timeout=2,
        **conf,
    )


def test_rendezvous_completes_over_tls_with_the_servers_ca(tls_redis: tuple[int, Path]) -> None:
    port, ca = tls_redis
    handler = create_handler(params(f"rediss://127.0.0.1:{port}", tls_ca_file=str(ca)))
    try:
        info = handler.next_rendezvous()
        assert info.world_size == 1
        assert handler.num_nodes_waiting() == 0
    finally:
        handler.shutdown()


def test_tls_can_be_asked_for_in_the_conf_instead_of_the_url(tls_redis: tuple[int, Path]) -> None:
    port, ca = tls_redis
    handler = create_handler(params(f"127.0.0.1:{port}", tls="true", tls_ca_file=str(ca)))
    try:
        assert handler.next_rendezvous().world_size == 1
    finally:
        handler.shutdown()


def test_an_untrusted_server_certificate_is_a_one_line_connection_error(
    tls_redis: tuple[int, Path],
) -> None:
    port, _ = tls_redis
    with pytest.raises(RendezvousConnectionError) as info:
        create_handler(params(f"rediss://127.0.0.1:{port}"))
    assert "\n" not in str(info.value)
    assert "certificate" in str(info.value).lower() or "ssl" in str(info.value).lower()


def test_plain_redis_to_a_tls_port_fails_with_a_clear_error(tls_redis: tuple[int, Path]) -> None:
    port, _ = tls_redis
    with pytest.raises(RendezvousConnectionError) as info:
        create_handler(params(f"redis://127.0.0.1:{port}"))
    assert "\n" not in str(info.value)

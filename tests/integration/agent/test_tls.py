"""The rendezvous over TLS (rediss://) against a real TLS-enabled redis-server."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousParameters,
)

from spottrain.agent.rendezvous.handler import create_handler
from spottrain.controller.run.embedded_redis import find_redis_server
from spottrain.ports import free_port
from spottrain.redis_conn import (
    RedisAuthError,
    RedisSettings,
    RedisUnavailableError,
    connect,
    ping,
)

PASSWORD = "tls-and-auth-Secret"
ACL_USER = "trainer"
ACL_PASSWORD = "acl-user-Secret"
ACL_CONFIG = f"user {ACL_USER} on >{ACL_PASSWORD} ~* &* +@all\nuser default off\n"


def make_certs(d: Path, san: str = "IP:127.0.0.1") -> None:
    """A CA and a server certificate it signs, naming ``san`` (an openssl subjectAltName)."""

    def run(*args: str) -> None:
        subprocess.run(args, cwd=d, check=True, capture_output=True)

    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        "-subj", "/CN=spottrain-test-ca", "-keyout", "ca.key", "-out", "ca.pem")  # fmt: skip
    run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=spottrain-test-server",
        "-keyout", "server.key", "-out", "server.csr")  # fmt: skip
    (d / "ext.cnf").write_text(f"subjectAltName={san}\n")
    run("openssl", "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "1", "-extfile", "ext.cnf", "-out", "server.pem")  # fmt: skip


@contextmanager
def run_tls_redis(
    d: Path,
    config: str = "",
    *,
    san: str = "IP:127.0.0.1",
    auth: dict[str, Any] | None = None,
) -> Iterator[int]:
    """A TLS-only redis-server on 127.0.0.1 whose certificate names ``san``; yields its port.

    ``config`` holds extra config lines (in a file: passwords stay off the command line);
    ``auth`` holds the username/password the readiness probe needs when they turn auth on.
    """
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    make_certs(d, san)
    port = free_port()
    (d / "extra.conf").write_text(config)
    # fmt: off
    args = [
        find_redis_server(),
        str(d / "extra.conf"),
        "--port", "0",
        "--tls-port", str(port),
        "--tls-cert-file", str(d / "server.pem"),
        "--tls-key-file", str(d / "server.key"),
        "--tls-ca-cert-file", str(d / "ca.pem"),
        "--tls-auth-clients", "no",
        "--bind", "127.0.0.1",
        "--dir", str(d),
        "--save", "",
    ]
    # fmt: on
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    # The probe checks only the CA: some servers here deliberately name another host.
    client = redis.Redis(
        host="127.0.0.1",
        port=port,
        ssl=True,
        ssl_ca_certs=str(d / "ca.pem"),
        ssl_check_hostname=False,
        **(auth or {}),
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
        yield port
    finally:
        client.close()
        proc.kill()
        proc.wait()


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    with run_tls_redis(tmp_path) as port:
        yield port, tmp_path / "ca.pem"


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


def tls_settings(port: int, ca: Path, host: str = "127.0.0.1", **kw: Any) -> RedisSettings:
    return RedisSettings(host=host, port=port, tls=True, tls_ca_file=str(ca), **kw)


def test_a_certificate_for_another_host_is_refused_even_from_a_trusted_ca(
    tmp_path: Path,
) -> None:
    with run_tls_redis(tmp_path, san="DNS:redis.elsewhere.example") as port:
        settings = tls_settings(port, tmp_path / "ca.pem")
        client = connect(settings, retries=0)
        try:
            with pytest.raises(RedisUnavailableError) as info:
                ping(client, settings)
        finally:
            client.close()
    message = str(info.value)
    assert "\n" not in message
    assert "TLS certificate we do not trust" in message
    assert "name '127.0.0.1'" in message


def test_the_rendezvous_refuses_a_certificate_for_another_host(tmp_path: Path) -> None:
    with (
        run_tls_redis(tmp_path, san="DNS:redis.elsewhere.example") as port,
        pytest.raises(RendezvousConnectionError, match="TLS certificate we do not trust"),
    ):
        create_handler(params(f"rediss://127.0.0.1:{port}", tls_ca_file=str(tmp_path / "ca.pem")))


def test_a_certificate_is_accepted_by_the_dns_name_it_gives(tmp_path: Path) -> None:
    with run_tls_redis(tmp_path, san="DNS:localhost") as port:
        by_name = tls_settings(port, tmp_path / "ca.pem", host="localhost")
        by_ip = tls_settings(port, tmp_path / "ca.pem")
        good, bad = connect(by_name, retries=0), connect(by_ip, retries=0)
        try:
            ping(good, by_name)
            with pytest.raises(RedisUnavailableError, match="do not trust"):
                ping(bad, by_ip)
        finally:
            good.close()
            bad.close()


def test_tls_and_a_password_together(tmp_path: Path) -> None:
    with run_tls_redis(tmp_path, f"requirepass {PASSWORD}\n", auth={"password": PASSWORD}) as port:
        ca = tmp_path / "ca.pem"
        for settings, error in [
            (tls_settings(port, ca, password=PASSWORD), None),
            (tls_settings(port, ca, password="wrong"), "refused the password"),
            (tls_settings(port, ca), "requires a password"),
        ]:
            client = connect(settings, retries=0)
            try:
                if error is None:
                    ping(client, settings)
                    client.set("k", "v")
                    assert client.get("k") == b"v"
                else:
                    with pytest.raises(RedisAuthError, match=error) as info:
                        ping(client, settings)
                    assert PASSWORD not in str(info.value)
            finally:
                client.close()


def test_tls_with_an_acl_user(tmp_path: Path) -> None:
    auth = {"username": ACL_USER, "password": ACL_PASSWORD}
    with run_tls_redis(tmp_path, ACL_CONFIG, auth=auth) as port:
        ca = tmp_path / "ca.pem"
        user = tls_settings(port, ca, username=ACL_USER, password=ACL_PASSWORD)
        client = connect(user, retries=0)
        try:
            ping(client, user)
            assert client.acl_whoami() == ACL_USER
        finally:
            client.close()
        for wrong in (
            tls_settings(port, ca, username=ACL_USER, password="wrong"),
            tls_settings(port, ca, password=ACL_PASSWORD),  # the default user is off
        ):
            client = connect(wrong, retries=0)
            try:
                with pytest.raises(RedisAuthError):
                    ping(client, wrong)
            finally:
                client.close()


def test_the_rendezvous_completes_over_tls_as_an_acl_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    auth = {"username": ACL_USER, "password": ACL_PASSWORD}
    monkeypatch.setenv("SPOTTRAIN_TEST_ACL_PASSWORD", ACL_PASSWORD)
    with run_tls_redis(tmp_path, ACL_CONFIG, auth=auth) as port:
        handler = create_handler(
            params(
                f"rediss://127.0.0.1:{port}",
                tls_ca_file=str(tmp_path / "ca.pem"),
                username=ACL_USER,
                password_env="SPOTTRAIN_TEST_ACL_PASSWORD",
            )
        )
        try:
            assert handler.next_rendezvous().world_size == 1
        finally:
            handler.shutdown()

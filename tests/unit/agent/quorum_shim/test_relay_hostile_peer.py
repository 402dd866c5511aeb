"""The relay's wire against a lying or broken peer, over real sockets on 127.0.0.1: a relay
that trickles its hello, a replica id that fits the id limit but not a frame, numbers a
member chose (digits of other scripts, a timeout too large for a float, a negative one), and
connections left idle or opened past a cap."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
import redis
from test_relay import CONFIG, FakeDirect

from spottrain.agent.quorum_shim import relay as r
from spottrain.agent.quorum_shim import wire
from spottrain.agent.quorum_shim.member import RelayedQuorum
from spottrain.ports import free_port
from spottrain.protocol.keys import RunKeys
from spottrain.quorum import scripts
from spottrain.quorum.model import Answer, BatchItem


def _answer(rid: str) -> Answer:
    """What the fake quorum answers ``rid`` (its direct request gives the same answer)."""
    return FakeDirect().request(rid, 0)


@pytest.fixture
def trickling_relay() -> Iterator[int]:
    """A relay that reads the member's hello, then answers with a frame one byte every
    20 ms, never finishing it (until the test ends)."""
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(64)
            for byte in b"\x00\x01\x00\x00" + b"x" * 65536:
                if done.wait(0.02):
                    return
                conn.sendall(bytes([byte]))

    threading.Thread(target=serve, daemon=True).start()
    yield listener.getsockname()[1]
    done.set()
    listener.close()


def test_a_relay_that_trickles_its_hello_is_given_up_at_the_hop_deadline(
    trickling_relay: int,
) -> None:
    # One deadline for the whole hello, not one per recv: a byte every 20 ms would keep a
    # per-recv timeout of 0.3 s from ever firing, with the VM's connection lock held.
    outcome: list[BaseException | wire.RelayClient] = []

    def connect() -> None:
        try:
            outcome.append(wire.RelayClient(f"127.0.0.1:{trickling_relay}", 0.3))
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(20)  # far past 0.3 s: only a client with no whole deadline is still in there
    assert not thread.is_alive(), "the member is still inside RelayClient() after 20 s"
    assert len(outcome) == 1 and isinstance(outcome[0], TimeoutError)
    assert "hello" in str(outcome[0])


@pytest.fixture
def relay() -> Iterator[tuple[wire.RelayServer, str, FakeDirect]]:
    fake = FakeDirect()
    batcher = r.Batcher(fake, "0-r", gather_s=0.0)
    address = f"127.0.0.1:{free_port()}"
    server = wire.RelayServer(address, batcher.submit).start()
    yield server, address, fake
    server.stop()
    batcher.stop()


def test_an_id_over_the_byte_limit_never_reaches_a_shared_connection(
    relay: tuple[wire.RelayServer, str, FakeDirect],
    redis_client: redis.Redis,
    run_keys: RunKeys,
) -> None:
    server, address, fake = relay
    cjk = "界" * 400  # 400 characters (under 512), 1,200 bytes
    refused = []
    for check in (
        lambda: scripts.check_replica_id(cjk),
        lambda: r.encode_request(BatchItem(cjk, 4), 5),
    ):
        try:
            check()
        except ValueError as exc:
            refused.append(str(exc))
    assert len(refused) == 2 and all("512 bytes" in m for m in refused), refused
    client = wire.RelayClient(address, 5)
    try:
        assert scripts.check_replica_id("界" * 170 + "ab")  # exactly 512 bytes
        widest = "m" + "1" * 511  # the widest id, with the widest numbers, fits one frame
        item = BatchItem(widest, -(2**53 - 1), held_qid=2**52, commit_failures=2**53 - 1)
        assert client.ask(item, 3600) == _answer(widest)
        with pytest.raises(ValueError, match="512 bytes"):
            client.ask(BatchItem(cjk, 4), 5)
        assert not client.closed and server.bad_frames == 0  # its co-located replicas' too
        assert client.ask(BatchItem("m1", 4), 5) == _answer("m1")
    finally:
        client.close()
    # The shim refuses it before choosing a relay: neither relayed nor asked directly.
    lease = r.Lease(redis_client, r.lease_key(run_keys, 0), address, 1800)
    member = RelayedQuorum(fake, lease, CONFIG, bind=f"127.0.0.1:{free_port()}")
    try:
        with pytest.raises(ValueError, match="512 bytes"):
            member.request(cjk, 4, timeout=5)
        assert (member.fallbacks, member.relayed, fake.direct) == (0, 0, [])
    finally:
        member.stop()


def _outcome(body: bytes) -> str:
    try:
        r.decode_request(body)
    except ValueError:
        return "refused"
    except Exception as exc:
        return type(exc).__name__
    return "accepted"


def test_a_request_with_numbers_outside_the_protocol_is_refused() -> None:
    ok = r.encode_request(BatchItem("m1", 4, 3, 1, True), 2.5)
    assert r.decode_request(ok) == (BatchItem("m1", 4, 3, 1, True), 2.5)
    bad = {
        "arabic-indic step": "m1 \u0663 0 0 0 500",
        "fullwidth timeout": "m1 4 0 0 0 \uff15\uff10\uff10",
        "timeout too large for a float": "m1 4 0 0 0 " + "9" * 400,
        "negative timeout": "m1 4 0 0 0 -500",
        "zero timeout": "m1 4 0 0 0 0",
        "timeout over an hour": "m1 4 0 0 0 3600001",
        "step past 2**53": f"m1 {2**63} 0 0 0 500",
        "held id past 2**52": f"m1 4 {2**63} 0 0 500",
        "negative held id": "m1 4 -1 0 0 500",
        "negative commit failures": "m1 4 0 -1 0 500",
        "shrink neither 0 nor 1": "m1 4 0 0 2 500",
        "plus sign": "m1 +4 0 0 0 500",
    }
    got = {name: _outcome(body.encode()) for name, body in bad.items()}
    assert got == dict.fromkeys(bad, "refused")


def test_a_timeout_too_large_for_a_float_closes_only_its_connection(
    relay: tuple[wire.RelayServer, str, FakeDirect],
) -> None:
    server, address, _ = relay
    host, port = wire.parse_bind(address)
    hello = wire.frame(wire.HELLO)
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(hello + wire.message(1, wire.REQUEST, b"m1 4 0 0 0 " + b"9" * 400))
        got = b""
        while chunk := s.recv(4096):
            got += chunk
    assert got == hello and server.bad_frames == 1  # counted and logged, not a crash
    client = wire.RelayClient(address, 5)
    try:
        assert client.ask(BatchItem("m1", 4), 5) == _answer("m1")
    finally:
        client.close()


def _hello(address: str) -> socket.socket:
    """A raw member connection that said hello and read the relay's."""
    s = socket.create_connection(wire.parse_bind(address), timeout=10)
    s.sendall(wire.frame(wire.HELLO))
    assert s.recv(64) == wire.frame(wire.HELLO)
    return s


def _closed_by_relay(s: socket.socket) -> bool:
    try:
        return s.recv(64) == b""
    except ConnectionResetError:  # closed with our bytes unread
        return True
    except TimeoutError:
        return False


def test_an_idle_connection_is_closed_and_its_member_reconnects() -> None:
    fake = FakeDirect()
    batcher = r.Batcher(fake, "0-r", gather_s=0.0)
    address = f"127.0.0.1:{free_port()}"
    server = wire.RelayServer(address, batcher.submit, idle_timeout_s=0.2).start()
    try:
        idle = _hello(address)
        assert _closed_by_relay(idle)  # within its 10 s socket timeout, not held forever
        client = wire.RelayClient(address, 5)
        assert client.ask(BatchItem("m1", 4), 5) == _answer("m1")
        # The member drops its own idle connection first (RelayedQuorum: after half the
        # relay's timeout), so its next ask never meets the relay's close.
        assert client.idle(0.0) and not client.idle(3600.0)
        client.close()
    finally:
        server.stop()
        batcher.stop()


def test_past_the_cap_the_oldest_idle_connection_goes_or_the_new_one_is_refused() -> None:
    fake = FakeDirect()
    batcher = r.Batcher(fake, "0-r", gather_s=0.0)
    address = f"127.0.0.1:{free_port()}"
    server = wire.RelayServer(address, batcher.submit, max_connections=1).start()
    idle = _hello(address)
    busy = wire.RelayClient(address, 5)  # the idle one makes room for it
    try:
        assert _closed_by_relay(idle)
        fake.hold.clear()  # busy's request stays in flight
        answers: list[Answer] = []
        asked = threading.Thread(
            target=lambda: answers.append(busy.ask(BatchItem("m2", 4), 10)), daemon=True
        )
        asked.start()
        assert fake.in_flight.wait(10)
        with socket.create_connection(wire.parse_bind(address), timeout=10) as refused:
            refused.sendall(wire.frame(wire.HELLO))
            assert _closed_by_relay(refused)  # no hello back: nobody idle to close
        fake.hold.set()
        asked.join(10)
        assert answers == [_answer("m2")] and not busy.closed
    finally:
        fake.hold.set()
        busy.close()
        idle.close()
        server.stop()
        batcher.stop()

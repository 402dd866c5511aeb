"""The relay's wire (framed requests over plain TCP): answers matched by request id on one
connection, and garbage (an oversize length, a bad hello, a truncated frame, a bad kind or
request) closes that connection only: the relay keeps serving the others, and a member
whose relay sends garbage asks the quorum directly."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable
from concurrent.futures import Future

import pytest
import redis
from test_relay import CONFIG, FakeDirect, _answer, not_formed_for, refused_for

from spottrain.agent.quorum_shim import relay as r
from spottrain.agent.quorum_shim import wire
from spottrain.agent.quorum_shim.member import RelayedQuorum
from spottrain.ports import free_port
from spottrain.protocol.keys import RunKeys
from spottrain.quorum import errors
from spottrain.quorum.errors import QuorumError, QuorumGone, QuorumNotReplicated
from spottrain.quorum.model import Answer, BatchItem


def _raw(port: int, *chunks: bytes) -> bytes:
    """What the relay sends back to a raw connection that sent ``chunks`` (then EOF)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        for c in chunks:
            s.sendall(c)
        s.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    return got


def _fake_relay(reply: Callable[[socket.socket], None]) -> int:
    """A listener that runs ``reply`` on each connection after reading the hello frame."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        with listener:
            while True:
                conn, _ = listener.accept()
                with conn:
                    conn.recv(64)
                    reply(conn)

    threading.Thread(target=serve, daemon=True).start()
    return port


def test_one_connection_carries_many_requests_and_garbage_closes_only_its_own() -> None:
    fake = FakeDirect()
    fake.gone.add("m9")
    batcher = r.Batcher(fake, "0-r", gather_s=0.0)
    port = free_port()
    server = wire.RelayServer(f"127.0.0.1:{port}", batcher.submit).start()
    client = wire.RelayClient(f"127.0.0.1:{port}", 5)
    try:
        got: dict[str, object] = {}
        threads = [
            threading.Thread(target=lambda j=j: got.update({j: client.ask(BatchItem(j, 4), 5)}))
            for j in ("m1", "m2", "m3", "m4")
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert got == {j: _answer(j) for j in ("m1", "m2", "m3", "m4")}
        with pytest.raises(QuorumGone):
            client.ask(BatchItem("m9", 4), 5)

        hello, huge = wire.frame(wire.HELLO), struct.pack(">I", 2**31)
        request = wire.message(1, wire.REQUEST, r.encode_request(BatchItem("m5", 4), 5))
        garbage = [
            (hello + huge, True),  # an oversize length: nothing allocated, closed
            (hello + struct.pack(">I", 0), True),  # an empty frame
            (wire.frame(b"STQR\x07"), True),  # another version's hello
            (hello + wire.message(1, ord("A"), b"x"), True),  # a member never sends answers
            (hello + wire.message(1, wire.REQUEST, b"not a request"), True),
            (hello + request[:9], False),  # a truncated frame: EOF mid-frame
        ]
        for n, (chunks, bad) in enumerate(garbage):
            before = server.bad_frames
            # The relay answers the hello with its own, then closes (and answers nothing).
            assert _raw(port, chunks) == hello, n
            assert server.bad_frames == before + bad, n
            assert client.ask(BatchItem("m1", 5), 5) == _answer("m1")  # others still served
        assert not client.closed
    finally:
        client.close()
        server.stop()
        batcher.stop()
    with pytest.raises(QuorumError, match="connection to the quorum relay"):
        client.ask(BatchItem("m1", 6), 5)


def test_a_member_falls_back_when_its_relay_speaks_garbage(
    redis_client: redis.Redis, run_keys: RunKeys
) -> None:
    other_version = _fake_relay(lambda c: c.sendall(wire.frame(b"STQR\x09")))
    with pytest.raises(QuorumError, match="must run the same spottrain"):
        wire.RelayClient(f"127.0.0.1:{other_version}", 5)
    huge = _fake_relay(
        lambda c: (c.sendall(wire.frame(wire.HELLO)), c.recv(256), c.sendall(b"\xff" * 8))
    )
    cut = _fake_relay(
        lambda c: (
            c.sendall(wire.frame(wire.HELLO)),
            c.recv(256),
            c.sendall(b"\x00\x00\x00\x30abc"),
        )
    )
    fake = FakeDirect()
    port = free_port()
    lease = r.Lease(redis_client, r.lease_key(run_keys, 0), f"127.0.0.1:{port}", 1800)
    member = RelayedQuorum(fake, lease, CONFIG, bind=f"127.0.0.1:{port}")
    try:
        for n, relay_port in enumerate((other_version, huge, cut), start=1):
            redis_client.set(lease.key, f"127.0.0.1:{relay_port}", px=1800)
            member._holder, member._avoid, member._next_read = None, None, 0.0
            assert member.relay() == f"127.0.0.1:{relay_port}"
            assert member.request("m1", 40 + n, timeout=5) == _answer("m1")
            assert (member.fallbacks, member.relayed, fake.direct) == (n, 0, ["m1"] * n)
            assert member._avoid is not None and member._avoid[0] == f"127.0.0.1:{relay_port}"
    finally:
        member.stop()


def test_a_redis_refusal_crosses_the_wire_as_its_own_kind() -> None:
    # R, not E: the member learns Redis refused (and why), the connection stays up.
    fake = FakeDirect()
    batcher = r.Batcher(fake, "0-r", gather_s=0.0)
    port = free_port()
    server = wire.RelayServer(f"127.0.0.1:{port}", batcher.submit).start()
    client = wire.RelayClient(f"127.0.0.1:{port}", 5)
    try:
        fake.refusals = 1
        with pytest.raises(errors.QuorumRedisRefused) as err:
            client.ask(BatchItem("m1", 4), 5)
        assert type(err.value) is errors.QuorumRedisRefused and err.value.cause == "OOM"
        assert str(err.value) == str(refused_for("m1"))
        unacked = errors.unacknowledged("quorum 7 for relay batch 0-r.0:ab", 0, 1, 0)
        frame = wire.RelayServer._answer_frame(9, _failed(unacked.for_replica("m2")))
        request_id, kind, payload = wire.split_message(frame[4:])
        assert (request_id, kind) == (9, wire.REFUSED)
        assert payload.decode().startswith("WAIT replica m2: quorum 7 for relay batch")
        assert not client.closed and server.bad_frames == 0
        assert client.ask(BatchItem("m1", 5), 5) == _answer("m1")  # the same connection
    finally:
        client.close()
        server.stop()
        batcher.stop()


def _failed(exc: BaseException) -> Future[Answer]:
    future: Future[Answer] = Future()
    future.set_exception(exc)
    return future


def test_a_member_reads_a_refusal_frame_back_as_the_relay_raised_it() -> None:
    unacked = errors.unacknowledged("quorum 7", 0, 1, 0).for_replica("m2")
    future: Future[Answer] = Future()
    body = wire.RelayServer._answer_frame(1, _failed(unacked))[4 + 5 :]
    wire.RelayClient._resolve(future, wire.REFUSED, body)
    with pytest.raises(QuorumNotReplicated) as err:
        future.result(0)
    assert err.value.cause == "WAIT" and str(err.value) == str(unacked)


def test_a_round_not_formed_crosses_the_wire_as_its_own_kind() -> None:
    # T, not E: the member learns the round did not form (the replicas', not the relay's
    # failure), and the connection stays up. A member that predates T takes it for an E
    # (its old fallback, as for R): a kind none of the old ones is, no new version.
    assert wire.NOT_FORMED not in b"QAGER" and wire.HELLO == b"STQR\x01"
    fake = FakeDirect()
    batcher = r.Batcher(fake, "0-r", gather_s=0.0)
    port = free_port()
    server = wire.RelayServer(f"127.0.0.1:{port}", batcher.submit).start()
    client = wire.RelayClient(f"127.0.0.1:{port}", 5)
    try:
        fake.not_formed = 1
        with pytest.raises(errors.QuorumNotFormed) as err:
            client.ask(BatchItem("m1", 4), 5)
        assert str(err.value) == str(not_formed_for("m1"))
        assert not client.closed and server.bad_frames == 0
        assert client.ask(BatchItem("m1", 5), 5) == _answer("m1")  # the same connection
        # Redis unreachable from the relay stays the relay's failure: the member asks directly.
        frame = wire.RelayServer._answer_frame(3, _failed(errors.QuorumTimeout("unreachable")))
        assert wire.split_message(frame[4:])[1] == wire.ERROR
    finally:
        client.close()
        server.stop()
        batcher.stop()

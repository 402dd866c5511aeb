"""A heartbeat timeout long enough that the client's BLPOP slice would outlast its
connection's socket timeout (the auto timeout at 100,000 replicas is 40 s: a 10-12 s slice,
and RedisSettings' socket timeout is 5 s): the slice is cut below the socket timeout, so a
request waiting on a round that does not form never loses its connection (redis-py does not
lengthen the socket's timeout for a blocking command) and ends as a round not formed."""

from __future__ import annotations

import pytest

from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys
from spottrain.quorum.client import QuorumClient
from spottrain.quorum.errors import QuorumNotFormed
from spottrain.quorum.model import Member, QuorumConfig
from spottrain.redis_conn import RedisSettings, connect

# A 10 s slice against a 1 s socket timeout; min_replicas 2 with one replica asking: no round.
CONFIG = QuorumConfig(heartbeat_timeout_ms=40_000, join_timeout_ms=150, min_replicas=2)


def test_a_slice_longer_than_the_socket_timeout_never_loses_the_connection() -> None:
    with RedisServer() as server:
        watch = server.client()
        settings = RedisSettings(host="127.0.0.1", port=server.port, socket_timeout=1.0)
        client = QuorumClient(connect(settings), RunKeys("socket-timeout-test"), CONFIG)
        client.join(Member("a"))
        connections = int(watch.info("stats")["total_connections_received"])
        with pytest.raises(QuorumNotFormed) as err:
            client.request("a", 0, timeout=3.0)
        assert str(err.value).startswith("no quorum formed for replica a in time")
        # Every BLPOP ended as Redis's timeout, on the connection the join opened.
        assert int(watch.info("stats")["total_connections_received"]) == connections

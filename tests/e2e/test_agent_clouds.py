"""End to end with each cloud's notice source: agents watching a fake AWS IMDSv2 or GCP
metadata server over HTTP (one per node, as each VM has its own), and a spot notice served
to one of them mid-training. The notice is seen by the real watcher, drains the node, and
no step is lost."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fakes.metadata_server import MetadataServer

from spottrain.agent.notices.gce_metadata import GCP_PREEMPTED_PATH
from spottrain.controller.run.embedded_redis import RedisServer
from spottrain.protocol.keys import RunKeys

from .agent_job import (
    RECOVER_TIMEOUT,
    START_TIMEOUT,
    assert_no_progress_lost,
    emergency_commit,
    events,
    make_job,
    wait_drained,
)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_a_cloud_notice_drains_the_node_and_loses_no_progress(
    cloud: str, redis_server: RedisServer, tmp_path: Path
) -> None:
    job = make_job(redis_server, tmp_path)
    client = redis_server.client()
    fakes = {n: MetadataServer().start() for n in ("a", "b")}
    try:
        for n, fake in fakes.items():
            endpoint = fake.url if cloud == "aws" else fake.host
            job.agent_args = [f"--cloud={cloud}", f"--metadata-endpoint={endpoint}"]
            job.agent_args.append("--poll-interval=0.5")
            job.start_node(n)
        job.wait_for_world(2, START_TIMEOUT, steps=3)
        noticed = time.time()
        if cloud == "aws":
            when = datetime.now(UTC) + timedelta(seconds=90)
            fakes["b"].set_spot_action("terminate", when.strftime("%Y-%m-%dT%H:%M:%SZ"))
        else:
            fakes["b"].set_gcp(GCP_PREEMPTED_PATH, "TRUE")
        job.wait_for_world(1, RECOVER_TIMEOUT, since=noticed, steps=3)
        wait_drained(job, "b")
        last = emergency_commit(client, job.run_id)
        assert last["kind"] == "emergency" and last["drain"] == "1", last
        assert_no_progress_lost(job, noticed, int(last["step"]))
        seen = [e for e in events(client, job.run_id, "b") if e["type"] == "notice"]
        assert seen and seen[0]["source"] == (
            "aws-imds:spot" if cloud == "aws" else "gcp:preempted"
        )
        assert not [e for e in events(client, job.run_id, "a") if e["type"] == "notice"]
        assert client.hget(RunKeys(job.run_id).node("a"), "cloud") == cloud.encode()
    finally:
        job.close(client)
        for fake in fakes.values():
            fake.close()

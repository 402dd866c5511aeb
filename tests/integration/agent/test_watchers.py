"""The preemption-notice watchers against a real HTTP metadata server on 127.0.0.1: one test
per notice and per failure mode (404, 401, 5xx, bad JSON, bad time, hangs, missing headers),
the poll loop, and the ``watch`` command."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from fakes.metadata_server import (
    AWS_LIFECYCLE_PATH,
    AWS_REBALANCE_PATH,
    AWS_SPOT_PATH,
    AWS_TOKEN_PATH,
    GCP_MAINTENANCE_PATH,
    GCP_PREEMPTED_PATH,
    MetadataServer,
)

from spottrain.agent.notices.aws import AwsImdsWatcher
from spottrain.agent.notices.aws_imds import AWS_ENDPOINT_ENV
from spottrain.agent.notices.gce_metadata import GCP_HOST_ENV
from spottrain.agent.notices.gcp import GcpMetadataWatcher
from spottrain.agent.notices.metadata_http import WatcherError
from spottrain.agent.notices.notice import Notice, NoticeKind
from spottrain.agent.notices.poll_loop import PollLoop
from spottrain.agent.watch_cmd import main as watch_main

TIMEOUT = 0.5  # client timeout in these tests; hangs last far longer


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.fixture
def md() -> Iterator[MetadataServer]:
    with MetadataServer() as server:
        yield server


@pytest.fixture
def aws(md: MetadataServer) -> AwsImdsWatcher:
    return AwsImdsWatcher(md.url, timeout=TIMEOUT)


@pytest.fixture
def gcp(md: MetadataServer) -> GcpMetadataWatcher:
    return GcpMetadataWatcher(md.host, timeout=TIMEOUT)


@pytest.fixture
def no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("NO_PROXY", "no_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


# AWS


def test_aws_poll_finds_nothing_when_every_path_is_404(
    aws: AwsImdsWatcher, md: MetadataServer
) -> None:
    assert aws.poll() == []
    assert aws.last_errors == []
    assert md.count(AWS_TOKEN_PATH, "PUT") == 1
    for path in (AWS_SPOT_PATH, AWS_REBALANCE_PATH, AWS_LIFECYCLE_PATH):
        assert md.count(path, "GET") == 1


def test_aws_terminate_notice_carries_the_exact_deadline(
    aws: AwsImdsWatcher, md: MetadataServer
) -> None:
    md.set_spot_action("terminate", "2026-11-22T14:40:00Z")
    [notice] = aws.poll()
    assert notice.source == "aws-imds:spot"
    assert notice.kind is NoticeKind.TERMINATE
    assert notice.deadline == 1795358400.0
    assert notice.detail["action"] == "terminate"
    assert notice.detail["time"] == "2026-11-22T14:40:00Z"


def test_each_aws_source_gives_its_notice_the_events_own_id(
    aws: AwsImdsWatcher, md: MetadataServer
) -> None:
    md.set_spot_action("terminate", "2026-11-22T14:40:00Z")
    md.set_rebalance("2026-11-22T14:30:00Z")
    md.set_lifecycle_state("Terminated")
    ids = {n.source: n.id for n in aws.poll()}
    assert ids == {
        "aws-imds:spot": "terminate 2026-11-22T14:40:00Z",
        "aws-imds:rebalance": "2026-11-22T14:30:00Z",
        "aws-imds:asg": "Terminated",
    }
    # The same events polled again dedup; a new recommendation is a new event.
    assert {n.dedup_key for n in aws.poll()} == {(s, i) for s, i in ids.items()}
    md.set_rebalance("2026-11-22T14:35:00Z")
    again = {n.source: n.dedup_key for n in aws.poll()}
    assert again["aws-imds:rebalance"] == ("aws-imds:rebalance", "2026-11-22T14:35:00Z")


@pytest.mark.parametrize(
    ("action", "kind"), [("stop", NoticeKind.STOP), ("hibernate", NoticeKind.HIBERNATE)]
)
def test_aws_stop_and_hibernate_notices_have_their_kind(
    aws: AwsImdsWatcher, md: MetadataServer, action: str, kind: NoticeKind
) -> None:
    when = time.time() + 120
    md.set_spot_action(action, iso(when))
    [notice] = aws.poll()
    assert notice.kind is kind
    assert notice.deadline == pytest.approx(int(when))
    assert notice.detail == {"action": action, "time": iso(when)}


def test_aws_reuses_its_token_across_polls(aws: AwsImdsWatcher, md: MetadataServer) -> None:
    for _ in range(3):
        aws.poll()
    assert md.count(AWS_TOKEN_PATH, "PUT") == 1


def test_aws_recovers_from_an_expired_token_with_a_new_one(
    aws: AwsImdsWatcher, md: MetadataServer
) -> None:
    aws.poll()
    md.expire_tokens()
    md.set_spot_action("terminate", iso(time.time() + 120))
    [notice] = aws.poll()
    assert notice.kind is NoticeKind.TERMINATE
    assert aws.last_errors == []
    assert md.count(AWS_TOKEN_PATH, "PUT") == 2
    assert md.unauthorized == 1


def test_aws_refreshes_a_short_lived_token_before_it_expires(md: MetadataServer) -> None:
    watcher = AwsImdsWatcher(md.url, timeout=TIMEOUT, token_ttl=1)
    watcher.poll()
    time.sleep(0.95)  # inside the token's last tenth of life, still before it lapses
    assert watcher.poll() == []
    assert watcher.last_errors == []
    assert md.count(AWS_TOKEN_PATH, "PUT") == 2
    assert md.unauthorized == 0


def test_aws_5xx_on_one_path_is_reported_and_other_paths_still_checked(
    aws: AwsImdsWatcher, md: MetadataServer
) -> None:
    md.set_status(AWS_SPOT_PATH, 500)
    md.set_rebalance("2026-11-22T14:38:00Z")
    [notice] = aws.poll()
    assert notice.kind is NoticeKind.REBALANCE
    [error] = aws.last_errors
    assert f"GET {md.url}{AWS_SPOT_PATH} returned HTTP 500" in error
    assert "will retry" in error


def test_aws_5xx_on_every_path_raises(aws: AwsImdsWatcher, md: MetadataServer) -> None:
    for path in (AWS_SPOT_PATH, AWS_REBALANCE_PATH, AWS_LIFECYCLE_PATH):
        md.set_status(path, 503)
    with pytest.raises(WatcherError, match=r"no metadata path could be checked.*HTTP 503"):
        aws.poll()
    assert len(aws.last_errors) == 3


def test_aws_5xx_on_the_token_raises(aws: AwsImdsWatcher, md: MetadataServer) -> None:
    md.set_status(AWS_TOKEN_PATH, 500)
    with pytest.raises(
        WatcherError, match=re.escape(f"PUT {md.url}{AWS_TOKEN_PATH} returned HTTP 500")
    ):
        aws.poll()
    assert md.count(AWS_SPOT_PATH) == 0


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        pytest.param(b'{"action": "termin', "returned malformed JSON", id="malformed-json"),
        pytest.param(b"", "returned malformed JSON", id="empty-body"),
        pytest.param(b'["terminate"]', "returned JSON that is not an object", id="not-an-object"),
        pytest.param(
            b'{"action": "explode", "time": "2026-11-22T14:40:00Z"}',
            "returned unknown action 'explode'",
            id="unknown-action",
        ),
        pytest.param(
            b'{"action": "terminate", "time": "in two minutes"}',
            "returned a bad time",
            id="bad-time",
        ),
        pytest.param(b'{"action": "terminate"}', "returned a bad time", id="no-time"),
    ],
)
def test_aws_unreadable_spot_notice_is_a_terminate_notice_two_minutes_out(
    md: MetadataServer, body: bytes, problem: str
) -> None:
    aws = AwsImdsWatcher(md.url, timeout=TIMEOUT, clock=lambda: 1000.0)
    md.set_body(AWS_SPOT_PATH, body)
    [notice] = aws.poll()
    assert notice.source == "aws-imds:spot"
    assert notice.kind is NoticeKind.TERMINATE
    assert notice.drains
    assert notice.seen_at == 1000.0
    assert notice.deadline == 1120.0
    assert notice.detail["unreadable"] is True
    [error] = aws.last_errors
    assert f"{AWS_SPOT_PATH} {problem}" in error
    assert "treated as a terminate notice" in error


def test_aws_unknown_spot_action_keeps_the_time_aws_gave(md: MetadataServer) -> None:
    aws = AwsImdsWatcher(md.url, timeout=TIMEOUT, clock=lambda: 1000.0)
    md.set_spot_action("evaporate", iso(1090.0))
    [notice] = aws.poll()
    assert notice.kind is NoticeKind.TERMINATE
    assert notice.deadline == 1090.0


def test_aws_unreadable_spot_notice_keeps_its_deadline_from_poll_to_poll(
    md: MetadataServer,
) -> None:
    now = [1000.0]
    aws = AwsImdsWatcher(md.url, timeout=TIMEOUT, clock=lambda: now[0])
    md.set_body(AWS_SPOT_PATH, b"garbage")
    [first] = aws.poll()
    now[0] = 1030.0
    [second] = aws.poll()
    assert first.deadline == second.deadline == 1120.0
    md.set_body(AWS_SPOT_PATH, None)
    assert aws.poll() == []
    md.set_body(AWS_SPOT_PATH, b"garbage")
    [third] = aws.poll()
    assert third.deadline == 1150.0


def test_aws_unreadable_spot_notice_survives_the_other_paths_failing(
    aws: AwsImdsWatcher, md: MetadataServer
) -> None:
    md.set_body(AWS_SPOT_PATH, b"garbage")
    md.set_status(AWS_REBALANCE_PATH, 500)
    md.set_status(AWS_LIFECYCLE_PATH, 500)
    [notice] = aws.poll()
    assert notice.kind is NoticeKind.TERMINATE
    assert len(aws.last_errors) == 3


def test_aws_hanging_token_request_raises_within_the_timeout(
    aws: AwsImdsWatcher, md: MetadataServer
) -> None:
    md.set_hang(AWS_TOKEN_PATH, 30)
    started = time.monotonic()
    with pytest.raises(WatcherError, match=r"timed out after 0\.5s"):
        aws.poll()
    assert time.monotonic() - started < TIMEOUT * 3


def test_aws_hanging_path_times_out_and_other_paths_still_answer(
    aws: AwsImdsWatcher, md: MetadataServer
) -> None:
    md.set_hang(AWS_SPOT_PATH, 30)
    md.set_lifecycle_state("Terminated")
    started = time.monotonic()
    [notice] = aws.poll()
    assert time.monotonic() - started < TIMEOUT * 3
    assert notice.kind is NoticeKind.SCALE_IN
    [error] = aws.last_errors
    assert f"GET {md.url}{AWS_SPOT_PATH} timed out after 0.5s" in error


def test_aws_notice_already_past_is_returned_and_marked_late(
    aws: AwsImdsWatcher, md: MetadataServer
) -> None:
    md.set_spot_action("terminate", "2020-01-01T00:00:00Z")
    [notice] = aws.poll()
    assert notice.deadline == datetime(2020, 1, 1, tzinfo=UTC).timestamp()
    assert notice.deadline < notice.seen_at
    assert notice.detail["late"] is True


def test_aws_rebalance_recommendation_is_a_notice_without_deadline(
    aws: AwsImdsWatcher, md: MetadataServer
) -> None:
    md.set_rebalance("2026-11-22T14:38:00Z")
    [notice] = aws.poll()
    assert notice.source == "aws-imds:rebalance"
    assert notice.kind is NoticeKind.REBALANCE
    assert notice.deadline is None
    assert notice.detail == {"noticeTime": "2026-11-22T14:38:00Z"}
    assert not notice.drains


def test_aws_lifecycle_state_terminated_is_a_scale_in_notice(
    aws: AwsImdsWatcher, md: MetadataServer
) -> None:
    md.set_lifecycle_state("InService")
    assert aws.poll() == []
    md.set_lifecycle_state("Terminated")
    [first] = aws.poll()
    assert first.source == "aws-imds:asg"
    assert first.kind is NoticeKind.SCALE_IN
    assert first.detail == {"state": "Terminated"}
    assert first.deadline == first.seen_at + 120
    assert first.seen_at == pytest.approx(time.time(), abs=5)
    [again] = aws.poll()
    assert again.deadline == first.deadline  # counted from first sight, not sliding


@pytest.mark.parametrize("slash", ["", "/"])
def test_aws_endpoint_comes_from_the_environment(
    md: MetadataServer, monkeypatch: pytest.MonkeyPatch, slash: str
) -> None:
    monkeypatch.setenv(AWS_ENDPOINT_ENV, md.url + slash)
    md.set_spot_action("terminate", iso(time.time() + 120))
    watcher = AwsImdsWatcher(timeout=TIMEOUT)
    assert watcher.endpoint == md.url
    [notice] = watcher.poll()
    assert notice.kind is NoticeKind.TERMINATE


def test_aws_requests_bypass_an_http_proxy_from_the_environment(
    md: MetadataServer, monkeypatch: pytest.MonkeyPatch, no_proxy_env: None
) -> None:
    with MetadataServer() as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        monkeypatch.setenv("http_proxy", proxy.url)
        # Control: plain urllib obeys the variable, so the test below means something. A
        # fresh opener: urlopen's global one read the variables when some earlier test in
        # this process first called it.
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.build_opener().open(md.url + AWS_SPOT_PATH, timeout=TIMEOUT)
        assert proxy.total_requests == 1
        md.set_spot_action("terminate", iso(time.time() + 120))
        [notice] = AwsImdsWatcher(md.url, timeout=TIMEOUT).poll()
        assert notice.kind is NoticeKind.TERMINATE
        assert proxy.total_requests == 1


def test_aws_unreachable_endpoint_raises(no_proxy_env: None) -> None:
    with MetadataServer() as gone:
        url = gone.url
    with pytest.raises(WatcherError, match=re.escape(f"PUT {url}{AWS_TOKEN_PATH} failed")):
        AwsImdsWatcher(url, timeout=TIMEOUT).poll()


# GCP


def test_gcp_preempted_false_is_no_notice(gcp: GcpMetadataWatcher, md: MetadataServer) -> None:
    assert gcp.poll() == []
    assert gcp.last_errors == []
    assert md.count(GCP_PREEMPTED_PATH) == 1
    assert md.count(GCP_MAINTENANCE_PATH) == 1


def test_gcp_preempted_true_is_a_notice_thirty_seconds_out(
    gcp: GcpMetadataWatcher, md: MetadataServer
) -> None:
    md.set_gcp(GCP_PREEMPTED_PATH, "TRUE")
    before = time.time()
    [notice] = gcp.poll()
    assert notice.source == "gcp:preempted"
    assert notice.kind is NoticeKind.PREEMPTED
    assert notice.detail == {"preempted": "TRUE"}
    assert before <= notice.seen_at <= time.time()
    assert notice.deadline == notice.seen_at + 30


def test_gcp_terminate_on_host_maintenance_is_a_notice(
    gcp: GcpMetadataWatcher, md: MetadataServer
) -> None:
    md.set_gcp(GCP_MAINTENANCE_PATH, "TERMINATE_ON_HOST_MAINTENANCE")
    [notice] = gcp.poll()
    assert notice.source == "gcp:maintenance"
    assert notice.kind is NoticeKind.MAINTENANCE
    assert notice.deadline == notice.seen_at + 60


def test_gcp_live_migration_is_no_notice(gcp: GcpMetadataWatcher, md: MetadataServer) -> None:
    md.set_gcp(GCP_MAINTENANCE_PATH, "MIGRATE_ON_HOST_MAINTENANCE")
    assert gcp.poll() == []
    assert gcp.last_errors == []


@pytest.mark.parametrize("wait", [0, 5])
def test_gcp_unexpected_preempted_value_fails_closed_as_a_preemption(
    gcp: GcpMetadataWatcher, md: MetadataServer, wait: float
) -> None:
    """The metadata server's own answer (its header is there) that is neither TRUE nor FALSE
    drains the node, as AWS's unreadable spot notice does: ignoring it could lose the
    emergency checkpoint. The problem is reported beside the notice."""
    assert gcp.poll() == []  # learns the ETag, so wait > 0 would long-poll
    md.set_gcp(GCP_PREEMPTED_PATH, "MAYBE")
    notices = gcp.poll(wait=wait)
    assert len(notices) == 1, gcp.last_errors
    notice = notices[0]
    assert notice.kind is NoticeKind.PREEMPTED and notice.drains
    assert notice.deadline == notice.seen_at + 30
    assert notice.detail == {"preempted": "MAYBE", "unreadable": True}
    [error] = gcp.last_errors
    assert "returned 'MAYBE', expected TRUE or FALSE; treated as a preemption" in error
    # Seen again: the same notice, from when it was first seen.
    [again] = gcp.poll()
    assert again.id == notice.id and again.seen_at == notice.seen_at


def test_gcp_unexpected_maintenance_value_fails_closed(
    gcp: GcpMetadataWatcher, md: MetadataServer
) -> None:
    md.set_gcp(GCP_MAINTENANCE_PATH, "TERMINATE_SOON")
    notices = gcp.poll()
    assert len(notices) == 1, gcp.last_errors
    notice = notices[0]
    assert notice.kind is NoticeKind.MAINTENANCE
    assert notice.deadline == notice.seen_at + 60
    [error] = gcp.last_errors
    assert "returned 'TERMINATE_SOON'" in error and "treated as a terminating maintenance" in error
    md.set_gcp(GCP_MAINTENANCE_PATH, "NONE")
    assert gcp.poll() == [] and gcp.last_errors == []


def test_gcp_answer_without_flavor_header_is_garbage(
    gcp: GcpMetadataWatcher, md: MetadataServer
) -> None:
    md.gcp_flavor_header = False
    md.set_gcp(GCP_PREEMPTED_PATH, "TRUE")
    with pytest.raises(WatcherError, match="without the Metadata-Flavor: Google header"):
        gcp.poll()


def test_gcp_5xx_is_reported_and_maintenance_still_checked(
    gcp: GcpMetadataWatcher, md: MetadataServer
) -> None:
    md.set_status(GCP_PREEMPTED_PATH, 503)
    md.set_gcp(GCP_MAINTENANCE_PATH, "TERMINATE_ON_HOST_MAINTENANCE")
    [notice] = gcp.poll()
    assert notice.kind is NoticeKind.MAINTENANCE
    [error] = gcp.last_errors
    assert f"GET http://{md.host}{GCP_PREEMPTED_PATH} returned HTTP 503" in error


def test_gcp_hanging_server_times_out(gcp: GcpMetadataWatcher, md: MetadataServer) -> None:
    md.set_hang(GCP_PREEMPTED_PATH, 30)
    md.set_hang(GCP_MAINTENANCE_PATH, 30)
    started = time.monotonic()
    with pytest.raises(WatcherError, match=r"timed out after 0\.5s"):
        gcp.poll()
    assert time.monotonic() - started < TIMEOUT * 4


def test_gcp_wait_for_change_returns_when_the_value_flips(
    gcp: GcpMetadataWatcher, md: MetadataServer
) -> None:
    assert gcp.poll() == []  # learns the ETag
    flip = threading.Timer(0.3, md.set_gcp, (GCP_PREEMPTED_PATH, "TRUE"))
    flip.start()
    started = time.monotonic()
    try:
        [notice] = gcp.poll(wait=5)
    finally:
        flip.cancel()
    elapsed = time.monotonic() - started
    assert 0.2 < elapsed < 2
    assert notice.kind is NoticeKind.PREEMPTED
    assert md.count(GCP_PREEMPTED_PATH) == 2  # one plain read, one long-poll


def test_gcp_wait_for_change_outlasts_the_request_timeout(
    gcp: GcpMetadataWatcher, md: MetadataServer
) -> None:
    gcp.poll()
    started = time.monotonic()
    assert gcp.poll(wait=1) == []  # the server holds it 1 s, twice the request timeout
    assert gcp.last_errors == []
    assert 0.9 < time.monotonic() - started < 2


def test_gcp_first_long_poll_reads_a_preemption_already_there(
    gcp: GcpMetadataWatcher, md: MetadataServer
) -> None:
    md.set_gcp(GCP_PREEMPTED_PATH, "TRUE")
    started = time.monotonic()
    [notice] = gcp.poll(wait=5)
    assert time.monotonic() - started < 1
    assert notice.kind is NoticeKind.PREEMPTED


def test_gcp_host_comes_from_the_environment(
    md: MetadataServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(GCP_HOST_ENV, md.host)
    md.set_gcp(GCP_PREEMPTED_PATH, "TRUE")
    watcher = GcpMetadataWatcher(timeout=TIMEOUT)
    assert watcher.host == md.host
    [notice] = watcher.poll()
    assert notice.kind is NoticeKind.PREEMPTED


def test_gcp_requests_bypass_an_http_proxy_from_the_environment(
    md: MetadataServer, monkeypatch: pytest.MonkeyPatch, no_proxy_env: None
) -> None:
    with MetadataServer() as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        monkeypatch.setenv("http_proxy", proxy.url)
        md.set_gcp(GCP_PREEMPTED_PATH, "TRUE")
        [notice] = GcpMetadataWatcher(md.host, timeout=TIMEOUT).poll()
        assert notice.kind is NoticeKind.PREEMPTED
        assert proxy.total_requests == 0


# PollLoop


def test_poll_loop_delivers_a_notice(aws: AwsImdsWatcher, md: MetadataServer) -> None:
    notices: queue.Queue[Notice] = queue.Queue()
    md.set_spot_action("terminate", iso(time.time() + 120))
    with PollLoop(aws, notices.put, lambda message: None, interval=0.05):
        notice = notices.get(timeout=5)
    assert notice.kind is NoticeKind.TERMINATE


def test_poll_loop_reports_each_error_once_and_survives_it(
    aws: AwsImdsWatcher, md: MetadataServer
) -> None:
    notices: queue.Queue[Notice] = queue.Queue()
    errors: list[str] = []
    md.set_status(AWS_TOKEN_PATH, 500)
    with PollLoop(aws, notices.put, errors.append, interval=0.02) as loop:
        deadline = time.monotonic() + 5
        while md.count(AWS_TOKEN_PATH) < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert md.count(AWS_TOKEN_PATH) >= 5
        md.set_status(AWS_TOKEN_PATH, None)
        md.set_spot_action("terminate", iso(time.time() + 120))
        notice = notices.get(timeout=5)
        assert loop.is_alive()
    assert notice.kind is NoticeKind.TERMINATE
    assert len(errors) == 1
    assert "returned HTTP 500" in errors[0]


class _CrashingWatcher:
    """Raises something that is not a WatcherError on its first polls."""

    def __init__(self, crashes: int) -> None:
        self.crashes = crashes
        self.last_errors: list[str] = []

    def poll(self) -> list[Notice]:
        if self.crashes > 0:
            self.crashes -= 1
            raise RuntimeError("boom")
        return [Notice("test", NoticeKind.INJECTED, None)]


def test_poll_loop_survives_an_unexpected_exception() -> None:
    notices: queue.Queue[Notice] = queue.Queue()
    errors: list[str] = []
    with PollLoop(_CrashingWatcher(3), notices.put, errors.append, interval=0.01):
        notice = notices.get(timeout=5)
    assert notice.kind is NoticeKind.INJECTED
    assert errors == ["watcher poll crashed: RuntimeError: boom; will retry on the next poll"]


def test_poll_loop_stops_promptly(aws: AwsImdsWatcher) -> None:
    loop = PollLoop(aws, lambda n: None, lambda m: None, interval=5).start()
    time.sleep(0.1)
    started = time.monotonic()
    assert loop.stop()
    assert time.monotonic() - started < 0.5
    assert not loop.is_alive()


@pytest.mark.parametrize("interval", [0, -1, 5.5])
def test_poll_loop_refuses_a_bad_interval(aws: AwsImdsWatcher, interval: float) -> None:
    with pytest.raises(ValueError, match="poll interval must be > 0 and <= 5 seconds"):
        PollLoop(aws, lambda n: None, lambda m: None, interval=interval)


# the watch command


def test_watch_once_prints_the_notice_as_a_json_line(
    md: MetadataServer, capsys: pytest.CaptureFixture[str]
) -> None:
    md.set_spot_action("terminate", "2026-11-22T14:40:00Z")
    rc = watch_main(["watch", "--cloud", "aws", "--endpoint", md.url, "--once"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert err == ""
    [line] = out.splitlines()
    data = json.loads(line)
    assert data["source"] == "aws-imds:spot"
    assert data["kind"] == "terminate"
    assert data["deadline"] == 1795358400.0


def test_watch_once_prints_nothing_without_a_notice(
    md: MetadataServer, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = watch_main(["watch", "--cloud", "gcp", "--endpoint", md.host, "--once"])
    assert rc == 0
    assert capsys.readouterr() == ("", "")


def test_watch_once_exits_2_when_the_poll_fails(
    md: MetadataServer, capsys: pytest.CaptureFixture[str]
) -> None:
    md.set_status(AWS_TOKEN_PATH, 500)
    rc = watch_main(["watch", "--cloud", "aws", "--endpoint", md.url, "--once"])
    out, err = capsys.readouterr()
    assert rc == 2
    assert out == ""
    assert err.startswith("spottrain-agent watch: PUT ") and "HTTP 500" in err


def test_watch_refuses_an_interval_over_five_seconds(
    md: MetadataServer, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = watch_main(["watch", "--cloud", "aws", "--endpoint", md.url, "--interval", "10"])
    assert rc == 2
    assert "poll interval must be > 0 and <= 5 seconds" in capsys.readouterr().err
    assert md.total_requests == 0


def test_watch_prints_a_lasting_notice_once_and_exits_0_on_sigterm(md: MetadataServer) -> None:
    md.set_spot_action("terminate", iso(time.time() + 120))
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "spottrain.agent.watch_cmd", "watch", "--cloud", "aws"),
            *("--endpoint", md.url, "--interval", "0.1", "--timeout", str(TIMEOUT)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 15
        while md.count(AWS_SPOT_PATH) < 5 and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        assert md.count(AWS_SPOT_PATH) >= 5
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert err == ""
    [line] = out.splitlines()
    data = json.loads(line)
    assert (data["source"], data["kind"]) == ("aws-imds:spot", "terminate")
    assert data["deadline"] is not None

"""The Secret Manager fake and the OAuth token endpoint fake, driven by the real google-auth:
``authorized_user`` and service-account credentials get their tokens from the fake, and the
bearer token reads secrets (and drives the GCE fake through ``google-cloud-compute``)."""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import google.auth
import google_crc32c
import pytest
import requests
from fakes.gce import GceFake
from fakes.google_oauth import (
    CLOUD_PLATFORM,
    GOOGLE_TOKEN_URI,
    JWT_GRANT,
    REFRESH_GRANT,
    GoogleOAuthFake,
)
from fakes.secret_manager import SecretManagerFake, crc32c
from google.api_core.client_options import ClientOptions
from google.auth.exceptions import RefreshError
from google.auth.transport.requests import AuthorizedSession, Request
from google.cloud import compute_v1
from google.oauth2 import service_account
from google.oauth2.credentials import Credentials


@pytest.fixture
def oauth(no_egress: None) -> Iterator[GoogleOAuthFake]:
    with GoogleOAuthFake() as fake:
        yield fake
    assert fake.internal_errors == []


@pytest.fixture
def sm(oauth: GoogleOAuthFake) -> Iterator[SecretManagerFake]:
    with SecretManagerFake(token_check=oauth.is_valid) as fake:
        yield fake
    assert fake.internal_errors == []


def _user_credentials(oauth: GoogleOAuthFake, **user: Any) -> Credentials:
    info = oauth.add_user(**user)
    # google-auth ignores an authorized_user file's token_uri: it is given here.
    return Credentials.from_authorized_user_info(info).with_token_uri(oauth.token_uri)


@pytest.fixture
def session(oauth: GoogleOAuthFake) -> AuthorizedSession:
    return AuthorizedSession(_user_credentials(oauth))


def _access(sm: SecretManagerFake, secret: str, version: str = "latest", project: str = "") -> str:
    return (
        f"{sm.url}/v1/projects/{project or sm.project}/secrets/{secret}/versions/{version}:access"
    )


def test_a_secret_is_read_with_a_bearer_token_in_the_apis_json(
    sm: SecretManagerFake, session: AuthorizedSession
) -> None:
    assert sm.add("gh-deploy", "ghp_first") == 1
    assert sm.add("gh-deploy", b"ghp_second\xff") == 2
    number = sm.project_number()
    got = session.get(_access(sm, "gh-deploy"))
    assert got.status_code == 200
    body = got.json()
    assert body["name"] == f"projects/{number}/secrets/gh-deploy/versions/2"
    data = base64.b64decode(body["payload"]["data"])
    assert data == b"ghp_second\xff"
    assert body["payload"]["dataCrc32c"] == str(google_crc32c.value(data))
    first = session.get(_access(sm, "gh-deploy", "1", project=number)).json()
    assert base64.b64decode(first["payload"]["data"]) == b"ghp_first"
    assert first["name"] == f"projects/{number}/secrets/gh-deploy/versions/1"
    assert sm.count("gh-deploy", status=200) == 2


def test_the_checksum_is_googles_crc32c() -> None:
    for data in (b"", b"a", b"123456789", bytes(range(256)), os.urandom(100_000)):
        assert crc32c(data) == google_crc32c.value(data)


def test_without_a_bearer_token_or_with_one_not_issued_it_is_401(sm: SecretManagerFake) -> None:
    sm.add("gh-deploy", "ghp_x")
    bare = requests.get(_access(sm, "gh-deploy"), timeout=10)
    assert bare.status_code == 401
    assert bare.json()["error"]["status"] == "UNAUTHENTICATED"
    assert bare.json()["error"]["message"].startswith(
        "Request is missing required authentication credential."
    )
    assert bare.headers["WWW-Authenticate"].startswith("Bearer")
    forged = requests.get(
        _access(sm, "gh-deploy"), headers={"Authorization": "Bearer ya29.forged"}, timeout=10
    )
    assert forged.status_code == 401
    assert forged.json()["error"]["message"].startswith(
        "Request had invalid authentication credentials."
    )
    assert sm.count("gh-deploy", status=401) == 2 and sm.count(status=200) == 0


def test_a_missing_secret_is_404_and_a_denied_one_403_in_googles_words(
    sm: SecretManagerFake, session: AuthorizedSession
) -> None:
    number = sm.project_number()
    sm.add("hf-token", "hf_x")
    missing = session.get(_access(sm, "nope"))
    assert missing.status_code == 404
    assert missing.json() == {
        "error": {
            "code": 404,
            "message": f"Secret [projects/{number}/secrets/nope] not found or has no versions.",
            "status": "NOT_FOUND",
        }
    }
    no_version = session.get(_access(sm, "hf-token", "7")).json()["error"]
    assert no_version["message"] == (
        f"Secret Version [projects/{number}/secrets/hf-token/versions/7] not found."
    )
    sm.deny("hf-token")
    sm.deny("nope")
    for secret in ("hf-token", "nope"):  # IAM is asked first: existing or not, 403
        denied = session.get(_access(sm, secret))
        assert denied.status_code == 403
        assert denied.json()["error"] == {
            "code": 403,
            "message": "Permission 'secretmanager.versions.access' denied for resource "
            f"'projects/{sm.project}/secrets/{secret}/versions/latest' (or it may not exist).",
            "status": "PERMISSION_DENIED",
        }
    sm.clear_denials()
    assert session.get(_access(sm, "hf-token")).status_code == 200


def test_user_credentials_refresh_against_the_fake_once_given_its_token_uri(
    oauth: GoogleOAuthFake, tmp_path: Path
) -> None:
    info = oauth.add_user()
    path = tmp_path / "application_default_credentials.json"
    path.write_text(json.dumps(info))
    creds = Credentials.from_authorized_user_file(str(path))
    assert not creds.valid
    # The file's token_uri is not taken: left alone, these would refresh at Google.
    assert info["token_uri"] == oauth.token_uri and creds.token_uri == GOOGLE_TOKEN_URI
    creds = creds.with_token_uri(oauth.token_uri)
    creds.refresh(Request())
    assert creds.valid and oauth.is_valid(creds.token)
    assert creds.expiry is not None
    left = creds.expiry.replace(tzinfo=UTC) - datetime.now(UTC)
    assert timedelta(minutes=55) < left <= timedelta(seconds=3599)
    assert oauth.count(REFRESH_GRANT) == 1 and oauth.clients == [info["client_id"]]


def test_a_revoked_refresh_token_or_a_wrong_client_secret_is_refused_as_google_does(
    oauth: GoogleOAuthFake,
) -> None:
    info = oauth.add_user(scopes=(CLOUD_PLATFORM,))
    wrong: dict[str, Any] = {**info, "client_secret": "GOCSPX-wrong"}
    with pytest.raises(RefreshError, match="invalid_client"):
        Credentials.from_authorized_user_info(wrong).with_token_uri(oauth.token_uri).refresh(
            Request()
        )
    creds = Credentials.from_authorized_user_info(info).with_token_uri(oauth.token_uri)
    creds.refresh(Request())
    token = creds.token
    oauth.revoke(info["refresh_token"])
    assert not oauth.is_valid(token)
    with pytest.raises(RefreshError, match="Token has been expired or revoked"):
        creds.refresh(Request())


def test_a_service_account_key_file_gets_a_token_for_its_signed_assertion(
    oauth: GoogleOAuthFake, sm: SecretManagerFake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = oauth.add_service_account()
    path = tmp_path / "key.json"
    path.write_text(json.dumps(key))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(path))
    creds, project = google.auth.default(scopes=[CLOUD_PLATFORM])
    assert isinstance(creds, service_account.Credentials) and project == key["project_id"]
    sm.add("redis-password", "s3cret")
    got = AuthorizedSession(creds).get(_access(sm, "redis-password"))
    assert got.status_code == 200
    assert base64.b64decode(got.json()["payload"]["data"]) == b"s3cret"
    assert oauth.count(JWT_GRANT) == 1 and oauth.clients == [key["client_email"]]
    unscoped = service_account.Credentials.from_service_account_info(key)
    with pytest.raises(RefreshError, match="invalid_scope"):
        unscoped.refresh(Request())
    oauth.remove_service_account(key["client_email"])
    assert not oauth.is_valid(creds.token)
    with pytest.raises(RefreshError, match="account not found"):
        creds.refresh(Request())


def test_the_gce_fake_serves_the_real_compute_client_with_those_credentials(
    oauth: GoogleOAuthFake,
) -> None:
    creds = _user_credentials(oauth)
    with GceFake() as gce:
        client = compute_v1.InstancesClient(
            credentials=creds,
            client_options=ClientOptions(api_endpoint=gce.url),
            transport="rest",
        )
        assert list(client.list(project=gce.project, zone="us-central1-a")) == []
        assert gce.count("instances.list") == 1
    assert gce.internal_errors == []
    assert creds.valid and oauth.is_valid(creds.token)
    assert oauth.count(REFRESH_GRANT) == 1

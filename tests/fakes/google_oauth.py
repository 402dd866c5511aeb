"""A fake of Google's OAuth 2.0 token endpoint over real HTTP, for the real ``google-auth``.

``POST /token`` with a form body, as ``https://oauth2.googleapis.com/token`` takes it, for
the two grants Google's credential files make:

- ``grant_type=refresh_token`` (``client_id``, ``client_secret``, ``refresh_token``, maybe
  ``scope``): an ``authorized_user`` file, from ``gcloud auth application-default login``;
- ``grant_type=urn:ietf:params:oauth:grant-type:jwt-bearer`` (``assertion``): a
  ``service_account`` key file. The assertion is checked as Google checks it: an RS256 JWT
  signed by a key this fake made (:meth:`GoogleOAuthFake.add_service_account`), issued by
  that account, for the token endpoint, not expired, with a scope.

Both answer ``{"access_token": "ya29...", "expires_in": 3599, "token_type": "Bearer",
"scope": "..."}``, and are refused as Google refuses them, in the token endpoint's error shape
``{"error": "...", "error_description": "..."}``: an unknown or revoked refresh token 400
``invalid_grant`` ("Token has been expired or revoked."), an unknown client 401
``invalid_client`` ("The OAuth client was not found."), a wrong client secret 401
``invalid_client`` ("Unauthorized"), a bad JWT 400 ``invalid_grant`` ("Invalid JWT
Signature.", "Invalid grant: account not found", ...), a JWT without a scope 400
``invalid_scope``, another grant type 400 ``unsupported_grant_type``.

Which file honours ``token_uri``: ``google-auth`` (2.63) reads it from a service-account key
file, but ``Credentials.from_authorized_user_info`` and ``from_authorized_user_file`` ignore
it and always use ``https://oauth2.googleapis.com/token``; give such credentials this fake
with ``creds.with_token_uri(fake.token_uri)``. Google's client libraries built on
``google-api-core`` (``google-cloud-compute``) sign their own JWT for a service account and
never call the endpoint; ``google-cloud-storage`` and ``AuthorizedSession`` do call it.

Access tokens it issued are good until they expire or are revoked: :meth:`is_valid` is what
another fake takes as its ``token_check`` (the Secret Manager fake). It keeps no credential in
the clear (refresh tokens, client secrets and access tokens are held as sha256 digests, and
private keys are handed out, not kept) and records of each request only the grant type and
the client id or service account::

    with GoogleOAuthFake() as oauth:
        creds = google.oauth2.credentials.Credentials.from_authorized_user_info(
            oauth.add_user()).with_token_uri(oauth.token_uri)
        creds.refresh(google.auth.transport.requests.Request())
        oauth.is_valid(creds.token)     # True
        oauth.count(REFRESH_GRANT)      # 1
        key_file = oauth.add_service_account()   # the JSON, token_uri pointing here
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

from fakes.http_fake import DispatchingHandler, HTTPFake

CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"
REFRESH_GRANT = "refresh_token"
JWT_GRANT = "urn:ietf:params:oauth:grant-type:jwt-bearer"
GOOGLE_TOKEN_URI = "https://oauth2.googleapis.com/token"
# The audiences Google takes in a service account's assertion (google-auth sends the first,
# whatever the file's token_uri says).
_AUDIENCES = (GOOGLE_TOKEN_URI, "https://accounts.google.com/o/oauth2/token")
_CLOCK_SKEW_S = 300
_MAX_LIFETIME_S = 3600


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass
class _User:
    client_id: str
    client_secret_sha: str
    scopes: tuple[str, ...]


@dataclass
class _ServiceAccount:
    email: str
    key_id: str
    public_key: Any  # cryptography's RSAPublicKey


def _b64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class _Handler(DispatchingHandler, methods=("GET", "POST")):
    def reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Cache-Control", "no-cache, no-store, max-age=0, must-revalidate")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _TokenError(Exception):
    def __init__(self, status: int, error: str, description: str) -> None:
        super().__init__(description)
        self.status = status
        self.body = {"error": error, "error_description": description}


class GoogleOAuthFake(HTTPFake):
    """The fake token endpoint; use it as a context manager (or call start() and close()).

    Args:
        expires_in: the lifetime, in seconds, of the access tokens it issues.

    Attributes:
        clients: the client id of every token request, in order.
        internal_errors: exceptions inside the fake, for the test to assert empty.
    """

    def __init__(self, *, expires_in: int = 3599) -> None:
        super().__init__(_Handler, thread_name="fake-google-oauth")
        self.expires_in = expires_in
        self.clients: list[str] = []
        self.internal_errors: list[str] = []
        self._lock = threading.Lock()
        self._users: dict[str, _User] = {}  # sha256(refresh token) -> user
        self._client_ids: set[str] = set()
        self._accounts: dict[str, _ServiceAccount] = {}  # email -> account
        # sha256(access token) -> (monotonic expiry, what it was granted for)
        self._tokens: dict[str, tuple[float, str]] = {}
        self._calls: Counter[str] = Counter()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def token_uri(self) -> str:
        """The ``token_uri`` to write in a credentials file."""
        return f"{self.url}/token"

    # what a test sets

    def add_user(
        self,
        *,
        client_id: str | None = None,
        client_secret: str | None = None,
        refresh_token: str | None = None,
        scopes: tuple[str, ...] = (CLOUD_PLATFORM,),
    ) -> dict[str, str]:
        """A user who may refresh; returns the ``authorized_user`` JSON (as a dict) that
        ``google-auth`` loads, with ``token_uri`` pointing here. Unset values are made up."""
        client_id = client_id or f"{secrets.randbelow(10**12):012d}.apps.googleusercontent.com"
        client_secret = client_secret or f"GOCSPX-{secrets.token_urlsafe(21)}"
        refresh_token = refresh_token or f"1//{secrets.token_urlsafe(60)}"
        with self._lock:
            self._client_ids.add(client_id)
            self._users[_digest(refresh_token)] = _User(
                client_id, _digest(client_secret), tuple(scopes)
            )
        return {
            "type": "authorized_user",
            "client_id": client_id,
            "client_secret": client_secret,
            "refresh_token": refresh_token,
            "token_uri": self.token_uri,
        }

    def revoke(self, refresh_token: str) -> None:
        """The refresh token stops working, and the access tokens it gave with it."""
        self._forget(_digest(refresh_token))

    def _forget(self, grantor: str) -> None:
        with self._lock:
            self._users.pop(grantor, None)
            self._accounts.pop(grantor, None)
            for token, (_, granted_for) in list(self._tokens.items()):
                if granted_for == grantor:
                    del self._tokens[token]

    def add_service_account(
        self, email: str | None = None, *, project_id: str = "spottrain-test"
    ) -> dict[str, str]:
        """A service account with a fresh RSA key; returns its key file's JSON (as a dict),
        ``token_uri`` pointing here (``google-auth`` honours it for this kind of file)."""
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        email = email or f"box-{secrets.token_hex(3)}@{project_id}.iam.gserviceaccount.com"
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        key_id = secrets.token_hex(20)
        with self._lock:
            self._accounts[email] = _ServiceAccount(email, key_id, key.public_key())
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ).decode()
        return {
            "type": "service_account",
            "project_id": project_id,
            "private_key_id": key_id,
            "private_key": pem,
            "client_email": email,
            "client_id": str(10**20 + secrets.randbelow(10**20)),
            "auth_uri": "https://accounts.google.com/o/oauth2/auth",
            "token_uri": self.token_uri,
            "universe_domain": "googleapis.com",
        }

    def remove_service_account(self, email: str) -> None:
        """Its key stops working (as when the account or key is deleted), and the access
        tokens it was given with it."""
        self._forget(email)

    # inspection

    def is_valid(self, access_token: str) -> bool:
        """Whether ``access_token`` was issued here and has not expired or been revoked."""
        with self._lock:
            expiry, _ = self._tokens.get(_digest(access_token), (0.0, ""))
        return time.monotonic() < expiry

    def count(self, grant_type: str | None = None) -> int:
        """Token requests received, of one grant type (:data:`REFRESH_GRANT`,
        :data:`JWT_GRANT`) or of all."""
        with self._lock:
            return self._calls[grant_type] if grant_type else sum(self._calls.values())

    # serving

    def _handle(self, handler: _Handler, method: str) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        raw = handler.rfile.read(length) if length else b""
        try:
            status, body = self._serve(method, urlsplit(handler.path).path, raw)
        except _TokenError as e:
            status, body = e.status, e.body
        except Exception as e:
            with self._lock:
                self.internal_errors.append(f"{method} {handler.path}: {type(e).__name__}: {e}")
            status, body = 500, {"error": "internal_failure", "error_description": str(e)}
        handler.reply(status, body)

    def _serve(self, method: str, path: str, raw: bytes) -> tuple[int, dict[str, Any]]:
        if method != "POST" or path != "/token":
            raise _TokenError(404, "not_found", f"The fake has no {method} {path}.")
        form = {k: v[-1] for k, v in parse_qs(raw.decode("utf-8", "replace")).items()}
        grant = form.get("grant_type", "")
        if grant == REFRESH_GRANT:
            scopes = self._refresh_grant(form)
            grantor = _digest(form.get("refresh_token", ""))
        elif grant == JWT_GRANT:
            scopes, grantor = self._jwt_grant(form.get("assertion", ""))
        else:
            self._note(grant, form.get("client_id", ""))
            raise _TokenError(400, "unsupported_grant_type", f"Invalid grant_type: {grant}")
        token = f"ya29.fake-{secrets.token_urlsafe(48)}"
        with self._lock:
            self._tokens[_digest(token)] = (time.monotonic() + self.expires_in, grantor)
        return 200, {
            "access_token": token,
            "expires_in": self.expires_in,
            "scope": " ".join(scopes),
            "token_type": "Bearer",
        }

    def _note(self, grant: str, caller: str) -> None:
        with self._lock:
            self._calls[grant] += 1
            self.clients.append(caller)

    def _refresh_grant(self, form: dict[str, str]) -> tuple[str, ...]:
        client_id = form.get("client_id", "")
        self._note(REFRESH_GRANT, client_id)
        with self._lock:
            known_client = client_id in self._client_ids
            user = self._users.get(_digest(form.get("refresh_token", "")))
        if not known_client:
            raise _TokenError(401, "invalid_client", "The OAuth client was not found.")
        if user is None or user.client_id != client_id:
            raise _TokenError(400, "invalid_grant", "Token has been expired or revoked.")
        if not hmac.compare_digest(_digest(form.get("client_secret", "")), user.client_secret_sha):
            raise _TokenError(401, "invalid_client", "Unauthorized")
        return tuple(form["scope"].split()) if form.get("scope") else user.scopes

    def _jwt_grant(self, assertion: str) -> tuple[tuple[str, ...], str]:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import padding

        try:
            head, body, signature = assertion.split(".")
            header = json.loads(_b64url(head))
            claims = json.loads(_b64url(body))
            sig = _b64url(signature)
        except (ValueError, binascii.Error):
            self._note(JWT_GRANT, "")
            raise _TokenError(400, "invalid_grant", "Invalid JWT: malformed.") from None
        issuer = str(claims.get("iss", ""))
        self._note(JWT_GRANT, issuer)
        with self._lock:
            account = self._accounts.get(issuer)
        if account is None or header.get("kid") not in (None, account.key_id):
            raise _TokenError(400, "invalid_grant", "Invalid grant: account not found")
        if header.get("alg") != "RS256":
            raise _TokenError(400, "invalid_grant", "Invalid JWT Signature.")
        try:
            account.public_key.verify(
                sig, f"{head}.{body}".encode(), padding.PKCS1v15(), hashes.SHA256()
            )
        except InvalidSignature:
            raise _TokenError(400, "invalid_grant", "Invalid JWT Signature.") from None
        now = time.time()
        iat, exp = float(claims.get("iat", 0)), float(claims.get("exp", 0))
        if not iat - _CLOCK_SKEW_S <= now <= exp + _CLOCK_SKEW_S or exp - iat > _MAX_LIFETIME_S:
            raise _TokenError(
                400,
                "invalid_grant",
                "Invalid JWT: Token must be a short-lived token (60 minutes) and in a "
                "reasonable timeframe. Check your iat and exp values in the JWT claim.",
            )
        if claims.get("aud") not in (*_AUDIENCES, self.token_uri):
            raise _TokenError(400, "invalid_grant", "Invalid JWT: audience is not the token URI.")
        scopes = tuple(str(claims.get("scope", "")).split())
        if not scopes:
            raise _TokenError(
                400, "invalid_scope", "Invalid OAuth scope or ID token audience provided."
            )
        return scopes, issuer

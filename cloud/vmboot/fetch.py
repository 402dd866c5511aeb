"""The first part of the boot's loader: fetch the run's files with the VM's own identity.

A fresh AWS or GCP VM runs this before anything of spottrain is installed: its user data
carries it (compressed: AWS takes 16 KB of user data), writes it to the VM and runs it with
the image's ``python3`` to fetch the rest of the boot from the run's object store, each file
refused unless its sha256 is the one the controller pinned. It uses the standard library
only and the Python 3.7 language (an image that old still gets a clear reason, not a syntax
error), and no cloud CLI: it signs its own requests with the VM's identity from the metadata
server (AWS: the instance profile's credentials through IMDSv2, SigV4; GCP: the service
account's token). :mod:`.loader`, fetched by this, does the rest of the boot's work.

``python3 fetch.py BOOT.json NAME DEST`` fetches the file NAME of the settings' ``files``
(url, sha256) into DEST. A failure whose cause is known exits 3 with a line ``spottrain:
<what failed>: <why; what to do>`` on stderr, which becomes the boot's reason.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

AWS_MD = "http://169.254.169.254"
GCE_MD = "http://metadata.google.internal"
TIMEOUT_S = 20.0
ATTEMPTS = 5


class BootError(Exception):
    """A failure whose cause is known: the message is the boot's reason."""


def read_json(path: str) -> dict[str, Any]:
    with open(path) as f:
        data: dict[str, Any] = json.load(f)
    return data


# --- HTTP ---------------------------------------------------------------------------------------
class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http(
    method: str,
    url: str,
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
    proxy: bool = True,
) -> Response:
    """One request; an HTTP error status is a Response, a transport failure an OSError."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    opener = urllib.request.build_opener() if proxy else _NO_PROXY
    try:
        with opener.open(req, timeout=TIMEOUT_S) as r:
            return Response(r.status, {k.lower(): v for k, v in r.headers.items()}, r.read())
    except urllib.error.HTTPError as e:
        return Response(e.code, {k.lower(): v for k, v in e.headers.items()}, e.read())


def retried(what: str, call: Any) -> Response:
    """``call()`` until it answers something other than a transport error, 429 or 5xx."""
    last = ""
    for attempt in range(ATTEMPTS):
        try:
            r: Response = call()
            if r.status != 429 and r.status < 500:
                return r
            last = f"HTTP {r.status}"
        except OSError as e:
            last = str(getattr(e, "reason", e))
        time.sleep(min(8.0, 0.5 * 2**attempt))
    raise BootError(f"{what}: unreachable after {ATTEMPTS} tries ({last})")


# --- the VM's identity: metadata servers ---------------------------------------------------------
class Aws:
    def __init__(self, conf: dict[str, Any]) -> None:
        self.md = os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT", AWS_MD).rstrip("/")
        self.endpoints: dict[str, str] = conf.get("endpoints") or {}
        self._token = ""
        self._creds: tuple[str, str, str, float] | None = None

    def meta(self, path: str) -> str:
        if not self._token:
            r = retried(
                "the instance metadata service",
                lambda: http(
                    "PUT",
                    self.md + "/latest/api/token",
                    {"X-aws-ec2-metadata-token-ttl-seconds": "21600"},
                    proxy=False,
                ),
            )
            if r.status != 200:
                raise BootError(f"IMDSv2 refused a token (HTTP {r.status})")
            self._token = r.body.decode()
        r = retried(
            "the instance metadata service",
            lambda: http(
                "GET",
                self.md + "/latest/meta-data/" + path,
                {"X-aws-ec2-metadata-token": self._token},
                proxy=False,
            ),
        )
        if r.status == 404:
            return ""
        if r.status != 200:
            raise BootError(f"the metadata service answered HTTP {r.status} for {path}")
        return r.body.decode().strip()

    def vm_id(self) -> str:
        return self.meta("instance-id")

    def region(self) -> str:
        return self.meta("placement/region")

    def creds(self) -> tuple[str, str, str]:
        if self._creds is None or self._creds[3] < time.time() + 300:
            role = self.meta("iam/security-credentials/").splitlines()
            if not role or not role[0]:
                raise BootError(
                    "the VM has no instance profile (IAM role): set aws.instance_profile to a "
                    "role that may read the run's bucket and secrets"
                )
            c = json.loads(self.meta("iam/security-credentials/" + role[0]))
            exp = datetime.datetime.strptime(c["Expiration"], "%Y-%m-%dT%H:%M:%SZ")
            expires = exp.replace(tzinfo=datetime.timezone.utc).timestamp()
            self._creds = (c["AccessKeyId"], c["SecretAccessKey"], c.get("Token", ""), expires)
        return self._creds[0], self._creds[1], self._creds[2]

    def signed(
        self,
        method: str,
        url: str,
        service: str,
        region: str,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
    ) -> Response:
        """A SigV4-signed request (the payload's hash signed too)."""
        key, secret, token = self.creds()
        parts = urllib.parse.urlsplit(url)
        now = datetime.datetime.now(datetime.timezone.utc)
        amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        h = {k.lower(): v for k, v in (headers or {}).items()}
        h.update({"host": parts.netloc, "x-amz-date": amz_date})
        h["x-amz-content-sha256"] = hashlib.sha256(body).hexdigest()
        if token:
            h["x-amz-security-token"] = token
        names = sorted(h)
        query = "&".join(
            sorted(
                "{}={}".format(
                    urllib.parse.quote(k, safe="-_.~"), urllib.parse.quote(v, safe="-_.~")
                )
                for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
            )
        )
        canonical = "\n".join(
            [
                method,
                parts.path or "/",
                query,
                "".join(f"{n}:{h[n].strip()}\n" for n in names),
                ";".join(names),
                h["x-amz-content-sha256"],
            ]
        )
        scope = f"{day}/{region}/{service}/aws4_request"
        to_sign = "\n".join(
            [
                "AWS4-HMAC-SHA256",
                amz_date,
                scope,
                hashlib.sha256(canonical.encode()).hexdigest(),
            ]
        )
        k = ("AWS4" + secret).encode()
        for part in (day, region, service, "aws4_request"):
            k = hmac.new(k, part.encode(), hashlib.sha256).digest()
        sig = hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()
        h["authorization"] = (
            "AWS4-HMAC-SHA256 Credential={}/{}, SignedHeaders={}, Signature={}".format(
                key,
                scope,
                ";".join(names),
                sig,
            )
        )
        del h["host"]
        return http(method, url, h, body or None)

    def s3_url(self, bucket: str, key: str, region: str) -> str:
        path = urllib.parse.quote(key, safe="/-_.~")
        custom = self.endpoints.get("s3")
        if custom:
            return "{}/{}/{}".format(custom.rstrip("/"), bucket, path)
        return f"https://{bucket}.s3.{region}.amazonaws.com/{path}"

    def s3(
        self,
        method: str,
        bucket: str,
        key: str,
        body: bytes = b"",
        meta: dict[str, str] | None = None,
    ) -> Response:
        region = self.region()
        headers = {f"x-amz-meta-{k}": v for k, v in (meta or {}).items()}
        if body:
            # Said explicitly: urllib would call a body form data, which a server may parse.
            headers["content-type"] = "application/octet-stream"
        for _ in range(2):
            url = self.s3_url(bucket, key, region)
            r = retried(
                f"s3://{bucket}/{key}",
                lambda u=url, g=region: self.signed(method, u, "s3", g, body, headers),
            )
            moved = r.headers.get("x-amz-bucket-region")
            if r.status in (301, 307, 400) and moved and moved != region:
                region = moved  # the bucket lives in another region: sign for that one
                continue
            return r
        return r

    def get_object(self, url: str) -> bytes:
        bucket, key = split_url(url, "s3://")
        r = self.s3("GET", bucket, key)
        if r.status != 200:
            raise BootError(s3_refusal(url, r, "s3:GetObject"))
        return r.body


class Gcp:
    def __init__(self, conf: dict[str, Any]) -> None:
        host = os.environ.get("GCE_METADATA_HOST", "")
        self.md = ("http://" + host) if host else GCE_MD
        self.endpoints: dict[str, str] = conf.get("endpoints") or {}
        self._token: tuple[str, float] | None = None

    def meta(self, path: str) -> str:
        r = retried(
            "the metadata server",
            lambda: http(
                "GET",
                self.md + "/computeMetadata/v1/" + path,
                {"Metadata-Flavor": "Google"},
                proxy=False,
            ),
        )
        if r.status == 404:
            return ""
        if r.status != 200:
            raise BootError(f"the metadata server answered HTTP {r.status} for {path}")
        return r.body.decode().strip()

    def vm_id(self) -> str:
        return self.meta("instance/name")

    def token(self) -> str:
        if self._token is None or self._token[1] < time.time() + 60:
            raw = self.meta("instance/service-accounts/default/token")
            if not raw:
                raise BootError(
                    "the VM has no service account: set gcp.service_account to one that may "
                    "read the run's bucket and secrets"
                )
            t = json.loads(raw)
            self._token = (t["access_token"], time.time() + float(t.get("expires_in", 300)))
        return self._token[0]

    def authed(self, method: str, url: str, body: bytes | None = None, ctype: str = "") -> Response:
        headers = {"Authorization": "Bearer " + self.token()}
        if ctype:
            headers["Content-Type"] = ctype
        return retried(url.split("?")[0], lambda: http(method, url, headers, body))

    def storage(self) -> str:
        return (self.endpoints.get("storage") or "https://storage.googleapis.com").rstrip("/")

    def get_object(self, url: str) -> bytes:
        bucket, key = split_url(url, "gs://")
        r = self.authed(
            "GET",
            "{}/storage/v1/b/{}/o/{}?alt=media".format(
                self.storage(), bucket, urllib.parse.quote(key, safe="")
            ),
        )
        if r.status != 200:
            raise BootError(gcs_refusal(url, r, "storage.objects.get"))
        return r.body


def split_url(url: str, scheme: str) -> tuple[str, str]:
    bucket, _, key = url[len(scheme) :].partition("/")
    return bucket, key


def json_field(body: bytes, path: str) -> str:
    try:
        value: Any = json.loads(body)
        for part in path.split("."):
            value = value[part]
        return str(value)
    except (ValueError, KeyError, TypeError):
        return ""


def xml_code(body: bytes) -> str:
    m = re.search(rb"<Code>([^<]+)</Code>", body)
    return m.group(1).decode() if m else ""


def s3_refusal(url: str, r: Response, action: str) -> str:
    code = xml_code(r.body) or f"HTTP {r.status}"
    if r.status == 403:
        why = f"the instance role may not: grant it {action} on the bucket's prefix"
    elif r.status == 404:
        why = "no such object or bucket (was the run's store emptied?)"
    else:
        why = "S3 refused it"
    return "cannot {} {}: {} ({})".format("read" if "Get" in action else "write", url, why, code)


def gcs_refusal(url: str, r: Response, permission: str) -> str:
    status = json_field(r.body, "error.status") or f"HTTP {r.status}"
    if r.status in (401, 403):
        why = f"the VM's service account lacks {permission} on the bucket"
    elif r.status == 404:
        why = "no such object or bucket (was the run's store emptied?)"
    else:
        why = json_field(r.body, "error.message") or "Cloud Storage refused it"
    verb = "read" if permission.endswith("get") else "write"
    return f"cannot {verb} {url}: {why} ({status})"


def cloud_of(conf: dict[str, Any]) -> Any:
    return Aws(conf) if conf["cloud"] == "aws" else Gcp(conf)


# --- objects --------------------------------------------------------------------------------------
def get_object(conf: dict[str, Any], url: str) -> bytes:
    if url.startswith("file://"):
        try:
            with open(urllib.parse.unquote(url[len("file://") :]), "rb") as f:
                return f.read()
        except OSError as e:
            raise BootError(f"cannot read {url}: {e.strerror}") from None
    return bytes(cloud_of(conf).get_object(url))


def fetch(conf: dict[str, Any], url: str, sha256: str, dest: str) -> None:
    """Download ``url`` into ``dest`` (mode 0644), refused unless its sha256 is ``sha256``."""
    data = get_object(conf, url)
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise BootError(
            f"{url} does not match the sha256 the controller pinned ({sha256[:16]}, got "
            f"{got[:16]}): it was changed "
            "after the run started; start a new run (spottrain up) to ship it again"
        )
    os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    tmp = dest + ".part"
    with open(tmp, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, dest)


def main(argv: list[str]) -> int:
    """``fetch.py BOOT.json NAME DEST``: exit 0 fetched, 3 refused (the reason on stderr)."""
    if len(argv) != 3:
        print("usage: fetch.py BOOT.json NAME DEST", file=sys.stderr)
        return 2
    conf = read_json(argv[0])
    try:
        f = conf["files"][argv[1]]
        fetch(conf, f["url"], f["sha256"], argv[2])
    except BootError as e:
        print(f"spottrain: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

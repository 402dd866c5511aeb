"""The rest of the boot's loader: secrets, pip's configuration, and the boot's reports.

:mod:`.fetch` brings this file to a fresh AWS or GCP VM (pinned by its sha256), and the boot
script runs it with the image's ``python3``, beside ``fetch.py``; like that one it uses the
standard library only and the Python 3.7 language. It:

- reads secrets from the cloud's secret store into root-only files, and remembers each value
  so that nothing it prints or ships can carry one (``secret``, ``secret-env``);
- writes pip's configuration for the spec's index, with its credentials (``pip-config``);
- reports the boot's stages to the run's Redis (RESP over TCP, TLS for ``rediss://``) and to
  the console, and on a failure computes the one-line reason, reports it and ships the
  boot's output to the run's log store (``stage``, ``fail``, ``booted``);
- takes the agent's systemd unit out of the shipped wheel for an image job (``unit-file``).

Its settings come from the JSON file the boot script writes (no secret in it); see
:func:`main` for the commands. Errors it knows the cause of exit 3 with a line
``spottrain: <what failed>: <why; what to do>`` on stderr, which becomes the boot's reason.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
import re
import socket
import ssl
import sys
import tempfile
import time
import urllib.parse
import zipfile
from typing import Any

try:
    from .fetch import (
        Aws,
        BootError,
        Gcp,
        cloud_of,
        gcs_refusal,
        json_field,
        read_json,
        retried,
        s3_refusal,
        split_url,
    )
except ImportError:  # on the VM: run as a script beside fetch.py
    from fetch import (  # type: ignore[no-redef]
        Aws,
        BootError,
        Gcp,
        cloud_of,
        gcs_refusal,
        json_field,
        read_json,
        retried,
        s3_refusal,
        split_url,
    )

REDACT_FILE = "/run/spottrain/redact"


# --- secrets never leave the VM ------------------------------------------------------------------
_CONTROLS = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f]")


class Secrets:
    """The secret values this boot read, noted in a root-only file (on the tmpfs /run) so
    that every later command of the boot can keep them out of what it prints or ships."""

    def __init__(self, path: str = REDACT_FILE) -> None:
        self.path = path

    def remember(self, value: str) -> None:
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(base64.b64encode(value.encode()).decode() + "\n")

    def values(self) -> list[str]:
        try:
            with open(self.path) as f:
                return [base64.b64decode(line).decode() for line in f if line.strip()]
        except OSError:
            return []

    def redact(self, text: str) -> str:
        for s in sorted(set(self.values()), key=len, reverse=True):
            if len(s) >= 6:
                text = text.replace(s, "[redacted]")
        return text

    def safe_line(self, text: str, limit: int = 300) -> str:
        """One line to show: secrets redacted, control characters escaped, cut."""
        line = _CONTROLS.sub(lambda m: f"\\x{ord(m.group()):02x}", self.redact(text).strip())
        return line if len(line) <= limit else line[: limit - 1] + "\u2026"


# --- what the fetch part does not need: writing objects, reading secrets ------------------
def aws_put(self: Aws, url: str, data: bytes) -> None:
    bucket, key = split_url(url, "s3://")
    sha = hashlib.sha256(data).hexdigest()
    r = self.s3("PUT", bucket, key, data, {"sha256": sha})
    if r.status != 200:
        raise BootError(s3_refusal(url, r, "s3:PutObject"))


def aws_secret(self: Aws, name: str) -> str:
    region = self.region()
    m = re.match(r"^arn:aws[a-z-]*:secretsmanager:([a-z0-9-]+):", name)
    if m:
        region = m.group(1)
    url = self.endpoints.get("secretsmanager") or (f"https://secretsmanager.{region}.amazonaws.com")
    body = json.dumps({"SecretId": name}).encode()
    headers = {
        "content-type": "application/x-amz-json-1.1",
        "x-amz-target": "secretsmanager.GetSecretValue",
    }
    r = retried(
        "Secrets Manager",
        lambda: self.signed("POST", url.rstrip("/") + "/", "secretsmanager", region, body, headers),
    )
    if r.status != 200:
        code = json_field(r.body, "__type") or r.headers.get("x-amzn-errortype", "")
        code = code.split("#")[-1].split(":")[0] or f"HTTP {r.status}"
        if "AccessDenied" in code:
            why = (
                "the instance role may not read it: grant secretsmanager:GetSecretValue "
                "on it (and kms:Decrypt on its key)"
            )
        elif "ResourceNotFound" in code:
            why = f"no such secret in {region}: create it, or fix the name in the spec"
        else:
            why = json_field(r.body, "Message") or json_field(r.body, "message")
        raise BootError(f"cannot read the secret {name!r}: {why} ({code})")
    data = json.loads(r.body)
    if "SecretString" in data:
        return str(data["SecretString"])
    return base64.b64decode(data.get("SecretBinary", "")).decode()


def gcp_put(self: Gcp, url: str, data: bytes) -> None:
    bucket, key = split_url(url, "gs://")
    meta = json.dumps({"name": key, "metadata": {"sha256": hashlib.sha256(data).hexdigest()}})
    boundary = "spottrain-" + hashlib.sha256(data).hexdigest()[:24]
    body = (
        (
            f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n{meta}\r\n"
        ).encode()
        + (f"--{boundary}\r\nContent-Type: application/gzip\r\n\r\n").encode()
        + data
        + (f"\r\n--{boundary}--\r\n").encode()
    )
    r = self.authed(
        "POST",
        f"{self.storage()}/upload/storage/v1/b/{bucket}/o?uploadType=multipart",
        body,
        "multipart/related; boundary=" + boundary,
    )
    if r.status != 200:
        raise BootError(gcs_refusal(url, r, "storage.objects.create"))


def gcp_secret(self: Gcp, name: str) -> str:
    full = (
        name
        if name.startswith("projects/")
        else "projects/{}/secrets/{}".format(
            self.meta("project/project-id"),
            name,
        )
    )
    if "/versions/" not in full:
        full += "/versions/latest"
    base = (self.endpoints.get("secretmanager") or "https://secretmanager.googleapis.com").rstrip(
        "/"
    )
    r = self.authed("GET", f"{base}/v1/{full}:access")
    if r.status != 200:
        status = json_field(r.body, "error.status") or f"HTTP {r.status}"
        if r.status == 403:
            why = (
                "the VM's service account may not read it: grant it "
                "roles/secretmanager.secretAccessor on the secret"
            )
        elif r.status == 404:
            why = "no such secret (or no version): create it, or fix the name in the spec"
        else:
            why = json_field(r.body, "error.message")
        raise BootError(f"cannot read the secret {name!r}: {why} ({status})")
    data = json.loads(r.body)
    return base64.b64decode(data["payload"]["data"]).decode()


def put_object(conf: dict[str, Any], url: str, data: bytes) -> None:
    """Store ``data`` at ``url`` (``s3://``, ``gs://``, ``file://``) with its sha256 in the
    object's metadata, as spottrain's stores record it."""
    if url.startswith("file://"):
        path = urllib.parse.unquote(url[len("file://") :])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".part", "wb") as f:
            f.write(data)
        os.replace(path + ".part", path)
        return
    cloud = cloud_of(conf)
    if isinstance(cloud, Aws):
        aws_put(cloud, url, data)
    else:
        gcp_put(cloud, url, data)


def read_secret(conf: dict[str, Any], name: str) -> str:
    """A secret's value from the VM's cloud's secret store."""
    cloud = cloud_of(conf)
    return aws_secret(cloud, name) if isinstance(cloud, Aws) else gcp_secret(cloud, name)


# --- Redis: the boot's record ---------------------------------------------------------------------
def _resp(*args: str) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def _reply(f: Any) -> Any:
    line = f.readline()
    if not line:
        raise OSError("Redis closed the connection")
    kind, rest = line[:1], line[1:-2]
    if kind == b"-":
        raise BootError("Redis refused: {}".format(rest.decode(errors="replace")))
    if kind in (b"+", b":"):
        return rest
    if kind == b"$":
        n = int(rest)
        return None if n < 0 else f.read(n + 2)[:-2]
    if kind == b"*":
        return [_reply(f) for _ in range(max(int(rest), 0))]
    raise OSError(f"not a Redis reply: {line[:40]!r}")


def redis_send(conf: dict[str, Any], commands: list[list[str]]) -> None:
    """Send ``commands`` to the run's Redis (once, within a few seconds)."""
    r = conf["redis"]
    parts = urllib.parse.urlsplit(r["url"] if "://" in r["url"] else "redis://" + r["url"])
    host, port = parts.hostname or "", parts.port or 6379
    db = parts.path.strip("/") or "0"
    sock: Any = socket.create_connection((host, port), timeout=5.0)
    try:
        if parts.scheme == "rediss":
            ctx = ssl.create_default_context(cafile=r.get("ca_file") or None)
            sock = ctx.wrap_socket(sock, server_hostname=host)
        pre: list[list[str]] = []
        password = _password(r)
        if password:
            pre.append(["AUTH", password])
        if db != "0":
            pre.append(["SELECT", db])
        sock.sendall(b"".join(_resp(*c) for c in pre + commands))
        f = sock.makefile("rb")
        for _ in pre + commands:
            _reply(f)
    finally:
        sock.close()


def _password(r: dict[str, Any]) -> str:
    path = r.get("password_file")
    if not path:
        return ""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def report(
    conf: dict[str, Any], secrets: Secrets, vm: str, stage: str, state: str, reason: str = ""
) -> None:
    """The boot's record in Redis, best effort (the console has it anyway); not before the
    boot has the Redis password, when the run's Redis has one."""
    r = conf["redis"]
    if r.get("password_file") and not os.path.exists(r["password_file"]):
        if state != "failed" or not r.get("password_secret"):
            return  # a stage before the password's: the console has it
        try:
            # A failure before the password was read: read it now, to report the failure
            # where the controller looks first (the console still has it if this fails).
            write_secret(conf, secrets, r["password_secret"], r["password_file"])
        except (OSError, BootError):
            return
    at = f"{time.time():.3f}"
    fields = ["vm", vm, "stage", stage, "state", state, "reason", reason, "at", at, "source", "vm"]
    event = ["type", "boot", "node", conf["node"], "at", at]
    event += ["vm", vm, "stage", stage, "state", state, "reason", reason]
    try:
        redis_send(
            conf,
            [
                ["HSET", r["boot_key"], *fields],
                ["XADD", r["events_key"], "MAXLEN", "~", str(r["events_maxlen"]), "*", *event],
            ],
        )
    except (OSError, BootError, ValueError) as e:
        why = secrets.safe_line(str(e))
        print(f"spottrain-boot: cannot report to Redis: {why}", file=sys.stderr)


# --- a failure's reason and the boot's output -----------------------------------------------------
_PIP_ERROR = re.compile(r"^ERROR: (.*)$")


def reason_from(lines: list[str]) -> str:
    """The most telling line of a failed stage's output: our own ``spottrain:`` line, else
    pip's or git's error, else the last line."""
    text = [ln.rstrip("\n") for ln in lines if ln.strip()]
    text = [ln for ln in text if not ln.startswith("spottrain-boot:")]
    for ln in reversed(text):
        if ln.startswith("spottrain: "):
            return ln[len("spottrain: ") :]
    for i in range(len(text) - 1, -1, -1):
        m = _PIP_ERROR.match(text[i])
        if m:
            why = m.group(1)
            if "DO NOT MATCH THE HASHES" in why:
                wrong = [t.strip() for t in text[i + 1 :] if " from " in t or "Expected" in t]
                why = "a file does not match the lock's hash" + (
                    ": " + " ".join(wrong[:2]) if wrong else ""
                )
            return "pip: " + why
    for ln in reversed(text):
        if ln.startswith("fatal: "):
            return "git: " + ln
        if ln.startswith("error: "):
            return ln[len("error: ") :]
    return text[-1] if text else "it exited non-zero without saying why"


def chunk_url(conf: dict[str, Any], vm: str, started_ms: int) -> str | None:
    logs = conf.get("logs")
    if not logs:
        return None
    return f"{logs['url'].rstrip('/')}/{logs['prefix']}{vm}/{0:08d}-{started_ms}.gz"


def ship_log(conf: dict[str, Any], secrets: Secrets, vm: str, log: str, started_ms: int) -> None:
    """The boot's whole output (whole lines, secrets redacted) as the VM's first log chunk,
    where ``spottrain logs --node`` reads a node's output."""
    url = chunk_url(conf, vm, started_ms)
    if url is None:
        return
    try:
        with open(log, "rb") as f:
            raw = f.read()
        raw = raw[: raw.rfind(b"\n") + 1] if b"\n" in raw else raw + b"\n"
        data = secrets.redact(raw.decode(errors="replace")).encode()
        put_object(conf, url, gzip.compress(data, mtime=0))
    except (OSError, BootError) as e:
        why = secrets.safe_line(str(e))
        print(f"spottrain-boot: cannot ship the boot's output: {why}", file=sys.stderr)


# --- commands ------------------------------------------------------------------------------------
def pip_config(conf: dict[str, Any], secrets: Secrets, path: str) -> None:
    """pip's configuration for the spec's index (root-only: it may hold credentials)."""
    pip = conf.get("pip") or {}
    cred = ""
    if pip.get("credentials_secret"):
        cred = read_secret(conf, pip["credentials_secret"]).strip()
        secrets.remember(cred)
        user, sep, password = cred.partition(":")
        if sep:
            secrets.remember(password)
        cred = urllib.parse.quote(user, safe="") + (
            ":" + urllib.parse.quote(password, safe="") if sep else ""
        )

    def with_cred(u: str) -> str:
        if not cred:
            return u
        p = urllib.parse.urlsplit(u)
        return urllib.parse.urlunsplit(p._replace(netloc=cred + "@" + p.netloc))

    lines = ["[global]", "disable-pip-version-check = true", "no-input = true"]
    if pip.get("index_url"):
        lines.append("index-url = " + with_cred(pip["index_url"]))
    extra = [with_cred(u) for u in pip.get("extra_index_urls") or []]
    if extra:
        lines.append("extra-index-url = " + " ".join(extra))
    links = [with_cred(u) for u in pip.get("find_links") or []]
    if links:
        lines.append("find-links = " + " ".join(links))
    if pip.get("trusted_hosts"):
        lines.append("trusted-host = " + " ".join(pip["trusted_hosts"]))
    fd = os.open(path + ".part", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(path + ".part", path)


def write_secret(conf: dict[str, Any], secrets: Secrets, name: str, dest: str) -> None:
    """The cloud secret NAME into DEST (mode 0600), its value remembered."""
    value = read_secret(conf, name)
    if not value.strip():
        raise BootError(f"the secret {name!r} is empty: put the value in it")
    secrets.remember(value)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(dest) or ".", prefix=".secret-")
    with os.fdopen(fd, "w") as f:
        f.write(value)
    os.chmod(tmp, 0o600)
    os.replace(tmp, dest)


def secret_env(
    conf: dict[str, Any], secrets: Secrets, var: str, name: str, files: list[str]
) -> None:
    """Append the cloud secret NAME as VAR to the env file(s) (:func:`write_env_line`)."""
    value = read_secret(conf, name)
    if not value:
        raise BootError(f"the secret {name!r} for {var} is empty: put the value in it")
    secrets.remember(value)
    write_env_line(var, name, value, files)


def secret_env_json(conf: dict[str, Any], secrets: Secrets, var: str, name: str, path: str) -> None:
    """Append the cloud secret NAME as VAR to the secret variables file PATH, one JSON
    object a line, mode 0600 (an image job's: its agent reads it in the container, so the
    value is in no docker setting that ``docker inspect`` shows)."""
    value = read_secret(conf, name)
    if not value:
        raise BootError(f"the secret {name!r} for {var} is empty: put the value in it")
    if "\0" in value:
        raise BootError(f"the secret {name!r} for {var} holds a NUL, which no environment carries")
    secrets.remember(value)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a") as f:
        f.write(json.dumps({"name": var, "value": value}) + "\n")


def write_env_line(var: str, name: str, value: str, files: list[str]) -> None:
    """Append ``VAR="value"`` (systemd's quoting) to the env file ``files[0]`` and
    ``VAR=value`` to docker's (``files[1]``, if given), both mode 0600: the value is on no
    command line; one holding a newline is refused (an env file cannot carry one)."""
    if "\n" in value or "\r" in value:
        raise BootError(
            f"the secret {name!r} for {var} holds a newline, which an environment file "
            "cannot carry: store it on one line"
        )
    quoted = value.replace("\\", "\\\\").replace('"', '\\"')
    lines = [f'{var}="{quoted}"\n', f"{var}={value}\n"]
    for i, path in enumerate(files[:2]):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(lines[i])


def unit_file(conf: dict[str, Any], state_dir: str, dest: str) -> None:
    """The agent's systemd unit, from the shipped wheel (an image job's VM installs no
    venv: its agent runs inside the image)."""
    name = conf["files"]["wheel"]["name"]
    with zipfile.ZipFile(os.path.join(state_dir, "wheels", name)) as z:
        text = z.read("spottrain/agent/systemd/spottrain-agent.service")
    with open(dest, "wb") as f:
        f.write(text)


def vm_id(conf: dict[str, Any], cache: str) -> str:
    try:
        with open(cache) as f:
            return f.read().strip()
    except OSError:
        pass
    vid = str(cloud_of(conf).vm_id()) or "unknown"
    with open(cache, "w") as f:
        f.write(vid)
    return vid


def main(argv: list[str]) -> int:
    """``loader.py CONF COMMAND ARGS``; commands:

    - ``secret NAME DEST``: the cloud secret NAME into DEST (0600), its value remembered;
    - ``secret-env VAR NAME FILE [DOCKER_FILE]``: the secret NAME appended as VAR to the
      env file(s);
    - ``secret-env-json VAR NAME FILE``: the secret NAME appended as VAR to the secret
      variables file (JSON lines, an image job's);
    - ``pip-config DEST``: pip's configuration for the spec's index into DEST (0600);
    - ``unit-file DEST``: the agent's systemd unit from the shipped wheel;
    - ``stage STAGE``: report a stage starting (console and Redis);
    - ``fail STAGE LOG OFFSET``: the failed stage's reason from LOG past byte OFFSET, printed
      as the console's failure line, reported to Redis, and LOG shipped to the log store;
    - ``booted``: report the boot done.
    """
    if len(argv) < 2:
        print("usage: loader.py CONF COMMAND [ARGS]", file=sys.stderr)
        return 2
    conf = read_json(argv[0])
    state_dir = os.path.dirname(os.path.abspath(argv[0]))
    secrets = Secrets(conf.get("redact_file") or REDACT_FILE)
    cmd, args = argv[1], argv[2:]
    try:
        if cmd == "secret":
            write_secret(conf, secrets, args[0], args[1])
        elif cmd == "secret-env":
            secret_env(conf, secrets, args[0], args[1], args[2:])
        elif cmd == "secret-env-json":
            secret_env_json(conf, secrets, args[0], args[1], args[2])
        elif cmd == "pip-config":
            pip_config(conf, secrets, args[0])
        elif cmd == "unit-file":
            unit_file(conf, state_dir, args[0])
        elif cmd in ("stage", "fail", "booted"):
            vm = vm_id(conf, os.path.join(state_dir, "vm-id"))
            node = conf["node"]
            if cmd == "stage":
                print(f"spottrain-boot: {node} {vm}: stage '{args[0]}'", flush=True)
                report(conf, secrets, vm, args[0], "booting")
            elif cmd == "booted":
                print(f"spottrain-boot: {node} {vm}: booted", flush=True)
                report(conf, secrets, vm, "start the agent", "booted")
            else:
                stage, log, offset = args[0], args[1], int(args[2])
                with open(log, "rb") as fh:
                    fh.seek(offset)
                    lines = fh.read().decode(errors="replace").splitlines()
                why = secrets.safe_line(reason_from(lines))
                print(f"spottrain-boot: {node} {vm}: failed in '{stage}': {why}", flush=True)
                report(conf, secrets, vm, stage, "failed", why)
                with open(os.path.join(state_dir, "started-ms")) as fh:
                    started = int(fh.read().strip() or "0")
                ship_log(conf, secrets, vm, log, started)
        else:
            print(f"loader.py: unknown command {cmd!r}", file=sys.stderr)
            return 2
    except BootError as e:
        print(f"spottrain: {secrets.safe_line(str(e), 1000)}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

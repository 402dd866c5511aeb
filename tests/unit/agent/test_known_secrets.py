"""The secret values a VM knows, as the agent reads them: the boot's redact file (written by
the boot's own loader), the Redis password's file and variable, read again when they change."""

from __future__ import annotations

from pathlib import Path

from spottrain.agent.known_secrets import KnownSecrets
from spottrain.cloud.vmboot import loader
from spottrain.protocol.boot import REDACT_FILE, parse_redact_lines


def test_the_agent_reads_what_the_boots_loader_notes(tmp_path: Path) -> None:
    assert loader.REDACT_FILE == REDACT_FILE
    noted = loader.Secrets(str(tmp_path / "redact"))
    for value in ("pw with spaces\tand tab", "ünïcode-secret", "line\nbreak-secret"):
        noted.remember(value)
    text = (tmp_path / "redact").read_text()
    assert parse_redact_lines(text) == noted.values()
    assert parse_redact_lines(text + "not base64 !!\n") == noted.values()  # a cut write


def test_known_values_are_redacted_and_a_changed_file_is_read_again(tmp_path: Path) -> None:
    redact, password = tmp_path / "redact", tmp_path / "password"
    password.write_text("first-password\n")
    known = KnownSecrets(
        password_file=str(password),
        redact_file=str(redact),
        environ={"SPOTTRAIN_REDIS_PASSWORD": "from-the-env"},
    )
    assert sorted(known.values()) == ["first-password", "from-the-env"]
    loader.Secrets(str(redact)).remember("a-git-token")
    password.write_text("second-password\n")
    assert sorted(known.values()) == ["a-git-token", "from-the-env", "second-password"]
    line = "git a-git-token pw second-password first-password short"
    assert known.redact(line) == "git [redacted] pw [redacted] first-password short"
    assert known.redact_bytes(line.encode()) == known.redact(line).encode()
    # Nothing noted and no password: nothing to redact.
    assert KnownSecrets(redact_file=str(tmp_path / "none"), environ={}).values() == []


def test_bytes_that_are_not_utf8_pass_untouched_beside_a_redacted_value(tmp_path: Path) -> None:
    secret = "p\u00e4sswort-1"
    known = KnownSecrets(
        redact_file=str(tmp_path / "none"), environ={"SPOTTRAIN_REDIS_PASSWORD": secret}
    )
    data = b"\xff\xfe raw " + secret.encode() + b" \x80 p\xe4sswort-1 (latin-1, not the secret)"
    assert known.redact_bytes(data) == (
        b"\xff\xfe raw [redacted] \x80 p\xe4sswort-1 (latin-1, not the secret)"
    )

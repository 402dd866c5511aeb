"""A long wait (the code's archive and upload at ``up``) is said while it lasts: a plain
line every few seconds away from a terminal, nothing at all when it was short; the end line
on a terminal always."""

from __future__ import annotations

import io
import time

from spottrain.controller.run.progress import Waiting, size


def test_a_plain_wait_says_where_it_is_every_few_seconds_then_how_it_ended() -> None:
    out = io.StringIO()
    with Waiting(
        "archiving /src", lambda: "3.0 MB so far", stream=out, every_s=0.01, tty=False
    ) as w:
        deadline = time.monotonic() + 20
        while out.getvalue().count("\n") < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        w.done("code archived: 12 files")
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("archiving /src: 3.0 MB so far, ") and lines[0].endswith(" s")
    assert lines[-1] == "code archived: 12 files"

    quiet = io.StringIO()
    with Waiting("uploading", stream=quiet, every_s=3600, tty=False) as w:
        w.done("uploaded")
    assert quiet.getvalue() == ""  # short: a log does not fill with waits

    term = io.StringIO()
    with Waiting("uploading", stream=term, tty=True) as w:
        w.done("code uploaded in 0.0 s")
    assert term.getvalue().splitlines()[-1] == "code uploaded in 0.0 s"
    assert (size(512), size(3_400_000), size(1.2e9)) == ("512 B", "3.4 MB", "1.20 GB")
